// The CUDA backend's products against the ref backend, op by op on random inputs (ragged sizes, FP8
// with ragged edge blocks, the GEMV, tensor-core GEMV and tensor-core GEMM paths): embedding, norm,
// linears and their pairs, the router, the dense MLP and the MoE with their fusions, the stand-in
// world's collectives. The attention and sampling tests are in cuda_attention_test.cc, the whole
// model's in cuda_model_test.cc.
// Every test skips cleanly where no GPU is present.
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
#include "model/shapes.h"
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

TEST(CudaOps, Embed) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  std::vector<float> tf = randn(50 * 72, 1);
  std::vector<uint16_t> tb(tf.size());
  for (size_t i = 0; i < tf.size(); ++i) tb[i] = f32_to_bf16(tf[i]);
  for (DType t : {DType::BF16, DType::F32}) {
    TensorView table{t, {50, 72}, t == DType::BF16 ? static_cast<const void*>(tb.data()) : tf.data()};
    ModelWeights w;
    w.embed = table;
    cuda->prepare_weights(ModelArgs{}, w);
    // The whole table, and the table as a rank's slice of the vocabulary [20, 70): tokens
    // outside the rows give zero rows.
    const std::vector<int32_t> tok = {3, 0, 49, 17, 17, 8, 21, 69, 75};
    Step st;
    st.tokens = tok.data(), st.n = int64_t(tok.size());
    for (int64_t row0 : {0, 20}) {
      Dev y(*cuda, tok.size() * 72);
      cuda->embed(st, w.embed, row0, y.p);
      std::vector<float> want(tok.size() * 72);
      make_ref_backend()->embed(st, table, row0, want.data());
      EXPECT_EQ(max_abs_diff(y.get(), want), 0.0) << row0;
      const std::vector<float> got = y.get();
      EXPECT_EQ(got[1 * 72 + 5], row0 == 0 ? want[1 * 72 + 5] : 0.f);  // token 0: in the first slice only
      EXPECT_NE(got[6 * 72 + 5], 0.f);                                  // token 21: in both
    }
  }
}

TEST(CudaOps, RmsNormStridedAndInPlace) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  auto ref = make_ref_backend();
  const int64_t n = 5, d = 300, stride = 320;
  std::vector<float> x = randn(size_t(n * stride), 2), wv = randn(size_t(d), 3);
  std::vector<uint16_t> wb(static_cast<size_t>(d));
  for (int64_t i = 0; i < d; ++i) wb[size_t(i)] = f32_to_bf16(wv[size_t(i)]);
  TensorView w{DType::BF16, {d}, wb.data()};
  TensorView wd = to_device(*cuda, w);
  std::vector<float> want = x;
  ref->rmsnorm(want.data(), n, d, stride, w, 1e-6f, want.data());
  Dev xd(*cuda, x);
  cuda->rmsnorm(xd.p, n, d, stride, wd, 1e-6f, xd.p);
  EXPECT_LE(rel_l2(xd.get().data(), want.data(), want.size()), 1e-6);
}

TEST(CudaOps, Add) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  std::vector<float> a = randn(1001, 4), b = randn(1001, 5);
  Dev ad(*cuda, a), bd(*cuda, b);
  cuda->add(ad.p, bd.p, 1001);
  std::vector<float> want(1001);
  for (size_t i = 0; i < want.size(); ++i) want[i] = a[i] + b[i];
  EXPECT_EQ(max_abs_diff(ad.get(), want), 0.0);
}

struct LinCase {
  int64_t n, out, in;
};

// Every weight dtype, ragged shapes, both paths: GEMV (few tokens) and tensor cores (many), and
// the tensor cores forced for few tokens too (gemv_max 0).
TEST(CudaOps, LinearMatchesRef) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  const std::vector<LinCase> cases = {{1, 300, 256},  {3, 257, 200},  {8, 130, 100}, {1, 64, 72},   {13, 300, 384},
                                      {70, 260, 272}, {130, 129, 128}, {9, 200, 136}, {2, 33, 4096}, {200, 515, 96},
                                      {65, 128, 1024}, {64, 1, 32},   {300, 200, 128}, {257, 640, 64}};
  for (int mode = 0; mode < kModes; ++mode) {
    const bool fast = mode_opts(mode).fast;
    auto cuda = make_cuda_backend(mode_opts(mode));
    for (DType t : {DType::BF16, DType::F8_E4M3, DType::F32}) {
      for (const LinCase& c : cases) {
        HostLinear h = make_linear(t, c.out, c.in, uint32_t(c.n * 1000 + c.out + c.in));
        Linear dl = to_device(*cuda, h.lin);
        std::vector<float> x = randn(size_t(c.n * c.in), uint32_t(c.in + 7));
        std::vector<float> want(static_cast<size_t>(c.n * c.out));
        ref->linear(x.data(), c.n, h.lin, want.data());
        Dev xd(*cuda, x), yd(*cuda, size_t(c.n * c.out));
        cuda->linear(xd.p, c.n, dl, yd.p);
        const double err = rel_l2(yd.get().data(), want.data(), want.size());
        const bool tensor_cores = ((mode != 0 && mode != 2) || c.n > 8) && t != DType::F32;
        const double tol = fast && tensor_cores ? 1e-2 : (tensor_cores ? 3e-5 : 2e-6);
        EXPECT_LE(err, tol) << dtype_name(t) << " n=" << c.n << " out=" << c.out << " in=" << c.in << " mode "
                            << mode;
      }
    }
  }
}

// Every e4m3 code through every product path, exactly: weight (r, c) is code (7 r + c) mod 256
// (the NaN codes 0 instead), block scales powers of two, and token t's activations are 1 at
// column t and 0 elsewhere, so y[t, r] is the decoded weight (r, t) times its scale, with no
// rounding anywhere. (The random weights of the tests above hold few subnormal codes, and a
// subnormal lost to a flush moves their relative error by less than their tolerance.)
TEST(CudaOps, EveryE4m3CodeExactOnEveryPath) {
  REQUIRE_GPU();
  const int64_t out = 256, in = 256;
  HostLinear h = make_linear(DType::F8_E4M3, out, in, 1);
  for (int64_t r = 0; r < out; ++r)
    for (int64_t c = 0; c < in; ++c) {
      const uint8_t b = uint8_t((7 * r + c) & 0xff);
      h.q[size_t(r * in + c)] = (b & 0x7f) == 0x7f ? 0 : b;
    }
  h.scale = {1.f, 0.125f, 4.f, 1.f};  // [2, 2] blocks
  h.lin.scale.data = h.scale.data();
  for (int mode = 0; mode < kModes; ++mode) {
    auto cuda = make_cuda_backend(mode_opts(mode));
    const Linear dl = to_device(*cuda, h.lin);
    for (int64_t n : {int64_t(5), int64_t(256)}) {
      std::vector<float> x(size_t(n * in), 0.f);
      for (int64_t t = 0; t < n; ++t) x[size_t(t * in + t)] = 1.f;
      Dev xd(*cuda, x), yd(*cuda, size_t(n * out));
      cuda->linear(xd.p, n, dl, yd.p);
      const std::vector<float> y = yd.get();
      int bad = 0;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t r = 0; r < out; ++r) {
          const float want = kE4m3[h.q[size_t(r * in + t)]] * h.scale[size_t((r / 128) * 2 + t / 128)];
          const float got = y[size_t(t * out + r)];
          if (!(got == want) && bad++ < 5)
            ADD_FAILURE() << "mode " << mode << " n=" << n << " token " << t << " row " << r << " code "
                          << int(h.q[size_t(r * in + t)]) << ": " << got << " != " << want;
        }
      EXPECT_EQ(bad, 0) << "mode " << mode << " n=" << n;
    }
  }
}

