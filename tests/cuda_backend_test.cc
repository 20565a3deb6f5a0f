// The CUDA backend against the ref backend, op by op on random inputs (ragged sizes, FP8 with
// ragged edge blocks, both the GEMV and the tensor-core paths), and the whole model against the
// golden float32 logits of every case. Every test skips cleanly where no GPU is present.
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

namespace {

#define REQUIRE_GPU()                                           \
  do {                                                          \
    std::string why_;                                           \
    if (!cuda::device_available(&why_)) GTEST_SKIP() << why_;   \
  } while (0)

CudaOptions opts(bool fast = false, int gemv_max = 8, bool graphs = true, int tc_min = 1 << 30) {
  CudaOptions o;
  o.fast = fast;
  o.tune.gemv_max = gemv_max;
  o.graphs = graphs;
  o.tune.tc_min = tc_min;
  o.tune.fast_min = 1;
  return o;
}
// Test modes of the product paths: 0 GEMV up to 8 tokens, WMMA GEMM beyond; 1 WMMA from one
// token; 2 as 0 in fast mode; 3 the pipelined kernel (kernels_tc.cu) from one token (its wgmma
// form on Hopper where K % 64 == 0; tiles of 64 rows for bf16 weights, 128 for e4m3); 4 as 3
// fast; 5 as 3 with 128-row tiles for every weight (two warpgroups in the wgmma form); 6 as 3 on
// mma.sync; 7 as 5 on mma.sync; 8 as 3 with 64-row tiles for every weight and the MoE stages'
// operands never swapped (tc_swap 0; by default they are for e4m3 weights and in fast mode:
// weight rows as the wgmma's M, tokens as its N); 9 as 3 with them always swapped, 10 the same fast.
constexpr int kModes = 11;
CudaOptions mode_opts(int mode) {
  const bool fast = mode == 2 || mode == 4;
  CudaOptions o = opts(fast, mode == 0 || mode == 2 ? 8 : 0, true, mode >= 3 ? 1 : 1 << 30);
  if (mode == 5 || mode == 7) o.tune.tc_tm = 128;
  if (mode == 8) o.tune.tc_tm = 64, o.tune.tc_swap = 0;
  if (mode == 9 || mode == 10) o.tune.tc_swap = 2, o.fast = mode == 10;
  if (mode == 6 || mode == 7) o.tune.wgmma = false;
  return o;
}

// A step graph built by hand over device buffers, run with the backend's fusions (rewrites)
// or without: how the fusions are tested op by op. plan() returns the fused nodes as text.
struct MiniGraph {
  StepGraph g;
  Step step;
  std::vector<int32_t> tokens;
  std::vector<TokenPos> pos;
  MiniGraph(const ModelArgs& a, int64_t n) : tokens(size_t(n), 0), pos(size_t(n), TokenPos{0, 0}) {
    g.args = &a, g.n = n;
    step.tokens = tokens.data(), step.pos = pos.data(), step.n = n;
  }
  int value(const char* name, float* p, int64_t rows, int64_t cols) {
    g.values.push_back({name, p, rows, cols, cols});
    return int(g.values.size()) - 1;
  }
  Op& op(OpKind k, const char* name, int in, int out) {
    Op o;
    o.kind = k, o.name = name, o.in = in, o.out = out;
    g.ops.push_back(o);
    return g.ops.back();
  }
  void linear(int in, const Linear& w, int out) { op(OpKind::kLinear, "linear", in, out).linear = &w; }
  void rmsnorm(int in, const TensorView& w, float eps, int out) {
    Op& o = op(OpKind::kRmsNorm, "rmsnorm", in, out);
    o.weight = &w, o.eps = eps;
  }
  // Runs the graph with `rewrites`; returns the fused nodes ("fusion;fusion;..."; "+defer" marks a
  // MoE whose combine the next node does).
  std::string run(Backend& be, uint32_t rewrites) {
    plan(g, be, rewrites);
    std::string fused;
    for (const Node& nd : g.nodes)
      if (nd.fusion != Fusion::kNone || nd.defer_combine)
        fused += std::string(fusion_name(nd.fusion)) + (nd.defer_combine ? "+defer" : "") + ";";
    be.run(g, step);
    return fused;
  }
};

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// A device buffer of the CUDA backend, filled from / read back to the host.
struct Dev {
  Backend& be;
  float* p;
  size_t n;
  Dev(Backend& b, const std::vector<float>& host) : be(b), p(b.alloc(host.size())), n(host.size()) {
    be.upload(p, host.data(), n);
  }
  Dev(Backend& b, size_t count) : be(b), p(b.alloc(count)), n(count) {}
  ~Dev() { be.release(p); }
  std::vector<float> get() const {
    std::vector<float> h(n);
    be.download(h.data(), p, n);
    return h;
  }
};

// Host weights that outlive their views.
struct HostLinear {
  std::vector<uint16_t> bf16;
  std::vector<uint8_t> q;
  std::vector<float> f32, scale;
  Linear lin;
};

HostLinear make_linear(DType t, int64_t out, int64_t in, uint32_t seed) {
  HostLinear h;
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.f, 1.f / std::sqrt(float(in)));
  h.lin.weight.dtype = t;
  h.lin.weight.shape = {out, in};
  if (t == DType::BF16) {
    h.bf16.resize(size_t(out * in));
    for (auto& v : h.bf16) v = f32_to_bf16(nd(g));
    h.lin.weight.data = h.bf16.data();
  } else if (t == DType::F32) {
    h.f32.resize(size_t(out * in));
    for (auto& v : h.f32) v = nd(g);
    h.lin.weight.data = h.f32.data();
  } else {
    std::uniform_int_distribution<int> b(0, 255);
    h.q.resize(size_t(out * in));
    for (auto& v : h.q) {
      v = uint8_t(b(g));
      if ((v & 0x7f) == 0x7f) v &= 0xfe;  // no NaN codes
    }
    const int64_t so = (out + 127) / 128, si = (in + 127) / 128;
    std::uniform_real_distribution<float> sd(0.5f, 2.f);
    h.scale.resize(size_t(so * si));
    for (auto& v : h.scale) v = sd(g) / (64.f * std::sqrt(float(in)));
    h.lin.weight.data = h.q.data();
    h.lin.scale = {DType::F32, {so, si}, h.scale.data()};
  }
  return h;
}

