// The CUDA backend's attention (MLA prefill and decode, the split and many-token kernels, the q and
// value absorption) against the ref backend and float64, the device sampler against the host's,
// options and memory errors, the uploader. Every test skips cleanly where no GPU is present (the
// products: cuda_backend_test.cc; the whole model: cuda_model_test.cc).
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include <nlohmann/json.hpp>

#include "golden_util.h"

#ifdef DSV3_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/upload.h"
#include "backend/ref/fp8.h"
#include "dist/comm.h"
#include "cuda_test_util.h"
#include "golden_util.h"
#include "io/checkpoint.h"
#include "paged_util.h"
#include "runtime/rewrites.h"
#include "io/safetensors.h"
#include "model/gate.h"
#include "runtime/model.h"
#include "model/rope.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"

using namespace dsv3;
using namespace dsv3::testing_util;
using namespace dsv3::cuda_test;

namespace {

// MLA of a mixed call: three decode tokens in slots with cached history and a 7-token chunk
// from position 0, against the ref on the same random cache; outputs and written cache rows.
TEST(CudaOps, MlaMatchesRef) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  auto cuda = make_cuda_backend(opts());
  for (std::string c : {"v2lite_bf16", "v3_fp8"}) {
    TwoWeights W(c, *cuda);
    const ModelArgs& a = W.a;
    const int64_t H = a.n_heads, qk = a.qk_head_dim(), C = a.kv_lora_rank, R = a.qk_rope_head_dim, V = a.v_head_dim;
    const int slots = 4, max_len = 40;
    RopeTable rope(a, max_len);
    const test::Paged paged(slots, max_len);
    Dev rope_dev(*cuda, std::vector<float>(rope.at(0), rope.at(0) + size_t(max_len) * size_t(2 * rope.half())));
    const RopeView hrope = test::rope_view(rope), drope = test::rope_view(rope, rope_dev.p);
    std::vector<TokenPos> tp = {{0, 5}, {1, 0}, {2, 33}};
    for (int t = 0; t < 7; ++t) tp.push_back({3, t});
    const int64_t n = int64_t(tp.size());
    const Step st = paged.step(tp);
    for (AttnImpl impl : {AttnImpl::kAbsorb, AttnImpl::kNaive}) {
      const bool absorb = impl == AttnImpl::kAbsorb;
      const size_t rows = size_t(paged.rows());
      std::vector<float> c1 = randn(rows * size_t(absorb ? C : H * qk), 21), c2 = randn(rows * size_t(absorb ? R : H * V), 22);
      std::vector<float> q = randn(size_t(n * H * qk), 23), kv = randn(size_t(n * (C + R)), 24);
      // Ref on host copies.
      std::vector<float> rc1 = c1, rc2 = c2, rq = q, rkv = kv, rout(size_t(n * H * V));
      LayerCache rcache;
      (absorb ? rcache.kv : rcache.k) = rc1.data();
      (absorb ? rcache.pe : rcache.v) = rc2.data();
      ref->mla({&a, impl, &W.host.layers[1].attn, &hrope, &st, &rcache, rq.data(), rkv.data(), rout.data()});
      Dev d1(*cuda, c1), d2(*cuda, c2), dq(*cuda, q), dkv(*cuda, kv), dout(*cuda, size_t(n * H * V));
      LayerCache dcache;
      (absorb ? dcache.kv : dcache.k) = d1.p;
      (absorb ? dcache.pe : dcache.v) = d2.p;
      cuda->mla({&a, impl, &W.dev.layers[1].attn, &drope, &st, &dcache, dq.p, dkv.p, dout.p});
      const char* mode = absorb ? "absorb" : "naive";
      // 10 tokens: the tensor-core GEMM (hi + lo bf16 parts) for wkv_b, ~1e-5
      const double tol = 5e-5;
      EXPECT_LE(rel_l2(dout.get().data(), rout.data(), rout.size()), tol) << c << " " << mode;
      EXPECT_LE(rel_l2(d1.get().data(), rc1.data(), rc1.size()), tol) << c << " " << mode << " cache 1";
      EXPECT_LE(rel_l2(d2.get().data(), rc2.data(), rc2.size()), tol) << c << " " << mode << " cache 2";
    }
  }
}