// A stand-in world (dsv3 bench --tp-shard): all_reduce keeps this rank's part, all_gather puts it
// in every rank's columns ([rows, P * d]), one row or several.
TEST(CudaOps, StandInWorldKeepsThisRanksPart) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  std::unique_ptr<Comm> world = make_stand_in_comm(3);
  for (int64_t rows : {1, 4}) {
    const int64_t d = 36;
    const std::vector<float> x = randn(size_t(rows * d), uint32_t(rows));
    Dev xd(*cuda, x), yd(*cuda, std::vector<float>(size_t(rows * 3 * d), -1.f));
    cuda->all_reduce(*world, xd.p, rows * d);
    EXPECT_EQ(xd.get(), x);
    cuda->all_gather(*world, xd.p, rows, d, yd.p);
    const std::vector<float> y = yd.get();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t p = 0; p < 3; ++p)
        for (int64_t c = 0; c < d; ++c)
          ASSERT_EQ(y[size_t(r * 3 * d + p * d + c)], x[size_t(r * d + c)]) << rows << " rows, row " << r << " part " << p;
  }
}

// 2 to 8 tokens of products with rows too long for the tensor-core GEMV's shared memory (the 671B
// shape's 7168, 16384 and 18432 columns), on each of tune.long_k's paths: the tensor-core GEMV in K
// chunks (the default), the pipelined GEMM, the FMA GEMV; a linear (4096 columns: too long only for
// 8 tokens of bf16), and the dense MLP whose second stage alone is too long. Against the ref
// backend, each at its path's bar.
TEST(CudaOps, FewTokensOfLongRowsMatchRef) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  const std::vector<LinCase> cases = {{3, 256, 18432}, {8, 200, 7168}, {4, 130, 16384}, {2, 128, 7168}, {8, 96, 4096}};
  for (int long_k : {2, 1, 0}) {
    CudaOptions o;
    o.tune.long_k = long_k;
    auto cuda = make_cuda_backend(o);
    for (DType t : {DType::BF16, DType::F8_E4M3}) {
      const int32_t wt = t == DType::BF16 ? cuda::kBF16 : cuda::kFP8;
      for (const LinCase& c : cases) {
        const bool gemm = long_k == 1 && !cuda::tcv_holds(wt, c.in, c.n);
        if (!cuda::tcv_holds(wt, c.in, c.n)) {  // the chunks: equal, on the iteration, each held
          const int64_t kc = cuda::tcv_chunk(wt, c.in, c.n);
          EXPECT_GT(kc, 0) << c.in << " n=" << c.n;
          EXPECT_EQ(kc % (wt == cuda::kFP8 ? 128 : 64), 0) << kc;
          EXPECT_TRUE(cuda::tcv_holds(wt, kc, c.n)) << kc;
          EXPECT_LT(kc, c.in);
        } else {
          EXPECT_EQ(cuda::tcv_chunk(wt, c.in, c.n), c.in);
        }
        if (c.in >= 16384) {
          EXPECT_FALSE(cuda::tcv_holds(wt, c.in, c.n)) << c.in << " n=" << c.n;
        }
        HostLinear h = make_linear(t, c.out, c.in, uint32_t(c.n * 1000 + c.out));
        Linear dl = to_device(*cuda, h.lin);
        std::vector<float> x = randn(size_t(c.n * c.in), uint32_t(c.in + 11)), want(size_t(c.n * c.out));
        ref->linear(x.data(), c.n, h.lin, want.data());
        Dev xd(*cuda, x), yd(*cuda, want.size());
        cuda->linear(xd.p, c.n, dl, yd.p);
        EXPECT_LE(rel_l2(yd.get().data(), want.data(), want.size()), gemm ? 3e-5 : 2e-6)
            << dtype_name(t) << " n=" << c.n << " in=" << c.in << " long_k " << long_k;
      }
      // dense MLP: dim 512, inter 18432 (w2's K: too long from 2 tokens up... at 3 for e4m3)
      const int64_t D = 512, I = 18432;
      std::vector<HostLinear> keep;
      keep.reserve(3);
      for (auto [out, in] : {std::pair<int64_t, int64_t>{I, D}, {D, I}, {I, D}})
        keep.push_back(make_linear(t, out, in, uint32_t(out * 3 + in + keep.size())));
      MLPWeights hw{keep[0].lin, keep[1].lin, keep[2].lin};
      MLPWeights dw{to_device(*cuda, hw.w1), to_device(*cuda, hw.w2), to_device(*cuda, hw.w3)};
      for (int64_t n : {2, 4, 8}) {
        const bool gemm = long_k == 1 && !cuda::tcv_holds(wt, I, n);
        std::vector<float> x = randn(size_t(n * D), uint32_t(n + 99)), want(x.size());
        ref->mlp(hw, x.data(), n, want.data());
        Dev xd(*cuda, x), yd(*cuda, x.size());
        cuda->mlp(dw, xd.p, n, yd.p);
        EXPECT_LE(rel_l2(yd.get().data(), want.data(), want.size()), gemm ? 5e-5 : 5e-6)
            << dtype_name(t) << " mlp n=" << n << " long_k " << long_k;
      }
    }
  }
}

