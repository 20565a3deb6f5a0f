// AVX2 + FMA + F16C kernels (float32 arithmetic throughout): the fallback for CPUs without
// AVX-512 BF16. Weights are widened to float32 four rows at a time into a small panel that the
// tokens of a batch share; e4m3 goes through fp16 (exact: byte << 7 with the sign moved is the
// fp16 of value * 2^-8, subnormals included) and vcvtph2ps.

// GCC 12 warns about _mm512_undefined_* inside its own intrinsic headers; not our code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#ifndef __clang__
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/kernels.h"
#include "core/dtype.h"
#include "core/error.h"

#define DSV3_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))

namespace dsv3::cpu {
namespace {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

DSV3_AVX2 inline __m256i tail_mask8(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(n, 8))), idx);
}

DSV3_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 e4m3 bytes -> 8 floats (value * 2^-8, exact).
DSV3_AVX2 inline __m256 e4m3x8(const uint8_t* p) {
  __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(b, 8), 1), _mm_set1_epi16(int16_t(0xBFFF)));
  return _mm256_cvtph_ps(h);
}

// Row `row` of w, columns [0, K), as float32 (FP8 with its block scales) into out (K padded to 8
// with zeros).
DSV3_AVX2 void widen_row(const Linear& w, int64_t row, float* out) {
  const int64_t K = w.in(), K8 = K / 8 * 8;
  if (w.fp8()) {
    const uint8_t* q = w.weight.as<uint8_t>() + row * K;
    const float* s = w.scale.as<float>() + (row / 128) * ceil_div(K, 128);
    for (int64_t k = 0; k < K8; k += 8)
      _mm256_storeu_ps(out + k, _mm256_mul_ps(e4m3x8(q + k), _mm256_set1_ps(s[k / 128] * 256.f)));
    for (int64_t k = K8; k < K; ++k) out[k] = e4m3_to_f32(q[k]) * s[k / 128];
  } else if (w.weight.dtype == DType::BF16) {
    const uint16_t* q = w.weight.as<uint16_t>() + row * K;
    for (int64_t k = 0; k < K8; k += 8) {
      __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k)));
      _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
    for (int64_t k = K8; k < K; ++k) out[k] = bf16_to_f32(q[k]);
  } else if (w.weight.dtype == DType::F16) {
    const uint16_t* q = w.weight.as<uint16_t>() + row * K;
    for (int64_t k = 0; k < K8; k += 8)
      _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
    for (int64_t k = K8; k < K; ++k) out[k] = f16_to_f32(q[k]);
  } else {
    DSV3_CHECK(w.weight.dtype == DType::F32, "unsupported weight dtype ", dtype_name(w.weight.dtype));
    std::memcpy(out, w.weight.as<float>() + row * K, size_t(K) * 4);
  }
  for (int64_t k = K; k < ceil_div(K, 8) * 8; ++k) out[k] = 0.f;
}

// R panel rows (stride ldp, K8 padded floats) x T tokens of x (stride ldx, K valid).
template <int R, int T>
DSV3_AVX2 void mk_f32(const float* p, int64_t ldp, const float* x, int64_t ldx, int64_t K, float* y, int64_t ldy) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(x + t * ldx + k);
    for (int r = 0; r < R; ++r) {
      __m256 wv = _mm256_loadu_ps(p + r * ldp + k);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
  if (k < K) {
    const __m256i km = tail_mask8(K - k);
    __m256 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm256_maskload_ps(x + t * ldx + k, km);
    for (int r = 0; r < R; ++r) {
      __m256 wv = _mm256_loadu_ps(p + r * ldp + k);  // zero padded
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) y[t * ldy + r] = hsum8(acc[r][t]);
}

template <int R>
DSV3_AVX2 void mk_f32_tokens(const float* p, int64_t ldp, const float* x, int64_t ldx, int64_t M, int64_t K, float* y,
                             int64_t ldy) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) mk_f32<R, 3>(p, ldp, x + m * ldx, ldx, K, y + m * ldy, ldy);
  if (M - m == 2) mk_f32<R, 2>(p, ldp, x + m * ldx, ldx, K, y + m * ldy, ldy);
  if (M - m == 1) mk_f32<R, 1>(p, ldp, x + m * ldx, ldx, K, y + m * ldy, ldy);
}