// The prefill form of absorbed MLA (the run's latent rows gathered from their blocks, the flash
// kernel or cuBLAS scores/values, the output projection on the pipelined kernel): a 280-token run
// after 10 cached positions plus a decode token of another sequence.
TEST(CudaOps, MlaLongRunMatchesRef) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  // Modes: 0 float32-grade; 1 fast mode; 2 fast mode over a bf16 cache (LayerCache::bf16, as the
  // backend keeps it in fast mode): the ref runs on the rounded rows, the rows written come back
  // rounded, the 20 singles of layout 1 take the tensor-core many-token kernel. Mode 3: mode 0 with
  // each run's wkv_b product alone (tune.mla_group_rows below the two runs' 330 rows).
  for (int mode : {0, 1, 2, 3}) {
    const bool fast = mode == 1 || mode == 2, b16 = mode == 2;
    CudaOptions o = opts(fast, 0, false, 1);
    if (mode == 3) o.tune.mla_group_rows = 200;
    auto cuda = make_cuda_backend(o);
    for (std::string c : {"v2lite_bf16", "v2_groups_bf16"}) {
      TwoWeights W(c, *cuda);
      const ModelArgs& a = W.a;
      const int64_t H = a.n_heads, qk = a.qk_head_dim(), C = a.kv_lora_rank, R = a.qk_rope_head_dim, V = a.v_head_dim;
      const int max_len = 300;
      RopeTable rope(a, max_len);
      Dev rope_dev(*cuda, std::vector<float>(rope.at(0), rope.at(0) + size_t(max_len) * size_t(2 * rope.half())));
      const RopeView hrope = test::rope_view(rope), drope = test::rope_view(rope, rope_dev.p);
      // A serving step's layout: single tokens (decodes) first, on the absorbed form, then runs of
      // prompt chunks on the long-run form. Layout 0: one single and a run of 280; 1: 20 singles
      // (the many-token kernel) and runs of 100 and 80.
      for (int layout : {0, 1}) {
        const int slots = layout == 0 ? 2 : 22;
        const test::Paged paged(slots, max_len);
        std::vector<TokenPos> tp;
        if (layout == 0) {
          tp.push_back({0, 20});
          for (int t = 10; t < 290; ++t) tp.push_back({1, t});
        } else {
          for (int s = 0; s < 20; ++s) tp.push_back({s, 5 + 13 * s});
          for (int t = 0; t < 100; ++t) tp.push_back({20, t});
          for (int t = 150; t < 230; ++t) tp.push_back({21, t});
        }
        const int64_t n = int64_t(tp.size());
        const Step st = paged.step(tp);
        const size_t rows = size_t(paged.rows());
        std::vector<float> c1 = randn(rows * size_t(C), 31), c2 = randn(rows * size_t(R), 32);
        if (b16) c1 = rounded_bf16(c1), c2 = rounded_bf16(c2);
        std::vector<float> q = randn(size_t(n * H * qk), 33), kv = randn(size_t(n * (C + R)), 34);
        std::vector<float> rc1 = c1, rc2 = c2, rq = q, rkv = kv, rout(size_t(n * H * V));
        LayerCache rcache;
        rcache.kv = rc1.data(), rcache.pe = rc2.data();
        ref->mla({&a, AttnImpl::kAbsorb, &W.host.layers[1].attn, &hrope, &st, &rcache, rq.data(), rkv.data(),
                  rout.data()});
        Dev d1(*cuda, b16 ? bf16_words(c1) : c1), d2(*cuda, b16 ? bf16_words(c2) : c2), dq(*cuda, q), dkv(*cuda, kv),
            dout(*cuda, size_t(n * H * V));
        LayerCache dcache;
        dcache.kv = d1.p, dcache.pe = d2.p, dcache.bf16 = b16;
        cuda->mla({&a, AttnImpl::kAbsorb, &W.dev.layers[1].attn, &drope, &st, &dcache, dq.p, dkv.p, dout.p});
        const double tol = fast ? 1e-2 : 5e-5;  // fast: scores and values on bf16 tensor cores
        const std::string what = c + " mode " + std::to_string(mode) + " layout " + std::to_string(layout);
        EXPECT_LE(rel_l2(dout.get().data(), rout.data(), rout.size()), tol) << what;
        // (the singles alone: their rows must hold too, not only the step's norm)
        const size_t singles = size_t(layout == 0 ? 1 : 20) * size_t(H * V);
        EXPECT_LE(rel_l2(dout.get().data(), rout.data(), singles), b16 ? 1e-2 : 5e-5) << what << " singles";
        // (a bf16 cache: the written rows rounded, about 2^-9 relative each)
        const std::vector<float> got1 = b16 ? from_bf16_words(d1.get()) : d1.get(),
                                 got2 = b16 ? from_bf16_words(d2.get()) : d2.get();
        EXPECT_LE(rel_l2(got1.data(), rc1.data(), rc1.size()), b16 ? 3e-3 : 5e-5) << what << " cache kv";
        EXPECT_LE(rel_l2(got2.data(), rc2.data(), rc2.size()), b16 ? 3e-3 : 5e-5) << what << " cache pe";
      }
    }
  }
}

// The absorbed attention in double on the host: ol[i, h, :] = softmax_t((qa[i,h]·kv[t] +
// q_pe[i,h]·pe[t]) * scale) · kv over token i's positions [0, pos_i], rows through the tables.
std::vector<float> absorbed_attention_f64(const cuda::MlaDims& d, const KvView& kvv, const std::vector<cuda::DevPos>& tp,
                                          const std::vector<float>& qa, const std::vector<float>& q,
                                          const std::vector<float>& ckv, const std::vector<float>& cpe) {
  const int64_t n = int64_t(tp.size()), H = d.H, C = d.C, R = d.R, qk = d.qk();
  std::vector<float> want(size_t(n * H * C));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t len = tp[size_t(i)].pos + 1;
      std::vector<double> sc(static_cast<size_t>(len)), o(size_t(C), 0.0);
      double mx = -1e300, sum = 0;
      for (int64_t t = 0; t < len; ++t) {
        const int64_t row = kvv.row(tp[size_t(i)].slot, t);
        double v = 0;
        for (int64_t c = 0; c < C; ++c) v += double(qa[size_t((i * H + h) * C + c)]) * ckv[size_t(row * C + c)];
        for (int64_t c = 0; c < R; ++c) v += double(q[size_t((i * H + h) * qk + d.nope + c)]) * cpe[size_t(row * R + c)];
        sc[size_t(t)] = v * d.scale;
        mx = std::max(mx, sc[size_t(t)]);
      }
      for (auto& v : sc) sum += (v = std::exp(v - mx));
      for (int64_t t = 0; t < len; ++t) {
        const float* kv = ckv.data() + kvv.row(tp[size_t(i)].slot, t) * C;
        for (int64_t c = 0; c < C; ++c) o[size_t(c)] += sc[size_t(t)] * kv[c];
      }
      for (int64_t c = 0; c < C; ++c) want[size_t((i * H + h) * C + c)] = float(o[size_t(c)] / sum);
    }
  return want;
}

