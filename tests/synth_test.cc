// dsv3 synth: random-weight checkpoints load and validate through the real loader, FP8 matches
// the bf16 values it quantises, generation is deterministic, a model made of them gives finite
// logits that vary with the token, bad input is refused, and an interrupted run leaves no DIR.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "backend/backend.h"
#include "core/dtype.h"
#include "golden_util.h"
#include "io/checkpoint.h"
#include "io/mmap_file.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "runtime/model.h"
#include "model/weights.h"
#include "text/tokenizer.h"
#include "tools/synth.h"

using namespace dsv3;
using namespace dsv3::testing_util;
namespace fs = std::filesystem;
using json = nlohmann::json;

extern char** environ;

namespace {

// A fresh folder under gtest's temp dir, removed with everything in it at the end of the test.
struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "dsv3_synth_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (!mkdtemp(buf.data())) ADD_FAILURE() << "mkdtemp failed for " << tmpl;
    path = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

SynthResult make(const std::string& out, const std::string& dtype, uint64_t seed = 0, int threads = 0,
                 double shard_gb = 4, const ModelArgs* args = nullptr) {
  SynthOptions o;
  o.shape = "tiny";
  o.dtype = dtype;
  o.out_dir = out;
  o.seed = seed;
  o.threads = threads;
  o.shard_gb = shard_gb;
  o.tokenizer = false;
  o.fsync = false;
  o.args = args;
  return synthesize(o);
}

std::string slurp(const std::string& path) { return read_text_file(path); }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Runs `cmd` through the shell; returns (exit status, stderr+stdout).
std::pair<int, std::string> run(const std::string& cmd) {
  std::string full = cmd + " 2>&1";
  FILE* p = ::popen(full.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int st = ::pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), out};
}

// Dequantised (or plain float) value i of a Linear.
float linear_at(const Linear& l, int64_t i) {
  float v = load_f32(l.weight, i);
  if (!l.fp8()) return v;
  int64_t r = i / l.in(), c = i % l.in(), nb = (l.in() + 127) / 128;
  return v * l.scale.as<float>()[(r / 128) * nb + c / 128];
}

}  // namespace

TEST(SynthNames, RefToHfInvertsHfToRefOverEveryManifestName) {
  std::set<std::string> words_seen;
  for (const std::string& shape : model_shape_names()) {
    ModelArgs a = shape_args(shape, "fp8", 4);  // dense and MoE layers, q LoRA or not, bias or not
    int n = 0;
    for (const WeightSpec& s : weight_manifest(a)) {
      std::vector<std::string> refs = {s.tensor_name()};
      if (s.kind == WeightKind::kLinear) refs.push_back(s.name + ".scale");
      for (const std::string& ref : refs) {
        std::string hf = ref_to_hf_name(ref);
        EXPECT_EQ(hf_to_ref_name(hf), ref) << hf;
        EXPECT_EQ(ref_to_hf_name(hf_to_ref_name(hf)), hf);
        EXPECT_TRUE(hf.rfind("model.", 0) == 0 || hf == "lm_head.weight" || hf == "lm_head.weight_scale_inv") << hf;
        ++n;
      }
    }
    EXPECT_GT(n, 50) << shape;
  }
  EXPECT_EQ(ref_to_hf_name("layers.3.attn.wq_a.scale"), "model.layers.3.self_attn.q_a_proj.weight_scale_inv");
  EXPECT_EQ(ref_to_hf_name("head.weight"), "lm_head.weight");
  EXPECT_EQ(ref_to_hf_name("embed.weight"), "model.embed_tokens.weight");
  EXPECT_EQ(ref_to_hf_name("norm.weight"), "model.norm.weight");
  EXPECT_EQ(ref_to_hf_name("layers.4.ffn.gate.bias"), "model.layers.4.mlp.gate.e_score_correction_bias");
  EXPECT_EQ(ref_to_hf_name("layers.4.ffn.gate.weight"), "model.layers.4.mlp.gate.weight");
  EXPECT_EQ(ref_to_hf_name("layers.4.ffn.experts.17.w1.weight"), "model.layers.4.mlp.experts.17.gate_proj.weight");
  EXPECT_EQ(ref_to_hf_name("layers.1.ffn.shared_experts.w2.weight"),
            "model.layers.1.mlp.shared_experts.down_proj.weight");
  EXPECT_EQ(ref_to_hf_name("layers.0.attn.wkv_a.weight"), "model.layers.0.self_attn.kv_a_proj_with_mqa.weight");
  EXPECT_EQ(ref_to_hf_name("layers.0.attn_norm.weight"), "model.layers.0.input_layernorm.weight");
  EXPECT_EQ(ref_to_hf_name("layers.0.ffn_norm.weight"), "model.layers.0.post_attention_layernorm.weight");
  // The names of a checkpoint exported by transformers (the golden v3 files) come back exactly.
  json idx = json::parse(slurp(case_dir("v3_fp8") + "/hf/model.safetensors.index.json"));
  for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it)
    EXPECT_EQ(ref_to_hf_name(hf_to_ref_name(it.key())), it.key());
}

