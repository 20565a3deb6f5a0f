// The CUDA backend's whole model against the golden float32 logits of every case (graphs, plain
// launches, fast mode, the pipelined kernel from one token, FP8 GEMM mode beside the reference's
// own FP8 GEMM row), fused and unfused; `dsv3 bench --device cuda`. Every test skips cleanly where
// no GPU is present.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include <nlohmann/json.hpp>

#include "golden_util.h"

#ifdef DSV3_HAVE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "cuda_test_util.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "runtime/model.h"
#include "runtime/rewrites.h"

using namespace dsv3;
using namespace dsv3::testing_util;
using namespace dsv3::cuda_test;

namespace {


struct GoldenParam {
  std::string name;
  AttnImpl attn;
  int variant;  // 0: default (graphs, PDL); 1: no graphs, no PDL, WMMA tensor cores from 1 token; 2: fast
                // (bf16 activations for steps of 16+ tokens); 3: pipelined kernel and cuBLAS
                // attention from 1 token, no graphs; 4 (FP8 cases): as 3 in FP8 GEMM mode for steps
                // of 16+ tokens (the prefills)
};

std::string golden_param_name(const ::testing::TestParamInfo<GoldenParam>& p) {
  static const char* v[] = {"graphs", "plain", "fast", "tc", "fp8gemm"};
  return p.param.name + (p.param.attn == AttnImpl::kAbsorb ? "_absorb_" : "_naive_") + v[p.param.variant];
}

std::vector<GoldenParam> golden_params() {
  std::vector<GoldenParam> v;
  for (auto& c : golden_cases())
    for (auto a : {AttnImpl::kAbsorb, AttnImpl::kNaive})
      for (int k = 0; k < 5; ++k)
        if (k < 4 || c.find("fp8") != std::string::npos) v.push_back({c, a, k});
  return v;
}

// The reference's own bf16 rows (golden/README.md): max and median relative L2 of its steps (each
// step's rows together), argmax agreements of its rows.
struct Bf16Row {
  double max_err, median_err;
  int agree, total;
};
Bf16Row bf16_row(const std::string& c, AttnImpl attn) {
  const bool nv = attn == AttnImpl::kNaive;
  if (c == "v2lite_bf16") return {nv ? 0.052 : 0.057, nv ? 0.0091 : 0.0095, 144, 148};
  if (c == "v2_groups_bf16") return {nv ? 0.553 : 0.439, nv ? 0.019 : 0.017, 144, 148};
  if (c == "v3_fp8") return {nv ? 0.565 : 0.386, nv ? 0.032 : 0.033, 135, 148};
  if (c == "v31_fp8_ue8m0") return {nv ? 0.404 : 0.450, nv ? 0.036 : 0.026, 140, 148};
  return {nv ? 0.566 : 0.541, nv ? 0.031 : 0.033, 94, 98};
}

// The reference's own run from the golden file (`kind`: logits_fp8gemm for gemm_impl="fp8",
// logits_bf16 / logits_naive_bf16 for bf16) against its float32 logits: bf16_row's statistics over
// steps, and the median and the worst of its single rows (a routing flip: 0.1-1.1 for bf16).
struct RefRow : Bf16Row {
  double row_median, row_max;
};
RefRow reference_row(SafetensorsFile& g, const std::string& kind) {
  std::vector<double> step_errs, row_errs;
  RefRow r{{0, 0, 0, 0}, 0, 0};
  for (int s = 0;; ++s) {
    char key[32];
    std::snprintf(key, sizeof key, "step%03d", s);
    if (!g.has(std::string(key) + ".tokens")) break;
    TensorView want = g.get(std::string(key) + ".logits_fp32"), got = g.get(std::string(key) + "." + kind);
    const int64_t B = want.dim(0), V = want.dim(1);
    step_errs.push_back(rel_l2(got.as<float>(), want.as<float>(), size_t(B * V)));
    for (int64_t b = 0; b < B; ++b) {
      r.agree += argmax(got.as<float>() + b * V, int(V)) == argmax(want.as<float>() + b * V, int(V));
      row_errs.push_back(rel_l2(got.as<float>() + b * V, want.as<float>() + b * V, size_t(V)));
    }
    r.total += int(B);
  }
  const auto [mx, med] = max_median(step_errs);
  const auto [row_mx, row_med] = max_median(row_errs);
  r.max_err = mx, r.median_err = med, r.row_median = row_med, r.row_max = row_mx;
  return r;
}

class CudaGolden : public ::testing::TestWithParam<GoldenParam> {};

TEST_P(CudaGolden, EveryStepMatchesFp32Logits) {
  REQUIRE_GPU();
  const GoldenParam& p = GetParam();
  CudaOptions o;
  if (p.variant == 1) o.graphs = false, o.pdl = false, o.tune.gemv_max = 0, o.tune.tc_min = 1 << 30;
  if (p.variant == 2) o.fast = true, o.tune.fast_min = 16;  // the golden prefills (28 tokens) in fast mode
  if (p.variant == 3 || p.variant == 4) o.graphs = false, o.tune.gemv_max = 0, o.tune.tc_min = 1, o.tune.attn_many_min = 1;
  // (FP8 GEMM mode as it ships, for steps of fast_min tokens or more: 16 here takes the golden prefills
  // of 28 tokens, while their decode steps stay float32-grade as any step below 64 tokens does; moe_tiles
  // 0 puts the prefills' experts on the grouped GEMM)
  if (p.variant == 4) o.fp8_gemm = true, o.tune.fast_min = 16, o.tune.moe_tiles = 0;
  SafetensorsFile g(case_dir(p.name) + "/golden.safetensors");
  ModelOptions mo;
  mo.attn = p.attn;
  mo.max_seqs = 4;
  Model model(Checkpoint::open(case_dir(p.name) + "/hf"), make_cuda_backend(o), mo);
  const int V = model.args().vocab_size;
  // Fast mode keeps the absorbed form's cache rows in bf16 (the reference's kv_cache and pe_cache),
  // half the bytes a position takes in float32; the naive form's K and V stay float32.
  const bool b16 = p.variant == 2 && p.attn == AttnImpl::kAbsorb;
  EXPECT_EQ(model.kv_cache().bf16(), b16);
  EXPECT_EQ(model.kv_cache().position_bytes() * (b16 ? 2 : 1), KvCache::bytes_per_position(model.args(), p.attn));
  std::vector<double> errs, step_errs;  // per row; per step (over its rows, as golden/README.md's table)
  int agree = 0, total = 0;
  for (int s = 0;; ++s) {
    char key[32];
    std::snprintf(key, sizeof key, "step%03d", s);
    if (!g.has(std::string(key) + ".tokens")) break;
    TensorView tok = g.get(std::string(key) + ".tokens"), want = g.get(std::string(key) + ".logits_fp32");
    const int B = int(tok.dim(0)), T = int(tok.dim(1));
    const int start = g.get(std::string(key) + ".start_pos").as<int32_t>()[0];
    std::vector<float> got(static_cast<size_t>(B) * V);
    model.forward(tok.as<int32_t>(), B, T, start, got.data());
    step_errs.push_back(rel_l2(got.data(), want.as<float>(), got.size()));
    for (int b = 0; b < B; ++b) {
      const float* w = want.as<float>() + size_t(b) * V;
      const double err = rel_l2(got.data() + size_t(b) * V, w, size_t(V));
      errs.push_back(err);
      const bool same = argmax(got.data() + size_t(b) * V, V) == argmax(w, V);
      agree += same, ++total;
      if (p.variant != 2 && p.variant != 4) {
        EXPECT_LE(err, 1e-3) << key << " row " << b;
        EXPECT_TRUE(same) << key << " row " << b;
      }
    }
  }
  ASSERT_FALSE(errs.empty());
  const auto [mx, med] = max_median(errs);
  const auto [smx, smed] = max_median(step_errs);
  std::printf("%s: %zu rows, max %.3g, median %.3g; %zu steps, max %.3g, median %.3g; argmax %d/%d\n",
              golden_param_name({p, 0}).c_str(), errs.size(), mx, med, step_errs.size(), smx, smed, agree, total);
  if (p.variant == 2) {  // bf16 activations and (absorb) the bf16 latent cache: no worse than the reference's
                         // own bf16 row, whose errors are per step, and no single row worse than its worst row
    const Bf16Row r = bf16_row(p.name, p.attn);
    EXPECT_LE(smx, r.max_err);
    EXPECT_LE(smed, r.median_err);
    EXPECT_LE(mx, reference_row(g, p.attn == AttnImpl::kNaive ? "logits_naive_bf16" : "logits_bf16").row_max);
    EXPECT_GE(agree * r.total, r.agree * total);
  }
  if (p.variant == 4) {  // e4m3 activations: no worse than the reference's own FP8 GEMM row on its
                         // statistics (golden/README.md: steps' max and median, argmax), and the median
                         // row no worse than its median row. (Single rows are not held to a maximum: the
                         // worst row of either is a routing flip, 0.8-1.1 in both.)
    const RefRow r = reference_row(g, "logits_fp8gemm");
    std::printf("  the reference's fp8gemm row: steps max %.3g, median %.3g; rows median %.3g; argmax %d/%d\n", r.max_err,
                r.median_err, r.row_median, r.agree, r.total);
    EXPECT_LE(smx, r.max_err);
    EXPECT_LE(smed, r.median_err);
    EXPECT_LE(med, r.row_median);
    EXPECT_GE(agree * r.total, r.agree * total);
  }
}

// Fresh prefills of the prefix with every position's logits (the long case: 283 rows).
TEST_P(CudaGolden, PrefixLogitsMatch) {
  REQUIRE_GPU();
  const GoldenParam& p = GetParam();
  if (p.variant == 2 || p.variant == 4) GTEST_SKIP() << "covered by the step test";
  CudaOptions o;
  if (p.variant == 1) o.graphs = false, o.pdl = false, o.tune.gemv_max = 0, o.tune.tc_min = 1 << 30;
  if (p.variant == 3) o.graphs = false, o.tune.gemv_max = 0, o.tune.tc_min = 1, o.tune.attn_many_min = 1;
  SafetensorsFile g(case_dir(p.name) + "/golden.safetensors");
  TensorView prefix = g.get("prefix_tokens"), want = g.get("prefix_logits_fp32");
  const int L = int(prefix.dim(1));
  ModelOptions mo;
  mo.attn = p.attn;
  mo.max_seqs = 1;
  Model model(Checkpoint::open(case_dir(p.name) + "/hf"), make_cuda_backend(o), mo);
  const int V = model.args().vocab_size;
  std::vector<TokenPos> pos(static_cast<size_t>(L));
  std::vector<int64_t> rows(static_cast<size_t>(L));
  for (int i = 0; i < L; ++i) pos[size_t(i)] = {0, i}, rows[size_t(i)] = i;
  std::vector<float> got(static_cast<size_t>(L) * V);
  BlockTable seq;
  model.kv_cache().reserve(seq, L);
  Model::Batch batch;
  batch.tokens = prefix.as<int32_t>(), batch.pos = pos.data(), batch.n = L, batch.seqs = {&seq}, batch.logit_rows = rows;
  model.forward(batch, got.data());
  for (int i = 0; i < L; ++i) {
    const float* w = want.as<float>() + size_t(i) * V;
    EXPECT_LE(rel_l2(got.data() + size_t(i) * V, w, size_t(V)), 1e-3) << "prefix length " << i + 1;
    EXPECT_EQ(argmax(got.data() + size_t(i) * V, V), argmax(w, V)) << "prefix length " << i + 1;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGolden, ::testing::ValuesIn(golden_params()), golden_param_name);

// Each rewrite of runtime/rewrites.h on its own (with the one it needs) against the unfused graph,
// in whole models: a prefill of two sequences, then decode steps of two and of one (graphs
// recorded and replayed). The logits agree to rounding, and the plan holds the fusion.
TEST(CudaRewrites, EachFusionGivesTheUnfusedLogits) {
  REQUIRE_GPU();
  const std::pair<uint32_t, Fusion> each[] = {
      {kRewriteAddRmsNorm, Fusion::kAddRmsNorm},
      {kRewriteLinearPair, Fusion::kLinearPair},
      {kRewriteAddRmsNormMoe, Fusion::kAddRmsNormMoe},
      {kRewriteMoeCombineIntoNorm, Fusion::kCombineAddRmsNorm},
      {kRewriteMoeCombineIntoNorm | kRewriteCombineIntoPair, Fusion::kCombineAddRmsNormPair},
      {kRewritesAll, Fusion::kCombineAddRmsNormPair}};
  for (std::string c : {"v2lite_bf16", "v3_fp8"}) {
    auto logits = [&](uint32_t rw, std::string* plan_seen) {
      ModelOptions mo;
      mo.max_seqs = 2, mo.max_len = 64, mo.rewrites = rw;
      Model m(Checkpoint::open(case_dir(c) + "/hf"), make_cuda_backend(opts()), mo);
      if (plan_seen)
        for (int64_t n : {int64_t(1), int64_t(2)})
          for (const Node& nd : m.graph(n, n).nodes) *plan_seen += std::string(fusion_name(nd.fusion)) + ";";
      const int V = m.args().vocab_size;
      std::vector<float> all, out(size_t(2 * V));
      const std::vector<int32_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8};
      m.forward(prompt.data(), 2, 6, 0, out.data());
      all.insert(all.end(), out.begin(), out.end());
      for (int s = 0; s < 4; ++s) {
        const int32_t next[2] = {int32_t(7 + s), int32_t(11 + s)};
        m.forward(next, s < 2 ? 2 : 1, 1, 6 + s, out.data());
        all.insert(all.end(), out.begin(), out.begin() + (s < 2 ? 2 : 1) * V);
      }
      return all;
    };
    const std::vector<float> plain = logits(0, nullptr);
    for (auto [rw, f] : each) {
      std::string seen;
      const std::vector<float> fused = logits(rw, &seen);
      const std::string what = str(c, " rewrites ", rw);
      EXPECT_NE(seen.find(fusion_name(f)), std::string::npos) << what << ": " << seen;
      ASSERT_EQ(fused.size(), plain.size());
      EXPECT_LE(rel_l2(fused.data(), plain.data(), plain.size()), 1e-5) << what;
    }
  }
}

// FP8 GEMM mode asked for where it takes nothing (a bf16 checkpoint) says so when the weights load;
// an FP8 checkpoint on a Hopper GPU loads without the warning.
TEST(CudaFp8GemmMode, WarnsWhereItHasNoEffect) {
  REQUIRE_GPU();
  auto load_stderr = [](const std::string& c) {
    CudaOptions o = opts();
    o.fp8_gemm = true;
    ModelOptions mo;
    mo.max_seqs = 1, mo.max_len = 16;
    ::testing::internal::CaptureStderr();
    { Model m(Checkpoint::open(case_dir(c) + "/hf"), make_cuda_backend(o), mo); }
    return ::testing::internal::GetCapturedStderr();
  };
  EXPECT_NE(load_stderr("v2lite_bf16").find("DSV3_CUDA_FP8_GEMM has no effect: the checkpoint has no FP8 weights"),
            std::string::npos);
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9) {
    EXPECT_EQ(load_stderr("v3_fp8").find("DSV3_CUDA_FP8_GEMM"), std::string::npos);
  }
}

}  // namespace

