// The reference-exact forward pass against the reference's float32 logits (golden/README.md):
// every step of every case, both attention modes: relative L2 <= 1e-3 and the same argmax.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <map>

#include "golden_util.h"
#include "io/safetensors.h"
#include "runtime/model.h"

using namespace dsv3;
using namespace dsv3::testing_util;

namespace {

struct Param {
  std::string name;
  AttnImpl attn;
};

void PrintTo(const Param& p, std::ostream* os) {
  *os << p.name << (p.attn == AttnImpl::kAbsorb ? " absorb" : " naive");
}

std::string param_name(const ::testing::TestParamInfo<Param>& p) {
  return p.param.name + (p.param.attn == AttnImpl::kAbsorb ? "_absorb" : "_naive");
}

std::vector<Param> all_params() {
  std::vector<Param> v;
  for (auto& c : golden_cases())
    for (auto a : {AttnImpl::kAbsorb, AttnImpl::kNaive}) v.push_back({c, a});
  return v;
}

class GoldenModel : public ::testing::TestWithParam<Param> {};

std::unique_ptr<Model> open_model(const std::string& c, AttnImpl attn, int slots, int len) {
  ModelOptions opt;
  opt.attn = attn;
  opt.max_seqs = slots;
  opt.max_len = len;
  return std::make_unique<Model>(Checkpoint::open(case_dir(c) + "/hf"), make_ref_backend(), opt);
}

TEST_P(GoldenModel, EveryStepMatchesFp32Logits) {
  const Param& p = GetParam();
  SafetensorsFile g(case_dir(p.name) + "/golden.safetensors");
  auto model = open_model(p.name, p.attn, 4, 0);
  const int V = model->args().vocab_size;
  int steps = 0;
  double worst = 0;
  for (int s = 0;; ++s) {
    char key[32];
    std::snprintf(key, sizeof key, "step%03d", s);
    if (!g.has(std::string(key) + ".tokens")) break;
    TensorView tok = g.get(std::string(key) + ".tokens"), want = g.get(std::string(key) + ".logits_fp32");
    int B = int(tok.dim(0)), T = int(tok.dim(1)), start = g.get(std::string(key) + ".start_pos").as<int32_t>()[0];
    std::vector<float> got(static_cast<size_t>(B) * V);
    model->forward(tok.as<int32_t>(), B, T, start, got.data());
    for (int b = 0; b < B; ++b) {
      const float* w = want.as<float>() + size_t(b) * V;
      double err = rel_l2(got.data() + size_t(b) * V, w, size_t(V));
      worst = std::max(worst, err);
      EXPECT_LE(err, 1e-3) << key << " row " << b;
      EXPECT_EQ(argmax(got.data() + size_t(b) * V, V), argmax(w, V)) << key << " row " << b;
    }
    ++steps;
  }
  EXPECT_GE(steps, 37);
  std::printf("%s: %d steps, worst relative L2 %.3g\n", p.name.c_str(), steps, worst);
}

TEST_P(GoldenModel, PrefixLogitsMatch) {
  const Param& p = GetParam();
  SafetensorsFile g(case_dir(p.name) + "/golden.safetensors");
  TensorView prefix = g.get("prefix_tokens"), want = g.get("prefix_logits_fp32");
  const int L = int(prefix.dim(1));
  auto model = open_model(p.name, p.attn, 1, 0);
  const int V = model->args().vocab_size;
  // A fresh prefill of prefix[:i+1], last position's logits, for a spread of i...
  for (int i : {0, 1, L / 2, L - 1}) {
    std::vector<float> got(static_cast<size_t>(V));
    model->forward(prefix.as<int32_t>(), 1, i + 1, 0, got.data());
    const float* w = want.as<float>() + size_t(i) * V;
    EXPECT_LE(rel_l2(got.data(), w, size_t(V)), 1e-3) << "prefix length " << i + 1;
    EXPECT_EQ(argmax(got.data(), V), argmax(w, V)) << "prefix length " << i + 1;
  }
  // ...and every i at once: with a causal mask, position i of one prefill is exactly that.
  std::vector<TokenPos> pos(static_cast<size_t>(L));
  std::vector<int64_t> rows(static_cast<size_t>(L));
  for (int i = 0; i < L; ++i) pos[size_t(i)] = {0, i}, rows[size_t(i)] = i;
  std::vector<float> got(static_cast<size_t>(L) * V);
  model->reset_rows();  // (the prefills above hold blocks)
  BlockTable seq;
  model->kv_cache().reserve(seq, L);
  Model::Batch b;
  b.tokens = prefix.as<int32_t>(), b.pos = pos.data(), b.n = L, b.seqs = {&seq}, b.logit_rows = rows;
  model->forward(b, got.data());
  model->kv_cache().free(seq);
  for (int i = 0; i < L; ++i) {
    const float* w = want.as<float>() + size_t(i) * V;
    EXPECT_LE(rel_l2(got.data() + size_t(i) * V, w, size_t(V)), 1e-3) << "prefix length " << i + 1;
    EXPECT_EQ(argmax(got.data() + size_t(i) * V, V), argmax(w, V)) << "prefix length " << i + 1;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenModel, ::testing::ValuesIn(all_params()), param_name);

// The replay command end to end: dsv3 logits on a golden file gives the same numbers.
TEST(LogitsCommand, ReplaysGoldenCallsThroughTheBinary) {
  std::string c = "v3_fp8", out = tmp_path("logits_cli.safetensors");
  std::string cmd = std::string(DSV3_BINARY) + " logits --model " + case_dir(c) + "/hf --calls " + case_dir(c) +
                    "/golden.safetensors --out " + out + " --attn naive 2>/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  SafetensorsFile got(out), g(case_dir(c) + "/golden.safetensors");
  int n = 0;
  for (auto& [name, e] : g.entries()) {
    if (name.size() < 12 || name.substr(name.size() - 12) != ".logits_fp32") continue;
    std::string key = name.substr(0, name.size() - 12) + ".logits";
    ASSERT_TRUE(got.has(key)) << key;
    TensorView a = got.get(key), b = g.get(name);
    ASSERT_EQ(a.shape, b.shape);
    EXPECT_LE(rel_l2(a.as<float>(), b.as<float>(), size_t(a.numel())), 1e-3) << key;
    ++n;
  }
  EXPECT_EQ(n, 37);
}

}  // namespace

namespace {
// Debug taps: every layer reports its intermediates, and they add up (h_l = h_{l-1} + attn + ffn).
TEST(DebugTaps, ReportEveryLayerAndSatisfyTheResidualSum) {
  ModelOptions opt;
  opt.max_seqs = 1;
  Model m(Checkpoint::open(case_dir("v2_groups_bf16") + "/hf"), make_ref_backend(), opt);
  std::map<std::string, std::vector<float>> taps;
  m.set_tap([&](const std::string& name, const float* d, int64_t rows, int64_t cols) {
    taps[name] = std::vector<float>(d, d + rows * cols);
  });
  std::vector<int32_t> toks = {3, 1, 4, 1, 5};
  std::vector<float> logits(static_cast<size_t>(m.args().vocab_size));
  m.forward(toks.data(), 1, 5, 0, logits.data());
  const int L = m.args().n_layers;
  EXPECT_EQ(int(taps.size()), 5 * L);
  for (int l = 1; l < L; ++l) {
    auto& prev = taps["h." + std::to_string(l - 1)];
    auto& a = taps["attn_out." + std::to_string(l)];
    auto& f = taps["ffn_out." + std::to_string(l)];
    auto& h = taps["h." + std::to_string(l)];
    ASSERT_EQ(h.size(), size_t(5 * m.args().dim));
    for (size_t i = 0; i < h.size(); ++i) ASSERT_NEAR(h[i], prev[i] + a[i] + f[i], 1e-4f * (1 + std::fabs(h[i])));
  }
}
}  // namespace