// The tensor-core GEMV (kernels_tcgemv.cu) called directly: plain, fused SwiGLU, two weights in
// one launch, gathered and strided activation rows, batched heads; bf16 and e4m3 weights, ragged
// rows, K from one iteration to many (so every K-slice count), 1 to 8 tokens; and the shapes it
// must refuse. Against the ref backend at the GEMV bar.
TEST(CudaOps, TensorCoreGemvMatchesRef) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  auto cuda = make_cuda_backend(opts());
  cuda::Launch L;
  L.tcv_max = 8;
  L.tcv_bf16_min = 1;
  auto sync = [] { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); };
  const double tol = 2e-6;
  struct Case {
    int64_t out, in;
  };
  for (DType t : {DType::BF16, DType::F8_E4M3}) {
    const bool fp8 = t == DType::F8_E4M3;
    for (const Case& c : std::vector<Case>{{16, 128}, {300, 256}, {1413, 2048}, {45, 1408}, {130, 512}, {7, 3072}}) {
      for (int64_t m : {1, 2, 5, 8}) {
        const std::string what = str(dtype_name(t), " ", c.out, "x", c.in, " m=", m);
        HostLinear h1 = make_linear(t, c.out, c.in, uint32_t(c.out + c.in)), h3 = make_linear(t, c.out, c.in, 99);
        const Linear d1 = to_device(*cuda, h1.lin), d3 = to_device(*cuda, h3.lin);
        const DevLinear w1 = dev_linear_of(d1, c.out, c.in), w3 = dev_linear_of(d3, c.out, c.in);
        // Token rows with a wide range (the e4m3 path scales each 128-column block of a token by
        // its own power of two): token 1 large, token 2 small, token 3's blocks alternating
        // between 3e4 and 1e-3, so a block's multiplier taken from another block shows.
        std::vector<float> x = randn(size_t(m * c.in), uint32_t(m + c.in));
        for (int64_t j = 0; j < m; ++j)
          for (int64_t k = 0; k < c.in; ++k)
            x[size_t(j * c.in + k)] *= j == 1 ? 3e4f : j == 2 ? 1e-4f : j == 3 ? ((k / 128) % 2 ? 1e-3f : 3e4f) : 1.f;
        std::vector<float> want1(size_t(m * c.out)), want3(want1.size()), wantf(want1.size());
        ref->linear(x.data(), m, h1.lin, want1.data());
        ref->linear(x.data(), m, h3.lin, want3.data());
        for (size_t e = 0; e < wantf.size(); ++e) wantf[e] = want1[e] / (1.f + std::exp(-want1[e])) * want3[e];
        Dev xd(*cuda, x), y1(*cuda, want1.size()), y3(*cuda, want1.size());
        ASSERT_TRUE(cuda::tcv_gemv(L, w1, nullptr, {xd.p, c.in, nullptr, m, y1.p, c.out, 1, {}})) << what;
        sync();
        EXPECT_LE(rel_l2(y1.get().data(), want1.data(), want1.size()), tol) << what << " plain";
        ASSERT_TRUE(cuda::tcv_gemv(L, w1, &w3, {xd.p, c.in, nullptr, m, y3.p, c.out, 1, {}})) << what;
        sync();
        EXPECT_LE(rel_l2(y3.get().data(), wantf.data(), wantf.size()), tol) << what << " fused";
        // Two weights in one launch: the second is a 40-row weight on the same activations.
        HostLinear h2 = make_linear(t, 40, c.in, 5);
        const Linear d2 = to_device(*cuda, h2.lin);
        std::vector<float> want2(size_t(m * 40));
        ref->linear(x.data(), m, h2.lin, want2.data());
        Dev z1(*cuda, want1.size()), z2(*cuda, want2.size());
        ASSERT_TRUE(cuda::tcv_gemv2(L, w1, z1.p, dev_linear_of(d2, 40, c.in), z2.p, xd.p, m)) << what;
        sync();
        EXPECT_LE(rel_l2(z1.get().data(), want1.data(), want1.size()), tol) << what << " pair first";
        EXPECT_LE(rel_l2(z2.get().data(), want2.data(), want2.size()), tol) << what << " pair second";
      }
    }
    // Gathered rows of a wider buffer: token j reads row idx[j] of x [5, in + 8].
    {
      const int64_t out = 200, in = 512, ldx = in + 8, m = 3;
      HostLinear h = make_linear(t, out, in, 77);
      const Linear d = to_device(*cuda, h.lin);
      std::vector<float> xb = randn(size_t(5 * ldx), 78), xg(size_t(m * in));
      const int32_t idx_h[3] = {4, 0, 2};
      for (int64_t j = 0; j < m; ++j) std::copy_n(xb.begin() + int64_t(idx_h[j]) * ldx, in, xg.begin() + j * in);
      std::vector<float> want(size_t(m * out));
      ref->linear(xg.data(), m, h.lin, want.data());
      int32_t* idx = nullptr;
      ASSERT_EQ(cudaMalloc(&idx, sizeof(idx_h)), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(idx, idx_h, sizeof(idx_h), cudaMemcpyHostToDevice), cudaSuccess);
      Dev xd(*cuda, xb), yd(*cuda, want.size());
      ASSERT_TRUE(cuda::tcv_gemv(L, dev_linear_of(d, out, in), nullptr, {xd.p, ldx, idx, m, yd.p, out, 1, {}}));
      sync();
      EXPECT_LE(rel_l2(yd.get().data(), want.data(), want.size()), tol) << dtype_name(t) << " gathered";
      cudaFree(idx);
    }
    // Batched heads: head b uses weight rows [b * 256, b * 256 + 128), x and y shifted.
    {
      const int64_t H = 3, V = 128, C = 256, m = 2;
      HostLinear h = make_linear(t, H * 256, C, 31);
      const Linear d = to_device(*cuda, h.lin);
      std::vector<float> x = randn(size_t(m * H * C), 32), want(size_t(m * H * V));
      for (int64_t b = 0; b < H; ++b) {
        HostLinear hb = make_linear(t, V, C, 1);  // the head's rows, copied from h
        for (int64_t r = 0; r < V; ++r)
          for (int64_t k = 0; k < C; ++k) {
            const size_t src = size_t((b * 256 + r) * C + k), dst = size_t(r * C + k);
            if (fp8) hb.q[dst] = h.q[src];
            else hb.bf16[dst] = h.bf16[src];
          }
        if (fp8)  // the head's one 128-row scale block (row block 2b of h), both column blocks
          for (int64_t k = 0; k < 2; ++k) hb.scale[size_t(k)] = h.scale[size_t((b * 2) * 2 + k)];
        std::vector<float> xb(size_t(m * C)), yb(size_t(m * V));
        for (int64_t j = 0; j < m; ++j) std::copy_n(x.begin() + (j * H + b) * C, C, xb.begin() + j * C);
        ref->linear(xb.data(), m, hb.lin, yb.data());
        for (int64_t j = 0; j < m; ++j) std::copy_n(yb.begin() + j * V, V, want.begin() + (j * H + b) * V);
      }
      DevLinear w = dev_linear_of(d, V, C);
      w.ld = C;
      cuda::GemvShift sh;
      sh.xs = C, sh.ys = V, sh.wrows = 256;
      Dev xd(*cuda, x), yd(*cuda, want.size());
      ASSERT_TRUE(cuda::tcv_gemv(L, w, nullptr, {xd.p, H * C, nullptr, m, yd.p, H * V, int(H), sh}));
      sync();
      EXPECT_LE(rel_l2(yd.get().data(), want.data(), want.size()), tol) << dtype_name(t) << " heads";
    }
  }
  // Refused: K off the iteration size, float32 weights, too many tokens, FP8 tiles off a block.
  {
    HostLinear hb = make_linear(DType::BF16, 64, 96, 1), hf = make_linear(DType::F32, 64, 128, 2),
               h8 = make_linear(DType::F8_E4M3, 64, 192, 3);
    const Linear db = to_device(*cuda, hb.lin), df = to_device(*cuda, hf.lin), d8 = to_device(*cuda, h8.lin);
    Dev xd(*cuda, randn(size_t(9 * 256), 4)), yd(*cuda, size_t(9 * 64));
    EXPECT_FALSE(cuda::tcv_gemv(L, dev_linear_of(db, 64, 96), nullptr, {xd.p, 96, nullptr, 1, yd.p, 64, 1, {}}));
    EXPECT_FALSE(cuda::tcv_gemv(L, dev_linear_of(df, 64, 128), nullptr, {xd.p, 128, nullptr, 1, yd.p, 64, 1, {}}));
    EXPECT_FALSE(cuda::tcv_gemv(L, dev_linear_of(d8, 64, 192), nullptr, {xd.p, 192, nullptr, 1, yd.p, 64, 1, {}}));
    HostLinear hk = make_linear(DType::BF16, 64, 128, 5);
    const Linear dk = to_device(*cuda, hk.lin);
    EXPECT_FALSE(cuda::tcv_gemv(L, dev_linear_of(dk, 64, 128), nullptr, {xd.p, 128, nullptr, 9, yd.p, 64, 1, {}}));
    DevLinear off = dev_linear_of(dk, 60, 128);
    off.row0 = 4;  // bf16: any row start
    EXPECT_TRUE(cuda::tcv_gemv(L, off, nullptr, {xd.p, 128, nullptr, 1, yd.p, 64, 1, {}}));
    HostLinear h8b = make_linear(DType::F8_E4M3, 64, 256, 6);
    const Linear d8b = to_device(*cuda, h8b.lin);
    DevLinear off8 = dev_linear_of(d8b, 60, 256);
    off8.row0 = 4;  // e4m3: 16-row tiles must stay inside a 128-row scale block
    EXPECT_FALSE(cuda::tcv_gemv(L, off8, nullptr, {xd.p, 256, nullptr, 1, yd.p, 64, 1, {}}));
    cuda::Launch off_l;  // tcv_max 0: off
    EXPECT_FALSE(cuda::tcv_gemv(off_l, dev_linear_of(dk, 64, 128), nullptr, {xd.p, 128, nullptr, 1, yd.p, 64, 1, {}}));
    off_l.tcv_max = 8;  // bf16 only when asked (tcv_bf16_min)
    EXPECT_FALSE(cuda::tcv_gemv(off_l, dev_linear_of(dk, 64, 128), nullptr, {xd.p, 128, nullptr, 1, yd.p, 64, 1, {}}));
    sync();
  }
}

// Two linears of the same activations as one node (linear_pair: one GEMV launch for few tokens):
// both outputs match the ref backend, fused and not, for every weight dtype the GEMVs take; the
// plan says the pair fused where gemv2 takes the weights (bf16, e4m3).
TEST(CudaOps, LinearPairMatchesRef) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  auto cuda = make_cuda_backend(opts());
  ModelArgs a;
  for (DType t : {DType::BF16, DType::F8_E4M3, DType::F32}) {
    for (int64_t n : {1, 3, 8}) {
      const int64_t in = 256;
      HostLinear h1 = make_linear(t, 300, in, 11), h2 = make_linear(t, 40, in, 12);
      const Linear d1 = to_device(*cuda, h1.lin), d2 = to_device(*cuda, h2.lin);
      const std::vector<float> x = randn(size_t(n * in), 14);
      std::vector<float> w1(size_t(n * 300)), w2(size_t(n * 40));
      ref->linear(x.data(), n, h1.lin, w1.data());
      ref->linear(x.data(), n, h2.lin, w2.data());
      for (uint32_t rw : {uint32_t(kRewritesAll), 0u}) {
        Dev dx(*cuda, x), y1(*cuda, w1.size()), y2(*cuda, w2.size());
        MiniGraph m(a, n);
        const int vx = m.value("x", dx.p, n, in), v1 = m.value("y1", y1.p, n, 300), v2 = m.value("y2", y2.p, n, 40);
        m.linear(vx, d1, v1);
        m.linear(vx, d2, v2);
        const std::string fused = m.run(*cuda, rw);
        const std::string what = str(dtype_name(t), " n ", n, rw ? " fused" : " unfused");
        if (rw && t != DType::F32) {
          EXPECT_EQ(fused, "linear_pair;") << what;
        }
        if (!rw) {
          EXPECT_EQ(fused, "") << what;
        }
        EXPECT_LE(rel_l2(y1.get().data(), w1.data(), w1.size()), 2e-6) << what << " first";
        EXPECT_LE(rel_l2(y2.get().data(), w2.data(), w2.size()), 2e-6) << what << " second";
      }
    }
  }
}