#endif  // DSV3_HAVE_CUDA

#ifdef DSV3_BINARY  // the dsv3 binary is built beside the tests (not in the GPU machine's build)
namespace {

bool gpu_usable() {
#ifdef DSV3_HAVE_CUDA
  return dsv3::cuda::device_available();
#else
  return false;
#endif
}

// `dsv3 bench --device cuda`: on a GPU, one JSON object with the HBM floor; without one (or
// without the CUDA build), a one-line error naming the option; an unknown device is refused.
TEST(BenchCommand, DeviceCuda) {
  const std::string dir = ::testing::TempDir(), out = dir + "/dsv3_bench_cuda.json", err = dir + "/dsv3_bench_cuda.err";
  const std::string cmd = std::string(DSV3_BINARY) + " bench --device cuda --model " +
                          dsv3::testing_util::case_dir("v2lite_bf16") +
                          "/hf --batch 1,3 --prompt 24 --gen 3 --decode-ctx 5 --bw-gb 0.05 --json > " + out + " 2> " + err;
  const int rc = std::system(cmd.c_str());
  std::ifstream ef(err);
  const std::string msg((std::istreambuf_iterator<char>(ef)), std::istreambuf_iterator<char>());
  if (gpu_usable()) {
    ASSERT_EQ(rc, 0) << cmd << "\n" << msg;
    std::ifstream f(out);
    nlohmann::json j = nlohmann::json::parse(f);
    EXPECT_EQ(j["device"].get<std::string>(), "cuda");
    EXPECT_GT(j["read_bandwidth_GBps"].get<double>(), 100);
    ASSERT_EQ(j["decode"].size(), 2u);
    EXPECT_GT(j["decode"][0]["fraction_of_floor"].get<double>(), 0);
  } else {
    EXPECT_NE(rc, 0);
    EXPECT_NE(msg.find("--device cuda"), std::string::npos) << msg;
  }
  if (gpu_usable()) {  // rank 0's share of a world of 2 (--tp-shard), random weights made on the GPU: half the bytes
    nlohmann::json whole, half;
    for (int tp : {1, 2}) {
      const std::string c = std::string(DSV3_BINARY) + " bench --device cuda --synthetic tiny --tp-shard " +
                            std::to_string(tp) + " --batch 1,3 --prompt 24 --gen 3 --decode-ctx 5 --bw-gb 0.05 --json > " +
                            out + " 2> " + err;
      ASSERT_EQ(std::system(c.c_str()), 0) << c;
      std::ifstream f(out);
      (tp == 1 ? whole : half) = nlohmann::json::parse(f);
    }
    EXPECT_EQ(half["tp_shard"].get<int>(), 2);
    const double ratio = half["weights_bytes"].get<double>() / whole["weights_bytes"].get<double>();
    EXPECT_GT(ratio, 0.45);
    EXPECT_LT(ratio, 0.6);  // (the gate and the low-rank projections are whole on every rank)
    EXPECT_GT(half["decode"][1]["tok_s"].get<double>(), 0);
  }
  const std::string bad = std::string(DSV3_BINARY) + " bench --device gpu --model x > /dev/null 2> " + err;
  EXPECT_NE(std::system(bad.c_str()), 0);
  std::ifstream bf(err);
  const std::string bmsg((std::istreambuf_iterator<char>(bf)), std::istreambuf_iterator<char>());
  EXPECT_NE(bmsg.find("--device must be cpu or cuda"), std::string::npos) << bmsg;
}

}  // namespace
#endif
