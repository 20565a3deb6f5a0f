// The "cpu" backend against its slow twins: every kernel of every instruction set this machine
// has against a plain float32 loop (or the ref backend's op) on random inputs, ragged sizes,
// batches 1..40 and thread pools of 1, 2 and 3; then the whole model against the golden logits
// under the bf16 bar (tests/data/golden/README.md).
//
// Tolerances follow from the arithmetic: every path widens weights exactly to float32 and sums in
// float32, so it differs from a double-precision loop only by rounding: ~K * 2^-24 * sum |x_k w_k|.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "backend/ref/fp8.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "golden_util.h"
#include "io/safetensors.h"
#include "runtime/model.h"
#include "paged_util.h"
#include "model/rope.h"

using namespace dsv3;
using namespace dsv3::testing_util;

namespace {

std::vector<cpu::Isa> isas() {
  std::vector<cpu::Isa> v;
  for (cpu::Isa i : {cpu::Isa::kScalar, cpu::Isa::kAvx2, cpu::Isa::kAvx512, cpu::Isa::kAmx})
    if (cpu::isa_supported(i)) v.push_back(i);
  return v;
}

// Relative tolerance per dot product (times sum |x w|): every ISA computes in float32 (weights
// widened exactly, FP8 block scale folded into x with one float32 rounding), so the difference
// from the double-precision loop is summation order: ~K * 2^-24 per term at worst.
// AMX carries activations as bf16 hi + lo (relative error <= 2^-17 per element), FP8/bf16 weights
// exactly: 2^-16 more.
double dot_tol(cpu::Isa isa, int64_t K, DType dt = DType::BF16) {
  const bool split = isa == cpu::Isa::kAmx && (dt == DType::F8_E4M3 || dt == DType::BF16);
  return (split ? std::ldexp(1.0, -16) : 0.0) + 2e-6 + double(K) * 1.2e-7;
}

// A random Linear [out, in] of a dtype, owning its bytes.
struct OwnedLinear {
  std::vector<uint8_t> w;
  std::vector<float> s;
  Linear lin;
  std::vector<float> deq;  // [out, in] dequantised float32 (what the ref computes with)
  OwnedLinear(DType dt, int64_t out, int64_t in, std::mt19937& rng) {
    std::normal_distribution<float> nd(0.f, 1.f);
    const int64_t n = out * in;
    deq.resize(size_t(n));
    w.resize(size_t(n) * dtype_size(dt));
    lin.weight = {dt, {out, in}, w.data()};
    if (dt == DType::F8_E4M3) {
      const int64_t so = (out + 127) / 128, si = (in + 127) / 128;
      s.resize(size_t(so * si));
      for (auto& v : s) v = std::ldexp(0.5f + float(rng() % 1000) / 1000.f, -int(rng() % 12));
      lin.scale = {DType::F32, {so, si}, s.data()};
      for (int64_t i = 0; i < n; ++i) {
        uint8_t b = uint8_t(rng());
        if ((b & 0x7f) == 0x7f) b = 0x00;  // no NaN codes
        w[size_t(i)] = b;
        deq[size_t(i)] = e4m3_to_f32(b) * s[size_t((i / in / 128) * si + (i % in) / 128)];
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        float v = nd(rng) * 0.3f;
        if (dt == DType::BF16) {
          uint16_t h = f32_to_bf16(v);
          std::memcpy(&w[size_t(i) * 2], &h, 2);
          deq[size_t(i)] = bf16_to_f32(h);
        } else if (dt == DType::F16) {
          uint16_t h = f32_to_f16(v);
          std::memcpy(&w[size_t(i) * 2], &h, 2);
          deq[size_t(i)] = f16_to_f32(h);
        } else {
          std::memcpy(&w[size_t(i) * 4], &v, 4);
          deq[size_t(i)] = v;
        }
      }
    }
  }
};

std::vector<float> randn(size_t n, std::mt19937& rng, float sd = 1.f) {
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// sum_k x[k * sx] w[k * sw] in double, and sum_k |x w| (what the tolerances scale with).
struct RefDot {
  double sum = 0, mag = 0;
};
RefDot ref_dot(const float* x, int64_t sx, const float* w, int64_t sw, int64_t n) {
  RefDot d;
  for (int64_t k = 0; k < n; ++k) {
    const double p = double(x[k * sx]) * w[k * sw];
    d.sum += p;
    d.mag += std::fabs(p);
  }
  return d;
}

// --- e4m3 conversion: every code, exactly -----------------------------------------------------------
// W[r][c] = code (r * 131 + c) % 256; one-hot activations read single weights back. Scale 2^-8
// makes the folded activation scale exactly 1, so y must equal the code's value * 2^-8 exactly.
std::vector<uint8_t> every_code_weights(int64_t rows, int64_t cols) {  // W[r][c] = (r * 131 + c) % 256
  std::vector<uint8_t> w(size_t(rows * cols));
  for (int64_t i = 0; i < rows * cols; ++i) {
    w[size_t(i)] = uint8_t((i / cols * 131 + i % cols) % 256);
    if ((w[size_t(i)] & 0x7f) == 0x7f) w[size_t(i)] = 0x80;  // NaN codes would poison the sums; -0 instead
  }
  return w;
}

void check_every_e4m3_code(cpu::Isa isa, int64_t M) {
  const int64_t out = 256, in = 128;
  const std::vector<uint8_t> w = every_code_weights(out, in);
  std::vector<float> s(2, std::ldexp(1.f, -8));
  Linear lin{{DType::F8_E4M3, {out, in}, w.data()}, {DType::F32, {2, 1}, s.data()}};
  cpu::Scratch scr;
  std::vector<float> x(size_t(M * in), 0.f), y(size_t(M * out));
  for (int64_t m = 0; m < M; ++m) x[size_t(m * in + (m * 37) % in)] = 1.f;
  cpu::kernels(isa).matmul({x.data(), M, in}, lin, {0, out}, {y.data(), out}, scr);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < out; ++r) {
      uint8_t b = w[size_t(r * in + (m * 37) % in)];
      float want = e4m3_to_f32(b) * std::ldexp(1.f, -8);
      if (std::isnan(want)) continue;
      ASSERT_EQ(y[size_t(m * out + r)], want) << cpu::isa_name(isa) << " code " << int(b) << " M " << M;
    }
}

// The same through the transposed product (y[m][c] = sum_d x[m][d] W[d][c]): one-hot x picks a
// row, whose codes (every one, across two scale blocks of columns) must come back exactly.
void check_every_e4m3_code_t(cpu::Isa isa, int64_t M) {
  const int64_t rows = 128, C = 256;
  const std::vector<uint8_t> w = every_code_weights(rows, C);
  std::vector<float> s(2, std::ldexp(1.f, -8));
  Linear lin{{DType::F8_E4M3, {rows, C}, w.data()}, {DType::F32, {1, 2}, s.data()}};
  cpu::Scratch scr;
  std::vector<float> x(size_t(M * rows), 0.f), y(size_t(M * C));
  for (int64_t m = 0; m < M; ++m) x[size_t(m * rows + (m * 37) % rows)] = 1.f;
  cpu::kernels(isa).matmul_t({x.data(), M, rows}, lin, {0, rows}, {y.data(), C}, scr);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t b = w[size_t(((m * 37) % rows) * C + c)];
      ASSERT_EQ(y[size_t(m * C + c)], e4m3_to_f32(b) * std::ldexp(1.f, -8)) << cpu::isa_name(isa) << " code " << int(b) << " M " << M;
    }
}