// The one-launch decode attention (scores, softmax, latent sum, split combination by the last
// block) at the real models' latent shape against double on the host, reading the cache through
// block tables of 16-position blocks interleaved across sequences: tokens at the first, a middle
// and the last cache position, several position splits; launched twice to show the split
// counters are left zeroed.
TEST(CudaOps, DecodeAttentionMatchesFloat64) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  const test::Paged paged(4, 2048);
  const KvView kvv = paged.view();
  DevTables tables(*cuda, paged);
  cuda::MlaDims d;
  d.H = 16, d.nope = 128, d.R = 64, d.C = 512, d.V = 128, d.scale = 0.0721f;
  tables.set(d, paged);
  const std::vector<cuda::DevPos> tp = {{0, 0}, {1, 700}, {2, 2047}, {3, 40}};  // 41: a few 16-row chunks
  const int64_t n = int64_t(tp.size()), H = d.H, C = d.C, R = d.R, qk = d.qk();
  ASSERT_TRUE(cuda::mla_decode_ok(d, n, 4096));
  const std::vector<float> qa = randn(size_t(n * H * C), 51), q = randn(size_t(n * H * qk), 52),
                           ckv = randn(size_t(paged.rows() * C), 53, 0.5f), cpe = randn(size_t(paged.rows() * R), 54, 0.5f);
  const std::vector<float> want = absorbed_attention_f64(d, kvv, tp, qa, q, ckv, cpe);
  EXPECT_GT(cuda::mla_decode_splits(d, n), 3) << "the case is meant to split the positions";
  Dev dqa(*cuda, qa), dq(*cuda, q), dkv(*cuda, ckv), dpe(*cuda, cpe), cnt(*cuda, 4096);
  Dev dpos(*cuda, pos_words(tp.data(), tp.size()));
  auto args = [&](int ns, int hb, Dev& part, Dev& ml, Dev& out) {
    cuda::DecodeAttn da;
    da.qa = dqa.p, da.q = dq.p, da.cache_kv = dkv.p, da.cache_pe = dpe.p, da.nsplit = ns, da.part = part.p;
    da.ml = ml.p, da.counters = reinterpret_cast<unsigned*>(cnt.p), da.ol = out.p, da.hb = hb;
    return da;
  };
  for (int hb : {2, 1})  // heads per block
    for (int ns : {cuda::mla_decode_splits(d, n, 0, hb), 3, 1}) {
      Dev part(*cuda, size_t(ns * n * H * C)), ml(*cuda, size_t(ns * n * H * 2));
      for (int rep = 0; rep < 2; ++rep) {  // twice (the counters reset)
        Dev out(*cuda, std::vector<float>(want.size(), std::nanf("")));
        cuda::Launch L;
        cuda::mla_decode_attn(L, d, reinterpret_cast<const cuda::DevPos*>(dpos.p), n, args(ns, hb, part, ml, out));
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> got = out.get();
        for (size_t e = 0; e < got.size(); ++e) ASSERT_TRUE(std::isfinite(got[e])) << "unwritten or NaN at " << e;
        EXPECT_LE(rel_l2(got.data(), want.data(), got.size()), 1e-5)
            << ns << " splits, launch " << rep << ", " << hb << " heads per block";
        const std::vector<float> c = cnt.get();
        EXPECT_TRUE(std::all_of(c.begin(), c.end(), [](float v) { return v == 0.f; })) << "counters left set";
      }
    }
  // Each token alone (a step of one: the kernel loads its first cache rows before the wait).
  for (int hb : {2, 1})
    for (int64_t i = 0; i < n; ++i) {
      const int ns = cuda::mla_decode_splits(d, 1, 0, hb);
      Dev part(*cuda, size_t(ns * H * C)), ml(*cuda, size_t(ns * H * 2));
      Dev pos1(*cuda, pos_words(&tp[size_t(i)], 1));
      Dev out(*cuda, std::vector<float>(size_t(H * C), std::nanf("")));
      cuda::DecodeAttn da = args(ns, hb, part, ml, out);
      da.qa = dqa.p + i * H * C, da.q = dq.p + i * H * qk;
      cuda::Launch L;
      cuda::mla_decode_attn(L, d, reinterpret_cast<const cuda::DevPos*>(pos1.p), 1, da);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> got = out.get();
      EXPECT_LE(rel_l2(got.data(), want.data() + i * H * C, got.size()), 1e-5)
          << "token " << i << " alone, " << ns << " splits, " << hb << " heads per block";
    }
}

// The many-token decode attention (serving batches) against double on the host: 40 tokens of
// 40 sequences at positions around tile (16, 32) and block (16) edges, the first and the last
// cache position, through interleaved block tables; its own split count, 3 splits and none; the
// 16B shape's heads and latent, a small shape with 20 heads (a second, partial head group) and
// the golden cases' latent with 4 heads. Three caches: float32; bf16 on the float32 kernel (the
// twin: float64 on the rounded rows within 1e-5); bf16 on the tensor-core kernel where its shape
// allows (bf16 queries and weights: the reference's bf16 error).
TEST(CudaOps, ManyTokenAttentionMatchesFloat64) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  for (int shape = 0; shape < 3; ++shape) {
    const test::Paged paged(40, shape == 0 ? 1024 : 256);
    const KvView kvv = paged.view();
    DevTables tables(*cuda, paged);
    cuda::MlaDims d;
    if (shape == 0) d.H = 16, d.nope = 128, d.R = 64, d.C = 512, d.V = 128, d.scale = 0.0721f;
    else if (shape == 1) d.H = 20, d.nope = 16, d.R = 8, d.C = 32, d.V = 16, d.scale = 0.25f;
    else d.H = 4, d.nope = 32, d.R = 16, d.C = 128, d.V = 32, d.scale = 0.144f;
    tables.set(d, paged);
    std::vector<cuda::DevPos> tp;
    const int32_t last = int32_t(paged.width * paged.block - 1);
    const int32_t at[] = {0, 1, 15, 16, 31, 32, 33, 63, 64, 95, 127, 128, 200, 255, last};
    for (int32_t s = 0; s < 40; ++s) tp.push_back({s, std::min(last, at[s % 15] + (s / 15) * 37)});
    const int64_t n = int64_t(tp.size()), H = d.H, C = d.C, R = d.R, qk = d.qk();
    ASSERT_TRUE(cuda::mla_many_ok(d));
    const std::vector<float> qa = randn(size_t(n * H * C), 61), q = randn(size_t(n * H * qk), 62),
                             ckv = randn(size_t(paged.rows() * C), 63, 0.5f),
                             cpe = randn(size_t(paged.rows() * R), 64, 0.5f);
    Dev dqa(*cuda, qa), dq(*cuda, q), dpos(*cuda, pos_words(tp.data(), tp.size()));
    int64_t len_max = 0;
    for (const cuda::DevPos& t : tp) len_max = std::max<int64_t>(len_max, t.pos + 1);
    for (int cache = 0; cache < 3; ++cache) {  // float32, bf16 on the twin, bf16 on tensor cores
      d.kv16 = cache > 0;
      const bool tc = cache == 2 && cuda::mla_many_tc_ok(d);
      if (cache == 2 && shape != 1) {
        EXPECT_TRUE(tc) << "shape " << shape << " is meant for the tensor-core kernel";
      }
      const std::vector<float> want =
          d.kv16 ? absorbed_attention_f64(d, kvv, tp, qa, q, rounded_bf16(ckv), rounded_bf16(cpe))
                 : absorbed_attention_f64(d, kvv, tp, qa, q, ckv, cpe);
      Dev dkv(*cuda, d.kv16 ? bf16_words(ckv) : ckv), dpe(*cuda, d.kv16 ? bf16_words(cpe) : cpe);
      // Splits over each token's own length (as a recorded step: no len_max) or over the step's
      // longest length.
      for (auto [ns, lm] : {std::pair{cuda::mla_many_splits(d, n, 0), int64_t(0)}, {3, 0}, {1, 0},
                            {cuda::mla_many_splits(d, n, len_max), len_max}, {2, len_max}}) {
        Dev part(*cuda, size_t(ns * n * H * C)), ml(*cuda, size_t(ns * n * H * 2));
        Dev out(*cuda, std::vector<float>(want.size(), std::nanf("")));
        cuda::DecodeAttn da;
        da.qa = dqa.p, da.q = dq.p, da.cache_kv = dkv.p, da.cache_pe = dpe.p, da.nsplit = ns, da.part = part.p;
        da.ml = ml.p, da.ol = out.p, da.len_max = lm, da.simple = cache == 1;
        cuda::Launch L;
        cuda::mla_decode_many(L, d, reinterpret_cast<const cuda::DevPos*>(dpos.p), n, da);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> got = out.get();
        for (size_t e = 0; e < got.size(); ++e) ASSERT_TRUE(std::isfinite(got[e])) << "unwritten or NaN at " << e;
        const std::string what = str("shape ", shape, ", cache ", cache, ", ", ns, " splits over ",
                                     lm ? str(lm, " positions") : std::string("each token's length"));
        const double err = rel_l2(got.data(), want.data(), got.size());
        EXPECT_LE(err, tc ? 4e-3 : 1e-5) << what;  // (tc: 1.2e-3 to 1.4e-3 measured, H100)
        double worst = 0;
        for (int64_t i = 0; i < n; ++i) {  // each token on its own, so no token's error hides in the others'
          const double e = rel_l2(got.data() + i * H * C, want.data() + i * H * C, size_t(H * C));
          worst = std::max(worst, e);
          EXPECT_LE(e, tc ? 2e-2 : 2e-5) << what << ", token " << i << " at " << tp[size_t(i)].pos;
        }
        if (tc) std::printf("[ tc many ] %s: rel l2 %.3g, worst token %.3g\n", what.c_str(), err, worst);
      }
    }
  }
}

