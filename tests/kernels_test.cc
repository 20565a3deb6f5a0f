// The reference's kernels against golden/kernels.safetensors (produced by kernel.py / model.py):
// act_quant bit-exact, weight_dequant and fp8_gemm within bf16 rounding, rope tables within
// 2e-5, gate indices identical and weights within 1e-6.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/ref/fp8.h"
#include "golden_util.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/gate.h"
#include "model/rope.h"

using namespace dsv3;
using namespace dsv3::testing_util;

namespace {

SafetensorsFile& kernels() {
  static SafetensorsFile f(golden_dir() + "/kernels.safetensors");
  return f;
}

// Within one bf16 rounding step of the expected bf16 value.
void expect_bf16_close(const std::vector<float>& got, const TensorView& want, const char* what) {
  ASSERT_EQ(int64_t(got.size()), want.numel());
  int bad = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    float w = load_f32(want, i), g = got[size_t(i)];
    float tol = std::ldexp(1.f, -7) * std::max(std::fabs(w), 1e-30f) + 1e-30f;
    if (round_bf16(g) != w && std::fabs(g - w) > tol && ++bad < 5)
      ADD_FAILURE() << what << "[" << i << "] got " << g << " want " << w;
  }
  EXPECT_EQ(bad, 0);
}

TEST(Kernels, ActQuantIsBitExactForBothScaleFormats) {
  TensorView x = kernels().get("act_quant.x");
  std::vector<float> xf = to_floats(x);
  const int64_t rows = x.dim(0), cols = x.dim(1);
  for (std::string fmt : {"none", "ue8m0"}) {
    std::vector<uint8_t> y(static_cast<size_t>(rows * cols));
    std::vector<float> s(static_cast<size_t>(rows * cols / 128));
    act_quant(xf.data(), rows, cols, fmt == "ue8m0", y.data(), s.data());
    TensorView wy = kernels().get("act_quant." + fmt + ".y_bits"), ws = kernels().get("act_quant." + fmt + ".s");
    for (int64_t i = 0; i < rows * cols; ++i) ASSERT_EQ(y[size_t(i)], wy.as<uint8_t>()[i]) << fmt << " element " << i;
    for (int64_t i = 0; i < int64_t(s.size()); ++i) ASSERT_EQ(s[size_t(i)], ws.as<float>()[i]) << fmt << " scale " << i;
  }
}

TEST(Kernels, WeightDequantWithRaggedEdgeBlocks) {
  TensorView q = kernels().get("weight_dequant.q_bits"), s = kernels().get("weight_dequant.s");
  const int64_t m = q.dim(0), n = q.dim(1);
  std::vector<float> y(static_cast<size_t>(m * n));
  weight_dequant(q.as<uint8_t>(), s.as<float>(), m, n, y.data());
  expect_bf16_close(y, kernels().get("weight_dequant.y"), "weight_dequant");
}

TEST(Kernels, Fp8Gemm) {
  TensorView a = kernels().get("fp8_gemm.a_bits"), b = kernels().get("fp8_gemm.b_bits");
  const int64_t M = a.dim(0), K = a.dim(1), N = b.dim(0);
  std::vector<float> c(static_cast<size_t>(M * N));
  fp8_gemm(a.as<uint8_t>(), kernels().get("fp8_gemm.a_s").as<float>(), b.as<uint8_t>(),
           kernels().get("fp8_gemm.b_s").as<float>(), M, N, K, c.data());
  expect_bf16_close(c, kernels().get("fp8_gemm.c"), "fp8_gemm");
}

ModelArgs case_args(const std::string& c) { return load_model_args(case_dir(c) + "/hf/config.json"); }

TEST(Kernels, RopeTablesMatchPrecomputeFreqsCis) {
  for (std::string c : {"v2lite_bf16", "v2_groups_bf16", "v3_fp8"}) {
    TensorView want = kernels().get("rope." + c + ".cos_sin");
    ModelArgs a = case_args(c);
    ASSERT_EQ(want.dim(1), a.qk_rope_head_dim / 2);
    RopeTable t(a, int(want.dim(0)));
    double worst = 0;
    for (int64_t p = 0; p < want.dim(0); ++p)
      for (int64_t i = 0; i < want.dim(1) * 2; ++i)
        worst = std::max(worst, double(std::fabs(t.at(int(p))[i] - want.as<float>()[p * want.dim(1) * 2 + i])));
    EXPECT_LE(worst, 2e-5) << c;
  }
}

TEST(Kernels, GateIndicesExactWeightsWithin1e6) {
  for (std::string c : {"v2_groups_bf16", "v3_fp8"}) {
    ModelArgs a = case_args(c);
    std::string p = "gate." + c + ".";
    TensorView W = kernels().get(p + "weight"), X = kernels().get(p + "x");
    TensorView wi = kernels().get(p + "indices"), ww = kernels().get(p + "weights");
    const float* bias = kernels().has(p + "bias") ? kernels().get(p + "bias").as<float>() : nullptr;
    const int64_t E = W.dim(0), D = W.dim(1), K = a.n_activated_experts;
    ASSERT_EQ(wi.dim(1), K);
    std::vector<float> logits(static_cast<size_t>(E)), scratch(static_cast<size_t>(2 * E + a.n_expert_groups)),
        wts(static_cast<size_t>(K));
    std::vector<int32_t> idx(static_cast<size_t>(K));
    for (int64_t r = 0; r < X.dim(0); ++r) {
      for (int64_t e = 0; e < E; ++e) {
        double acc = 0;
        for (int64_t d = 0; d < D; ++d) acc += double(X.as<float>()[r * D + d]) * W.as<float>()[e * D + d];
        logits[size_t(e)] = float(acc);
      }
      route_token(a, logits.data(), bias, idx.data(), wts.data(), scratch.data());
      for (int64_t k = 0; k < K; ++k) {
        EXPECT_EQ(idx[size_t(k)], wi.as<int32_t>()[r * K + k]) << c << " row " << r << " k " << k;
        EXPECT_NEAR(wts[size_t(k)], ww.as<float>()[r * K + k], 1e-6) << c << " row " << r << " k " << k;
      }
    }
  }
}

TEST(Checkpoint, HfNamesMapToReferenceNames) {
  EXPECT_EQ(hf_to_ref_name("model.layers.3.self_attn.q_a_proj.weight_scale_inv"), "layers.3.attn.wq_a.scale");
  EXPECT_EQ(hf_to_ref_name("model.layers.0.mlp.experts.12.down_proj.weight"), "layers.0.ffn.experts.12.w2.weight");
  EXPECT_EQ(hf_to_ref_name("model.layers.1.mlp.gate.e_score_correction_bias"), "layers.1.ffn.gate.bias");
  EXPECT_EQ(hf_to_ref_name("model.layers.1.mlp.shared_experts.up_proj.weight"), "layers.1.ffn.shared_experts.w3.weight");
  EXPECT_EQ(hf_to_ref_name("model.embed_tokens.weight"), "embed.weight");
  EXPECT_EQ(hf_to_ref_name("lm_head.weight"), "head.weight");
  EXPECT_EQ(hf_to_ref_name("model.norm.weight"), "norm.weight");
  EXPECT_EQ(hf_to_ref_name("model.layers.2.self_attn.kv_a_layernorm.weight"), "layers.2.attn.kv_norm.weight");
}

}  // namespace