TEST(CpuKernels, EveryE4m3CodeConvertsExactly) {
  for (cpu::Isa isa : isas()) {
    for (int64_t M : {1, 3, 4, 40}) check_every_e4m3_code(isa, M);
    for (int64_t M : {1, 9, 40}) check_every_e4m3_code_t(isa, M);
  }
}

// --- matmul vs the float32 loop -----------------------------------------------------------------------
void check_matmul(cpu::Isa isa, DType dt, int64_t out, int64_t in, int64_t M, std::mt19937& rng) {
  OwnedLinear L(dt, out, in, rng);
  std::vector<float> x = randn(size_t(M * in), rng);
  // A row range that starts and ends off the 128-row blocks when possible.
  int64_t r0 = out > 3 ? int64_t(rng() % uint32_t(out / 3)) : 0;
  int64_t nr = out - r0 - (out > 5 ? int64_t(rng() % 3) : 0);
  const int64_t ldy = nr + 3;
  std::vector<float> y(size_t(M * ldy), -7.f);
  cpu::Scratch scr;
  cpu::kernels(isa).matmul({x.data(), M, in}, L.lin, {r0, nr}, {y.data(), ldy}, scr);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < nr; ++j) {
      const RefDot d = ref_dot(&x[size_t(m * in)], 1, &L.deq[size_t((r0 + j) * in)], 1, in);
      ASSERT_NEAR(y[size_t(m * ldy + j)], d.sum, dot_tol(isa, in, dt) * d.mag + 1e-30)
          << cpu::isa_name(isa) << " " << dtype_name(dt) << " out " << out << " in " << in << " M " << M << " row "
          << r0 + j << " token " << m;
    }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = nr; j < ldy; ++j) ASSERT_EQ(y[size_t(m * ldy + j)], -7.f) << "wrote past the row range";
}

TEST(CpuKernels, MatmulMatchesFloatLoopOnRaggedShapes) {
  std::mt19937 rng(1);
  for (cpu::Isa isa : isas())
    for (DType dt : {DType::F8_E4M3, DType::BF16, DType::F32, DType::F16})
      for (auto [out, in] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {5, 17}, {33, 64}, {130, 100}, {257, 300}, {64, 129}, {300, 256}})
        for (int64_t M : {1, 2, 3, 4, 5, 6, 7, 8, 9, 13}) check_matmul(isa, dt, out, in, M, rng);
}

TEST(CpuKernels, MatmulBatchSizes1To40) {
  std::mt19937 rng(2);
  for (cpu::Isa isa : isas())
    for (DType dt : {DType::F8_E4M3, DType::BF16})
      for (int64_t M = 1; M <= 40; ++M) check_matmul(isa, dt, 140, 200, M, rng);
  // A large batch crosses the token tiles of the packed activations.
  for (cpu::Isa isa : isas()) check_matmul(isa, DType::F8_E4M3, 40, 2100, 70, rng);
}

// Beyond 8 tokens the AVX2 table runs a blocked product (16-row panels, 6-token register tiles,
// K blocks of 256, row blocks of 128, token blocks of 120) and the AVX-512 table 32-row panels in
// 256-column blocks (partial sums added): token counts off the tile, K off the K block and off 8,
// row ranges off the 16- and 32-row groups and across row blocks, every weight dtype.
TEST(CpuKernels, ManyTokenMatmulOnRaggedBlocks) {
  std::mt19937 rng(7);
  for (cpu::Isa isa : isas())
    for (DType dt : {DType::F8_E4M3, DType::BF16, DType::F32, DType::F16})
      for (auto [out, in] : std::vector<std::pair<int64_t, int64_t>>{{150, 300}, {37, 517}, {290, 260}})
        for (int64_t M : {9, 10, 12, 13, 17, 23, 48, 61, 70}) check_matmul(isa, dt, out, in, M, rng);
  // Across token blocks.
  for (cpu::Isa isa : isas()) check_matmul(isa, DType::F8_E4M3, 45, 300, 251, rng);
}