TEST(SafetensorsWriter, StreamedFileEqualsTheInMemoryWriter) {
  TempDir d;
  std::vector<uint8_t> c = {7, 8, 9, 10, 11};
  std::vector<uint16_t> b = {1, 2, 3, 4, 5, 6};
  std::vector<float> a = {1.f, -2.f, 3.5f};
  // Declared smallest first: laid out largest element first, like safetensors_bytes (aligned).
  std::vector<NamedTensor> nt = {{"c", DType::F8_E4M3, {5}, c.data()},
                                 {"b", DType::BF16, {2, 3}, b.data()},
                                 {"a", DType::F32, {3}, a.data()}};
  std::vector<TensorDecl> decls = {{"c", DType::F8_E4M3, {5}}, {"b", DType::BF16, {2, 3}}, {"a", DType::F32, {3}}};
  std::map<std::string, std::string> meta = {{"format", "pt"}};
  const std::string want = safetensors_bytes(nt, meta);
  std::vector<uint64_t> begin;
  EXPECT_EQ(want.substr(0, safetensors_header(decls, meta, &begin).size()), safetensors_header(decls, meta));
  EXPECT_EQ(begin, (std::vector<uint64_t>{24, 12, 0}));
  {  // append(): the tensors' bytes in declaration order, any split
    SafetensorsWriter w(d / "x.safetensors", decls, meta);
    EXPECT_EQ(w.file_size(), want.size());
    std::string data(reinterpret_cast<const char*>(c.data()), 5);
    data.append(reinterpret_cast<const char*>(b.data()), 12);
    data.append(reinterpret_cast<const char*>(a.data()), 12);
    EXPECT_EQ(w.current_tensor(), "c");
    w.append(data.data(), 3);
    EXPECT_EQ(w.current_tensor(), "c");
    w.append(data.data() + 3, 4);
    EXPECT_EQ(w.current_tensor(), "b");
    w.append(data.data() + 7, 20);
    EXPECT_FALSE(fs::exists(d / "x.safetensors"));  // only under its name once finished
    w.append(data.data() + 27, 2);
    EXPECT_EQ(w.current_tensor(), "");
    w.finish();
  }
  EXPECT_EQ(slurp(d / "x.safetensors"), want);
  {  // write(): pieces of tensors in any order
    SafetensorsWriter w(d / "y.safetensors", decls, meta);
    w.write(2, 4, a.data() + 1, 8);
    w.write(1, 0, b.data(), 12);
    w.write(0, 0, c.data(), 5);
    w.write(2, 0, a.data(), 4);
    w.finish();
  }
  EXPECT_EQ(slurp(d / "y.safetensors"), want);
  SafetensorsFile f(d / "y.safetensors");
  EXPECT_EQ(f.get("a").as<float>()[2], 3.5f);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.get("a").data) % 4, 0u);

  // Overrun, short write and abandonment are refused and leave nothing behind.
  {
    SafetensorsWriter w(d / "z.safetensors", {{"a", DType::F32, {2}}});
    char z[16] = {};
    EXPECT_NE(error_of([&] { w.append(z, 9); }).find("past the end"), std::string::npos);
    EXPECT_NE(error_of([&] { w.write(0, 4, z, 8); }).find("past its end"), std::string::npos);
    EXPECT_NE(error_of([&] { w.write(1, 0, z, 1); }).find("no tensor #1"), std::string::npos);
    w.write(0, 0, z, 4);
    EXPECT_NE(error_of([&] { w.finish(); }).find("4 of the 8 bytes of tensor 'a' were written"), std::string::npos);
  }
  EXPECT_FALSE(fs::exists(d / "z.safetensors"));
  for (auto& e : fs::directory_iterator(d.path)) {
    std::string n = e.path().filename();
    EXPECT_TRUE(n == "x.safetensors" || n == "y.safetensors") << n;
  }
  EXPECT_NE(error_of([&] { SafetensorsWriter w(d / "q", {{"a", DType::F32, {1}}, {"a", DType::F32, {1}}}); })
                .find("more than once"),
            std::string::npos);
}

