// Helpers of the CUDA backend's tests (cuda_backend_test.cc, cuda_attention_test.cc, cuda_model_test.cc): options for
// each product path, random inputs, device buffers, host linears of every weight type and their
// device copies, a hand-built step graph, golden weights on both backends.
#pragma once
#ifdef DSV3_HAVE_CUDA
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/kernels.h"
#include "backend/ref/fp8.h"
#include "core/dtype.h"
#include "golden_util.h"
#include "io/checkpoint.h"
#include "paged_util.h"
#include "runtime/model.h"
#include "runtime/rewrites.h"

namespace dsv3::cuda_test {

using namespace dsv3::testing_util;


#define REQUIRE_GPU()                                           \
  do {                                                          \
    std::string why_;                                           \
    if (!cuda::device_available(&why_)) GTEST_SKIP() << why_;   \
  } while (0)

inline CudaOptions opts(bool fast = false, int gemv_max = 8, bool graphs = true, int tc_min = 1 << 30) {
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
inline CudaOptions mode_opts(int mode) {
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

inline std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.f) {
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

inline HostLinear make_linear(DType t, int64_t out, int64_t in, uint32_t seed) {
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
inline Linear to_device(Backend& be, const Linear& l) {
  ModelWeights w;
  w.head = l;
  ModelArgs a;
  be.prepare_weights(a, w);
  return w.head;
}
inline TensorView to_device(Backend& be, const TensorView& t) {
  ModelWeights w;
  w.norm = t;
  ModelArgs a;
  be.prepare_weights(a, w);
  return w.norm;
}

// n (slot, pos) pairs as the float words a Dev buffer uploads (the kernels read them as DevPos).
// A bf16 cache (LayerCache::bf16) as the floats that hold it: x rounded to bf16, two per float
// (x.size() even); from_bf16_words reads such words back; rounded_bf16: x as the cache holds it.
inline std::vector<float> bf16_words(const std::vector<float>& x) {
  std::vector<float> w(x.size() / 2);
  for (size_t i = 0; i < w.size(); ++i) {
    const uint32_t u = uint32_t(f32_to_bf16(x[2 * i])) | uint32_t(f32_to_bf16(x[2 * i + 1])) << 16;
    std::memcpy(&w[i], &u, 4);
  }
  return w;
}
inline std::vector<float> from_bf16_words(const std::vector<float>& w) {
  std::vector<float> x(2 * w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &w[i], 4);
    x[2 * i] = bf16_to_f32(uint16_t(u & 0xffff)), x[2 * i + 1] = bf16_to_f32(uint16_t(u >> 16));
  }
  return x;
}
inline std::vector<float> rounded_bf16(std::vector<float> x) {
  for (float& v : x) v = round_bf16(v);
  return x;
}

inline std::vector<float> pos_words(const cuda::DevPos* p, size_t n) {
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
inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
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


using cuda::DevLinear;
inline DevLinear dev_linear_of(const Linear& l, int64_t rows, int64_t cols) {
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
inline double host_w(const HostLinear& h, DType t, int64_t cols, int64_t r, int64_t c) {
  const size_t e = size_t(r * cols + c);
  if (t == DType::BF16) return bf16_to_f32(h.bf16[e]);
  if (t == DType::F32) return h.f32[e];
  return double(e4m3_to_f32(h.q[e])) * h.scale[size_t((r / 128) * ((cols + 127) / 128) + c / 128)];
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

}  // namespace dsv3::cuda_test
#endif  // DSV3_HAVE_CUDA
