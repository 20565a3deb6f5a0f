// dsv3 convert against the reference's inference/convert.py: the expected output is derived here
// from convert.py's own mapping table and split rules (written below as data, not through dsv3's
// name mapping), and every byte of every rank's tensors is compared with the slice of the input
// it must be. The N=1 output loads and gives the HF layout's logits; bad input is refused with a
// clear message and nothing written.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <tuple>

#include "checkpoint_tool_util.h"
#include "io/safetensors.h"

using namespace dsv3;
using namespace dsv3::testing_util;

namespace {

// convert.py's `mapping`: Hugging Face key -> (reference key, split dim; -1 for None).
const std::map<std::string, std::pair<std::string, int>> kMapping = {
    {"embed_tokens", {"embed", 0}},         {"input_layernorm", {"attn_norm", -1}},
    {"post_attention_layernorm", {"ffn_norm", -1}}, {"q_proj", {"wq", 0}},
    {"q_a_proj", {"wq_a", -1}},             {"q_a_layernorm", {"q_norm", -1}},
    {"q_b_proj", {"wq_b", 0}},              {"kv_a_proj_with_mqa", {"wkv_a", -1}},
    {"kv_a_layernorm", {"kv_norm", -1}},    {"kv_b_proj", {"wkv_b", 0}},
    {"o_proj", {"wo", 1}},                  {"gate", {"gate", -1}},
    {"gate_proj", {"w1", 0}},               {"down_proj", {"w2", 1}},
    {"up_proj", {"w3", 0}},                 {"norm", {"norm", -1}},
    {"lm_head", {"head", 0}},               {"scale", {"scale", -1}}};

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size())) s.replace(p, from.size(), to);
}

std::vector<std::string> split_dots(const std::string& s) {
  std::vector<std::string> w(1);
  for (char c : s) {
    if (c == '.') w.emplace_back();
    else w.back().push_back(c);
  }
  return w;
}

struct RefTarget {
  std::string name;
  int dim = -1;     // split dim
  int expert = -1;  // routed expert index
};

// convert.py's per-tensor steps: the prefix, the four replacements, the key, the expert index.
RefTarget ref_target(std::string name) {
  if (name.rfind("model.", 0) == 0) name = name.substr(6);
  replace_all(name, "self_attn", "attn");
  replace_all(name, "mlp", "ffn");
  replace_all(name, "weight_scale_inv", "scale");
  replace_all(name, "e_score_correction_bias", "bias");
  std::vector<std::string> w = split_dots(name);
  const std::string key = w.at(w.size() - 2);
  const auto& [new_key, dim] = kMapping.at(key);
  replace_all(name, key, new_key);
  RefTarget t{name, dim, -1};
  if (name.find("experts") != std::string::npos && name.find("shared_experts") == std::string::npos) {
    w = split_dots(name);
    t.expert = std::stoi(w.at(w.size() - 3));
  }
  return t;
}

// torch's param.narrow(dim, r * n / mp, n / mp), element by element: the rank's expected bytes.
std::string narrow_bytes(const TensorView& t, int dim, int r, int mp) {
  const size_t es = dtype_size(t.dtype);
  if (dim < 0) return std::string(static_cast<const char*>(t.data), t.nbytes());
  std::vector<int64_t> out_shape = t.shape;
  out_shape[size_t(dim)] /= mp;
  int64_t n = 1;
  for (auto d : out_shape) n *= d;
  std::string out(size_t(n) * es, '\0');
  std::vector<int64_t> idx(out_shape.size(), 0);
  for (int64_t k = 0; k < n; ++k) {
    int64_t rem = k, src = 0;
    for (size_t d = out_shape.size(); d-- > 0;) {
      idx[d] = rem % out_shape[d];
      rem /= out_shape[d];
    }
    for (size_t d = 0; d < out_shape.size(); ++d)
      src = src * t.shape[d] + idx[d] + (int(d) == dim ? int64_t(r) * out_shape[d] : 0);
    std::memcpy(out.data() + size_t(k) * es, static_cast<const char*>(t.data) + size_t(src) * es, es);
  }
  return out;
}