TEST(SynthShapes, ConfigRoundTripsAndParameterCountsMatchTheRealModels) {
  std::map<std::string, std::pair<double, double>> params = {
      {"16B", {15.5e9, 16.2e9}}, {"236B", {233e9, 239e9}}, {"671B", {665e9, 677e9}}, {"v3.1", {665e9, 677e9}},
      {"tiny", {0, 0.1e9}}};
  for (const std::string& shape : model_shape_names()) {
    for (const char* dtype : {"bf16", "fp8"}) {
      ModelArgs a = shape_args(shape, dtype, 0);
      ModelArgs b = parse_model_args(synth_config_json(a), shape);
      EXPECT_EQ(b.vocab_size, 129280);
      EXPECT_EQ(b.dim, a.dim);
      EXPECT_EQ(b.inter_dim, a.inter_dim);
      EXPECT_EQ(b.moe_inter_dim, a.moe_inter_dim);
      EXPECT_EQ(b.n_layers, a.n_layers);
      EXPECT_EQ(b.n_dense_layers, a.n_dense_layers);
      EXPECT_EQ(b.n_heads, a.n_heads);
      EXPECT_EQ(b.n_routed_experts, a.n_routed_experts);
      EXPECT_EQ(b.n_shared_experts, a.n_shared_experts);
      EXPECT_EQ(b.n_activated_experts, a.n_activated_experts);
      EXPECT_EQ(b.n_expert_groups, a.n_expert_groups);
      EXPECT_EQ(b.n_limited_groups, a.n_limited_groups);
      EXPECT_EQ(b.score_func, a.score_func);
      EXPECT_EQ(b.route_scale, a.route_scale);
      EXPECT_EQ(b.norm_topk_prob, a.norm_topk_prob);
      EXPECT_EQ(b.topk_method, a.topk_method);
      EXPECT_EQ(b.q_lora_rank, a.q_lora_rank);
      EXPECT_EQ(b.kv_lora_rank, a.kv_lora_rank);
      EXPECT_EQ(b.qk_nope_head_dim, a.qk_nope_head_dim);
      EXPECT_EQ(b.qk_rope_head_dim, a.qk_rope_head_dim);
      EXPECT_EQ(b.v_head_dim, a.v_head_dim);
      EXPECT_EQ(b.max_seq_len, a.max_seq_len);
      EXPECT_TRUE(b.yarn);
      EXPECT_EQ(b.rope_factor, a.rope_factor);
      EXPECT_EQ(b.original_seq_len, a.original_seq_len);
      EXPECT_EQ(b.mscale, a.mscale);
      EXPECT_EQ(b.mscale_all_dim, a.mscale_all_dim);
      EXPECT_EQ(b.dtype, dtype);
      EXPECT_EQ(b.scale_fmt, shape == "v3.1" && std::string(dtype) == "fp8" ? "ue8m0" : "");
      EXPECT_EQ(b.softmax_scale(), a.softmax_scale());
      int64_t n = 0;
      for (auto& s : weight_manifest(b)) {
        int64_t k = 1;
        for (auto d : s.shape) k *= d;
        if (s.kind != WeightKind::kBias || b.score_func == "sigmoid") n += k;
      }
      EXPECT_GE(double(n), params[shape].first) << shape;
      EXPECT_LE(double(n), params[shape].second) << shape;
    }
  }
  // The V3 shapes are the real ones.
  ModelArgs v3 = model_shape("671B");
  EXPECT_EQ(v3.dim, 7168);
  EXPECT_EQ(v3.n_layers, 61);
  EXPECT_EQ(v3.n_dense_layers, 3);
  EXPECT_EQ(v3.n_routed_experts, 256);
  EXPECT_EQ(v3.dtype, "fp8");
  EXPECT_EQ(model_shape("16B").dtype, "bf16");
  // --layers caps the dense prefix.
  ModelArgs two = shape_args("671B", "", 2);
  EXPECT_EQ(two.n_layers, 2);
  EXPECT_EQ(two.n_dense_layers, 2);
}

