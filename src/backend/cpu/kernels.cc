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

void matmul_scalar(const float* x, int64_t M, int64_t ldx, const Linear& w, int64_t r0, int64_t nr, float* y,
                   int64_t ldy, Scratch& s) {
  const int64_t K = w.in();
  float* row = s.get<float>(0, size_t(K));
  for (int64_t j = 0; j < nr; ++j) {
    weight_row_f32(w, r0 + j, row);
    for (int64_t m = 0; m < M; ++m) y[m * ldy + j] = dot_f32(x + m * ldx, row, K);
  }
}

void matmul_t_scalar(const float* x, int64_t M, int64_t ldx, const Linear& w, int64_t d0, int64_t nd, float* y,
                     int64_t ldy, Scratch& s) {
  const int64_t C = w.in();
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

void gemm_nt_f32_scalar(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t M, int64_t N, int64_t K,
                        float alpha, float* c, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = alpha * dot_f32(a + i * lda, b + j * ldb, K);
}

void gemm_nn_acc_f32_scalar(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t M, int64_t N, int64_t J,
                            float* o, int64_t ldo) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t n = 0; n < N; ++n) {
      const float pv = p[i * ldp + n];
      for (int64_t j = 0; j < J; ++j) o[i * ldo + j] += pv * v[n * ldv + j];
    }
}

void rmsnorm_scalar(const float* x, int64_t sx, int64_t n, int64_t d, const float* w, float eps, float* y, int64_t sy) {
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * sx;
    const float r = 1.f / std::sqrt(dot_f32(xi, xi, d) / float(d) + eps);
    for (int64_t k = 0; k < d; ++k) y[i * sy + k] = xi[k] * r * w[k];
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