// The one-launch decode attention and the score / value kernels over a bf16 cache: float64 on
// the rounded rows (the kernels widen them; every sum stays float32).
TEST(CudaOps, DecodeAttentionOnBf16Cache) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  const test::Paged paged(4, 512);
  const KvView kvv = paged.view();
  DevTables tables(*cuda, paged);
  cuda::MlaDims d;
  d.H = 16, d.nope = 128, d.R = 64, d.C = 512, d.V = 128, d.scale = 0.0721f, d.kv16 = true;
  tables.set(d, paged);
  const std::vector<cuda::DevPos> tp = {{0, 0}, {1, 300}, {2, 511}, {3, 40}};
  const int64_t n = int64_t(tp.size()), H = d.H, C = d.C, R = d.R, qk = d.qk();
  const std::vector<float> qa = randn(size_t(n * H * C), 71), q = randn(size_t(n * H * qk), 72),
                           ckv = randn(size_t(paged.rows() * C), 73, 0.5f), cpe = randn(size_t(paged.rows() * R), 74, 0.5f);
  const std::vector<float> want = absorbed_attention_f64(d, kvv, tp, qa, q, rounded_bf16(ckv), rounded_bf16(cpe));
  Dev dqa(*cuda, qa), dq(*cuda, q), dkv(*cuda, bf16_words(ckv)), dpe(*cuda, bf16_words(cpe)), cnt(*cuda, 4096);
  Dev dpos(*cuda, pos_words(tp.data(), tp.size()));
  const cuda::DevPos* pp = reinterpret_cast<const cuda::DevPos*>(dpos.p);
  for (int form = 0; form < 2; ++form) {  // one launch; scores then values
    const int ns = form == 0 ? cuda::mla_decode_splits(d, n) : cuda::mla_splits(d, n);
    Dev part(*cuda, size_t(ns * n * H * C)), ml(*cuda, size_t(ns * n * H * 2));
    Dev out(*cuda, std::vector<float>(want.size(), std::nanf(""))), S(*cuda, size_t(n * H * d.max_len));
    cuda::DecodeAttn da;
    da.qa = dqa.p, da.q = dq.p, da.cache_kv = dkv.p, da.cache_pe = dpe.p, da.nsplit = ns, da.part = part.p;
    da.ml = ml.p, da.counters = reinterpret_cast<unsigned*>(cnt.p), da.ol = out.p;
    cuda::Launch L;
    if (form == 0) {
      cuda::mla_decode_attn(L, d, pp, n, da);
    } else {
      cuda::mla_scores(L, d, pp, n, da, S.p);
      cuda::mla_values(L, d, pp, n, S.p, da);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got = out.get();
    for (size_t e = 0; e < got.size(); ++e) ASSERT_TRUE(std::isfinite(got[e])) << "unwritten or NaN at " << e;
    EXPECT_LE(rel_l2(got.data(), want.data(), got.size()), 1e-5) << (form == 0 ? "one launch" : "scores, values");
  }
}

// One token at position p of a single-token decode attention test: its position on the device
// and the buffers for the attention's splits (mla_decode_splits, one head per block).
struct OneTokenSplits {
  cuda::DevPos tp;
  int ns;
  Dev pos, part, ml, ol;
  OneTokenSplits(Backend& be, const cuda::MlaDims& d, int32_t p)
      : tp{0, p}, ns(cuda::mla_decode_splits(d, 1, 0, 1)), pos(be, pos_words(&tp, 1)),
        part(be, size_t(ns * d.H * d.C)), ml(be, size_t(ns * d.H * 2)), ol(be, size_t(d.H * d.C)) {}
  const cuda::DevPos* pp() const { return reinterpret_cast<const cuda::DevPos*>(pos.p); }
};