// --- transposed product -------------------------------------------------------------------------------
void check_matmul_t(cpu::Isa isa, OwnedLinear& L, int64_t M, std::mt19937& rng) {
  const int64_t rows = L.lin.out(), C = L.lin.in();
  const int64_t d0 = rows > 4 ? int64_t(rng() % uint32_t(rows / 4)) : 0, nd = rows - d0 - (rows > 9 ? 3 : 0);
  std::vector<float> x = randn(size_t(M * nd), rng);
  const int64_t ldy = C + 5;
  std::vector<float> y(size_t(M * ldy), -7.f);
  cpu::Scratch scr;
  cpu::kernels(isa).matmul_t({x.data(), M, nd}, L.lin, {d0, nd}, {y.data(), ldy}, scr);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c) {
      const RefDot d = ref_dot(&x[size_t(m * nd)], 1, &L.deq[size_t(d0 * C + c)], C, nd);
      ASSERT_NEAR(y[size_t(m * ldy + c)], d.sum, dot_tol(isa, nd) * d.mag + 1e-30)
          << cpu::isa_name(isa) << " " << dtype_name(L.lin.weight.dtype) << " rows " << rows << " C " << C << " M " << M;
    }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = C; c < ldy; ++c) ASSERT_EQ(y[size_t(m * ldy + c)], -7.f);
}

TEST(CpuKernels, TransposedMatmulMatchesFloatLoop) {
  std::mt19937 rng(3);
  for (cpu::Isa isa : isas())
    for (DType dt : {DType::F8_E4M3, DType::BF16, DType::F32, DType::F16})
      for (auto [rows, C] : std::vector<std::pair<int64_t, int64_t>>{{8, 16}, {77, 70}, {300, 130}, {256, 512}})
        for (int64_t M : {1, 2, 3, 5, 9, 20, 47}) {
          OwnedLinear L(dt, rows, C, rng);
          check_matmul_t(isa, L, M, rng);
        }
}

// --- the AVX2 table's e4m3 routes -------------------------------------------------------------------------
// Its integer route (value * 2^-120, subnormal codes as float32 subnormals; AMD) and its fp16 route
// are both exact; each is forced in turn on every code, at 1..9 tokens (one-token stream, every
// register blocking), row lengths off the 32- and 64-weight steps, row ranges off the 128-row
// blocks, and on blocks whose activation x scale x 2^120 overflows (those must fall back to the
// fp16 route). Auto selection under MXCSR.DAZ (subnormals read as zero) must stay exact too.
struct Avx2Route {
  explicit Avx2Route(int r) { cpu::set_avx2_fp8_route(r); }
  ~Avx2Route() { cpu::set_avx2_fp8_route(0); }
};

// L's scales of every other 128-row block multiplied by 2^k (and deq to match).
void scale_blocks(OwnedLinear& L, int k) {
  const int64_t in = L.lin.in(), si = (in + 127) / 128;
  for (size_t j = 0; j < L.s.size(); ++j)
    if (j / size_t(si) % 2 == 1) L.s[j] = std::ldexp(L.s[j], k);
  for (size_t i = 0; i < L.deq.size(); ++i)
    L.deq[i] = e4m3_to_f32(L.w[i]) * L.s[size_t((int64_t(i) / in / 128) * si + (int64_t(i) % in) / 128)];
}

TEST(CpuKernels, Avx2E4m3RoutesAreExactOnRaggedShapes) {
  if (!cpu::isa_supported(cpu::Isa::kAvx2)) GTEST_SKIP() << "no AVX2";
  const cpu::Isa isa = cpu::Isa::kAvx2;
  std::mt19937 rng(7);
  for (int route : {1, 2}) {
    Avx2Route forced(route);
    for (int64_t M = 1; M <= 9; ++M) check_every_e4m3_code(isa, M);
    for (auto [out, in] : std::vector<std::pair<int64_t, int64_t>>{{37, 31}, {70, 33}, {129, 95}, {300, 2100}, {260, 256}})
      for (int64_t M = 1; M <= 9; ++M) check_matmul(isa, DType::F8_E4M3, out, in, M, rng);
    for (auto [rows, C] : std::vector<std::pair<int64_t, int64_t>>{{77, 70}, {300, 130}, {256, 512}})
      for (int64_t M : {1, 2}) {
        OwnedLinear L(DType::F8_E4M3, rows, C, rng);
        check_matmul_t(isa, L, M, rng);
        scale_blocks(L, 20);  // scale * 2^120 > FLT_MAX in those blocks
        check_matmul_t(isa, L, M, rng);
      }
  }
  // Overflow: blocks with scale x 2^120 infinite, or activations large enough that x scale 2^120 is.
  for (int64_t M : {1, 2, 8, 12}) {
    OwnedLinear L(DType::F8_E4M3, 300, 400, rng);
    scale_blocks(L, 20);
    std::vector<float> x = randn(size_t(M * 400), rng, 1e3f);
    const int64_t ldy = 300;
    std::vector<float> y(size_t(M * ldy));
    cpu::Scratch scr;
    cpu::kernels(isa).matmul({x.data(), M, 400}, L.lin, {0, 300}, {y.data(), ldy}, scr);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < 300; ++j) {
        const RefDot d = ref_dot(&x[size_t(m * 400)], 1, &L.deq[size_t(j * 400)], 1, 400);
        ASSERT_NEAR(y[size_t(m * ldy + j)], d.sum, dot_tol(isa, 400) * d.mag) << "M " << M << " row " << j;
      }
  }
#if defined(__x86_64__)
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x40);  // DAZ
  for (int64_t M : {1, 4, 12}) check_every_e4m3_code(isa, M);
  _mm_setcsr(csr);
#endif
}