TEST(SynthShapes, BadInputIsRefusedClearly) {
  EXPECT_NE(error_of([] { model_shape("7B"); }).find("unknown shape '7B' (known: tiny, 16B, 236B, 671B, v3.1)"),
            std::string::npos);
  EXPECT_NE(error_of([] { shape_args("tiny", "fp16", 0); }).find("dtype must be bf16 or fp8, got 'fp16'"),
            std::string::npos);
  EXPECT_NE(error_of([] { shape_args("tiny", "", -1); }).find("at least 1"), std::string::npos);
  TempDir d;
  SynthOptions o;
  o.out_dir = d / "m";
  o.tokenizer = false;
  o.shard_gb = 0;
  EXPECT_NE(error_of([&] { synthesize(o); }).find("shard size"), std::string::npos);
  EXPECT_FALSE(fs::exists(d / "m"));

  const std::string bin = DSV3_BINARY;
  for (auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"--shape 7B --out " + d / "m", "unknown shape '7B'"},
           {"--shape tiny --dtype int4 --out " + d / "m", "--dtype must be bf16 or fp8, got 'int4'"},
           {"--shape tiny --layers 0 --out " + d / "m", "--layers must be at least 1, got 0"},
           {"--shape tiny --layers two --out " + d / "m", "--layers expects an integer"},
           {"--shape tiny --seed -3 --out " + d / "m", "--seed expects a non-negative integer"},
           {"--shape tiny --shard-gb 0 --out " + d / "m", "--shard-gb must be positive"},
           {"--shape tiny", "missing required option --out"},
           {"--out " + d / "m", "missing required option --shape"}}) {
    auto [rc, out] = run(bin + " synth " + args);
    EXPECT_NE(rc, 0) << args;
    EXPECT_NE(out.find(want), std::string::npos) << args << " -> " << out;
    EXPECT_EQ(out.find("terminate"), std::string::npos) << out;
  }
  EXPECT_FALSE(fs::exists(d / "m"));
}