// A copy of `l` in the backend's memory (through prepare_weights of a one-tensor model).
Linear to_device(Backend& be, const Linear& l) {
  ModelWeights w;
  w.head = l;
  ModelArgs a;
  be.prepare_weights(a, w);
  return w.head;
}
TensorView to_device(Backend& be, const TensorView& t) {
  ModelWeights w;
  w.norm = t;
  ModelArgs a;
  be.prepare_weights(a, w);
  return w.norm;
}

// n (slot, pos) pairs as the float words a Dev buffer uploads (the kernels read them as DevPos).
std::vector<float> pos_words(const cuda::DevPos* p, size_t n) {
  const float* w = reinterpret_cast<const float*>(p);
  return std::vector<float>(w, w + 2 * n);
}

// A paged fixture's block tables in device memory, and MlaDims reading the cache through them.
struct DevTables {
  Dev words;
  DevTables(Backend& be, const test::Paged& p)
      : words(be, std::vector<float>(reinterpret_cast<const float*>(p.table.data()),
                                     reinterpret_cast<const float*>(p.table.data()) + p.table.size())) {}
  void set(cuda::MlaDims& d, const test::Paged& p) const {
    d.table = reinterpret_cast<const int32_t*>(words.p), d.table_w = p.width, d.max_len = p.width * p.block;
    d.block_shift = 0;
    while ((1 << d.block_shift) < p.block) ++d.block_shift;
  }
};

// (infinite where either side holds a NaN the other does not, or the sizes differ)
double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) {
      if (std::isnan(a[i]) != std::isnan(b[i])) return INFINITY;
      continue;
    }
    m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
  }
  return m;
}

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
        if (c.in >= 16384) EXPECT_FALSE(cuda::tcv_holds(wt, c.in, c.n)) << c.in << " n=" << c.n;
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
using cuda::DevLinear;
DevLinear dev_linear_of(const Linear& l, int64_t rows, int64_t cols) {
  DevLinear d;
  d.w = l.weight.data;
  d.rows = rows, d.cols = cols, d.ld = cols;
  if (l.weight.dtype == DType::F8_E4M3) {
    d.t = cuda::kFP8;
    d.s = static_cast<const float*>(l.scale.data);
    d.lds = (cols + 127) / 128;
  } else {
    d.t = l.weight.dtype == DType::BF16 ? cuda::kBF16 : cuda::kF32;
  }
  return d;
}