// One token's value absorption combining the decode attention's position splits itself
// (mla_decode_attn with combine = false, then gemv_splits), bf16 and float32 wkv_b at the 16B
// shape: the same numbers as the attention's own combine followed by the plain GEMV, and the
// reference op's on the float64 attention. Positions 0 (one split) to 2047.
TEST(CudaOps, ValueAbsorptionCombinesSplits) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  auto cuda = make_cuda_backend(opts());
  const test::Paged paged(1, 2048);
  DevTables tables(*cuda, paged);
  cuda::MlaDims d;
  d.H = 16, d.nope = 128, d.R = 64, d.C = 512, d.V = 128, d.scale = 0.0721f;
  tables.set(d, paged);
  const int64_t H = d.H, C = d.C, R = d.R, V = d.V, KV = d.nope + d.V;
  const std::vector<float> qa = randn(size_t(H * C), 61), q = randn(size_t(H * d.qk()), 62),
                           ckv = randn(size_t(paged.rows() * C), 63, 0.5f), cpe = randn(size_t(paged.rows() * R), 64, 0.5f);
  Dev dqa(*cuda, qa), dq(*cuda, q), dkv(*cuda, ckv), dpe(*cuda, cpe), cnt(*cuda, 4096);
  for (DType t : {DType::BF16, DType::F32}) {
    HostLinear hw = make_linear(t, H * KV, C, 65);
    const Linear dl = to_device(*cuda, hw.lin);
    DevLinear wv = dev_linear_of(dl, H * KV, C);
    wv.row0 = d.nope, wv.rows = V;  // head 0's value rows; the shift steps to head b's
    cuda::GemvShift sh;
    sh.xs = C, sh.ys = V, sh.wrows = KV;
    cuda::Launch L;
    ASSERT_TRUE(cuda::gemv_splits_ok(L, wv));
    for (int32_t p : {0, 40, 700, 2047}) {
      OneTokenSplits k(*cuda, d, p);
      const auto* pp = k.pp();
      const int ns = k.ns;
      Dev &part = k.part, &ml = k.ml, &ol = k.ol;
      Dev want(*cuda, std::vector<float>(size_t(H * V), std::nanf(""))), got(*cuda, want.get());
      cuda::DecodeAttn da;
      da.qa = dqa.p, da.q = dq.p, da.cache_kv = dkv.p, da.cache_pe = dpe.p, da.nsplit = ns, da.part = part.p;
      da.ml = ml.p, da.counters = reinterpret_cast<unsigned*>(cnt.p), da.ol = ol.p, da.hb = 1;
      cuda::mla_decode_attn(L, d, pp, 1, da);
      cuda::gemv(L, wv, nullptr, {ol.p, H * C, nullptr, 1, want.p, H * V, int(H), sh});
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> olh = ol.get(), wanth = want.get();
      Dev ol2(*cuda, std::vector<float>(size_t(H * C), p == 0 ? 0.f : std::nanf("")));  // one split: ol is written
      da.ol = ol2.p, da.combine = false;
      cuda::mla_decode_attn(L, d, pp, 1, da);
      cuda::gemv_splits(L, wv, int(H), sh, pp, da, got.p);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> goth = got.get();
      const std::string what = str(dtype_name(t), " position ", p, ", ", ns, " splits");
      for (size_t e = 0; e < goth.size(); ++e) ASSERT_TRUE(std::isfinite(goth[e])) << what << ": NaN at " << e;
      EXPECT_LE(rel_l2(goth.data(), wanth.data(), goth.size()), 1e-6) << what;
      if (p > 0) {  // the combine left to the absorption: the attention wrote no ol
        const std::vector<float> o2 = ol2.get();
        EXPECT_TRUE(std::all_of(o2.begin(), o2.end(), [](float v) { return std::isnan(v); })) << what;
      }
      // The reference op on the GPU attention's latent, head by head.
      std::vector<float> full(size_t(H * KV)), oracle(size_t(H * V));
      for (int64_t b = 0; b < H; ++b) {
        ref->linear(olh.data() + b * C, 1, hw.lin, full.data());
        for (int64_t v = 0; v < V; ++v) oracle[size_t(b * V + v)] = full[size_t(b * KV + d.nope + v)];
      }
      EXPECT_LE(rel_l2(goth.data(), oracle.data(), goth.size()), 2e-6) << what;
    }
  }
}

// The q absorption of mla_prep_qabs at the 16B shape (nope 128, C 512, 16 heads), its forms
// (16-byte loads for 1-8 tokens, tensor cores for 40, 70 and 150: partial 16-token tiles, two
// blocks of tokens; element-wise, the twin; the tensor-core form with qabs_bf16), bf16 / e4m3 / float32
// wkv_b: against float64 on the host, and the prep half's cache row written.
TEST(CudaOps, DecodeQAbsorptionMatchesFloat64) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  const test::Paged paged(150, 16, 4);
  DevTables tables(*cuda, paged);
  cuda::MlaDims d;
  d.H = 16, d.nope = 128, d.R = 64, d.C = 512, d.V = 128, d.scale = 0.07f, d.eps = 1e-6f;
  tables.set(d, paged);
  const int64_t H = d.H, C = d.C, R = d.R, qk = d.qk(), rows = H * (d.nope + d.V);
  for (DType t : {DType::BF16, DType::F8_E4M3, DType::F32}) {
    HostLinear h = make_linear(t, rows, C, 61);
    const Linear dl = to_device(*cuda, h.lin);
    const DevLinear w = dev_linear_of(dl, rows, C);
    auto wval = [&](int64_t r, int64_t c) { return host_w(h, t, C, r, c); };
    for (int64_t n : {1, 3, 8, 40, 70, 150}) {
      std::vector<cuda::DevPos> tp;
      for (int64_t i = 0; i < n; ++i) tp.push_back({int32_t(i), int32_t(i % 5)});
      const std::vector<float> q = randn(size_t(n * H * qk), 71), kv = randn(size_t(n * (C + R)), 72),
                               nw = randn(size_t(C), 73), rope = randn(size_t(d.max_len * R), 74);
      // The tensor-core form with qabs_bf16 (fast mode) takes q_nope rounded to bf16: its oracle
      // is the same float64 sum over the rounded values.
      const std::vector<float> q16 = rounded_bf16(q);
      auto absorbed = [&](const std::vector<float>& qv) {
        std::vector<float> want(size_t(n * H * C));
        for (int64_t i = 0; i < n; ++i)
          for (int64_t hh = 0; hh < H; ++hh)
            for (int64_t c = 0; c < C; ++c) {
              double v = 0;
              for (int64_t k = 0; k < d.nope; ++k)
                v += double(qv[size_t((i * H + hh) * qk + k)]) * wval(hh * (d.nope + d.V) + k, c);
              want[size_t((i * H + hh) * C + c)] = float(v);
            }
        return want;
      };
      const std::vector<float> want32 = absorbed(q), want16 = absorbed(q16);
      for (int form : {0, 1, 2}) {  // 16-byte (tensor cores from 16 tokens), element-wise, 16-byte with qabs_bf16
        const bool vec = form != 1, b16 = form == 2 && n >= 16 && t != DType::F32;
        if (form == 2 && !b16) continue;
        const std::vector<float>& want = b16 ? want16 : want32;
        Dev dq(*cuda, q), dkv(*cuda, kv), dnw(*cuda, nw), drope(*cuda, rope);
        Dev ckv(*cuda, std::vector<float>(size_t(paged.rows() * C), 0.f)), cpe(*cuda, size_t(paged.rows() * R));
        Dev qa(*cuda, std::vector<float>(want.size(), std::nanf("")));
        Dev dpos(*cuda, pos_words(tp.data(), tp.size()));
        cuda::Launch L;
        cuda::MlaPrep prep{reinterpret_cast<const cuda::DevPos*>(dpos.p), n, dq.p, dkv.p, dnw.p, drope.p,
                           ckv.p, cpe.p};
        prep.qabs_bf16 = b16;
        cuda::mla_prep_qabs(L, d, prep, w, qa.p, vec);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> got = qa.get();
        const std::string what = std::string(dtype_name(t)) + " n=" + std::to_string(n) +
                                 (vec ? " 16-byte" : " scalar") + (b16 ? " bf16 q" : "");
        for (size_t e = 0; e < got.size(); ++e) ASSERT_TRUE(std::isfinite(got[e])) << what << ": unwritten at " << e;
        EXPECT_LE(rel_l2(got.data(), want.data(), got.size()), 2e-6) << what;
        // the prep half: token i's normalised latent in its cache row (slot i, position i % 5)
        const std::vector<float> cache = ckv.get();
        for (int64_t i = 0; i < n; ++i) {
          double ss = 0;
          for (int64_t c = 0; c < C; ++c) ss += double(kv[size_t(i * (C + R) + c)]) * kv[size_t(i * (C + R) + c)];
          const double r = 1.0 / std::sqrt(ss / double(C) + d.eps);
          const int64_t row = paged.view().row(int32_t(i), i % 5);
          for (int64_t c = 0; c < C; c += 97)
            EXPECT_NEAR(cache[size_t(row * C + c)], kv[size_t(i * (C + R) + c)] * r * nw[size_t(c)], 1e-4) << what;
        }
      }
    }
  }
}