TEST(Synth, ExistingDirectoryIsRefusedUnlessForcedOnAModel) {
  TempDir d;
  fs::create_directories(d / "notes");
  std::ofstream(d / "notes/todo.txt") << "keep me";
  SynthOptions o;
  o.out_dir = d / "notes";
  o.tokenizer = false;
  o.fsync = false;
  EXPECT_NE(error_of([&] { synthesize(o); }).find("exists and is not empty (pass --force"), std::string::npos);
  o.force = true;
  EXPECT_NE(error_of([&] { synthesize(o); }).find("holds no config.json"), std::string::npos);
  EXPECT_EQ(slurp(d / "notes/todo.txt"), "keep me");
  for (auto& e : fs::directory_iterator(d.path)) EXPECT_EQ(e.path().filename(), "notes");  // no partial left

  // An empty folder is filled; a model folder is replaced with --force.
  fs::create_directories(d / "empty");
  make(d / "empty", "bf16");
  EXPECT_TRUE(fs::exists(d / "empty/config.json"));
  o.out_dir = d / "empty";
  o.force = false;
  EXPECT_NE(error_of([&] { synthesize(o); }).find("not empty"), std::string::npos);
  o.force = true;
  o.seed = 5;
  synthesize(o);
  EXPECT_EQ(load_model_args(d / "empty/config.json").dtype, "fp8");
  for (auto& e : fs::directory_iterator(d.path)) {
    std::string n = e.path().filename();
    EXPECT_TRUE(n == "notes" || n == "empty") << n;
  }
  // A missing tokenizer is an error that says how to do without.
  TempDir none;
  const char* old = std::getenv("DSV3_TOKENIZER_DIR");
  std::string saved = old ? old : "";
  ::setenv("DSV3_TOKENIZER_DIR", none.path.c_str(), 1);
  SynthOptions t;
  t.out_dir = d / "tok";
  std::string err = error_of([&] { synthesize(t); });
  if (old) ::setenv("DSV3_TOKENIZER_DIR", saved.c_str(), 1);
  else ::unsetenv("DSV3_TOKENIZER_DIR");
  EXPECT_NE(err.find("--no-tokenizer"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(d / "tok"));
}

TEST(Synth, TinyLoadsAndValidatesInBothDtypes) {
  TempDir d;
  for (const char* dtype : {"bf16", "fp8"}) {
    std::string dir = d / dtype;
    SynthResult r = make(dir, dtype);
    EXPECT_EQ(r.n_shards, 1);
    auto ck = Checkpoint::open(dir);
    EXPECT_EQ(ck->layout(), "hf");
    const ModelArgs a = load_model_args(*ck);
    EXPECT_EQ(a.dtype, dtype);
    EXPECT_GT(a.q_lora_rank, 0);
    EXPECT_GT(a.n_expert_groups, 1);
    EXPECT_EQ(a.score_func, "sigmoid");
    EXPECT_NE(a.dim % 128, 0);  // ragged FP8 blocks
    ModelWeights w = load_weights(*ck);  // every manifest tensor: dtype, shape, scale shape
    EXPECT_EQ(w.embed.dtype, DType::BF16);
    EXPECT_EQ(w.head.weight.dtype, DType::BF16);  // lm_head stays unquantised, as in the real files
    EXPECT_EQ(w.norm.dtype, DType::BF16);
    const LayerWeights& L = w.layers.back();
    ASSERT_TRUE(L.moe);
    EXPECT_EQ(L.moe_w.bias.dtype, DType::F32);
    EXPECT_EQ(L.moe_w.gate.dtype, DType::BF16);
    const DType lin = std::string(dtype) == "fp8" ? DType::F8_E4M3 : DType::BF16;
    EXPECT_EQ(L.attn.wq_a.weight.dtype, lin);
    EXPECT_EQ(L.moe_w.experts[3].w2.weight.dtype, lin);
    EXPECT_EQ(w.layers[0].ffn.w1.weight.dtype, lin);
    if (lin == DType::F8_E4M3) {
      EXPECT_EQ(L.attn.wq_b.scale.shape, (std::vector<int64_t>{3, 1}));  // [320, 96]
      EXPECT_EQ(w.layers[0].ffn.w2.scale.shape, (std::vector<int64_t>{2, 4}));  // [160, 400]
    }
    // The index lists every tensor of every shard, each in the shard that holds it.
    json idx = json::parse(slurp(dir + "/model.safetensors.index.json"));
    std::set<std::string> in_files;
    uint64_t total = 0;
    for (auto& e : fs::directory_iterator(dir)) {
      std::string f = e.path().filename();
      if (f.find(".safetensors") == std::string::npos || f.find("index") != std::string::npos) continue;
      SafetensorsFile sf(e.path().string());
      EXPECT_EQ(sf.metadata().at("format"), "pt");
      for (auto& [name, te] : sf.entries()) {
        in_files.insert(name);
        total += te.end - te.begin;
        ASSERT_TRUE(idx["weight_map"].contains(name)) << name;
        EXPECT_EQ(idx["weight_map"][name], f) << name;
      }
    }
    EXPECT_EQ(in_files.size(), idx["weight_map"].size());
    EXPECT_EQ(int(in_files.size()), r.n_tensors);
    EXPECT_EQ(idx["metadata"]["total_size"].get<uint64_t>(), total);
    EXPECT_EQ(total, r.data_bytes);
    EXPECT_EQ(ck->names().size(), in_files.size());
    for (const std::string& n : ck->names()) {  // every view aligned to its element size
      TensorView t = ck->get(n);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype), 0u) << n;
    }
    EXPECT_LT(fs::file_size(dir + "/model-00001-of-00001.safetensors"), 100u << 20);
    EXPECT_FALSE(fs::exists(dir + "/tokenizer.json"));  // tokenizer = false
  }
}

TEST(Synth, ShardsRespectTheLimitAndKeepScalesWithTheirWeights) {
  TempDir d;
  SynthResult r = make(d / "m", "fp8", 0, 0, 0.001);  // 1 MB shards: embed and head alone, layers split
  EXPECT_GE(r.n_shards, 5);
  auto ck = Checkpoint::open(d / "m");
  load_weights(*ck);
  json idx = json::parse(slurp(d / "m/model.safetensors.index.json"));
  for (int i = 1; i <= r.n_shards; ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", i, r.n_shards);
    SafetensorsFile f(d / "m/" + name);
    uint64_t data = 0;
    for (auto& [n, e] : f.entries()) data += e.end - e.begin;
    if (f.entries().size() > 2) {
      EXPECT_LE(data, uint64_t(1e6)) << name;  // only a lone tensor may exceed
    }
  }
  for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
    const std::string& n = it.key();
    const std::string suffix = ".weight_scale_inv";
    if (n.size() > suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0) {
      EXPECT_EQ(it.value(), idx["weight_map"][n.substr(0, n.size() - suffix.size()) + ".weight"]) << n;
    }
  }
}