// Two linears of the same activations on the pipelined kernel (wq and wkv_a at prefill) in one
// launch: the first's rows not a whole number of tiles, so the second's tiles start past a ragged
// one; bf16 and e4m3, plain and fast mode (both stay exact), mma.sync and wgmma forms; the
// profile names the paired launch, so the test fails if the pair is not what ran.
TEST(CudaOps, TensorCoreLinearPairMatchesRef) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  ModelArgs a;
  for (int mode : {3, 4, 5, 6, 8}) {
    CudaOptions o = mode_opts(mode);
    o.profile = true;
    auto cuda = make_cuda_backend(o);
    for (DType t : {DType::BF16, DType::F8_E4M3}) {
      for (int64_t n : {1, 70, 130}) {
        const int64_t in = 256;
        HostLinear h1 = make_linear(t, 300, in, 21), h2 = make_linear(t, 72, in, 22);
        const Linear d1 = to_device(*cuda, h1.lin), d2 = to_device(*cuda, h2.lin);
        const std::vector<float> x = randn(size_t(n * in), 23);
        std::vector<float> w1(size_t(n * 300)), w2(size_t(n * 72));
        ref->linear(x.data(), n, h1.lin, w1.data());
        ref->linear(x.data(), n, h2.lin, w2.data());
        Dev dx(*cuda, x), y1(*cuda, w1.size()), y2(*cuda, w2.size());
        cuda::profile_report(*cuda, true);
        MiniGraph m(a, n);
        const int vx = m.value("x", dx.p, n, in), v1 = m.value("y1", y1.p, n, 300), v2 = m.value("y2", y2.p, n, 72);
        m.linear(vx, d1, v1);
        m.linear(vx, d2, v2);
        m.run(*cuda, kRewritesAll);
        const std::string what = str(dtype_name(t), " n ", n, " mode ", mode);
        EXPECT_LE(rel_l2(y1.get().data(), w1.data(), w1.size()), 3e-5) << what << " first";
        EXPECT_LE(rel_l2(y2.get().data(), w2.data(), w2.size()), 3e-5) << what << " second";
        const bool wgmma_fp8 = t != DType::F8_E4M3 || mode != 6;  // e4m3 takes only the wgmma form
        const std::string rep = cuda::profile_report(*cuda, true);
        if (wgmma_fp8) {
          EXPECT_NE(rep.find("linear pair tc 300+72x256"), std::string::npos) << what << "\n" << rep;
        }
      }
    }
  }
}

// act_quant on the GPU: bits and scales identical to the reference's (golden kernels), and to
// the host twin on random rows with an all-zero block, tiny and saturating values.
TEST(CudaOps, ActQuantBitExact) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  SafetensorsFile g(golden_dir() + "/kernels.safetensors");
  TensorView x = g.get("act_quant.x");
  const std::vector<float> xf = to_floats(x);
  const int64_t rows = x.dim(0), cols = x.dim(1);
  std::vector<float> xr = randn(size_t(9 * 384), 77, 3.f);
  for (int i = 0; i < 128; ++i) xr[size_t(128 + i)] = 0.f;       // amax below the 1e-4 floor
  for (int i = 0; i < 128; ++i) xr[size_t(512 + i)] *= 1e-7f;     // tiny
  xr[1000] = 3e4f, xr[1001] = -7e5f;                               // far above the others
  for (bool ue8m0 : {false, true}) {
    const char* fmt = ue8m0 ? "ue8m0" : "none";
    Dev xd(*cuda, xf);
    std::vector<uint8_t> y(size_t(rows * cols));
    std::vector<float> sc(size_t(rows * cols / 128));
    cuda::act_quant_for_test(*cuda, xd.p, rows, cols, ue8m0, y.data(), sc.data());
    TensorView wy = g.get(std::string("act_quant.") + fmt + ".y_bits"), ws = g.get(std::string("act_quant.") + fmt + ".s");
    int bad = 0;
    for (int64_t i = 0; i < rows * cols; ++i) bad += y[size_t(i)] != wy.as<uint8_t>()[i];
    for (int64_t i = 0; i < int64_t(sc.size()); ++i) bad += sc[size_t(i)] != ws.as<float>()[i];
    EXPECT_EQ(bad, 0) << fmt << " golden";
    Dev rd(*cuda, xr);
    std::vector<uint8_t> ry(xr.size()), hy(xr.size());
    std::vector<float> rs(xr.size() / 128), hs(xr.size() / 128);
    cuda::act_quant_for_test(*cuda, rd.p, 9, 384, ue8m0, ry.data(), rs.data());
    act_quant(xr.data(), 9, 384, ue8m0, hy.data(), hs.data());
    EXPECT_EQ(ry, hy) << fmt << " random";
    EXPECT_EQ(rs, hs) << fmt << " random";
  }
}

