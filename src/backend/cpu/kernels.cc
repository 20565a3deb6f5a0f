// The kernel tables, per-thread scratch, the plain C++ kernels (ISA "scalar": float32, any CPU)
// and the bench microbenchmarks' dispatch.
#include "backend/cpu/kernels.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backend/ref/fp8.h"
#include "backend/ref/rows.h"
#include "core/dtype.h"
#include "core/error.h"

namespace dsv3::cpu {

Scratch::~Scratch() {
  for (void* p : p_) std::free(p);
}

void* Scratch::get(int i, size_t bytes) {
  DSV3_CHECK(i >= 0 && i < kSlots, "scratch slot ", i);
  if (bytes > n_[i]) {
    std::free(p_[i]);
    size_t n = std::max(bytes, n_[i] * 3 / 2);
    n = (n + 63) & ~size_t(63);
    p_[i] = std::aligned_alloc(64, n);
    DSV3_CHECK(p_[i], "out of memory for ", n, " bytes of scratch");
    n_[i] = n;
  }
  return p_[i];
}

namespace {

void matmul_scalar(Rows xr, const Linear& w, RowRange rows, OutRows yr, Scratch& s) {
  const float* x = xr.p;
  float* y = yr.p;
  const int64_t M = xr.n, ldx = xr.ld, r0 = rows.r0, nr = rows.n, ldy = yr.ld, K = w.in();
  float* row = s.get<float>(0, size_t(K));
  for (int64_t j = 0; j < nr; ++j) {
    weight_row_f32(w, r0 + j, row);
    for (int64_t m = 0; m < M; ++m) y[m * ldy + j] = dot_f32(x + m * ldx, row, K);
  }
}

void matmul_t_scalar(Rows xr, const Linear& w, RowRange rows, OutRows yr, Scratch& s) {
  const float* x = xr.p;
  float* y = yr.p;
  const int64_t M = xr.n, ldx = xr.ld, d0 = rows.r0, nd = rows.n, ldy = yr.ld, C = w.in();
  float* row = s.get<float>(0, size_t(C));
  for (int64_t m = 0; m < M; ++m) std::fill(y + m * ldy, y + m * ldy + C, 0.f);
  for (int64_t d = 0; d < nd; ++d) {
    weight_row_f32(w, d0 + d, row);
    for (int64_t m = 0; m < M; ++m) {
      const float xv = x[m * ldx + d];
      float* ym = y + m * ldy;
      for (int64_t c = 0; c < C; ++c) ym[c] += xv * row[c];
    }
  }
}

void gemm_nt_f32_scalar(Rows a, Rows b, int64_t K, float alpha, OutRows c) {
  for (int64_t i = 0; i < a.n; ++i)
    for (int64_t j = 0; j < b.n; ++j) c.p[i * c.ld + j] = alpha * dot_f32(a.p + i * a.ld, b.p + j * b.ld, K);
}

void gemm_nn_acc_f32_scalar(Rows p, Rows v, int64_t J, OutRows o) {
  for (int64_t i = 0; i < p.n; ++i)
    for (int64_t n = 0; n < v.n; ++n) {
      const float pv = p.p[i * p.ld + n];
      for (int64_t j = 0; j < J; ++j) o.p[i * o.ld + j] += pv * v.p[n * v.ld + j];
    }
}

void rmsnorm_scalar(Rows x, int64_t d, const float* w, float eps, OutRows y) {
  for (int64_t i = 0; i < x.n; ++i) {
    const float* xi = x.p + i * x.ld;
    const float r = 1.f / std::sqrt(dot_f32(xi, xi, d) / float(d) + eps);
    for (int64_t k = 0; k < d; ++k) y.p[i * y.ld + k] = xi[k] * r * w[k];
  }
}

void silu_mul_scalar(const float* a, const float* b, int64_t n, float* h) {
  for (int64_t i = 0; i < n; ++i) h[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
}

void axpy_scalar(float alpha, const float* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace

void softmax_scalar(float* x, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - mx));
  for (int64_t i = 0; i < n; ++i) x[i] /= sum;
}

const Kernels kScalarKernels = {Isa::kScalar,  matmul_scalar,   matmul_t_scalar, gemm_nt_f32_scalar, gemm_nn_acc_f32_scalar,
                                rmsnorm_scalar, silu_mul_scalar, axpy_scalar,     softmax_scalar};

const Kernels& kernels(Isa isa) {
  DSV3_CHECK(isa_supported(isa), "ISA ", isa_name(isa), " is not supported on this CPU");
  switch (isa) {
    case Isa::kAmx: return kAmxKernels;
    case Isa::kAvx512: return kAvx512Kernels;
    case Isa::kAvx2: return kAvx2Kernels;
    default: return kScalarKernels;
  }
}

// Microbenchmark loops (kernels_avx512.cc / kernels_avx2.cc).
double fma_peak_avx512(long iters);
float read_sum_avx512(const float* p, int64_t n);
double fma_peak_avx2(long iters);
float read_sum_avx2(const float* p, int64_t n);

namespace {
// Seconds of this thread's CPU time (not wall time: on a shared machine the peak of the hardware
// is what we want, not the share of it another process left us).
double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}
template <class F>
double timed(F f) {
  const double t0 = thread_seconds();
  volatile double sink = f();
  (void)sink;
  return thread_seconds() - t0;
}
}  // namespace

double fma_f32_peak_flops_1thread(Isa isa, long iters) {
  if (isa == Isa::kAvx512 || isa == Isa::kAmx)
    return double(iters) * 24 * 32 / timed([&] { return fma_peak_avx512(iters); });
  if (isa == Isa::kAvx2) return double(iters) * 12 * 16 / timed([&] { return fma_peak_avx2(iters); });
  // Scalar: what the compiler makes of a plain multiply-add loop (8 independent chains).
  return double(iters) * 8 * 2 / timed([&] {
           float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
           volatile float m = 1.f, c = 1e-8f;
           const float mm = m, cc = c;
           for (long i = 0; i < iters; ++i)
             for (int j = 0; j < 8; ++j) a[j] = a[j] * mm + cc;
           return double(a[0] + a[7]);
         });
}

float read_sum(Isa isa, const float* p, int64_t n) {
  if (isa == Isa::kAvx512 || isa == Isa::kAmx) return read_sum_avx512(p, n);
  if (isa == Isa::kAvx2) return read_sum_avx2(p, n);
  float s = 0;
  for (int64_t i = 0; i < n; ++i) s += p[i];
  return s;
}

}  // namespace dsv3::cpu