// --- float32 kernels ------------------------------------------------------------------------------------
TEST(CpuKernels, Float32KernelsMatchLoops) {
  std::mt19937 rng(4);
  for (cpu::Isa isa : isas()) {
    const cpu::Kernels& k = cpu::kernels(isa);
    for (auto [M, N, K] : std::vector<std::array<int64_t, 3>>{{1, 1, 1}, {3, 5, 17}, {16, 33, 576}, {9, 130, 100}, {20, 300, 270}, {140, 7, 40}}) {
      std::vector<float> a = randn(size_t(M * (K + 2)), rng), b = randn(size_t(N * (K + 1)), rng);
      std::vector<float> c(size_t(M * (N + 1)), -7.f);
      k.gemm_nt_f32({a.data(), M, K + 2}, {b.data(), N, K + 1}, K, 0.5f, {c.data(), N + 1});
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double want = 0, mag = 0;
          for (int64_t q = 0; q < K; ++q) {
            double p = double(a[size_t(i * (K + 2) + q)]) * b[size_t(j * (K + 1) + q)];
            want += p;
            mag += std::fabs(p);
          }
          ASSERT_NEAR(c[size_t(i * (N + 1) + j)], 0.5 * want, 0.5 * (1e-6 + K * 1.2e-7) * mag) << cpu::isa_name(isa);
        }
      // o += p v, J ragged
      const int64_t J = K;
      std::vector<float> p = randn(size_t(M * N), rng), v = randn(size_t(N * J), rng), o = randn(size_t(M * J), rng);
      std::vector<float> o0 = o;
      k.gemm_nn_acc_f32({p.data(), M, N}, {v.data(), N, J}, J, {o.data(), J});
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < J; ++j) {
          double want = o0[size_t(i * J + j)], mag = std::fabs(want);
          for (int64_t n = 0; n < N; ++n) {
            double t = double(p[size_t(i * N + n)]) * v[size_t(n * J + j)];
            want += t;
            mag += std::fabs(t);
          }
          ASSERT_NEAR(o[size_t(i * J + j)], want, (1e-6 + N * 1.2e-7) * mag) << cpu::isa_name(isa);
        }
    }
    // Element-wise ops.
    for (int64_t n : {1, 15, 16, 17, 100, 2048}) {
      std::vector<float> a = randn(size_t(n), rng, 3.f), b = randn(size_t(n), rng), h(a.size());
      k.silu_mul(a.data(), b.data(), n, h.data());
      for (int64_t i = 0; i < n; ++i) {
        float want = a[size_t(i)] / (1.f + std::exp(-a[size_t(i)])) * b[size_t(i)];
        ASSERT_NEAR(h[size_t(i)], want, 1e-6 * std::fabs(want) + 1e-30) << cpu::isa_name(isa);
      }
      std::vector<float> s = a;
      k.softmax(s.data(), n);
      float mx = *std::max_element(a.begin(), a.end());
      double sum = 0;
      for (float v : a) sum += std::exp(double(v) - mx);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_NEAR(s[size_t(i)], std::exp(double(a[size_t(i)]) - mx) / sum, 4e-6 * s[size_t(i)] + 1e-9) << cpu::isa_name(isa);
      std::vector<float> w = randn(size_t(n), rng), y(a.size() + 2, 5.f);
      k.rmsnorm({a.data(), 1, n}, n, w.data(), 1e-6f, {y.data(), n});
      double ss = 0;
      for (float v : a) ss += double(v) * v;
      const double r = 1 / std::sqrt(ss / double(n) + 1e-6);
      for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(y[size_t(i)], a[size_t(i)] * r * w[size_t(i)], 2e-6 * std::fabs(a[size_t(i)] * r * w[size_t(i)]) + 1e-30);
      EXPECT_EQ(y[size_t(n)], 5.f);
      std::vector<float> y2 = b;
      k.axpy(0.25f, a.data(), n, y2.data());
      for (int64_t i = 0; i < n; ++i) ASSERT_FLOAT_EQ(y2[size_t(i)], b[size_t(i)] + 0.25f * a[size_t(i)]);
    }
  }
}

// --- whole ops: cpu backend vs ref backend ----------------------------------------------------------------
// A small random model description: ragged dims (not multiples of 16 or 128) and FP8 edge blocks.
ModelArgs small_args(bool fp8) {
  ModelArgs a;
  a.dim = 200;
  a.inter_dim = 300;
  a.moe_inter_dim = 136;
  a.n_layers = 2;
  a.n_heads = 3;
  a.n_routed_experts = 12;
  a.n_shared_experts = 1;
  a.n_activated_experts = 3;
  a.n_expert_groups = 4;
  a.n_limited_groups = 2;
  a.score_func = "sigmoid";
  a.norm_topk_prob = true;
  a.route_scale = 2.5f;
  a.q_lora_rank = 0;
  a.kv_lora_rank = 144;
  a.qk_nope_head_dim = 24;
  a.qk_rope_head_dim = 8;
  a.v_head_dim = 20;
  a.vocab_size = 300;
  a.max_seq_len = 64;
  a.dtype = fp8 ? "fp8" : "bf16";
  return a;
}

double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  return rel_l2(got.data(), want.data(), want.size());
}

struct BackendPair {
  ThreadPool pool;
  std::unique_ptr<Backend> cpu, ref;
  BackendPair(cpu::Isa isa, int threads)
      : pool(threads), cpu(make_cpu_backend(cpu::isa_name(isa), &pool)), ref(make_ref_backend()) {}
};

// The bound for a whole op (float32 arithmetic, different summation order): 1e-5 relative L2;
// 5e-5 with AMX's hi + lo activations.
double op_tol(cpu::Isa isa) { return isa == cpu::Isa::kAmx ? 5e-5 : 1e-5; }