// The reference's FP8 path composed on the host (backend/ref/fp8.h): y = fp8_gemm(act_quant(x), W).
std::vector<float> host_fp8_linear(const std::vector<float>& x, int64_t n, const Linear& w) {
  const int64_t K = w.in(), N = w.out();
  std::vector<uint8_t> q(size_t(n * K));
  std::vector<float> s(size_t(n * K / 128)), y(size_t(n * N));
  act_quant(x.data(), n, K, /*ue8m0=*/false, q.data(), s.data());
  fp8_gemm(q.data(), s.data(), static_cast<const uint8_t*>(w.weight.data), w.scale.as<float>(), n, N, K, y.data());
  return y;
}
std::vector<float> host_fp8_mlp(const MLPWeights& w, const std::vector<float>& x, int64_t n) {
  const std::vector<float> a = host_fp8_linear(x, n, w.w1), b = host_fp8_linear(x, n, w.w3);
  std::vector<float> h(a.size());
  for (size_t i = 0; i < h.size(); ++i) h[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
  return host_fp8_linear(h, n, w.w2);
}

// FP8 GEMM mode (CudaOptions::fp8_gemm: e4m3 activations) against that host path: linears (ragged
// rows and tokens, split K), the dense MLP (SwiGLU output quantised again) and the MoE's grouped
// stages with the weights or the tokens as the MMA's M. Only the order of float32 sums differs (and
// the tensor cores' FP8 accumulation inside a 128-K block: 2.3e-4 on every linear, measured); in
// the MLP and the MoE that moves a few e4m3 roundings of the SwiGLU output (2.5e-3 to 4.1e-3). The
// bars sit a few times above those, far below what a wrong scale or block costs (tens of percent).
TEST(CudaOps, Fp8GemmModeMatchesHostFp8Path) {
  REQUIRE_GPU();
  CudaOptions o = opts(false, 0, true, 1);  // the pipelined kernel from one token, fast_min 1
  o.fp8_gemm = true;
  {
    auto cuda = make_cuda_backend(o);
    const std::vector<LinCase> cases = {{64, 300, 256}, {130, 129, 128}, {200, 515, 384},
                                        {65, 128, 1024}, {300, 200, 128}, {9, 256, 2048}};
    for (const LinCase& c : cases) {
      HostLinear h = make_linear(DType::F8_E4M3, c.out, c.in, uint32_t(c.n * 31 + c.out));
      Linear dl = to_device(*cuda, h.lin);
      const std::vector<float> x = randn(size_t(c.n * c.in), uint32_t(c.in + 3));
      const std::vector<float> want = host_fp8_linear(x, c.n, h.lin);
      Dev xd(*cuda, x), yd(*cuda, size_t(c.n * c.out));
      cuda->linear(xd.p, c.n, dl, yd.p);
      const double err = rel_l2(yd.get().data(), want.data(), want.size());
      std::printf("fp8 gemm linear n=%lld out=%lld in=%lld: rel %.3g\n", (long long)c.n, (long long)c.out,
                  (long long)c.in, err);
      EXPECT_LE(err, 1e-3) << "n=" << c.n << " out=" << c.out << " in=" << c.in;
    }
  }
  auto ref = make_ref_backend();
  for (int swap : {0, 1}) {
    o.tune.tc_swap = swap, o.tune.moe_tiles = 0;
    auto cuda = make_cuda_backend(o);
    TwoWeights W("v3_fp8", *cuda);
    const int64_t D = W.a.dim, E = W.a.n_routed_experts, K = W.a.n_activated_experts;
    for (int64_t n : {37, 150, 300}) {
      const std::vector<float> x = randn(size_t(n * D), uint32_t(n + 11));
      Dev xd(*cuda, x), yd(*cuda, size_t(n * D));
      std::vector<float> want = host_fp8_mlp(W.host.layers[0].ffn, x, n);
      cuda->mlp(W.dev.layers[0].ffn, xd.p, n, yd.p);
      double err = rel_l2(yd.get().data(), want.data(), want.size());
      std::printf("fp8 gemm mlp n=%lld swap %d: rel %.3g\n", (long long)n, swap, err);
      EXPECT_LE(err, 1.2e-2) << "mlp n=" << n;
      const MoEWeights& mw = W.host.layers[1].moe_w;
      std::vector<float> logits(size_t(n * E)), sc(size_t(2 * E + W.a.n_expert_groups));
      ref->linear(x.data(), n, Linear{mw.gate, {}}, logits.data());
      const std::vector<float> shared = host_fp8_mlp(mw.shared_experts, x, n);
      for (int64_t t = 0; t < n; ++t) {
        std::vector<int32_t> idx(static_cast<size_t>(K));
        std::vector<float> wt(static_cast<size_t>(K));
        route_token(W.a, logits.data() + t * E, mw.bias.empty() ? nullptr : mw.bias.as<float>(), idx.data(), wt.data(),
                    sc.data());
        const std::vector<float> xt(x.begin() + t * D, x.begin() + (t + 1) * D);
        for (int64_t d = 0; d < D; ++d) want[size_t(t * D + d)] = shared[size_t(t * D + d)];
        for (int64_t k = 0; k < K; ++k) {
          const std::vector<float> e = host_fp8_mlp(mw.experts[size_t(idx[size_t(k)])], xt, 1);
          for (int64_t d = 0; d < D; ++d) want[size_t(t * D + d)] += wt[size_t(k)] * e[size_t(d)];
        }
      }
      cuda->reset_counters();
      cuda->moe(W.a, W.dev.layers[1].moe_w, xd.p, n, yd.p);
      err = rel_l2(yd.get().data(), want.data(), want.size());
      std::printf("fp8 gemm moe n=%lld swap %d: rel %.3g\n", (long long)n, swap, err);
      EXPECT_LE(err, 1.2e-2) << "moe n=" << n << " swap " << swap;
    }
  }
}

// The persistent MoE kernel (kernels_moe_persist.cu) against its twins, tc_gemm's swapped forms:
// FP8 GEMM mode's e4m3 experts (stage 0 quantising its own output for stage 1, and writing float32
// for act_quant) and fast mode's bf16 experts. The same MMAs, scales and float32 sums
// in the same order, so the layers agree to the last bit (measured: 0). The golden shapes (K of 2
// and 1 e4m3 blocks, 4 and 2 bf16 blocks) at 2,000 tokens give blocks several (token tile, weight
// tile) pairs; the 16B shape's experts (K 2048 and 1408) run the ring of stages many times over
// each pair, with a half-filled tile of a few tokens among full ones.
TEST(CudaOps, PersistentMoeMatchesTwin) {
  REQUIRE_GPU();
  for (const bool bf : {false, true}) {
    CudaOptions o = opts(bf, 0, true, 1);
    o.fp8_gemm = !bf, o.tune.moe_tiles = 0, o.tune.moe_persist_bf16_min = 0;
    const char* dtype = bf ? "bf16" : "fp8";
    int64_t ran = 0;  // stages the last run put on the persistent kernel
    auto run = [&](bool persist, const ModelArgs* shape, const std::vector<int64_t>& ns, bool fused = true) {
      CudaOptions oo = o;
      oo.tune.moe_persist = persist, oo.tune.moe_quant_fused = fused;
      auto cuda = make_cuda_backend(oo);
      std::vector<std::vector<float>> out;
      auto layer = [&](const ModelArgs& a, const MoEWeights& mw) {
        for (int64_t n : ns) {
          const std::vector<float> x = randn(size_t(n * a.dim), uint32_t(n + 5));
          Dev xd(*cuda, x), yd(*cuda, size_t(n * a.dim));
          cuda->reset_counters();
          cuda->moe(a, mw, xd.p, n, yd.p);
          out.push_back(yd.get());
        }
        ran = cuda::persistent_moe_stages(*cuda);
      };
      if (shape) {
        const ModelWeights w = cuda::random_weights(*cuda, *shape, 7);
        layer(*shape, w.layers[1].moe_w);
      } else {
        TwoWeights W(bf ? "v2lite_bf16" : "v3_fp8", *cuda);
        layer(W.a, W.dev.layers[1].moe_w);
      }
      return out;
    };
    ModelArgs wide = shape_args("16B", dtype, 2);
    wide.vocab_size = 512;
    const std::vector<int64_t> golden_ns = {37, 300, 2000}, wide_ns = {3, 200, 517};
    for (const ModelArgs* shape : {static_cast<const ModelArgs*>(nullptr), static_cast<const ModelArgs*>(&wide)}) {
      const std::vector<int64_t>& ns = shape ? wide_ns : golden_ns;
      testing::internal::CaptureStderr();
      const auto got = run(true, shape, ns);
      const std::string warned = testing::internal::GetCapturedStderr();
      EXPECT_EQ(warned.find("slower GEMM form"), std::string::npos) << "the persistent kernel did not run: " << warned;
      // (every size ran both stages on it)
      EXPECT_EQ(ran, int64_t(2 * ns.size())) << dtype << (shape ? " 16B" : " golden");
      const auto want = run(false, shape, ns);
      // (e4m3: stage 0 quantising its own output, as above, and writing float32 for act_quant)
      const auto sep = bf ? got : run(true, shape, ns, /*fused=*/false);
      for (size_t i = 0; i < ns.size(); ++i) {
        const double err = rel_l2(got[i].data(), want[i].data(), want[i].size()),
                     err_sep = rel_l2(sep[i].data(), want[i].data(), want[i].size());
        std::printf("persistent %s moe %s n=%lld: rel %.3g against the twin (%.3g with act_quant after stage 0)\n",
                    dtype, shape ? "16B" : "golden", (long long)ns[i], err, err_sep);
        EXPECT_LE(err, 1e-6) << dtype << " " << (shape ? "16B" : "golden") << " n=" << ns[i];
        EXPECT_LE(err_sep, 1e-6) << dtype << " " << (shape ? "16B" : "golden") << " n=" << ns[i] << " act_quant after";
      }
    }
  }
}

// The device router against model/gate.cc on random logits with planted ties.
TEST(CudaOps, RouterMatchesGate) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  for (std::string c : {"v2lite_bf16", "v2_groups_bf16", "v3_fp8"}) {
    ModelArgs a = load_model_args(case_dir(c) + "/hf/config.json");
    const int E = a.n_routed_experts, K = a.n_activated_experts;
    for (int64_t n : {37, 300}) {  // one block routes and groups; a warp per token, then the group kernel
      std::vector<float> lg = randn(size_t(n * E), uint32_t(11 + n));
      for (int64_t i = 0; i < n; i += 3) lg[size_t(i * E + 1)] = lg[size_t(i * E + 5)];  // ties
      for (int64_t i = 1; i < n; i += 4)
        for (int e = 0; e < E; ++e) lg[size_t(i * E + e)] = float(e % 3);  // many ties
      std::vector<float> bias;
      if (a.score_func == "sigmoid") bias = randn(size_t(E), 12, 0.1f);
      Dev ld(*cuda, lg);
      std::unique_ptr<Dev> bd;
      if (!bias.empty()) bd = std::make_unique<Dev>(*cuda, bias);
      std::vector<int32_t> idx(static_cast<size_t>(n * K));
      std::vector<float> wts(static_cast<size_t>(n * K));
      cuda->reset_counters();
      cuda::route_for_test(*cuda, a, ld.p, bd ? bd->p : nullptr, n, idx.data(), wts.data());
      std::vector<float> scratch(static_cast<size_t>(2 * E + a.n_expert_groups));
      std::vector<bool> used(static_cast<size_t>(E));
      for (int64_t i = 0; i < n; ++i) {
        std::vector<int32_t> wi(static_cast<size_t>(K));
        std::vector<float> ww(static_cast<size_t>(K));
        route_token(a, &lg[size_t(i * E)], bias.empty() ? nullptr : bias.data(), wi.data(), ww.data(), scratch.data());
        for (int k = 0; k < K; ++k) used[size_t(wi[size_t(k)])] = true;
        for (int k = 0; k < K; ++k) {
          EXPECT_EQ(idx[size_t(i * K + k)], wi[size_t(k)]) << c << " token " << i << " choice " << k;
          EXPECT_NEAR(wts[size_t(i * K + k)], ww[size_t(k)], 1e-6f * std::max(1.f, std::fabs(ww[size_t(k)])))
              << c << " token " << i;
        }
      }
      // The device counter: the distinct experts gate.cc chose for these tokens.
      EXPECT_EQ(cuda->routed_experts_run(), int64_t(std::count(used.begin(), used.end(), true))) << c;
      cuda->reset_counters();
      EXPECT_EQ(cuda->routed_experts_run(), 0) << c;
      // Each token alone: a step of one token is routed by a whole block (ranks, not rounds).
      for (int64_t i = 0; i < n; ++i) {
        std::vector<int32_t> one_idx(static_cast<size_t>(K)), wi(static_cast<size_t>(K));
        std::vector<float> one_w(static_cast<size_t>(K)), ww(static_cast<size_t>(K));
        cuda::route_for_test(*cuda, a, ld.p + i * E, bd ? bd->p : nullptr, 1, one_idx.data(), one_w.data());
        route_token(a, &lg[size_t(i * E)], bias.empty() ? nullptr : bias.data(), wi.data(), ww.data(), scratch.data());
        EXPECT_EQ(one_idx, wi) << c << " token " << i << " alone";
        for (int k = 0; k < K; ++k)
          EXPECT_NEAR(one_w[size_t(k)], ww[size_t(k)], 1e-6f * std::max(1.f, std::fabs(ww[size_t(k)])))
              << c << " token " << i << " alone";
      }
      EXPECT_EQ(cuda->routed_experts_run(), n * K) << c << " one token at a time";
      cuda->reset_counters();
    }
  }
}