int n_experts_of(const std::string& c) { return read_json(case_dir(c) + "/hf/config.json")["n_routed_experts"]; }

CliRun convert(const std::string& in, const std::string& out, long experts, long mp) {
  return run_dsv3("convert --hf-ckpt-path '" + in + "' --save-path '" + out + "' --n-experts " +
                  std::to_string(experts) + " --model-parallel " + std::to_string(mp));
}

std::string rank_file(const std::string& out, int r, int mp) {
  return out + "/model" + std::to_string(r) + "-mp" + std::to_string(mp) + ".safetensors";
}

class ConvertGolden : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(ConvertGolden, EveryRankHoldsExactlyTheReferenceSlices) {
  const auto [c, mp] = GetParam();
  const int E = n_experts_of(c);
  const std::string out = fresh_dir("conv_" + c + "_" + std::to_string(mp));
  const CliRun run = convert(case_dir(c) + "/hf", out, E, mp);
  ASSERT_EQ(run.rc, 0) << run.err;
  std::set<std::string> want_files;
  for (int r = 0; r < mp; ++r) want_files.insert("model" + std::to_string(r) + "-mp" + std::to_string(mp) + ".safetensors");
  EXPECT_EQ(dir_entries(out), want_files);  // the golden hf/ folders hold no *token* files

  std::vector<std::unique_ptr<SafetensorsFile>> ranks;
  std::vector<std::set<std::string>> unseen(static_cast<size_t>(mp));
  for (int r = 0; r < mp; ++r) {
    ranks.push_back(std::make_unique<SafetensorsFile>(rank_file(out, r, mp)));
    for (auto& [n, e] : ranks.back()->entries()) unseen[size_t(r)].insert(n);
  }
  int checked = 0;
  for (auto& f : dir_entries(case_dir(c) + "/hf")) {
    if (f.size() < 12 || f.substr(f.size() - 12) != ".safetensors") continue;
    SafetensorsFile in(case_dir(c) + "/hf/" + f);
    for (auto& [hf_name, e] : in.entries()) {
      const RefTarget t = ref_target(hf_name);
      const TensorView src = in.get(hf_name);
      for (int r = 0; r < mp; ++r) {
        const bool here = t.expert < 0 || t.expert / (E / mp) == r;
        ASSERT_EQ(ranks[size_t(r)]->has(t.name), here) << hf_name << " -> " << t.name << " on rank " << r;
        if (!here) continue;
        unseen[size_t(r)].erase(t.name);
        const TensorView got = ranks[size_t(r)]->get(t.name);
        std::vector<int64_t> shape = src.shape;
        if (t.expert < 0 && t.dim >= 0) shape[size_t(t.dim)] /= mp;
        EXPECT_EQ(got.dtype, src.dtype) << t.name;
        ASSERT_EQ(got.shape, shape) << t.name << " on rank " << r;
        const std::string want = narrow_bytes(src, t.expert < 0 ? t.dim : -1, r, mp);
        EXPECT_EQ(std::memcmp(got.data, want.data(), want.size()), 0) << t.name << " on rank " << r;
        ++checked;
      }
    }
  }
  for (int r = 0; r < mp; ++r) EXPECT_TRUE(unseen[size_t(r)].empty()) << "rank " << r << " holds extra tensors";
  EXPECT_GT(checked, 50);
}

// FP8 cases only at N=1: their 128x128 scale grids of the tiny shapes are 1 wide along o_proj's
// split dim, which convert.py refuses at N=2 too (see RefusesBadInput).
INSTANTIATE_TEST_SUITE_P(Bf16, ConvertGolden,
                         ::testing::Combine(::testing::Values("v2lite_bf16", "v2_groups_bf16"), ::testing::Values(1, 2, 4)));
INSTANTIATE_TEST_SUITE_P(Fp8, ConvertGolden,
                         ::testing::Combine(::testing::Values("v3_fp8", "v31_fp8_ue8m0"), ::testing::Values(1)));