TEST(CpuBackend, LinearNormEmbedMatchRef) {
  std::mt19937 rng(5);
  for (cpu::Isa isa : isas())
    for (int threads : {1, 2, 3}) {
      BackendPair bp(isa, threads);
      for (DType dt : {DType::F8_E4M3, DType::BF16}) {
        OwnedLinear L(dt, 259, 333, rng);
        for (int64_t n : {1, 3, 8, 33}) {
          std::vector<float> x = randn(size_t(n * 333), rng), a(size_t(n * 259)), b(size_t(n * 259));
          bp.cpu->linear(x.data(), n, L.lin, a.data());
          bp.ref->linear(x.data(), n, L.lin, b.data());
          EXPECT_LT(rel_err(a, b), op_tol(isa)) << cpu::isa_name(isa) << " threads " << threads << " n " << n;
        }
      }
      std::vector<uint16_t> wn(333);
      for (auto& v : wn) v = f32_to_bf16(1.f + 0.1f * randn(1, rng)[0]);
      TensorView wv{DType::BF16, {333}, wn.data()};
      std::vector<float> x = randn(size_t(5 * 340), rng), a = x, b = x;
      bp.cpu->rmsnorm(x.data(), 5, 333, 340, wv, 1e-6f, a.data());
      bp.ref->rmsnorm(x.data(), 5, 333, 340, wv, 1e-6f, b.data());
      EXPECT_LT(rel_err(a, b), 1e-6);
      std::vector<uint16_t> table(size_t(50 * 20));
      for (size_t i = 0; i < table.size(); ++i) table[i] = f32_to_bf16(float(i) * 0.01f);
      TensorView tv{DType::BF16, {50, 20}, table.data()};
      int32_t tok[3] = {49, 0, 7};
      std::vector<float> ea(60), eb(60);
      Step st;
      st.tokens = tok, st.n = 3;
      bp.cpu->embed(st, tv, 0, ea.data());
      bp.ref->embed(st, tv, 0, eb.data());
      EXPECT_EQ(ea, eb);
      bp.cpu->embed(st, tv, 10, ea.data());  // a slice of the vocabulary from token 10: token 0 is not in it
      bp.ref->embed(st, tv, 10, eb.data());
      EXPECT_EQ(std::vector<float>(ea.begin() + 20, ea.begin() + 40), std::vector<float>(20, 0.f));
      EXPECT_EQ(ea, eb);
    }
}

// Random weights for one layer's MoE / MLA of small_args.
struct LayerFixture {
  ModelArgs a;
  std::vector<std::unique_ptr<OwnedLinear>> owned;
  std::vector<std::vector<uint16_t>> vecs;
  std::vector<std::vector<float>> fvecs;
  MoEWeights moe;
  MLPWeights dense;
  AttnWeights attn;
  std::mt19937 rng{6};
  Linear lin(int64_t out, int64_t in) {
    owned.push_back(std::make_unique<OwnedLinear>(a.dtype == "fp8" ? DType::F8_E4M3 : DType::BF16, out, in, rng));
    return owned.back()->lin;
  }
  TensorView vec(int64_t n, float base, float sd) {
    vecs.emplace_back(size_t(n));
    for (auto& v : vecs.back()) v = f32_to_bf16(base + sd * randn(1, rng)[0]);
    return {DType::BF16, {n}, vecs.back().data()};
  }
  MLPWeights mlp(int64_t inter) { return {lin(inter, a.dim), lin(a.dim, inter), lin(inter, a.dim)}; }
  explicit LayerFixture(bool fp8) : a(small_args(fp8)) {
    moe.experts.resize(size_t(a.n_routed_experts));
    for (auto& e : moe.experts) e = mlp(a.moe_inter_dim);
    moe.shared_experts = mlp(int64_t(a.n_shared_experts) * a.moe_inter_dim);
    moe.has_shared = true;
    vecs.emplace_back(size_t(a.n_routed_experts * a.dim));
    for (auto& v : vecs.back()) v = f32_to_bf16(randn(1, rng)[0] / std::sqrt(float(a.dim)));
    moe.gate = {DType::BF16, {a.n_routed_experts, a.dim}, vecs.back().data()};
    fvecs.emplace_back(randn(size_t(a.n_routed_experts), rng, 0.02f));
    moe.bias = {DType::F32, {a.n_routed_experts}, fvecs.back().data()};
    dense = mlp(a.inter_dim);
    attn.wq = lin(a.n_heads * a.qk_head_dim(), a.dim);
    attn.wkv_a = lin(a.kv_lora_rank + a.qk_rope_head_dim, a.dim);
    attn.kv_norm = vec(a.kv_lora_rank, 1.f, 0.05f);
    attn.wkv_b = lin(a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank);
    attn.wo = lin(a.dim, a.n_heads * a.v_head_dim);
  }
};

TEST(CpuBackend, MoeAndMlpMatchRef) {
  for (bool fp8 : {true, false}) {
    LayerFixture f(fp8);
    std::mt19937 rng(7);
    for (cpu::Isa isa : isas())
      for (int threads : {1, 2, 3}) {
        BackendPair bp(isa, threads);
        for (int64_t n : {1, 2, 5, 8, 40}) {
          std::vector<float> x = randn(size_t(n * f.a.dim), rng), a(size_t(n * f.a.dim)), b(size_t(n * f.a.dim));
          bp.cpu->moe(f.a, f.moe, x.data(), n, a.data());
          bp.ref->moe(f.a, f.moe, x.data(), n, b.data());
          EXPECT_LT(rel_err(a, b), op_tol(isa)) << "moe " << cpu::isa_name(isa) << " fp8 " << fp8 << " n " << n;
          bp.cpu->mlp(f.dense, x.data(), n, a.data());
          bp.ref->mlp(f.dense, x.data(), n, b.data());
          EXPECT_LT(rel_err(a, b), op_tol(isa)) << "mlp " << cpu::isa_name(isa) << " fp8 " << fp8 << " n " << n;
        }
        EXPECT_GT(bp.cpu->routed_experts_run(), 0);
        bp.cpu->reset_counters();
        EXPECT_EQ(bp.cpu->routed_experts_run(), 0);
      }
  }
}