// The gate's float32 FMA logits (gate_logits: steps whose experts take x in pair order) against
// float64 on the host: bf16 and float32 gates, the 16B shape's 64 x 2048 and a 160-expert gate
// (two passes of a warp's experts) over 520 columns (the last 16-byte pieces of a row: not a whole
// 256-column round), token counts that leave a block's last tokens empty.
TEST(CudaOps, GateLogitsMatchFloat64) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  struct Shape {
    int64_t E, D;
  };
  for (DType t : {DType::BF16, DType::F32})
    for (Shape sh : {Shape{64, 2048}, Shape{160, 520}}) {
      HostLinear h = make_linear(t, sh.E, sh.D, 81);
      const Linear dl = to_device(*cuda, h.lin);
      const DevLinear w = dev_linear_of(dl, sh.E, sh.D);
      ASSERT_TRUE(cuda::gate_logits_ok(w));
      for (int64_t n : {9, 66, 257}) {
        const std::vector<float> x = randn(size_t(n * sh.D), uint32_t(82 + n));
        Dev dx(*cuda, x), out(*cuda, std::vector<float>(size_t(n * sh.E), std::nanf("")));
        cuda::Launch L;
        cuda::gate_logits(L, w, dx.p, n, out.p);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> got = out.get();
        const std::string what = str(dtype_name(t), " ", sh.E, " x ", sh.D, ", ", n, " tokens");
        double worst = 0;
        for (int64_t i = 0; i < n; ++i)
          for (int64_t e = 0; e < sh.E; ++e) {
            double v = 0, mag = 0;
            for (int64_t k = 0; k < sh.D; ++k) {
              const double p = double(x[size_t(i * sh.D + k)]) * host_w(h, t, sh.D, e, k);
              v += p, mag += std::fabs(p);
            }
            const double g = got[size_t(i * sh.E + e)];
            ASSERT_TRUE(std::isfinite(g)) << what << ": unwritten at token " << i << ", expert " << e;
            worst = std::max(worst, std::fabs(g - v) / mag);
          }
        EXPECT_LE(worst, 2e-6) << what;  // (float32 sums: about 1e-7 of the products' magnitudes)
      }
    }
}

TEST(CudaOps, MlpAndMoeMatchRef) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  for (int mode = 0; mode < kModes; ++mode) {
    auto cuda = make_cuda_backend(mode_opts(mode));
    const bool fast = mode_opts(mode).fast;
    for (std::string c : {"v2lite_bf16", "v2_groups_bf16", "v3_fp8"}) {
      TwoWeights W(c, *cuda);
      const int64_t D = W.a.dim;
      for (int64_t n : {1, 4, 8, 37, 150, 300}) {
        std::vector<float> x = randn(size_t(n * D), uint32_t(n));
        Dev xd(*cuda, x), yd(*cuda, size_t(n * D));
        std::vector<float> want(static_cast<size_t>(n * D));
        const bool tc = (mode != 0 && mode != 2) || n > 8;
        const double tol = fast && tc ? 2e-2 : (tc ? 5e-5 : 5e-6);
        ref->mlp(W.host.layers[0].ffn, x.data(), n, want.data());
        cuda->mlp(W.dev.layers[0].ffn, xd.p, n, yd.p);
        EXPECT_LE(rel_l2(yd.get().data(), want.data(), want.size()), tol) << c << " mlp n=" << n << " mode " << mode;
        for (int l = 1; l < W.a.n_layers; ++l) {
          ref->moe(W.a, W.host.layers[size_t(l)].moe_w, x.data(), n, want.data());
          cuda->reset_counters();
          cuda->moe(W.a, W.dev.layers[size_t(l)].moe_w, xd.p, n, yd.p);
          EXPECT_LE(rel_l2(yd.get().data(), want.data(), want.size()), tol)
              << c << " moe layer " << l << " n=" << n << " mode " << mode;
          // one token uses exactly K routed experts; n tokens between K and min(n K, E)
          const int64_t run = cuda->routed_experts_run(), K = W.a.n_activated_experts;
          if (n == 1) {
            EXPECT_EQ(run, K) << c << " mode " << mode;
          }
          EXPECT_GE(run, K) << c << " n=" << n;
          EXPECT_LE(run, std::min<int64_t>(n * K, W.a.n_routed_experts)) << c << " n=" << n;
        }
      }
    }
  }
}