// The converted N=1 checkpoint with the case's reference ModelArgs JSON gives, at every golden
// step, exactly the logits of the Hugging Face layout it came from.
class ConvertLoads : public ::testing::TestWithParam<std::string> {};

TEST_P(ConvertLoads, Mp1GivesTheHfLayoutsLogits) {
  const std::string c = GetParam();
  const std::string out = fresh_dir("conv_load_" + c);
  const CliRun run = convert(case_dir(c) + "/hf", out, n_experts_of(c), 1);
  ASSERT_EQ(run.rc, 0) << run.err;
  SafetensorsFile hf(golden_logits(c, case_dir(c) + "/hf", "", fresh_dir("conv_hf_" + c + ".safetensors")));
  SafetensorsFile ref(golden_logits(c, out, "--config '" + case_dir(c) + "/ref_config.json'",
                                    fresh_dir("conv_ref_" + c + ".safetensors")));
  SafetensorsFile g(case_dir(c) + "/golden.safetensors");
  const int steps = golden_steps(g);
  ASSERT_EQ(hf.entries().size(), size_t(steps));
  for (int s = 0; s < steps; ++s) {
    const TensorView a = hf.get(step_key(s, "logits")), b = ref.get(step_key(s, "logits"));
    ASSERT_EQ(a.shape, b.shape);
    EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes()), 0) << step_key(s, "logits");
    // And both are the engine's float32 result: the golden bar (README: 1e-3).
    const TensorView w = g.get(step_key(s, "logits_fp32"));
    EXPECT_LE(rel_l2(b.as<float>(), w.as<float>(), size_t(w.numel())), 1e-3) << step_key(s, "logits");
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ConvertLoads, ::testing::Values("v2lite_bf16", "v2_groups_bf16", "v3_fp8", "v31_fp8_ue8m0"));

// A tensor file at `path` of bf16 zeros, one per name, each [4, 4].
void write_small_tensors(const std::string& path, const std::vector<std::string>& names) {
  static const std::vector<uint16_t> zeros(16, 0);
  std::vector<NamedTensor> ts;
  for (auto& n : names) ts.push_back({n, DType::BF16, {4, 4}, zeros.data()});
  write_safetensors(path, ts);
}

// convert.py leaves out the multi-token-prediction layer (its "model.layers.61", the layer past
// the 671B model's 61) and copies every *token* file.
TEST(ConvertCommand, SkipsMtpLayersAndCopiesTokenizerFiles) {
  const std::string in = fresh_dir("conv_mtp_in");
  copy_hf("v2lite_bf16", in);  // 3 layers
  write_small_tensors(in + "/mtp.safetensors", {"model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight",
                                                "model.layers.3.self_attn.q_proj.weight"});
  std::ofstream(in + "/tokenizer.json") << "{\"tok\": 1}";
  std::ofstream(in + "/tokenizer_config.json") << "{\"cfg\": 2}";
  std::ofstream(in + "/README.md") << "not copied";
  const std::string out = fresh_dir("conv_mtp_out"), plain = fresh_dir("conv_mtp_plain");
  CliRun r = convert(in, out, 8, 2);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("3 multi-token-prediction tensors skipped, 2 tokenizer files copied"), std::string::npos) << r.err;
  EXPECT_EQ(dir_entries(out), (std::set<std::string>{"model0-mp2.safetensors", "model1-mp2.safetensors",
                                                      "tokenizer.json", "tokenizer_config.json"}));
  EXPECT_EQ(read_text_file(out + "/tokenizer.json"), "{\"tok\": 1}");
  EXPECT_EQ(read_text_file(out + "/tokenizer_config.json"), "{\"cfg\": 2}");
  r = convert(case_dir("v2lite_bf16") + "/hf", plain, 8, 2);
  ASSERT_EQ(r.rc, 0) << r.err;
  for (int rank = 0; rank < 2; ++rank)
    EXPECT_EQ(read_text_file(rank_file(out, rank, 2)), read_text_file(rank_file(plain, rank, 2))) << rank;

  // Without config.json, the layer convert.py names: 61.
  const std::string in2 = fresh_dir("conv_mtp61_in"), out2 = fresh_dir("conv_mtp61_out");
  std::filesystem::create_directories(in2);
  write_small_tensors(in2 + "/a.safetensors", {"model.layers.61.eh_proj.weight", "model.norm.weight",
                                               "model.layers.60.input_layernorm.weight"});
  r = convert(in2, out2, 1, 1);
  ASSERT_EQ(r.rc, 0) << r.err;
  SafetensorsFile f(rank_file(out2, 0, 1));
  EXPECT_EQ(f.entries().size(), 2u);
  EXPECT_TRUE(f.has("norm.weight"));
  EXPECT_TRUE(f.has("layers.60.attn_norm.weight"));
}