DSV3_AVX2 void matmul_avx2(const float* x, int64_t M, int64_t ldx, const Linear& w, int64_t r0, int64_t nr, float* y,
                           int64_t ldy, Scratch& s) {
  const int64_t K = w.in(), ldp = ceil_div(K, 8) * 8;
  float* panel = s.get<float>(0, size_t(4 * ldp));
  for (int64_t r = 0; r < nr; r += 4) {
    const int64_t np = std::min<int64_t>(4, nr - r);
    for (int64_t q = 0; q < np; ++q) widen_row(w, r0 + r + q, panel + q * ldp);
    if (np == 4) {
      mk_f32_tokens<4>(panel, ldp, x, ldx, M, K, y + r, ldy);
    } else {
      for (int64_t q = 0; q < np; ++q) mk_f32_tokens<1>(panel + q * ldp, ldp, x, ldx, M, K, y + r + q, ldy);
    }
  }
}

DSV3_AVX2 void axpy_avx2(float alpha, const float* x, int64_t n, float* y) {
  const __m256 av = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

DSV3_AVX2 void matmul_t_avx2(const float* x, int64_t M, int64_t ldx, const Linear& w, int64_t d0, int64_t nd, float* y,
                             int64_t ldy, Scratch& s) {
  const int64_t C = w.in();
  float* row = s.get<float>(0, size_t(ceil_div(C, 8) * 8));
  for (int64_t m = 0; m < M; ++m) std::fill(y + m * ldy, y + m * ldy + C, 0.f);
  for (int64_t d = 0; d < nd; ++d) {
    widen_row(w, d0 + d, row);
    for (int64_t m = 0; m < M; ++m) axpy_avx2(x[m * ldx + d], row, C, y + m * ldy);
  }
}

DSV3_AVX2 float dot_avx2(const float* a, const float* b, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), a1);
  }
  float s = hsum8(_mm256_add_ps(a0, a1));
  for (; k < K; ++k) s += a[k] * b[k];
  return s;
}

DSV3_AVX2 void gemm_nt_f32_avx2(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t M, int64_t N,
                                int64_t K, float alpha, float* c, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = alpha * dot_avx2(a + i * lda, b + j * ldb, K);
}

DSV3_AVX2 void gemm_nn_acc_f32_avx2(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t M, int64_t N,
                                    int64_t J, float* o, int64_t ldo) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t n = 0; n < N; ++n) axpy_avx2(p[i * ldp + n], v + n * ldv, J, o + i * ldo);
}

DSV3_AVX2 void rmsnorm_avx2(const float* x, int64_t sx, int64_t n, int64_t d, const float* w, float eps, float* y,
                            int64_t sy) {
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * sx;
    const float r = 1.f / std::sqrt(dot_avx2(xi, xi, d) / float(d) + eps);
    for (int64_t k = 0; k < d; ++k) y[i * sy + k] = xi[k] * r * w[k];
  }
}

void silu_mul_avx2(const float* a, const float* b, int64_t n, float* h) {
  for (int64_t i = 0; i < n; ++i) h[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
}

}  // namespace

void softmax_scalar(float* x, int64_t n);

DSV3_AVX2 double fma_peak_avx2(long iters) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_ps();
  __m256 a = _mm256_set1_ps(1.f), b = _mm256_set1_ps(1e-8f);
  for (long it = 0; it < iters; ++it) {
    _Pragma("GCC unroll 16")
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
    __asm__ volatile("" : "+x"(a), "+x"(b));
  }
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  return hsum8(s);
}

DSV3_AVX2 float read_sum_avx2(const float* p, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
  }
  float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += p[i];
  return s;
}

const Kernels kAvx2Kernels = {Isa::kAvx2,   matmul_avx2,   matmul_t_avx2, gemm_nt_f32_avx2, gemm_nn_acc_f32_avx2,
                              rmsnorm_avx2, silu_mul_avx2, axpy_avx2,     softmax_scalar};

}  // namespace dsv3::cpu