// Expert parallelism: a rank holds half of the routed experts (the others' weights empty, as
// load_weights leaves another rank's); its MoE equals the ref backend's on the same weights (which
// skips the absent ones) on every routing path: one token (the gate kernel's router, or the route
// kernel's block), a few (grouped in one block), many (grouped tiles: WMMA or the pipelined kernel).
TEST(CudaOps, MoeSkipsOtherRanksExperts) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  for (int mode : {0, 3}) {
    auto cuda = make_cuda_backend(mode_opts(mode));
    for (std::string c : {"v2lite_bf16", "v3_fp8"}) {
      auto ck = Checkpoint::open(case_dir(c) + "/hf");
      const ModelArgs a = load_model_args(*ck);
      const int E = a.n_routed_experts, D = int(a.dim);
      for (int part = 0; part < 2; ++part) {
        ModelWeights host = load_weights(*ck), dev = load_weights(*ck);
        const int e0 = part * E / 2, e1 = e0 + E / 2;
        for (ModelWeights* w : {&host, &dev})
          for (LayerWeights& L : w->layers)
            for (int e = 0; e < int(L.moe_w.experts.size()); ++e)
              if (e < e0 || e >= e1) L.moe_w.experts[size_t(e)] = MLPWeights{};
        cuda->prepare_weights(a, dev);
        for (int64_t n : {1, 4, 37, 150}) {
          std::vector<float> x = randn(size_t(n * D), uint32_t(n + 7)), want(x.size());
          Dev xd(*cuda, x), yd(*cuda, x.size());
          const double tol = mode != 0 || n > 8 ? 5e-5 : 5e-6;
          ref->moe(a, host.layers[1].moe_w, x.data(), n, want.data());
          cuda->reset_counters();
          cuda->moe(a, dev.layers[1].moe_w, xd.p, n, yd.p);
          EXPECT_LE(rel_l2(yd.get().data(), want.data(), want.size()), tol)
              << c << " experts [" << e0 << ", " << e1 << ") n=" << n << " mode " << mode;
          EXPECT_LE(cuda->routed_experts_run(), std::min<int64_t>(n * a.n_activated_experts, E / 2)) << c;
        }
      }
    }
  }
}

// A MoE layer whose shapes the tensor-core GEMV takes (K a multiple of 128, FP8 shared slices on
// scale blocks), built from random host linears: the decode expert paths (FMA or tensor-core
// GEMVs) against the ref backend. Shapes: small; the 16B model's (2048 / 1408: 32 and 22 chunks per
// warp slice); K 4096 (two passes over each warp's slice).
TEST(CudaOps, MoeDecodePathsMatchRef) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  struct Shape {
    int64_t dim, inter, E, K, S;
  };
  // (dim 7168, the 671B shape's: from 7 tokens of e4m3 (4 of bf16) the first stage's rows do not fit
  // the tensor-core GEMV whole: it takes them in K chunks, or the pipelined GEMM takes both stages)
  for (Shape sh : {Shape{256, 128, 8, 2, 2}, Shape{2048, 1408, 4, 2, 1}, Shape{4096, 384, 4, 2, 2},
                   Shape{7168, 256, 4, 2, 1}}) {
    ModelArgs a;
    a.dim = sh.dim, a.moe_inter_dim = sh.inter, a.n_routed_experts = sh.E, a.n_activated_experts = sh.K;
    a.n_shared_experts = sh.S, a.n_layers = 1, a.n_dense_layers = 0;
    const int64_t D = a.dim, I = a.moe_inter_dim, SI = I * sh.S;
    for (DType t : {DType::BF16, DType::F8_E4M3, DType::F32}) {
      if (t == DType::F32 && D > 256) continue;
      std::vector<HostLinear> keep;
      keep.reserve(3 * size_t(sh.E + 1) + 1);
      auto lin = [&](int64_t out, int64_t in) -> Linear {
        keep.push_back(make_linear(t, out, in, uint32_t(keep.size() * 17 + 3)));
        return keep.back().lin;
      };
      ModelWeights host;
      host.layers.resize(1);
      LayerWeights& L = host.layers[0];
      L.moe = true;
      for (int e = 0; e < a.n_routed_experts; ++e) L.moe_w.experts.push_back({lin(I, D), lin(D, I), lin(I, D)});
      L.moe_w.shared_experts = {lin(SI, D), lin(D, SI), lin(SI, D)};
      L.moe_w.has_shared = true;
      keep.push_back(make_linear(DType::BF16, a.n_routed_experts, a.dim, 4242));
      L.moe_w.gate = keep.back().lin.weight;
      // 0: default (tensor cores: e4m3, bf16 from 2 tokens), 1: bf16 at 1 too, 2: FMA only;
      // 3 and 4: 0 and 2 with one token routed by the gate kernel's last block, not the experts';
      // 5 and 6: 0 with rows too long for the tensor-core GEMV on the FMA GEMV (long_k 0) and on the
      // pipelined GEMM (long_k 1) instead of in chunks; 7 and 8 (e4m3): 12 and 40 tokens, on the
      // tensor-core GEMV's tiles of 8 pairs (moe_tiles; experts with 1 to 3 tiles, 2 to 5 per shared
      // slice) and on the grouped GEMM (moe_tiles 0)
      for (int path = 0; path < 9; ++path) {
        const bool many = path >= 7;
        if (many && t != DType::F8_E4M3) continue;
        CudaOptions o = opts(false, 8, true, many ? 9 : 1 << 30);
        o.tune.moe_tiles = path == 7 ? 64 : 0;
        o.tune.tcv_bf16_min = path == 1 ? 1 : (path == 0 || path == 3 || path >= 5 ? 2 : 0);
        if (path == 2 || path == 4) o.tune.tcv_max = 0;
        o.tune.route_in_experts = path < 3 || path >= 5;
        o.tune.long_k = path == 5 ? 0 : path == 6 ? 1 : 2;
        auto cuda = make_cuda_backend(o);
        ModelWeights dev = host;
        cuda->prepare_weights(a, dev);
        for (int64_t n : many ? std::vector<int64_t>{12, 40} : std::vector<int64_t>{1, 3, 8}) {
          const std::vector<float> x = randn(size_t(n * a.dim), uint32_t(n + 50));
          std::vector<float> want(x.size());
          ref->moe(a, host.layers[0].moe_w, x.data(), n, want.data());
          Dev xd(*cuda, x), yd(*cuda, x.size());
          cuda->moe(a, dev.layers[0].moe_w, xd.p, n, yd.p);
          // (the pipelined GEMM splits activations into bf16 hi + lo: its bar)
          const bool gemm = path == 8 || (o.tune.long_k == 1 && o.tune.tcv_max >= n && n >= 2 &&
                                          !cuda::tcv_holds(t == DType::BF16 ? cuda::kBF16 : cuda::kFP8, D, n));
          EXPECT_LE(rel_l2(yd.get().data(), want.data(), want.size()), gemm ? 5e-5 : 5e-6)
              << dtype_name(t) << " dim " << D << " n=" << n << " path " << path;
        }
      }
    }
  }
}

// The layer loop's "y = moe(x); h += y; x2 = rmsnorm(h)" with the MoE's combine deferred into one
// kernel with the add and the norm (moe_combine_into_norm) and unfused: both forms of that kernel,
// float4 (aligned rows) and per element (h one float off alignment).
TEST(CudaOps, MoeAddNormFusedMatchesRef) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  auto cuda = make_cuda_backend(opts());
  TwoWeights W("v3_fp8", *cuda);
  const ModelArgs& a = W.a;
  const int64_t D = a.dim;
  const LayerWeights& hl = W.host.layers[1];
  const LayerWeights& dl = W.dev.layers[1];
  for (int64_t n : {1, 5, 40}) {
    for (int shift : {0, 1}) {
      std::vector<float> x = randn(size_t(n * D), uint32_t(n + 3)), h = randn(size_t(n * D), uint32_t(n + 4));
      std::vector<float> y(size_t(n * D)), rh = h, rx(size_t(n * D));
      ref->moe(a, hl.moe_w, x.data(), n, y.data());
      ref->add(rh.data(), y.data(), n * D);
      ref->rmsnorm(rh.data(), n, D, D, hl.ffn_norm, a.rms_norm_eps, rx.data());
      std::vector<float> hpad(size_t(n * D + 1), 0.f);
      std::copy(h.begin(), h.end(), hpad.begin() + shift);
      for (uint32_t rw : {uint32_t(kRewriteMoeCombineIntoNorm), 0u}) {
        Dev xd(*cuda, x), yd(*cuda, size_t(n * D)), hd(*cuda, hpad), od(*cuda, size_t(n * D));
        MiniGraph m(a, n);
        const int vx = m.value("x", xd.p, n, D), vy = m.value("y", yd.p, n, D), vh = m.value("h", hd.p + shift, n, D),
                  vo = m.value("o", od.p, n, D);
        m.op(OpKind::kMoe, "ffn", vx, vy).moe = &dl.moe_w;
        m.op(OpKind::kAdd, "add", vy, vh);
        m.rmsnorm(vh, dl.ffn_norm, a.rms_norm_eps, vo);
        const std::string fused = m.run(*cuda, rw);
        const std::string what = str("n=", n, " shift ", shift, rw ? " fused" : " unfused");
        EXPECT_EQ(fused, rw ? "none+defer;combine_add_rmsnorm;" : "") << what;
        std::vector<float> gh = hd.get();
        EXPECT_LE(rel_l2(od.get().data(), rx.data(), rx.size()), 5e-5) << what;
        EXPECT_LE(rel_l2(gh.data() + shift, rh.data(), rh.size()), 5e-5) << what;
        EXPECT_LE(rel_l2(yd.get().data(), y.data(), y.size()), 5e-5) << what;
      }
    }
  }
}