// Greedy sampling on the device (Backend::argmax_rows) against the host sampler's greedy draw:
// random rows with planted ties and -inf, a vocabulary limit; and its errors (NaN, +inf, all -inf).
TEST(CudaOps, ArgmaxRowsMatchesTheHostSampler) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  const int64_t rows = 5, cols = 102400;
  std::vector<float> x = randn(size_t(rows * cols), 81, 3.f);
  x[size_t(1 * cols + 7)] = x[size_t(1 * cols + 90000)] = 40.f;  // a tie: 7 wins
  for (int64_t c = 0; c < cols; ++c)
    if (c % 3) x[size_t(2 * cols + c)] = -INFINITY;
  x[size_t(3 * cols + cols - 1)] = 50.f;  // beyond the limit below for one call
  for (int64_t limit : {cols, cols - 10, int64_t(1000)}) {
    Dev xd(*cuda, x);
    std::vector<int32_t> ids(static_cast<size_t>(rows), -1);
    ASSERT_TRUE(cuda->argmax_rows(xd.p, rows, cols, limit, ids.data()));
    SamplingParams g;
    for (int64_t r = 0; r < rows; ++r) {
      Sampler s(g);
      EXPECT_EQ(ids[size_t(r)], s.sample(&x[size_t(r * cols)], int(limit), {})) << "row " << r << " limit " << limit;
    }
  }
  EXPECT_EQ([&] {
    Dev xd(*cuda, x);
    std::vector<int32_t> ids(static_cast<size_t>(rows));
    cuda->argmax_rows(xd.p, rows, cols, cols, ids.data());
    return ids[1];
  }(), 7);
  for (float bad : {std::nanf(""), INFINITY}) {
    std::vector<float> y = x;
    y[size_t(4 * cols + 123)] = bad;
    Dev yd(*cuda, y);
    std::vector<int32_t> ids(static_cast<size_t>(rows));
    try {
      cuda->argmax_rows(yd.p, rows, cols, cols, ids.data());
      ADD_FAILURE() << "no error for a logit of " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("logit of token 123"), std::string::npos) << e.what();
    }
  }
  std::vector<float> ninf(size_t(cols), -INFINITY);
  Dev nd(*cuda, ninf);
  int32_t id = 0;
  EXPECT_THROW(cuda->argmax_rows(nd.p, 1, cols, cols, &id), Error);
}

// Backend::sample_rows against the host sampler's sample_at with the same u, over 102400-token
// rows: greedy, temperature alone, top-k (with ties at the boundary), top-p, min-p and their
// mixes, masked tokens, a vocabulary limit, the long draw (top-p / min-p prefixes past the 1024
// the kernel sorts, top_k above 1024, one tie group of the whole row, +0 / -0 ties); a row marked
// `host` comes back as logits; NaN / all -inf refused.
TEST(CudaOps, SampleRowsMatchTheHostSampler) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  const int64_t cols = 102400;
  struct Case {
    float t, p, minp;
    int k;
    // 0 peaked (randn * 3), 1 flat (randn * 0.1), 2 ties at 5.0 around the top 50, 3 every third -inf,
    // 4 every logit 1.0 (one tie group), 5 peaked minus 20 with 512 logits +0.0 / -0.0 on top (equal)
    int row;
    bool host;   // the device is expected to leave it to the host
    bool flag = false;
  };
  // Rows 6, 13 and from 16 on take the long draw (no sorted prefix: top_k above 1024, a top-p /
  // min-p prefix past 1024 tokens, more ties than the prefix holds).
  const std::vector<Case> cases = {
      {0.f, 1.f, 0.f, 0, 0, false},      {1.f, 1.f, 0.f, 0, 0, false},     {0.7f, 1.f, 0.f, 0, 3, false},
      {0.7f, 1.f, 0.f, 1, 0, false},     {0.8f, 1.f, 0.f, 40, 0, false},   {1.f, 1.f, 0.f, 1024, 1, false},
      {1.f, 1.f, 0.f, 1500, 0, false},   {0.7f, 0.9f, 0.f, 0, 0, false},   {0.7f, 0.5f, 0.f, 0, 3, false},
      {1.f, 1.f, 0.1f, 0, 0, false},     {0.8f, 0.8f, 0.f, 50, 0, false},  {0.9f, 1.f, 0.05f, 50, 2, false},
      {1.f, 1.f, 0.f, 50, 2, false},     {1.f, 0.99f, 0.f, 0, 1, false},   {0.7f, 0.9f, 0.f, 0, 0, true, true},
      {2.f, 1.f, 0.f, 0, 1, false},      {1.f, 0.9f, 0.f, 0, 1, false},    {1.f, 1.f, 0.001f, 0, 1, false},
      {1.5f, 0.95f, 0.02f, 3000, 0, false}, {1.f, 1.f, 0.f, 5000, 1, false}, {1.f, 0.3f, 0.f, 0, 4, false},
      {1.f, 1.f, 0.f, 2000, 4, false},   {1.f, 0.999f, 0.f, 0, 3, false},  {1.f, 0.5f, 0.f, 1500, 5, false},
      {0.6f, 0.3f, 0.f, 0, 2, false},    {1.f, 0.7f, 0.3f, 0, 1, false},   {0.5f, 0.6f, 0.f, 0, 5, false}};
  const int64_t rows = int64_t(cases.size());
  std::vector<float> x(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const Case& c = cases[size_t(r)];
    std::vector<float> v = randn(size_t(cols), uint32_t(90 + r), c.row == 1 ? 0.1f : 3.f);
    if (c.row == 4) std::fill(v.begin(), v.end(), 1.f);
    if (c.row == 5)
      for (int64_t j = 0; j < cols; ++j) v[size_t(j)] = j % 200 == 7 ? (j % 400 == 7 ? 0.f : -0.f) : v[size_t(j)] - 20.f;
    if (c.row == 2)
      for (int64_t j = 0; j < 60; ++j) v[size_t(j * 1601 + 3)] = 5.f * 3.f;  // 60 equal logits, above the rest
    if (c.row == 3)
      for (int64_t j = 0; j < cols; j += 3) v[size_t(j)] = -INFINITY;
    std::copy(v.begin(), v.end(), x.begin() + r * cols);
  }
  Dev xd(*cuda, x);
  Rng rng(5);
  for (int64_t limit : {cols, cols - 100}) {
    for (int trial = 0; trial < 6; ++trial) {
      std::vector<Backend::SampleSpec> spec(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        const Case& c = cases[size_t(r)];
        spec[size_t(r)].temperature = c.t, spec[size_t(r)].top_p = c.p, spec[size_t(r)].min_p = c.minp;
        spec[size_t(r)].top_k = c.k, spec[size_t(r)].host = c.flag;
        spec[size_t(r)].u = trial == 0 ? 0.0 : (trial == 1 ? 0.9999999 : rng.uniform());
      }
      std::vector<int32_t> ids(static_cast<size_t>(rows), -7);
      std::vector<float> back(x.size(), std::nanf(""));
      ASSERT_TRUE(cuda->sample_rows(xd.p, rows, cols, limit, spec.data(), ids.data(), back.data()));
      for (int64_t r = 0; r < rows; ++r) {
        const Case& c = cases[size_t(r)];
        SamplingParams sp;
        sp.temperature = c.t, sp.top_p = c.p, sp.min_p = c.minp, sp.top_k = c.k;
        const Sampler host(sp);
        const float* row = &x[size_t(r * cols)];
        const int32_t want = host.sample_at(row, int(limit), {}, spec[size_t(r)].u);
        const std::string what = "row " + std::to_string(r) + " limit " + std::to_string(limit) + " trial " +
                                 std::to_string(trial);
        if (c.host) {
          EXPECT_EQ(ids[size_t(r)], -1) << what << ": expected to be left to the host";
          if (ids[size_t(r)] == -1) {
            EXPECT_TRUE(std::equal(row, row + cols, back.begin() + r * cols)) << what << ": logits not copied back";
          }
        } else {
          EXPECT_EQ(ids[size_t(r)], want) << what;
        }
      }
    }
  }
  for (float bad : {std::nanf(""), INFINITY}) {
    std::vector<float> y(x.begin(), x.begin() + cols);
    y[123] = bad;
    Dev yd(*cuda, y);
    Backend::SampleSpec sp;
    sp.temperature = 1.f;
    int32_t id = 0;
    std::vector<float> back(static_cast<size_t>(cols));
    try {
      cuda->sample_rows(yd.p, 1, cols, cols, &sp, &id, back.data());
      ADD_FAILURE() << "no error for a logit of " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("logit of token 123"), std::string::npos) << e.what();
    }
  }
  std::vector<float> ninf(size_t(cols), -INFINITY);
  Dev nd(*cuda, ninf);
  Backend::SampleSpec sp;
  sp.temperature = 1.f;
  int32_t id = 0;
  std::vector<float> back(static_cast<size_t>(cols));
  EXPECT_THROW(cuda->sample_rows(nd.p, 1, cols, cols, &sp, &id, back.data()), Error);
}