// Each refusal: exit status 1, the message, nothing at the output path.
void expect_refused(const CliRun& r, const std::string& out, const std::string& message) {
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_NE(r.err.find(message), std::string::npos) << "wanted: " << message << "\ngot: " << r.err;
  EXPECT_TRUE(nothing_at(out)) << out;
}

TEST(ConvertCommand, RefusesBadInput) {
  const std::string out = fresh_dir("conv_bad_out"), v3 = case_dir("v3_fp8") + "/hf";
  expect_refused(convert(tmp_path("no_such_dir"), out, 16, 1), out, "no_such_dir: no such directory");
  const std::string empty = fresh_dir("conv_empty");
  std::filesystem::create_directories(empty);
  expect_refused(convert(empty, out, 16, 1), out, "conv_empty: no *.safetensors files");
  expect_refused(convert(v3, out, 16, 0), out, "--model-parallel must be in [1, 4096], got 0");
  expect_refused(convert(v3, out, 0, 1), out, "--n-experts must be in [1, 1048576], got 0");
  expect_refused(convert(v3, out, 16, 3), out, "--n-experts 16 is not divisible by --model-parallel 3");
  expect_refused(convert(v3, out, 8, 1), out, "--n-experts is 8 but " + v3 + "/config.json has n_routed_experts 16");
  expect_refused(run_dsv3("convert --hf-ckpt-path '" + v3 + "' --save-path '" + out + "' --n-experts x --model-parallel 1"),
                 out, "option --n-experts expects an integer, got 'x'");
  // convert.py's divisibility assertion, with the tensor and the numbers.
  expect_refused(convert(v3, out, 16, 2), out,
                 "model-00001-of-00002.safetensors: tensor 'model.layers.0.self_attn.o_proj.weight_scale_inv' "
                 "[2, 1]: dim 1 (size 1) is not divisible by --model-parallel 2");
  // Nor the folders above the output path that do not exist yet.
  const std::string nested = fresh_dir("conv_bad_parent") + "/a/b";
  expect_refused(convert(v3, nested, 16, 2), nested, "is not divisible by --model-parallel 2");
  EXPECT_FALSE(std::filesystem::exists(tmp_path("conv_bad_parent")));
  // A name convert.py's mapping does not know.
  const std::string odd = fresh_dir("conv_odd");
  std::filesystem::create_directories(odd);
  write_small_tensors(odd + "/m.safetensors", {"model.norm.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"});
  expect_refused(convert(odd, out, 1, 1), out,
                 "tensor 'model.layers.0.self_attn.rotary_emb.inv_freq': unknown module name 'rotary_emb'");
  // An expert past --n-experts (no config.json to compare with).
  write_small_tensors(odd + "/m.safetensors", {"model.layers.1.mlp.experts.4.up_proj.weight"});
  expect_refused(convert(odd, out, 4, 1), out, "'model.layers.1.mlp.experts.4.up_proj.weight' is expert 4 but --n-experts is 4");
  // An output folder that holds something is left as it is.
  std::filesystem::create_directories(out);
  std::ofstream(out + "/keep.txt") << "mine";
  const CliRun r = convert(v3, out, 16, 1);
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("exists and is not empty"), std::string::npos) << r.err;
  EXPECT_EQ(dir_entries(out), std::set<std::string>{"keep.txt"});
}

}  // namespace