// The fusion tests' cases: f(name, weights, host layer 1, device layer 1), layer 1 a MoE layer.
template <class F>
void each_moe_case(Backend& cuda, F f) {
  for (std::string c : {"v2lite_bf16", "v2_groups_bf16", "v3_fp8"}) {
    TwoWeights W(c, cuda);
    ASSERT_TRUE(W.host.layers[1].moe) << c;
    f(c, W, W.host.layers[1], W.dev.layers[1]);
  }
}

// One token's "h += r; x = ffn_norm(h); y = moe(x)" with the add + norm done by the gate kernel
// (add_rmsnorm_moe), by its own kernel (add_rmsnorm) or unfused, and the same add + norm followed
// by a linear instead: x, h and y against the reference ops, and the plan the rewrites made.
TEST(CudaOps, AddNormIntoGateMatchesRef) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  auto cuda = make_cuda_backend(opts());
  each_moe_case(*cuda, [&](const std::string& c, const TwoWeights& W, const auto& hl, const auto& dl) {
    const ModelArgs& a = W.a;
    const int64_t D = a.dim;
    const std::vector<float> h0 = randn(size_t(D), 71), r = randn(size_t(D), 72);
    std::vector<float> rh = h0, rx(static_cast<size_t>(D)), ry(static_cast<size_t>(D)),
        rq(static_cast<size_t>(hl.attn.wkv_a.out()));
    ref->add(rh.data(), r.data(), D);
    ref->rmsnorm(rh.data(), 1, D, D, hl.ffn_norm, a.rms_norm_eps, rx.data());
    ref->moe(a, hl.moe_w, rx.data(), 1, ry.data());
    ref->linear(rx.data(), 1, hl.attn.wkv_a, rq.data());
    for (uint32_t rw : {uint32_t(kRewriteAddRmsNormMoe | kRewriteAddRmsNorm), uint32_t(kRewriteAddRmsNorm), 0u})
      for (bool then_moe : {true, false}) {
        const std::string what = str(c, " rewrites ", rw, then_moe ? ", then moe" : ", then a linear");
        Dev hd(*cuda, h0), rd(*cuda, r), xd(*cuda, size_t(D)), yd(*cuda, size_t(then_moe ? D : rq.size()));
        MiniGraph m(a, 1);
        const int vh = m.value("h", hd.p, 1, D), vr = m.value("r", rd.p, 1, D), vx = m.value("x", xd.p, 1, D),
                  vy = m.value("y", yd.p, 1, then_moe ? D : int64_t(rq.size()));
        m.op(OpKind::kAdd, "add", vr, vh);
        m.rmsnorm(vh, dl.ffn_norm, a.rms_norm_eps, vx);
        if (then_moe) m.op(OpKind::kMoe, "ffn", vx, vy).moe = &dl.moe_w;
        else m.linear(vx, dl.attn.wkv_a, vy);
        const std::string fused = m.run(*cuda, rw);
        const bool gate = then_moe && (rw & kRewriteAddRmsNormMoe);
        EXPECT_EQ(fused, gate ? "add_rmsnorm_moe;" : (rw ? "add_rmsnorm;" : "")) << what;
        EXPECT_LE(rel_l2(hd.get().data(), rh.data(), rh.size()), 1e-6) << what;
        EXPECT_LE(rel_l2(xd.get().data(), rx.data(), rx.size()), 1e-6) << what;
        const std::vector<float>& want = then_moe ? ry : rq;
        EXPECT_LE(rel_l2(yd.get().data(), want.data(), want.size()), 5e-5) << what;
      }
  });
}

// One token's "y = moe(x); h += y; x2 = attn_norm(h); q = wq x2; kv = wkv_a x2" with the MoE combine
// + add + norm done by the paired GEMV's blocks (combine_into_pair), by its own kernel before the
// pair (moe_combine_into_norm, linear_pair), or unfused: y, h, x2 and both products against the
// reference ops, and the plan the rewrites made.
TEST(CudaOps, MoeCombineIntoPairedGemvMatchesRef) {
  REQUIRE_GPU();
  auto ref = make_ref_backend();
  auto cuda = make_cuda_backend(opts(false, 8, false));
  each_moe_case(*cuda, [&](const std::string& c, const TwoWeights& W, const auto& hl, const auto& dl) {
    const ModelArgs& a = W.a;
    const int64_t D = a.dim;
    const bool lora = a.q_lora_rank > 0;
    const Linear& hq = lora ? hl.attn.wq_a : hl.attn.wq;
    const Linear& dq = lora ? dl.attn.wq_a : dl.attn.wq;
    const std::vector<float> x0 = randn(size_t(D), 81), h0 = randn(size_t(D), 82);
    std::vector<float> rh = h0, ry(static_cast<size_t>(D)), rx(static_cast<size_t>(D)),
        rq(static_cast<size_t>(hq.out())), rkv(static_cast<size_t>(hl.attn.wkv_a.out()));
    ref->moe(a, hl.moe_w, x0.data(), 1, ry.data());
    ref->add(rh.data(), ry.data(), D);
    ref->rmsnorm(rh.data(), 1, D, D, hl.attn_norm, a.rms_norm_eps, rx.data());
    ref->linear(rx.data(), 1, hq, rq.data());
    ref->linear(rx.data(), 1, hl.attn.wkv_a, rkv.data());
    const uint32_t all = kRewritesAll, apart = kRewritesAll & ~kRewriteCombineIntoPair;
    for (uint32_t rw : {all, apart, 0u}) {
      Dev xd(*cuda, x0), hd(*cuda, h0), yd(*cuda, size_t(D)), x2(*cuda, size_t(D)), qd(*cuda, rq.size()),
          kvd(*cuda, rkv.size());
      MiniGraph m(a, 1);
      const int vx = m.value("x", xd.p, 1, D), vy = m.value("y", yd.p, 1, D), vh = m.value("h", hd.p, 1, D),
                vx2 = m.value("x2", x2.p, 1, D), vq = m.value("q", qd.p, 1, int64_t(rq.size())),
                vkv = m.value("kv", kvd.p, 1, int64_t(rkv.size()));
      m.op(OpKind::kMoe, "ffn", vx, vy).moe = &dl.moe_w;
      m.op(OpKind::kAdd, "add", vy, vh);
      m.rmsnorm(vh, dl.attn_norm, a.rms_norm_eps, vx2);
      m.linear(vx2, dq, vq);
      m.linear(vx2, dl.attn.wkv_a, vkv);
      const std::string fused = m.run(*cuda, rw);
      const std::string what = str(c, " rewrites ", rw);
      EXPECT_EQ(fused, rw == all ? "none+defer;combine_add_rmsnorm_pair;"
                                 : (rw ? "none+defer;combine_add_rmsnorm;linear_pair;" : ""))
          << what;
      EXPECT_LE(rel_l2(yd.get().data(), ry.data(), ry.size()), 5e-5) << what;
      EXPECT_LE(rel_l2(hd.get().data(), rh.data(), rh.size()), 5e-5) << what;
      EXPECT_LE(rel_l2(x2.get().data(), rx.data(), rx.size()), 5e-5) << what;
      EXPECT_LE(rel_l2(qd.get().data(), rq.data(), rq.size()), 5e-5) << what;
      EXPECT_LE(rel_l2(kvd.get().data(), rkv.data(), rkv.size()), 5e-5) << what;
    }
  });
}

}  // namespace

#else  // !DSV3_HAVE_CUDA

TEST(CudaBackend, NotBuilt) { GTEST_SKIP() << "built without CUDA (-DDSV3_CUDA=OFF or no nvcc)"; }

#endif