// MLA, absorbed: a prefill of several rows, then decode steps over the cache, both backends
// writing their own caches.
TEST(CpuBackend, AbsorbedMlaMatchesRef) {
  for (bool fp8 : {true, false}) {
    LayerFixture f(fp8);
    const ModelArgs& a = f.a;
    RopeTable rope(a, a.max_seq_len);
    std::mt19937 rng(8);
    const int64_t H = a.n_heads, qk = a.qk_head_dim(), C = a.kv_lora_rank, R = a.qk_rope_head_dim, V = a.v_head_dim;
    const int slots = 3, max_len = a.max_seq_len;
    const test::Paged paged(slots, max_len);
    const RopeView rv = test::rope_view(rope);
    for (cpu::Isa isa : isas())
      for (int threads : {1, 3}) {
        BackendPair bp(isa, threads);
        std::vector<float> ckv[2], cpe[2];
        LayerCache cache[2];
        for (int b = 0; b < 2; ++b) {
          ckv[b].assign(size_t(paged.rows() * C), 0.f);
          cpe[b].assign(size_t(paged.rows() * R), 0.f);
          cache[b].kv = ckv[b].data();
          cache[b].pe = cpe[b].data();
        }
        // Calls: a prefill of 2 slots x 21 tokens, then 3 decode steps of 3 slots (slot 2 starts late).
        std::vector<std::vector<TokenPos>> calls;
        std::vector<TokenPos> pre;
        for (int s = 0; s < 2; ++s)
          for (int p = 0; p < 21; ++p) pre.push_back({s, p});
        calls.push_back(pre);
        calls.push_back({{2, 0}, {2, 1}, {2, 2}});
        for (int step = 0; step < 3; ++step) calls.push_back({{0, 21 + step}, {1, 21 + step}, {2, 3 + step}});
        // Single-token steps (decode at batch 1: the one-token kernels).
        calls.push_back({{1, 24}});
        calls.push_back({{2, 6}});
        for (auto& tp : calls) {
          const int64_t n = int64_t(tp.size());
          std::vector<float> q = randn(size_t(n * H * qk), rng), kv = randn(size_t(n * (C + R)), rng);
          std::vector<float> q2 = q, kv2 = kv, oa(size_t(n * H * V)), ob(size_t(n * H * V));
          const Step st = paged.step(tp);
          MlaCall c{&a, AttnImpl::kAbsorb, &f.attn, &rv, &st, &cache[0], q.data(), kv.data(), oa.data()};
          bp.cpu->mla(c);
          c.cache = &cache[1], c.q = q2.data(), c.kv = kv2.data(), c.out = ob.data();
          bp.ref->mla(c);
          EXPECT_LT(rel_err(oa, ob), op_tol(isa)) << cpu::isa_name(isa) << " fp8 " << fp8 << " n " << n;
        }
        EXPECT_LT(rel_err(ckv[0], ckv[1]), 1e-6);
        EXPECT_LT(rel_err(cpe[0], cpe[1]), 1e-6);
      }
  }
}

// The pool's workers spin between tasks and sleep after a while: back-to-back regions (the spin
// path) and regions after a pause (the sleep path) must both cover every index exactly once.
TEST(CpuThreadPool, BackToBackAndAfterSleepRegionsCoverEveryIndexOnce) {
  for (int threads : {2, 3, 5}) {
    ThreadPool pool(threads);
    for (int round = 0; round < 3; ++round) {
      for (int call = 0; call < 2000; ++call) {
        const int64_t n = 1 + call % 11;
        std::vector<int> hits(size_t(n), 0);
        pool.parallel_for(n, [&](int64_t b, int64_t e, int) {
          for (int64_t i = b; i < e; ++i) hits[size_t(i)]++;
        });
        for (int h : hits) ASSERT_EQ(h, 1) << "threads " << threads << " n " << n;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));  // past the spin: workers sleep
    }
  }
}

// One-token products are shared out in guided chunks: a wide matrix (many chunks, split at
// arbitrary 16-row multiples and across FP8 scale blocks) on pools of odd sizes.
TEST(CpuBackend, OneTokenLinearOnWideMatricesMatchesRef) {
  std::mt19937 rng(11);
  for (cpu::Isa isa : isas())
    for (int threads : {1, 2, 3, 7}) {
      BackendPair bp(isa, threads);
      for (DType dt : {DType::F8_E4M3, DType::BF16})
        for (auto [out, in] : std::vector<std::pair<int64_t, int64_t>>{{2000, 260}, {4099, 129}, {17, 520}}) {
          OwnedLinear L(dt, out, in, rng);
          std::vector<float> x = randn(static_cast<size_t>(in), rng), a(static_cast<size_t>(out)), b(static_cast<size_t>(out));
          bp.cpu->linear(x.data(), 1, L.lin, a.data());
          bp.ref->linear(x.data(), 1, L.lin, b.data());
          EXPECT_LT(rel_err(a, b), op_tol(isa)) << cpu::isa_name(isa) << " threads " << threads << " " << out << "x" << in;
        }
    }
}

TEST(CpuBackend, UnknownOrUnsupportedIsaIsAnError) {
  EXPECT_THROW(make_cpu_backend("sse9"), Error);
  EXPECT_EQ(make_backend("cpu")->name(), "cpu");
}