// Element (r, c) of a host linear with `cols` columns, as the device reads it (e4m3 times its
// 128x128 block scale).
double host_w(const HostLinear& h, DType t, int64_t cols, int64_t r, int64_t c) {
  const size_t e = size_t(r * cols + c);
  if (t == DType::BF16) return bf16_to_f32(h.bf16[e]);
  if (t == DType::F32) return h.f32[e];
  return double(e4m3_to_f32(h.q[e])) * h.scale[size_t((r / 128) * ((cols + 127) / 128) + c / 128)];
}

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
        if (rw && t != DType::F32) EXPECT_EQ(fused, "linear_pair;") << what;
        if (!rw) EXPECT_EQ(fused, "") << what;
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

// One golden checkpoint twice: host views for the ref backend, device copies for CUDA.
struct TwoWeights {
  std::unique_ptr<Checkpoint> ck;
  ModelWeights host, dev;
  ModelArgs a;
  TwoWeights(const std::string& c, Backend& cuda) {
    ck = Checkpoint::open(case_dir(c) + "/hf");
    a = load_model_args(*ck);
    host = load_weights(*ck);
    dev = load_weights(*ck);
    cuda.prepare_weights(a, dev);
  }
};

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
      // pipelined GEMM (long_k 1) instead of in chunks
      for (int path = 0; path < 7; ++path) {
        CudaOptions o = opts();
        o.tune.tcv_bf16_min = path == 1 ? 1 : (path == 0 || path == 3 || path >= 5 ? 2 : 0);
        if (path == 2 || path == 4) o.tune.tcv_max = 0;
        o.tune.route_in_experts = path < 3 || path >= 5;
        o.tune.long_k = path == 5 ? 0 : path == 6 ? 1 : 2;
        auto cuda = make_cuda_backend(o);
        ModelWeights dev = host;
        cuda->prepare_weights(a, dev);
        for (int64_t n : {1, 3, 8}) {
          const std::vector<float> x = randn(size_t(n * a.dim), uint32_t(n + 50));
          std::vector<float> want(x.size());
          ref->moe(a, host.layers[0].moe_w, x.data(), n, want.data());
          Dev xd(*cuda, x), yd(*cuda, x.size());
          cuda->moe(a, dev.layers[0].moe_w, xd.p, n, yd.p);
          // (the pipelined GEMM splits activations into bf16 hi + lo: its bar)
          const bool gemm = o.tune.long_k == 1 && o.tune.tcv_max >= n && n >= 2 &&
                            !cuda::tcv_holds(t == DType::BF16 ? cuda::kBF16 : cuda::kFP8, D, n);
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
  for (bool fast : {false, true}) {
    auto cuda = make_cuda_backend(opts(fast, 0, false, 1));
    for (std::string c : {"v2lite_bf16", "v2_groups_bf16"}) {
      TwoWeights W(c, *cuda);
      const ModelArgs& a = W.a;
      const int64_t H = a.n_heads, qk = a.qk_head_dim(), C = a.kv_lora_rank, R = a.qk_rope_head_dim, V = a.v_head_dim;
      const int slots = 2, max_len = 300;
      RopeTable rope(a, max_len);
      const test::Paged paged(slots, max_len);
      Dev rope_dev(*cuda, std::vector<float>(rope.at(0), rope.at(0) + size_t(max_len) * size_t(2 * rope.half())));
      const RopeView hrope = test::rope_view(rope), drope = test::rope_view(rope, rope_dev.p);
      std::vector<TokenPos> tp = {{0, 20}};
      for (int t = 10; t < 290; ++t) tp.push_back({1, t});
      const int64_t n = int64_t(tp.size());
      const Step st = paged.step(tp);
      const size_t rows = size_t(paged.rows());
      std::vector<float> c1 = randn(rows * size_t(C), 31), c2 = randn(rows * size_t(R), 32);
      std::vector<float> q = randn(size_t(n * H * qk), 33), kv = randn(size_t(n * (C + R)), 34);
      std::vector<float> rc1 = c1, rc2 = c2, rq = q, rkv = kv, rout(size_t(n * H * V));
      LayerCache rcache;
      rcache.kv = rc1.data(), rcache.pe = rc2.data();
      ref->mla({&a, AttnImpl::kAbsorb, &W.host.layers[1].attn, &hrope, &st, &rcache, rq.data(), rkv.data(),
                rout.data()});
      Dev d1(*cuda, c1), d2(*cuda, c2), dq(*cuda, q), dkv(*cuda, kv), dout(*cuda, size_t(n * H * V));
      LayerCache dcache;
      dcache.kv = d1.p, dcache.pe = d2.p;
      cuda->mla({&a, AttnImpl::kAbsorb, &W.dev.layers[1].attn, &drope, &st, &dcache, dq.p, dkv.p, dout.p});
      const double tol = fast ? 1e-2 : 5e-5;  // fast: scores and values on bf16 tensor cores
      EXPECT_LE(rel_l2(dout.get().data(), rout.data(), rout.size()), tol) << c << (fast ? " fast" : "");
      EXPECT_LE(rel_l2(d1.get().data(), rc1.data(), rc1.size()), 5e-5) << c << " cache kv";
      EXPECT_LE(rel_l2(d2.get().data(), rc2.data(), rc2.size()), 5e-5) << c << " cache pe";
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
// 40 sequences at positions around tile (32) and block (16) edges, the first and the last cache
// position, through interleaved block tables; its own split count, 3 splits and none; the
// 16B shape's heads and latent, and a small shape with 20 heads (a second, partial head group).
TEST(CudaOps, ManyTokenAttentionMatchesFloat64) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  for (int shape = 0; shape < 2; ++shape) {
    const test::Paged paged(40, shape == 0 ? 1024 : 256);
    const KvView kvv = paged.view();
    DevTables tables(*cuda, paged);
    cuda::MlaDims d;
    if (shape == 0) d.H = 16, d.nope = 128, d.R = 64, d.C = 512, d.V = 128, d.scale = 0.0721f;
    else d.H = 20, d.nope = 16, d.R = 8, d.C = 32, d.V = 16, d.scale = 0.25f;
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
    const std::vector<float> want = absorbed_attention_f64(d, kvv, tp, qa, q, ckv, cpe);
    Dev dqa(*cuda, qa), dq(*cuda, q), dkv(*cuda, ckv), dpe(*cuda, cpe);
    Dev dpos(*cuda, pos_words(tp.data(), tp.size()));
    int64_t len_max = 0;
    for (const cuda::DevPos& t : tp) len_max = std::max<int64_t>(len_max, t.pos + 1);
    // Splits over max_len (as a recorded step) or over the step's longest length.
    for (auto [ns, lm] : {std::pair{cuda::mla_many_splits(d, n, 0), int64_t(0)}, {3, 0}, {1, 0},
                          {cuda::mla_many_splits(d, n, len_max), len_max}, {2, len_max}}) {
      Dev part(*cuda, size_t(ns * n * H * C)), ml(*cuda, size_t(ns * n * H * 2));
      Dev out(*cuda, std::vector<float>(want.size(), std::nanf("")));
      cuda::DecodeAttn da;
      da.qa = dqa.p, da.q = dq.p, da.cache_kv = dkv.p, da.cache_pe = dpe.p, da.nsplit = ns, da.part = part.p;
      da.ml = ml.p, da.ol = out.p, da.len_max = lm;
      cuda::Launch L;
      cuda::mla_decode_many(L, d, reinterpret_cast<const cuda::DevPos*>(dpos.p), n, da);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> got = out.get();
      for (size_t e = 0; e < got.size(); ++e) ASSERT_TRUE(std::isfinite(got[e])) << "unwritten or NaN at " << e;
      const std::string what = str("shape ", shape, ", ", ns, " splits over ", lm ? lm : d.max_len, " positions");
      EXPECT_LE(rel_l2(got.data(), want.data(), got.size()), 1e-5) << what;
      for (int64_t i = 0; i < n; ++i)  // each token on its own, so no token's error hides in the others'
        EXPECT_LE(rel_l2(got.data() + i * H * C, want.data() + i * H * C, size_t(H * C)), 2e-5)
            << what << ", token " << i << " at " << tp[size_t(i)].pos;
    }
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

// The decode q absorption of mla_prep_qabs at the 16B shape (nope 128, C 512, 16 heads), both
// forms (16-byte loads, element-wise), bf16 / e4m3 / float32 wkv_b, 1-8 tokens: against float64
// on the host, and the prep half's cache row written.
TEST(CudaOps, DecodeQAbsorptionMatchesFloat64) {
  REQUIRE_GPU();
  auto cuda = make_cuda_backend(opts());
  const test::Paged paged(8, 16, 4);
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
    for (int64_t n : {1, 3, 8}) {
      std::vector<cuda::DevPos> tp;
      for (int64_t i = 0; i < n; ++i) tp.push_back({int32_t(i), int32_t(i % 5)});
      const std::vector<float> q = randn(size_t(n * H * qk), 71), kv = randn(size_t(n * (C + R)), 72),
                               nw = randn(size_t(C), 73), rope = randn(size_t(d.max_len * R), 74);
      std::vector<float> want(size_t(n * H * C));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t hh = 0; hh < H; ++hh)
          for (int64_t c = 0; c < C; ++c) {
            double v = 0;
            for (int64_t k = 0; k < d.nope; ++k) v += double(q[size_t((i * H + hh) * qk + k)]) * wval(hh * (d.nope + d.V) + k, c);
            want[size_t((i * H + hh) * C + c)] = float(v);
          }
      for (bool vec : {true, false}) {
        Dev dq(*cuda, q), dkv(*cuda, kv), dnw(*cuda, nw), drope(*cuda, rope);
        Dev ckv(*cuda, std::vector<float>(size_t(paged.rows() * C), 0.f)), cpe(*cuda, size_t(paged.rows() * R));
        Dev qa(*cuda, std::vector<float>(want.size(), std::nanf("")));
        Dev dpos(*cuda, pos_words(tp.data(), tp.size()));
        cuda::Launch L;
        const cuda::MlaPrep prep{reinterpret_cast<const cuda::DevPos*>(dpos.p), n, dq.p, dkv.p, dnw.p, drope.p,
                                 ckv.p, cpe.p};
        cuda::mla_prep_qabs(L, d, prep, w, qa.p, vec);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> got = qa.get();
        const std::string what = std::string(dtype_name(t)) + " n=" + std::to_string(n) + (vec ? " 16-byte" : " scalar");
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

// ---- the whole model against the golden float32 logits

struct GoldenParam {
  std::string name;
  AttnImpl attn;
  int variant;  // 0: default (graphs, PDL); 1: no graphs, no PDL, WMMA tensor cores from 1 token; 2: fast
                // (bf16 activations for steps of 16+ tokens); 3: pipelined kernel and cuBLAS
                // attention from 1 token, no graphs
};

std::string golden_param_name(const ::testing::TestParamInfo<GoldenParam>& p) {
  static const char* v[] = {"graphs", "plain", "fast", "tc"};
  return p.param.name + (p.param.attn == AttnImpl::kAbsorb ? "_absorb_" : "_naive_") + v[p.param.variant];
}

std::vector<GoldenParam> golden_params() {
  std::vector<GoldenParam> v;
  for (auto& c : golden_cases())
    for (auto a : {AttnImpl::kAbsorb, AttnImpl::kNaive})
      for (int k = 0; k < 4; ++k) v.push_back({c, a, k});
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

class CudaGolden : public ::testing::TestWithParam<GoldenParam> {};

TEST_P(CudaGolden, EveryStepMatchesFp32Logits) {
  REQUIRE_GPU();
  const GoldenParam& p = GetParam();
  CudaOptions o;
  if (p.variant == 1) o.graphs = false, o.pdl = false, o.tune.gemv_max = 0, o.tune.tc_min = 1 << 30;
  if (p.variant == 2) o.fast = true, o.tune.fast_min = 16;  // the golden prefills (28 tokens) in fast mode
  if (p.variant == 3) o.graphs = false, o.tune.gemv_max = 0, o.tune.tc_min = 1, o.tune.attn_many_min = 1;
  SafetensorsFile g(case_dir(p.name) + "/golden.safetensors");
  ModelOptions mo;
  mo.attn = p.attn;
  mo.max_seqs = 4;
  Model model(Checkpoint::open(case_dir(p.name) + "/hf"), make_cuda_backend(o), mo);
  const int V = model.args().vocab_size;
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
      if (p.variant != 2) {
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
  if (p.variant == 2) {  // bf16 activations: no worse than the reference's own bf16 row, whose errors are
                         // per step; every single row is held to that step maximum as well
    const Bf16Row r = bf16_row(p.name, p.attn);
    EXPECT_LE(smx, r.max_err);
    EXPECT_LE(smed, r.median_err);
    EXPECT_LE(mx, r.max_err);
    EXPECT_GE(agree * r.total, r.agree * total);
  }
}

// Fresh prefills of the prefix with every position's logits (the long case: 283 rows).
TEST_P(CudaGolden, PrefixLogitsMatch) {
  REQUIRE_GPU();
  const GoldenParam& p = GetParam();
  if (p.variant == 2) GTEST_SKIP() << "covered by the step test";
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

}  // namespace

#else  // !DSV3_HAVE_CUDA

TEST(CudaBackend, NotBuilt) { GTEST_SKIP() << "built without CUDA (-DDSV3_CUDA=OFF or no nvcc)"; }

#endif

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