TEST(Synth, Fp8IsTheBlockQuantisedFormOfTheBf16Values) {
  TempDir d;
  make(d / "bf16", "bf16", 7);
  make(d / "fp8", "fp8", 7);
  ModelArgs ue = shape_args("tiny", "fp8", 0);
  ue.scale_fmt = "ue8m0";
  make(d / "ue8m0", "", 7, 0, 4, &ue);
  auto cb = Checkpoint::open(d / "bf16");
  ModelWeights wb = load_weights(*cb);
  for (const char* q : {"fp8", "ue8m0"}) {
    auto cq = Checkpoint::open(d / q);
    EXPECT_EQ(load_model_args(*cq).scale_fmt, std::string(q) == "ue8m0" ? "ue8m0" : "");
    ModelWeights wq = load_weights(*cq);
    int checked = 0;
    auto compare = [&](const Linear& b, const Linear& f, const std::string& name) {
      ASSERT_EQ(b.weight.shape, f.weight.shape) << name;
      if (!f.fp8()) {  // lm_head: identical bf16
        EXPECT_EQ(std::memcmp(b.weight.data, f.weight.data, b.weight.nbytes()), 0) << name;
        return;
      }
      double num = 0, den = 0;
      const int64_t nb = (f.in() + 127) / 128;
      for (int64_t i = 0; i < f.weight.numel(); ++i) {
        float vb = load_f32(b.weight, i), vf = linear_at(f, i);
        float s = f.scale.as<float>()[(i / f.in() / 128) * nb + (i % f.in()) / 128];
        // e4m3 keeps 3 mantissa bits (half a step: 1/16 relative) down to s * 2^-6, then steps of s * 2^-9.
        ASSERT_LE(std::fabs(vf - vb), std::fabs(vb) / 16 * 1.01f + s / 1024 + std::fabs(vb) / 256)
            << name << " element " << i;
        num += double(vf - vb) * (vf - vb);
        den += double(vb) * vb;
      }
      EXPECT_LT(std::sqrt(num / den), 0.05) << name;
      if (std::string(q) == "ue8m0")
        for (int64_t k = 0; k < f.scale.numel(); ++k) {
          int e;
          EXPECT_EQ(std::frexp(f.scale.as<float>()[k], &e), 0.5f) << name << " scale " << k;
        }
      else  // scale = amax / 448: each block's largest value is stored as +-448
        for (int64_t k = 0; k < f.scale.numel(); ++k) {
          const int64_t br = k / nb, bc = k % nb;
          uint8_t mx = 0;
          for (int64_t r = br * 128; r < std::min(f.out(), br * 128 + 128); ++r)
            for (int64_t c = bc * 128; c < std::min(f.in(), bc * 128 + 128); ++c)
              mx = std::max<uint8_t>(mx, f.weight.as<uint8_t>()[r * f.in() + c] & 0x7f);
          EXPECT_EQ(mx, 0x7e) << name << " block " << k;
        }
      ++checked;
    };
    for (size_t l = 0; l < wb.layers.size(); ++l) {
      const LayerWeights &B = wb.layers[l], &F = wq.layers[l];
      std::string p = "layers." + std::to_string(l);
      compare(B.attn.wq_a, F.attn.wq_a, p + ".wq_a");
      compare(B.attn.wq_b, F.attn.wq_b, p + ".wq_b");
      compare(B.attn.wkv_a, F.attn.wkv_a, p + ".wkv_a");
      compare(B.attn.wkv_b, F.attn.wkv_b, p + ".wkv_b");
      compare(B.attn.wo, F.attn.wo, p + ".wo");
      if (B.moe) {
        compare(B.moe_w.experts[5].w1, F.moe_w.experts[5].w1, p + ".experts.5.w1");
        compare(B.moe_w.shared_experts.w2, F.moe_w.shared_experts.w2, p + ".shared.w2");
        EXPECT_EQ(std::memcmp(B.moe_w.bias.data, F.moe_w.bias.data, B.moe_w.bias.nbytes()), 0);
        EXPECT_EQ(std::memcmp(B.moe_w.gate.data, F.moe_w.gate.data, B.moe_w.gate.nbytes()), 0);
      } else {
        compare(B.ffn.w2, F.ffn.w2, p + ".w2");
      }
    }
    compare(wb.head, wq.head, "head");
    EXPECT_EQ(std::memcmp(wb.embed.data, wq.embed.data, wb.embed.nbytes()), 0);
    EXPECT_GE(checked, 15);
  }
}