// --- golden conformance under the bf16 bar -------------------------------------------------------------
// The reference's own bf16 run against its float32 math (golden/README.md): max / median relative
// L2 error of its steps (each call's rows together) and argmax agreement of its rows. The cpu
// backend must do no worse than the row of its mode.
struct Bar {
  double max_err, median_err;
  int argmax_ok, rows;
};
Bar bar(const std::string& c, AttnImpl attn) {
  const bool naive = attn == AttnImpl::kNaive;
  if (c == "v2lite_bf16") return naive ? Bar{0.052, 0.0091, 144, 148} : Bar{0.057, 0.0095, 144, 148};
  if (c == "v2_groups_bf16") return naive ? Bar{0.553, 0.019, 144, 148} : Bar{0.439, 0.017, 144, 148};
  if (c == "v3_fp8") return naive ? Bar{0.565, 0.032, 135, 148} : Bar{0.386, 0.033, 135, 148};
  if (c == "v31_fp8_ue8m0") return naive ? Bar{0.404, 0.036, 140, 148} : Bar{0.450, 0.026, 140, 148};
  return naive ? Bar{0.566, 0.031, 94, 98} : Bar{0.541, 0.033, 94, 98};  // v3_fp8_long
}

struct GoldenParam {
  std::string name;
  AttnImpl attn;
  cpu::Isa isa;
};

class CpuGolden : public ::testing::TestWithParam<GoldenParam> {};

TEST_P(CpuGolden, MeetsTheBf16Bar) {
  const GoldenParam& p = GetParam();
  SafetensorsFile g(case_dir(p.name) + "/golden.safetensors");
  ModelOptions opt;
  opt.attn = p.attn;
  opt.max_seqs = 4;
  Model model(Checkpoint::open(case_dir(p.name) + "/hf"), make_cpu_backend(cpu::isa_name(p.isa)), opt);
  const int V = model.args().vocab_size;
  std::vector<double> errs, step_errs;  // per row; per step, as the table
  int agree = 0;
  for (int s = 0;; ++s) {
    char key[32];
    std::snprintf(key, sizeof key, "step%03d", s);
    if (!g.has(std::string(key) + ".tokens")) break;
    TensorView tok = g.get(std::string(key) + ".tokens"), want = g.get(std::string(key) + ".logits_fp32");
    const int B = int(tok.dim(0)), T = int(tok.dim(1)), start = g.get(std::string(key) + ".start_pos").as<int32_t>()[0];
    std::vector<float> got(size_t(B) * V);
    model.forward(tok.as<int32_t>(), B, T, start, got.data());
    step_errs.push_back(rel_l2(got.data(), want.as<float>(), got.size()));
    for (int b = 0; b < B; ++b) {
      const float* w = want.as<float>() + size_t(b) * V;
      errs.push_back(rel_l2(got.data() + size_t(b) * V, w, size_t(V)));
      agree += argmax(got.data() + size_t(b) * V, V) == argmax(w, V);
    }
  }
  const auto [mx, med] = max_median(errs);
  const auto [smx, smed] = max_median(step_errs);
  const Bar b = bar(p.name, p.attn);
  EXPECT_EQ(int(errs.size()), b.rows);
  EXPECT_LE(smx, b.max_err) << p.name;
  EXPECT_LE(smed, b.median_err) << p.name;
  EXPECT_LE(mx, b.max_err) << p.name;  // every row, too
  EXPECT_GE(agree, b.argmax_ok) << p.name;
  // The cpu backend computes in float32, so it is held to the float32 bar as well: every row
  // within 1e-3 and the same argmax.
  EXPECT_LE(mx, 1e-3) << p.name;
  EXPECT_EQ(agree, int(errs.size())) << p.name;
  std::printf("%s %s (%s): max %.2g median %.2g per row, %.2g / %.2g per step, argmax %d/%zu (bf16 bar: %.3f / "
              "%.4f, %d)\n", p.name.c_str(), p.attn == AttnImpl::kAbsorb ? "absorb" : "naive", cpu::isa_name(p.isa), mx,
              med, smx, smed, agree, errs.size(), b.max_err, b.median_err, b.argmax_ok);
}

// Every SIMD level this machine has (scalar is covered by the kernel tests).
std::vector<GoldenParam> golden_params() {
  std::vector<GoldenParam> v;
  for (cpu::Isa isa : isas())
    if (isa != cpu::Isa::kScalar)
      for (auto& c : golden_cases())
        for (auto a : {AttnImpl::kAbsorb, AttnImpl::kNaive}) v.push_back({c, a, isa});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, CpuGolden, ::testing::ValuesIn(golden_params()),
                         [](const ::testing::TestParamInfo<GoldenParam>& p) {
                           return p.param.name + (p.param.attn == AttnImpl::kAbsorb ? "_absorb_" : "_naive_") +
                                  cpu::isa_name(p.param.isa);
                         });

}  // namespace

namespace {

// --kv-cache-gb: the cache holds the blocks the budget pays for, and a request past them is a
// clear error naming the positions and the option.
TEST(KvCacheBudget, HoldsWhatTheBudgetPaysForAndNamesItWhenExceeded) {
  const std::string dir = case_dir("v3_fp8") + "/hf";
  ModelOptions opt;
  opt.max_seqs = 4;
  auto probe = Checkpoint::open(dir);
  const int64_t per_pos = KvCache::bytes_per_position(load_model_args(*probe), AttnImpl::kAbsorb);
  opt.kv_cache_gb = double(2 * 64 * per_pos + 100) / 1e9;  // two blocks of 64 positions
  Model model(std::move(probe), make_cpu_backend(), opt);
  EXPECT_EQ(model.kv_cache().n_blocks(), 2);
  EXPECT_EQ(model.kv_cache().bytes(), 2 * 64 * per_pos);
  std::vector<int32_t> toks(100, 3);
  std::vector<float> logits(size_t(model.args().vocab_size) * 2);
  model.forward(toks.data(), 1, 100, 0, logits.data());  // positions 0..99: two blocks, fits
  try {
    model.forward(toks.data(), 2, 1, 0, logits.data());  // a second sequence: no block left
    FAIL() << "a second sequence should not fit";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--kv-cache-gb"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("out of KV cache: 1 more positions needed, 0 free of the 128"),
              std::string::npos) << e.what();
  }
  ModelOptions tiny = opt;
  tiny.kv_cache_gb = 1e-9;
  EXPECT_THROW(Model(Checkpoint::open(dir), make_cpu_backend(), tiny), Error);
}