// The generator drawing on the device (argmax_rows, sample_rows) matches the host sampler's path
// on the same backend (same logits, same seeds): token for token, batched, with a vocabulary
// limit; greedy, temperature, top-k, top-p, min-p, and a step mixing them with a penalised
// request (that row sampled on the host).
TEST(CudaOps, DeviceSamplingMatchesHostSampling) {
  REQUIRE_GPU();
  auto sp = [](float t, int k, float p, float minp, float rep) {
    SamplingParams s;
    s.temperature = t, s.top_k = k, s.top_p = p, s.min_p = minp, s.repetition_penalty = rep;
    return s;
  };
  const std::vector<std::vector<SamplingParams>> sets = {
      {sp(0.f, 0, 1.f, 0.f, 1.f)},
      {sp(0.8f, 0, 1.f, 0.f, 1.f)},
      {sp(0.8f, 20, 1.f, 0.f, 1.f), sp(1.f, 20, 0.9f, 0.f, 1.f)},
      {sp(0.9f, 0, 0.9f, 0.f, 1.f), sp(1.f, 0, 1.f, 0.1f, 1.f)},
      {sp(0.f, 0, 1.f, 0.f, 1.f), sp(0.8f, 0, 0.95f, 0.f, 1.f), sp(0.8f, 0, 1.f, 0.f, 1.3f)}};
  for (std::string c : {"v2lite_bf16", "v3_fp8"}) {
    ModelOptions mo;
    mo.max_seqs = 3;
    Model m(Checkpoint::open(case_dir(c) + "/hf"), make_cuda_backend(opts()), mo);
    for (size_t set = 0; set < sets.size(); ++set) {
      std::vector<GenerateRequest> reqs(3);
      for (size_t i = 0; i < reqs.size(); ++i) {
        reqs[i].prompt = {int32_t(5 + i), 6, int32_t(7 + 2 * i)};
        reqs[i].max_new_tokens = 12 + int(i);
        reqs[i].sampling = sets[set][i % sets[set].size()];
        reqs[i].sampling.seed = 11 + i;
      }
      std::vector<std::vector<int32_t>> out[2];
      for (int dev = 0; dev < 2; ++dev) {
        Generator gen(m, -1);
        gen.set_vocab_limit(300);
        gen.set_device_sampling(dev == 1);
        for (auto& r : gen.run(reqs)) out[dev].push_back(r.tokens);
      }
      EXPECT_EQ(out[0], out[1]) << c << " parameter set " << set;
      for (auto& t : out[1])
        for (int32_t id : t) EXPECT_LT(id, 300) << c;
    }
  }
}

// More device memory than the GPU has: an error in the user's terms (how much was asked, how much
// is free, what to change), and the backend still works afterwards (the error is not sticky).
TEST(CudaOps, OutOfDeviceMemoryIsSaidClearly) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  try {
    cuda->alloc(size_t(1) << 40);  // 4 TiB
    ADD_FAILURE() << "4 TiB allocated";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("out of device memory"), std::string::npos) << m;
    EXPECT_NE(m.find("4096 GiB asked"), std::string::npos) << m;
    EXPECT_NE(m.find("GiB free of"), std::string::npos) << m;
    EXPECT_NE(m.find("--kv-cache-gb"), std::string::npos) << m;
  }
  const std::vector<float> x = randn(1000, 5), y0 = randn(1000, 6);
  Dev dx(*cuda, x), dy(*cuda, y0);
  cuda->add(dy.p, dx.p, 1000);
  std::vector<float> want(y0);
  for (size_t i = 0; i < want.size(); ++i) want[i] += x[i];
  EXPECT_EQ(dy.get(), want) << "the backend after the failed allocation";
}