TEST(Synth, FastE4m3ConversionIsExact) {
  // Every float bit pattern of |f| <= 512 at a stride, plus both neighbours of every e4m3 value
  // and of every midpoint between two (the ties), NaN, infinities and zeros.
  std::vector<float> vals = {0.f, -0.f, INFINITY, -INFINITY, NAN, 448.f, 449.f, 464.f, 480.f, 1e30f, 1e-30f};
  for (uint32_t u = 0; u <= 0x44000000u; u += 97) vals.push_back(f32_from_bits(u));
  for (int b = 0; b < 0x7f; ++b) {
    float v = e4m3_to_f32(uint8_t(b)), next = b + 1 < 0x7f ? e4m3_to_f32(uint8_t(b + 1)) : 480.f;
    for (float x : {v, (v + next) / 2}) {
      uint32_t u = bits_from_f32(x);
      for (uint32_t k : {u - 1, u, u + 1}) vals.push_back(f32_from_bits(k));
    }
  }
  int n = 0;
  for (float v : vals)
    for (float x : {v, -v}) {
      ASSERT_EQ(synth_f32_to_e4m3(x), f32_to_e4m3(x)) << x;
      ++n;
    }
  EXPECT_GT(n, 20000000);
}

TEST(Synth, DeterministicForASeedWhateverTheThreadsAndSeedsDiffer) {
  TempDir d;
  make(d / "a", "fp8", 42, 1);
  make(d / "b", "fp8", 42, 3);
  make(d / "c", "fp8", 43, 2);
  const std::string f = "/model-00001-of-00001.safetensors";
  EXPECT_EQ(slurp(d / "a" + f), slurp(d / "b" + f));
  EXPECT_EQ(slurp(d / "a/model.safetensors.index.json"), slurp(d / "c/model.safetensors.index.json"));
  auto ca = Checkpoint::open(d / "a"), cc = Checkpoint::open(d / "c");
  int differ = 0, same = 0;
  for (const std::string& n : ca->names()) {
    TensorView x = ca->get(n), y = cc->get(n);
    ASSERT_EQ(x.nbytes(), y.nbytes());
    (std::memcmp(x.data, y.data, x.nbytes()) == 0 ? same : differ)++;
  }
  EXPECT_EQ(same, 0);  // every tensor changes with the seed (scales too)
  EXPECT_GT(differ, 100);
}

// Logits of single tokens through the whole model: finite, not constant, different per token,
// with an argmax that moves; and a prefill over several positions stays finite.
TEST(Synth, TinyModelGivesFiniteLogitsThatVaryWithTheToken) {
  TempDir d;
  for (const char* dtype : {"bf16", "fp8"}) {
    make(d / dtype, dtype, 1);
    ModelOptions opt;
    opt.max_seqs = 1;
    opt.max_len = 16;
    Model m(Checkpoint::open(d / dtype), make_ref_backend(), opt);
    const int V = m.args().vocab_size;
    std::vector<int32_t> toks = {0, 1, 17, 1000, 31337, 77777, 100000, 129279};
    std::vector<std::vector<float>> logits;
    std::set<int> argmaxes;
    for (int32_t t : toks) {
      std::vector<float> l(static_cast<size_t>(V));
      m.forward(&t, 1, 1, 0, l.data());
      double mean = 0, var = 0;
      for (float v : l) {
        ASSERT_TRUE(std::isfinite(v)) << dtype << " token " << t;
        mean += v;
      }
      mean /= V;
      for (float v : l) var += (v - mean) * (v - mean);
      EXPECT_GT(std::sqrt(var / V), 0.1) << dtype << " token " << t;
      argmaxes.insert(argmax(l.data(), V));
      for (auto& prev : logits) EXPECT_GT(rel_l2(l.data(), prev.data(), size_t(V)), 0.05) << dtype;
      logits.push_back(std::move(l));
    }
    EXPECT_GE(argmaxes.size(), 4u) << dtype;
    std::vector<int32_t> seq = {0, 523, 9000, 42, 128000, 7, 7, 7, 64000, 3};
    std::vector<float> l(static_cast<size_t>(V));
    m.forward(seq.data(), 1, int(seq.size()), 0, l.data());
    for (float v : l) ASSERT_TRUE(std::isfinite(v));
    std::vector<float> l2(static_cast<size_t>(V));
    int32_t next = 11;
    m.forward(&next, 1, 1, int(seq.size()), l2.data());
    for (float v : l2) ASSERT_TRUE(std::isfinite(v));
    EXPECT_GT(rel_l2(l.data(), l2.data(), size_t(V)), 0.05);
  }
}

