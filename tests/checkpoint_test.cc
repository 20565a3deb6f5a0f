// Checkpoint directories: the reference's own layout, and bad input — each problem gives an
// Error naming what is wrong (and through the CLI a non-zero exit), never a crash.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>

#include "golden_util.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "runtime/model.h"

using namespace dsv3;
using namespace dsv3::testing_util;

namespace {

std::string fresh_dir(const std::string& name) {
  std::string d = ::testing::TempDir() + "/dsv3_ck_" + name + "_" + std::to_string(::getpid());
  std::system(("rm -rf '" + d + "' && mkdir -p '" + d + "'").c_str());
  return d;
}

void copy_file(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  std::ofstream out(to, std::ios::binary);
  out << in.rdbuf();
}

// The tensors of a single-file golden checkpoint, to be edited and written back.
struct Tensors {
  std::unique_ptr<SafetensorsFile> src;
  std::vector<NamedTensor> list;
  explicit Tensors(const std::string& path) : src(std::make_unique<SafetensorsFile>(path)) {
    for (auto& [name, e] : src->entries()) {
      TensorView t = src->get(name);
      list.push_back({name, t.dtype, t.shape, t.data});
    }
  }
  NamedTensor* find(const std::string& n) {
    for (auto& t : list)
      if (t.name == n) return &t;
    return nullptr;
  }
};

// A v2lite checkpoint directory whose tensors went through `edit` first.
std::string edited_checkpoint(const std::string& name, const std::function<void(Tensors&)>& edit) {
  std::string src = case_dir("v2lite_bf16") + "/hf", d = fresh_dir(name);
  copy_file(src + "/config.json", d + "/config.json");
  Tensors t(src + "/model.safetensors");
  edit(t);
  write_safetensors(d + "/model.safetensors", t.list);
  return d;
}

std::string load_error(const std::string& dir) {
  try {
    auto ck = Checkpoint::open(dir);
    load_weights(*ck);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_HAS(hay, needle) EXPECT_NE(std::string(hay).find(needle), std::string::npos) << (hay)

TEST(CheckpointErrors, MissingTensorIsNamed) {
  auto d = edited_checkpoint("missing", [](Tensors& t) {
    t.list.erase(std::remove_if(t.list.begin(), t.list.end(),
                                [](auto& x) { return x.name == "model.layers.1.self_attn.kv_b_proj.weight"; }),
                 t.list.end());
  });
  EXPECT_HAS(load_error(d), "missing tensor 'layers.1.attn.wkv_b.weight'");
}

TEST(CheckpointErrors, WrongShapeIsNamed) {
  auto d = edited_checkpoint("shape", [](Tensors& t) {
    auto* x = t.find("model.layers.0.self_attn.o_proj.weight");
    std::swap(x->shape[0], x->shape[1]);
  });
  std::string e = load_error(d);
  EXPECT_HAS(e, "layers.0.attn.wo.weight");
  EXPECT_HAS(e, "has shape [128, 256], expected [256, 128]");
}

TEST(CheckpointErrors, WrongDtypeIsNamed) {
  static std::vector<int32_t> ints(256);
  auto d = edited_checkpoint("dtype", [](Tensors& t) {
    auto* x = t.find("model.norm.weight");
    x->dtype = DType::I32;
    x->data = ints.data();
  });
  std::string e = load_error(d);
  EXPECT_HAS(e, "norm.weight");
  EXPECT_HAS(e, "dtype I32");
}

TEST(CheckpointErrors, Fp8WeightWithoutItsScale) {
  static std::vector<uint8_t> q(256 * 128);
  auto d = edited_checkpoint("noscale", [](Tensors& t) {
    auto* x = t.find("model.layers.0.self_attn.o_proj.weight");
    x->dtype = DType::F8_E4M3;
    x->data = q.data();
  });
  EXPECT_HAS(load_error(d), "its scale 'layers.0.attn.wo.scale' is missing");
}

TEST(CheckpointErrors, Fp8ScaleOfTheWrongShape) {
  static std::vector<uint8_t> q(256 * 128);
  static std::vector<float> s(4, 1.f);
  auto d = edited_checkpoint("badscale", [](Tensors& t) {
    auto* x = t.find("model.layers.0.self_attn.o_proj.weight");
    x->dtype = DType::F8_E4M3;
    x->data = q.data();
    t.list.push_back({"model.layers.0.self_attn.o_proj.weight_scale_inv", DType::F32, {4, 1}, s.data()});
  });
  std::string e = load_error(d);
  EXPECT_HAS(e, "layers.0.attn.wo.scale");
  EXPECT_HAS(e, "expected [2, 1]");
}

TEST(CheckpointErrors, ShardNamedInIndexIsMissing) {
  std::string src = case_dir("v3_fp8") + "/hf", d = fresh_dir("shard");
  for (auto f : {"config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors"})
    copy_file(src + "/" + f, d + "/" + f);
  std::string e = load_error(d);
  EXPECT_HAS(e, "names shard 'model-00002-of-00002.safetensors', which is missing");
}

TEST(CheckpointErrors, TruncatedShard) {
  std::string src = case_dir("v3_fp8") + "/hf", d = fresh_dir("trunc");
  for (auto f : {"config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                 "model-00002-of-00002.safetensors"})
    copy_file(src + "/" + f, d + "/" + f);
  ASSERT_EQ(::truncate((d + "/model-00002-of-00002.safetensors").c_str(), 100000), 0);
  std::string e = load_error(d);
  EXPECT_HAS(e, "model-00002-of-00002.safetensors");
  EXPECT_HAS(e, "past the data section");
}

TEST(CheckpointErrors, ConfigNotJsonAndNoConfig) {
  std::string d = fresh_dir("cfg");
  copy_file(case_dir("v2lite_bf16") + "/hf/model.safetensors", d + "/model.safetensors");
  EXPECT_HAS(load_error(d), "no config.json");
  std::ofstream(d + "/config.json") << "{\"hidden_size\": 256,";
  EXPECT_HAS(load_error(d), "config.json: not valid JSON");
  EXPECT_HAS(load_error(fresh_dir("empty_dir") + "/nope"), "cannot open model directory");
}

// The reference's converted layout: short names in model0-mp1.safetensors plus its ModelArgs JSON.
TEST(ReferenceLayout, LoadsShortNamesWithModelArgsJson) {
  for (std::string c : {"v2lite_bf16", "v3_fp8"}) {
    std::string d = fresh_dir("ref_" + c);
    std::vector<std::unique_ptr<SafetensorsFile>> files;
    std::vector<NamedTensor> list;
    std::vector<std::string> names;
    names.reserve(1000);
    auto hf = Checkpoint::open(case_dir(c) + "/hf");
    for (auto& n : hf->names()) {
      TensorView t = hf->get(n);
      names.push_back(n);
      list.push_back({names.back(), t.dtype, t.shape, t.data});
    }
    write_safetensors(d + "/model0-mp1.safetensors", list);
    ModelOptions opt;
    opt.max_seqs = 4;
    Model m(Checkpoint::open(d, case_dir(c) + "/ref_config.json"), make_ref_backend(), opt);
    EXPECT_EQ(m.checkpoint().layout(), "reference");
    SafetensorsFile g(case_dir(c) + "/golden.safetensors");
    TensorView tok = g.get("step000.tokens"), want = g.get("step000.logits_fp32");
    const int V = m.args().vocab_size, B = int(tok.dim(0));
    std::vector<float> got(static_cast<size_t>(B) * V);
    m.forward(tok.as<int32_t>(), B, int(tok.dim(1)), 0, got.data());
    EXPECT_LE(rel_l2(got.data(), want.as<float>(), got.size()), 1e-3) << c;
  }
}

// Through the binary: bad calls files give a message and a non-zero exit.
struct CliResult {
  int code;
  std::string err;
};
CliResult run_cli(const std::string& args) {
  std::string errf = tmp_path("cli_err.txt");
  int rc = std::system((std::string(DSV3_BINARY) + " " + args + " 2>" + errf + " >/dev/null").c_str());
  std::ifstream f(errf);
  std::string err((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + WTERMSIG(rc), err};
}

std::string calls_file(const std::string& name, int start, std::vector<int32_t> tokens) {
  static std::vector<int32_t> keep;
  std::string p = fresh_dir("calls_" + name) + "/calls.safetensors";
  int32_t sp = start;
  write_safetensors(p, {{"step000.start_pos", DType::I32, {1}, &sp},
                        {"step000.tokens", DType::I32, {1, int64_t(tokens.size())}, tokens.data()}});
  return p;
}

TEST(LogitsCommandErrors, TokenOutsideVocabulary) {
  std::string out = fresh_dir("oov") + "/out.safetensors";
  CliResult r = run_cli("logits --model " + case_dir("v3_fp8") + "/hf --calls " + calls_file("oov", 0, {5, 512}) +
                  " --out " + out);
  EXPECT_EQ(r.code, 1);
  EXPECT_HAS(r.err, "token id 512 is outside the vocabulary [0, 512)");
  EXPECT_FALSE(std::ifstream(out).good()) << "no output may be written on error";
}

TEST(LogitsCommandErrors, PositionPastTheMaximum) {
  CliResult r = run_cli("logits --model " + case_dir("v3_fp8") + "/hf --calls " + calls_file("pos", 255, {5, 6}) +
                  " --out /dev/null");
  EXPECT_EQ(r.code, 1);
  EXPECT_HAS(r.err, "past the model's maximum sequence length 256");
}

TEST(LogitsCommandErrors, BadOptionsAndFiles) {
  EXPECT_HAS(run_cli("logits --model x").err, "missing required option --calls");
  CliResult r = run_cli("logits --model " + case_dir("v3_fp8") + "/hf --calls /nonexistent --out /dev/null");
  EXPECT_EQ(r.code, 1);
  EXPECT_HAS(r.err, "/nonexistent: cannot open");
  r = run_cli("logits --model " + case_dir("v3_fp8") + "/hf --calls " + calls_file("attn", 0, {1}) +
              " --out /dev/null --attn fast");
  EXPECT_HAS(r.err, "--attn must be absorb or naive");
  EXPECT_HAS(run_cli("logits --bogus 1").err, "unknown option --bogus");
  EXPECT_EQ(run_cli("nosuchcommand").code, 2);
}

TEST(InspectCommand, SummarisesAndValidates) {
  std::string out = tmp_path("inspect.txt");
  ASSERT_EQ(std::system((std::string(DSV3_BINARY) + " inspect --model " + case_dir("v3_fp8") + "/hf >" + out).c_str()), 0);
  std::ifstream f(out);
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_HAS(s, "16 routed (4 active, 4 groups, top 2 groups) + 1 shared");
  EXPECT_HAS(s, "validation  ok");
  EXPECT_HAS(s, "F8_E4M3");
  auto d = edited_checkpoint("inspect_bad", [](Tensors& t) {
    t.list.erase(std::remove_if(t.list.begin(), t.list.end(),
                                [](auto& x) { return x.name == "lm_head.weight"; }),
                 t.list.end());
  });
  CliResult r = run_cli("inspect --model " + d);
  EXPECT_EQ(r.code, 1);
  EXPECT_HAS(r.err, "missing tensor 'head.weight'");
}

}  // namespace