// Options out of range are refused with the option's name, before any device is touched (no GPU
// needed); the defaults pass.
TEST(CudaOptions, OutOfRangeOptionsAreRefused) {
  EXPECT_NO_THROW(CudaOptions().validate());
  struct IntOption {
    int CudaOptions::Tuning::*field;
    const char* name;
    std::vector<int> bad, good;
  };
  const IntOption cases[] = {
      {&CudaOptions::Tuning::tc_tm, "tc_tm", {-1, 32, 96, 256}, {0, 64, 128}},
      {&CudaOptions::Tuning::tc_swap, "tc_swap", {-1, 3}, {0, 1, 2}},
      {&CudaOptions::Tuning::gemv_max, "gemv_max", {-1, 9}, {0, 1, 8}},
      {&CudaOptions::Tuning::moe_tiles, "moe_tiles", {-1}, {0, 12}},
      {&CudaOptions::Tuning::moe_tiles_fp8gemm, "moe_tiles_fp8gemm", {-1}, {0, 5}},
      {&CudaOptions::Tuning::moe_persist_bf16_min, "moe_persist_bf16_min", {-1}, {0, 256}},
      {&CudaOptions::Tuning::mla_group_rows, "mla_group_rows", {-1, 0}, {1, 16384}},
  };
  for (const IntOption& c : cases) {
    for (int v : c.bad) {
      CudaOptions o;
      o.tune.*c.field = v;
      try {
        o.validate();
        ADD_FAILURE() << c.name << " = " << v << " accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(c.name), std::string::npos) << e.what();
      }
      EXPECT_THROW(make_cuda_backend(o), Error) << c.name << " = " << v;
    }
    for (int v : c.good) {
      CudaOptions o;
      o.tune.*c.field = v;
      EXPECT_NO_THROW(o.validate()) << c.name << " = " << v;
    }
  }
}

// The weight upload through two pinned staging buffers: ranges with gaps (alignment padding),
// pieces larger and smaller than a chunk, a chunk size that divides nothing; out-of-order puts
// are refused.
TEST(CudaOps, UploaderWritesEveryRange) {
  REQUIRE_GPU();
  const size_t total = 100000, chunk = 997;
  std::vector<std::pair<size_t, size_t>> ranges = {{0, 10}, {256, 5000}, {5376, 1}, {5632, 997}, {7000, 40000}, {99000, 1000}};
  std::mt19937 g(7);
  std::vector<char> host(total);
  for (auto& c : host) c = char(g());
  char* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, total), cudaSuccess);
  ASSERT_EQ(cudaMemset(dev, 0, total), cudaSuccess);
  cudaStream_t st;
  ASSERT_EQ(cudaStreamCreate(&st), cudaSuccess);
  {
    cuda::Uploader up(dev, total, chunk, st, false);
    for (auto [at, n] : ranges) up.put(at, host.data() + at, n);
    up.finish();
  }
  std::vector<char> back(total);
  ASSERT_EQ(cudaMemcpy(back.data(), dev, total, cudaMemcpyDeviceToHost), cudaSuccess);
  for (auto [at, n] : ranges)
    EXPECT_EQ(std::memcmp(back.data() + at, host.data() + at, n), 0) << "range at " << at << " of " << n;
  {
    cuda::Uploader up(dev, total, chunk, st, false);
    up.put(5000, host.data(), 10);
    EXPECT_THROW(up.put(100, host.data(), 10), Error);
    EXPECT_THROW(up.put(total - 5, host.data(), 10), Error);
  }
  cudaStreamDestroy(st);
  cudaFree(dev);
}

// The one-kernel prefill attention (kernels_attn.cu) against attention in double on the host:
// both head shapes it is built for (the real models' 128/64/128 and the golden models' 32/16/32),
// a run that starts after cached positions and ends inside a query block, every output written
// (poisoned with NaN before).
TEST(CudaOps, FlashPrefillMatchesFloat64) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  struct Shape {
    int nope, R, V, H;
    int64_t pos0, m;
  };
  for (Shape sh : {Shape{128, 64, 128, 3, 37, 150}, Shape{32, 16, 32, 4, 0, 97}, Shape{128, 64, 128, 2, 0, 64}}) {
    cuda::MlaDims d;
    d.H = sh.H, d.nope = sh.nope, d.R = sh.R, d.V = sh.V, d.scale = 1.f / std::sqrt(float(sh.nope + sh.R));
    ASSERT_TRUE(cuda::flash_prefill_ok(d));
    const int64_t H = sh.H, qk = sh.nope + sh.R, KV = sh.nope + sh.V, Lk = sh.pos0 + sh.m, m = sh.m;
    const std::vector<float> q = randn(size_t(m * H * qk), 41), kvb = randn(size_t(Lk * H * KV), 42),
                             pe = randn(size_t(Lk * sh.R), 43);
    std::vector<double> want(size_t(m * H * sh.V), 0.0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const float* qi = &q[size_t((i * H + h) * qk)];
        const int64_t len = sh.pos0 + i + 1;
        std::vector<double> sc(static_cast<size_t>(len));
        double mx = -1e300, sum = 0;
        for (int64_t t = 0; t < len; ++t) {
          double v = 0;
          for (int c = 0; c < sh.nope; ++c) v += double(qi[c]) * kvb[size_t((t * H + h) * KV + c)];
          for (int c = 0; c < sh.R; ++c) v += double(qi[sh.nope + c]) * pe[size_t(t * sh.R + c)];
          sc[size_t(t)] = v * d.scale;
          mx = std::max(mx, sc[size_t(t)]);
        }
        for (auto& v : sc) sum += (v = std::exp(v - mx));
        for (int64_t t = 0; t < len; ++t)
          for (int c = 0; c < sh.V; ++c)
            want[size_t((i * H + h) * sh.V + c)] += sc[size_t(t)] / sum * kvb[size_t((t * H + h) * KV + sh.nope + c)];
      }
    std::vector<float> wantf(want.begin(), want.end());
    for (bool split : {true, false}) {
      Dev dq(*cuda, q), dk(*cuda, kvb), dp(*cuda, pe);
      Dev dout(*cuda, std::vector<float>(want.size(), std::nanf("")));
      Dev ws(*cuda, cuda::flash_prefill_ws(d, m, sh.pos0) / 4 + 1);
      cuda::Launch L;
      cuda::flash_prefill(L, d, {dq.p, m, sh.pos0, dk.p, dp.p, dout.p, split, ws.p});
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> got = dout.get();
      for (size_t e = 0; e < got.size(); ++e) ASSERT_TRUE(std::isfinite(got[e])) << "unwritten or NaN at " << e;
      // split: three bf16 products per MMA (~16 bits kept); fast: operands rounded once to bf16
      EXPECT_LE(rel_l2(got.data(), wantf.data(), got.size()), split ? 5e-5 : 1e-2)
          << sh.nope << "/" << sh.R << "/" << sh.V << " m " << m << " pos0 " << sh.pos0 << (split ? " split" : " fast");
    }
  }
}

}  // namespace

#endif  // DSV3_HAVE_CUDA