// dsv3 bench end to end on a tiny golden model: one JSON object with the fields the issue names.
TEST(BenchCommand, PrintsOneJsonObjectWithTheFloors) {
  const std::string out = ::testing::TempDir() + "/dsv3_bench.json";
  const std::string cmd = std::string(DSV3_BINARY) + " bench --model " + case_dir("v3_fp8") +
                          "/hf --batch 1,3 --prompt 20 --gen 3 --decode-ctx 5 --bw-gb 0.05 --threads 2 --json > " + out +
                          " 2>/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream f(out);
  nlohmann::json j = nlohmann::json::parse(f);
  EXPECT_GT(j["read_bandwidth_GBps"].get<double>(), 0);
  EXPECT_EQ(j["prefill"]["tokens"].get<int>(), 20);
  EXPECT_GT(j["prefill"]["tok_s"].get<double>(), 0);
  ASSERT_EQ(j["decode"].size(), 2u);
  EXPECT_EQ(j["decode"][1]["batch"].get<int>(), 3);
  EXPECT_GT(j["decode"][1]["bytes_per_step"].get<double>(), j["decode"][0]["bytes_per_step"].get<double>());
  EXPECT_GT(j["decode"][0]["fraction_of_floor"].get<double>(), 0);
  EXPECT_EQ(j["decode"][1]["tokens"].get<int>(), 3 * 3);  // decoded as generate runs it: 3 tokens each
  EXPECT_GT(j["peak_rss_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(j["weight_memory"].get<std::string>(), "copy");  // a tiny model fits: --weight-memory auto copies it
}

// dsv3 bench --tp-shard 2: rank 0's share of the model spread over 2 ranks, the other stood in
// for: its slices of the checkpoint only (fewer bytes, fewer experts a step), the report says so.
TEST(BenchCommand, TpShardMeasuresRankZerosShare) {
  const std::string out = ::testing::TempDir() + "/dsv3_bench_tp.json";
  nlohmann::json whole, half;
  for (int tp : {1, 2}) {
    const std::string cmd = std::string(DSV3_BINARY) + " bench --model " + case_dir("v3_fp8") + "/hf --tp-shard " +
                            std::to_string(tp) + " --batch 1,3 --prompt 20 --gen 3 --decode-ctx 5 --bw-gb 0.05 --threads 2 --json > " +
                            out + " 2>/dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::ifstream f(out);
    (tp == 1 ? whole : half) = nlohmann::json::parse(f);
  }
  EXPECT_EQ(whole["tp_shard"].get<int>(), 1);
  EXPECT_EQ(half["tp_shard"].get<int>(), 2);
  EXPECT_NE(half["model"].get<std::string>().find("rank 0 of 2"), std::string::npos) << half["model"];
  const double ratio = half["weights_bytes"].get<double>() / whole["weights_bytes"].get<double>();
  EXPECT_GT(ratio, 0.45);
  EXPECT_LT(ratio, 0.65);  // (the gate and the low-rank projections are whole on every rank)
  // At batch 1 a rank reads its slices and, on average, half of the activated experts.
  EXPECT_LT(half["decode_bytes_per_token_batch1"].get<double>(), 0.65 * whole["decode_bytes_per_token_batch1"].get<double>());
  // Rank 0 runs only its half of the experts: fewer a step than the whole model at batch 3.
  EXPECT_LT(half["decode"][1]["routed_experts_per_layer"].get<double>(), whole["decode"][1]["routed_experts_per_layer"].get<double>());
  EXPECT_EQ(half["decode"][1]["tokens"].get<int>(), 3 * 3);
}

// dsv3 bench's model choice: a checkpoint or a synthetic shape (made on the GPU), not both or
// neither; the synthetic options only with --synthetic; a bad shape named.
TEST(BenchCommand, RefusesBadModelChoices) {
  const std::string err = ::testing::TempDir() + "/dsv3_bench_err.txt", model = case_dir("v3_fp8") + "/hf";
  auto run = [&](const std::string& opts) {
    const std::string cmd = std::string(DSV3_BINARY) + " bench " + opts + " > /dev/null 2> " + err;
    const int rc = std::system(cmd.c_str());
    std::ifstream f(err);
    return std::pair<int, std::string>{rc, std::string(std::istreambuf_iterator<char>(f), {})};
  };
  const std::pair<std::string, std::string> cases[] = {
      {"", "give one of --model DIR or --synthetic SHAPE"},
      {"--model " + model + " --synthetic 16B", "give one of --model DIR or --synthetic SHAPE"},
      {"--model " + model + " --dtype fp8", "--dtype, --layers and --vocab go with --synthetic"},
      {"--synthetic 16B --bw-gb 0.01", "--synthetic makes its weights on the GPU: give --device cuda"},
      {"--model " + model + " --bw-gb 0.01 --weight-memory mapped", "--weight-memory must be auto, map or copy, got 'mapped'"},
      {"--model " + model + " --bw-gb 0.01 --tp-shard 3", "num_attention_heads 4 does not divide among 3 ranks"},
      {"--model " + model + " --bw-gb 0.01 --tp-shard 0", "--tp-shard must be in [1, 1024], got 0"},
  };
  for (const auto& [opts, want] : cases) {
    const auto [rc, msg] = run(opts);
    EXPECT_NE(rc, 0) << opts;
    EXPECT_NE(msg.find(want), std::string::npos) << opts << ": " << msg;
  }
}

}  // namespace