TEST(Synth, CopiesTheTokenizerWhenThereIsOne) {
  std::string tok;
  try {
    tok = find_tokenizer_dir("");
  } catch (const Error& e) {
    GTEST_SKIP() << e.what();
  }
  TempDir d;
  auto [rc, out] = run(std::string(DSV3_BINARY) + " synth --shape tiny --out " + d / "m" + " --seed 3");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("100%"), std::string::npos) << out;  // progress lines when stderr is no terminal
  EXPECT_EQ(slurp(d / "m/tokenizer.json"), slurp(tok + "/tokenizer.json"));
  if (fs::exists(tok + "/tokenizer_config.json")) {
    EXPECT_EQ(slurp(d / "m/tokenizer_config.json"), slurp(tok + "/tokenizer_config.json"));
  }
  EXPECT_EQ(load_model_args(*Checkpoint::open(d / "m")).dtype, "fp8");  // tiny's own dtype
}

namespace {

// Starts `dsv3 synth` of a multi-GB shape into `out`, waits until it is writing weights, then
// sends `sig`. Returns the child's pid and its wait status.
std::pair<pid_t, int> start_and_signal(const std::string& out, int sig) {
  // 16B with 2 layers: ~1.7 GB if it ran to the end (it is stopped after its first batches).
  std::vector<std::string> argv_s = {DSV3_BINARY, "synth", "--shape", "16B", "--layers", "2", "--dtype", "fp8",
                                     "--no-tokenizer", "--quiet", "--threads", "1", "--out", out};
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  EXPECT_EQ(posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&fa);
  const std::string partial = out + ".partial-" + std::to_string(pid);
  bool writing = false;
  for (int i = 0; i < 600 && !writing; ++i) {  // up to 60 s
    std::error_code ec;
    for (auto& e : fs::directory_iterator(partial, ec))
      if (e.path().filename().string().rfind("model-", 0) == 0 && fs::file_size(e.path(), ec) > (8u << 20))
        writing = true;
    if (!writing) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(writing) << "synth never started writing into " << partial;
  ::kill(pid, sig);
  int st = 0;
  ::waitpid(pid, &st, 0);
  return {pid, st};
}

}  // namespace

TEST(Synth, KilledRunLeavesNoOutputDirectory) {
  TempDir d;
  const std::string out = d / "big";
  auto [pid, st] = start_and_signal(out, SIGKILL);
  EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
  EXPECT_FALSE(fs::exists(out));
  const std::string partial = out + ".partial-" + std::to_string(pid);
  EXPECT_TRUE(fs::exists(partial));  // what SIGKILL leaves: never under the final name
  // The next synth of that folder removes the dead run's leftovers.
  make(out, "bf16");
  EXPECT_FALSE(fs::exists(partial));
  EXPECT_TRUE(fs::exists(out + "/config.json"));
}

TEST(Synth, InterruptedRunCleansUp) {
  TempDir d;
  const std::string out = d / "big";
  auto [pid, st] = start_and_signal(out, SIGINT);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) != 0) << st;
  EXPECT_FALSE(fs::exists(out));
  EXPECT_FALSE(fs::exists(out + ".partial-" + std::to_string(pid)));
  for (auto& e : fs::directory_iterator(d.path)) ADD_FAILURE() << "left behind: " << e.path();
}
