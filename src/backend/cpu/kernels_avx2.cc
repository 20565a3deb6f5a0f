// AVX2 + FMA + F16C kernels (float32 arithmetic throughout): the table for CPUs without
// AVX-512 BF16 (e.g. AMD Zen 2/3, Intel client cores).
//
// Few tokens (<= 8, decode): rows are read one after another, so a call's weights are one
// sequential stream (with software prefetch), and each 32-weight chunk is converted to float32 in
// registers once and feeds the FMAs of every token; nothing is written back to memory. The FP8
// block scale (and the power of two of the conversion) is folded into the activations, packed
// per 128-row block in the lane order the conversion delivers. Two exact e4m3 conversions:
//  - integer route (AMD): the byte against zero in 16-bit lanes (b << 8), an arithmetic shift by
//    4 and a mask give the high half of the float32 of value * 2^-120 (subnormal codes become
//    float32 subnormals, exact), a second unpack makes the float32. No conversion instruction; on
//    Zen 3 FMAs take subnormal operands at full speed. Needs x * scale * 2^120 to be finite (else
//    the block falls back to the fp16 route) and MXCSR.DAZ clear.
//  - fp16 route (elsewhere; Intel cores slow down on subnormal FMA operands): b << 8 shifted right
//    by one with the sign kept is the fp16 of value * 2^-8, then vcvtph2ps.
// Both give every product exactly w * fl(x * scale): the results are bit-identical.
// Many tokens (prefill): a blocked float32 GEMM; blocks of weights widened once per call into
// 16-row panels that all the tokens share (gemm_blocked).

// GCC 12 warns about _mm512_undefined_* inside its own intrinsic headers; not our code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#ifndef __clang__
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "backend/cpu/exp_poly.h"
#include "backend/cpu/kernels.h"
#include "core/dtype.h"
#include "core/error.h"

#define DSV3_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#define DSV3_AVX2_INLINE DSV3_AVX2 inline __attribute__((always_inline))
// Loops over register-array indices must be unrolled, or the arrays live in memory.
#define DSV3_UNROLL2 _Pragma("GCC unroll 32")

namespace dsv3::cpu {

void softmax_scalar(float* x, int64_t n);

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

constexpr int64_t kBlock = 128;  // FP8 block size
inline int64_t round32(int64_t k) { return (k + 31) / 32 * 32; }

// --- weights -> float32 in registers, 32 at a time ---------------------------------------------------
enum class WT { kFp8, kBf16, kF16, kF32 };
template <WT T>
constexpr size_t elem_size() { return T == WT::kFp8 ? 1 : T == WT::kF32 ? 4 : 2; }

// The lane order in which load32 delivers a 32-weight chunk as four vectors of 8 (the activations
// are packed to match): kNatural: vector q holds k = 8q..8q+7; kStride4 (FP8, integer route):
// vector q holds k = 4i + q (i < 8); kQuad8 (bf16): vector 2h+j holds 16h+4j..+3 and 16h+8+4j..+3.
enum class Ord { kNatural, kStride4, kQuad8 };
template <WT T, bool kInt>
constexpr Ord order_of() { return T == WT::kFp8 ? (kInt ? Ord::kStride4 : Ord::kNatural) : T == WT::kBf16 ? Ord::kQuad8 : Ord::kNatural; }

// Transposes the 4x4 blocks held in each 128-bit lane of a[0..4).
DSV3_AVX2_INLINE void transpose4_lanes(const __m256 a[4], __m256 v[4]) {
  const __m256 u0 = _mm256_unpacklo_ps(a[0], a[1]), u1 = _mm256_unpackhi_ps(a[0], a[1]);
  const __m256 u2 = _mm256_unpacklo_ps(a[2], a[3]), u3 = _mm256_unpackhi_ps(a[2], a[3]);
  v[0] = _mm256_shuffle_ps(u0, u2, 0x44), v[1] = _mm256_shuffle_ps(u0, u2, 0xEE);
  v[2] = _mm256_shuffle_ps(u1, u3, 0x44), v[3] = _mm256_shuffle_ps(u1, u3, 0xEE);
}

// Natural vectors a[0..4) (k = 8q..) in order O (from_order: back).
template <Ord O>
DSV3_AVX2_INLINE void to_order(const __m256 a[4], __m256 v[4]) {
  if constexpr (O == Ord::kNatural) {
    for (int q = 0; q < 4; ++q) v[q] = a[q];
  } else if constexpr (O == Ord::kStride4) {
    // Rows A_i = k 4i..4i+3: a = [A0 A1] [A2 A3] [A4 A5] [A6 A7]; pair rows i and i + 4 in the
    // lanes, then transpose each lane's 4x4 block: v_q = column q.
    const __m256 t[4] = {_mm256_permute2f128_ps(a[0], a[2], 0x20), _mm256_permute2f128_ps(a[0], a[2], 0x31),
                         _mm256_permute2f128_ps(a[1], a[3], 0x20), _mm256_permute2f128_ps(a[1], a[3], 0x31)};
    transpose4_lanes(t, v);
  } else {
    v[0] = _mm256_permute2f128_ps(a[0], a[1], 0x20), v[1] = _mm256_permute2f128_ps(a[0], a[1], 0x31);
    v[2] = _mm256_permute2f128_ps(a[2], a[3], 0x20), v[3] = _mm256_permute2f128_ps(a[2], a[3], 0x31);
  }
}
template <Ord O>
DSV3_AVX2_INLINE void from_order(const __m256 v[4], __m256 a[4]) {
  if constexpr (O == Ord::kStride4) {
    __m256 r[4];
    transpose4_lanes(v, r);  // r_q = [A_q | A_{q+4}]
    a[0] = _mm256_permute2f128_ps(r[0], r[1], 0x20), a[1] = _mm256_permute2f128_ps(r[2], r[3], 0x20);
    a[2] = _mm256_permute2f128_ps(r[0], r[1], 0x31), a[3] = _mm256_permute2f128_ps(r[2], r[3], 0x31);
  } else {
    to_order<O>(v, a);  // natural and kQuad8 are their own inverses
  }
}

// 32 weights at p (a whole chunk) as float32 in order_of<T, kInt>. FP8: value * 2^-120 (integer
// route) or value * 2^-8 (fp16 route); the caller folds the power of two into the activations.
template <WT T, bool kInt>
DSV3_AVX2_INLINE void load32(const char* p, __m256 v[4]) {
  if constexpr (T == WT::kFp8) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (kInt) {
      // A 32-bit lane holds bytes b0..b3 (b3 on top). s.eeee.mmm at bits 31..24 shifted right by 4
      // (arithmetic), & 0x87F00000: s.0000.eeee.mmm.0..., the float32 with exponent field e and
      // mantissa m: value * 2^-120 (e == 0: a float32 subnormal, m * 2^-129, exact). 16-bit shifts
      // treat b3 and b1 (the high byte of each half) alike; b1 is then moved up, b2 and b0 are
      // moved into the high bytes first. No shuffles: the lane order is kStride4.
      const __m256i mask = _mm256_set1_epi32(int32_t(0x87F00000u));
      const __m256i t = _mm256_srai_epi16(b, 4), u = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 4);
      v[0] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(u, 16), mask));
      v[1] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(t, 16), mask));
      v[2] = _mm256_castsi256_ps(_mm256_and_si256(u, mask));
      v[3] = _mm256_castsi256_ps(_mm256_and_si256(t, mask));
    } else {
      // Each byte as b << 8 in a 16-bit lane (lo: bytes 0-7 | 16-23, hi: 8-15 | 24-31), shifted
      // right by one (arithmetic) with bit 14 cleared: the fp16 of value * 2^-8 (exact,
      // subnormals too).
      const __m256i z = _mm256_setzero_si256(), mask = _mm256_set1_epi16(int16_t(0xBFFF));
      const __m256i l = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(z, b), 1), mask);
      const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(z, b), 1), mask);
      v[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(l)), v[1] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
      v[2] = _mm256_cvtph_ps(_mm256_extracti128_si256(l, 1)), v[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    }
  } else if constexpr (T == WT::kBf16) {
    const __m256i z = _mm256_setzero_si256();
    DSV3_UNROLL2
    for (int h = 0; h < 2; ++h) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
      v[2 * h] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, b));
      v[2 * h + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, b));
    }
  } else if constexpr (T == WT::kF16) {
    DSV3_UNROLL2
    for (int q = 0; q < 4; ++q) v[q] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * q)));
  } else {
    DSV3_UNROLL2
    for (int q = 0; q < 4; ++q) v[q] = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * q);
  }
}

// The last n < 32 weights of a row, zero padded (zero bytes are 0.0 in every format).
template <WT T, bool kInt>
DSV3_AVX2_INLINE void load32_tail(const char* p, int64_t n, __m256 v[4]) {
  alignas(32) char buf[32 * elem_size<T>()] = {};
  std::memcpy(buf, p, size_t(n) * elem_size<T>());
  load32<T, kInt>(buf, v);
}

// The integer e4m3 route: on AMD cores (FMAs take float32 subnormal operands at full speed; Intel
// cores take a slow assist for them), with MXCSR.DAZ clear. set_avx2_fp8_route forces a route
// (tests).
std::atomic<int> g_fp8_route{0};
bool fp8_int_route() {
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  const int r = g_fp8_route.load(std::memory_order_relaxed);
  if (r != 0) return r == 2;
  return amd && (_mm_getcsr() & 0x40) == 0;
}

// xs[m * ldxs + k] (k < round32(K)) = x[m * ldx + k] * f[k / 128] (f == nullptr: 1), zero padded,
// each 32-chunk in order O. Returns whether every packed value is finite.
template <Ord O>
DSV3_AVX2 bool pack_x(const float* x, int64_t M, int64_t ldx, int64_t K, const float* f, float* xs, int64_t ldxs) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), big = _mm256_set1_ps(FLT_MAX);
  __m256 bad = _mm256_setzero_ps();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      const __m256 fv = _mm256_set1_ps(f ? f[k0 / kBlock] : 1.f);
      const float* xm = x + m * ldx + k0;
      __m256 a[4], v[4];
      DSV3_UNROLL2
      for (int q = 0; q < 4; ++q) {
        const int64_t k = k0 + 8 * q;
        a[q] = _mm256_mul_ps(k + 8 <= K ? _mm256_loadu_ps(xm + 8 * q) : _mm256_maskload_ps(xm + 8 * q, tail_mask8(K - k)), fv);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(a[q], abs_mask), big, _CMP_NLE_UQ));
      }
      to_order<O>(a, v);
      DSV3_UNROLL2
      for (int q = 0; q < 4; ++q) _mm256_storeu_ps(xs + m * ldxs + k0 + 8 * q, v[q]);
    }
  return _mm256_movemask_ps(bad) == 0;
}

// --- few tokens: rows one after another, each chunk converted once for all M tokens -----------------
// Software prefetch per 64-byte line: 4 KB ahead into L1 and 32 KB ahead into L2 (more misses in
// flight than L1's fill buffers allow), the latter only up to `wend`, the end of the call's rows.
constexpr size_t kNearPrefetch = 4096, kFarPrefetch = 32768;

// Accumulator chains per token: enough independent FMAs to cover their latency.
template <WT T, int M>
constexpr int chains() { return M == 1 ? (T == WT::kFp8 ? 8 : 4) : M == 2 ? 4 : M <= 4 ? 2 : 1; }

template <int M, int NA>
DSV3_AVX2_INLINE void fma_chunk(const __m256 v[4], const float* xs, int64_t ldxs, int c, __m256 (&acc)[M][NA]) {
  DSV3_UNROLL2
  for (int m = 0; m < M; ++m)
    DSV3_UNROLL2
    for (int q = 0; q < 4; ++q)
      acc[m][(4 * c + q) % NA] = _mm256_fmadd_ps(v[q], _mm256_loadu_ps(xs + m * ldxs + 8 * q), acc[m][(4 * c + q) % NA]);
}

// acc[m] += row[k0, k1) . xs[m][k0, k1) for M tokens (k0 a multiple of the step; k1 one too, or K).
template <WT T, bool kInt, int M, int NA>
DSV3_AVX2_INLINE void row_span(const char* row, int64_t k0, int64_t k1, int64_t K, const float* xs, int64_t ldxs,
                               uintptr_t far_end, __m256 (&acc)[M][NA]) {
  constexpr size_t esz = elem_size<T>();
  constexpr int64_t kStep = std::max<int64_t>(32, 64 / int64_t(esz));  // elements per iteration (>= one line)
  const int64_t kfull = k0 + (k1 - k0) / kStep * kStep;
  int64_t k = k0;
  for (; k < kfull; k += kStep) {
    const char* pa = row + size_t(k) * esz;
    DSV3_UNROLL2
    for (size_t off = 0; off < size_t(kStep) * esz; off += 64) {
      _mm_prefetch(pa + kNearPrefetch + off, _MM_HINT_T0);
      if (reinterpret_cast<uintptr_t>(pa + off) < far_end) _mm_prefetch(pa + kFarPrefetch + off, _MM_HINT_T1);
    }
    DSV3_UNROLL2
    for (int c = 0; c < int(kStep / 32); ++c) {
      __m256 v[4];
      load32<T, kInt>(pa + 32 * c * esz, v);
      fma_chunk<M, NA>(v, xs + k + 32 * c, ldxs, c, acc);
    }
  }
  for (; k < k1; k += 32) {  // whole chunks past the last step, then the ragged end
    __m256 v[4];
    if (k + 32 <= K) {
      load32<T, kInt>(row + size_t(k) * esz, v);
    } else {
      load32_tail<T, kInt>(row + size_t(k) * esz, K - k, v);
    }
    fma_chunk<M, NA>(v, xs + k, ldxs, 0, acc);
  }
}

// y[m][r] = sum_k W[r][k] xs[m][k] for rows r < nr (row stride ldw elements), M tokens.
// Rows in memory order; when the M tokens' activations outgrow L1 (several tokens, long rows),
// groups of 8 rows go through K in segments whose activations stay in L1, partial sums kept
// between segments (each x load would otherwise come from L2 for every row).
template <WT T, bool kInt, int M>
DSV3_AVX2 void rows_direct(const char* w, int64_t ldw, int64_t nr, int64_t K, Rows xr, OutRows yr,
                           const char* wend) {
  const float* xs = xr.p;
  float* y = yr.p;
  const int64_t ldxs = xr.ld, ldy = yr.ld;
  constexpr size_t esz = elem_size<T>();
  constexpr int64_t kStep = std::max<int64_t>(32, 64 / int64_t(esz));
  constexpr int NA = chains<T, M>(), kGroup = 8;
  const int64_t seg = M == 1 || int64_t(M) * K * 4 <= 20480 ? K : std::max<int64_t>(kStep, 16384 / (4 * M) / kStep * kStep);
  // Far lines only below wend (integers: wend - kFarPrefetch may lie before the weights).
  const uintptr_t far_end = reinterpret_cast<uintptr_t>(wend) - kFarPrefetch;
  __m256 part[kGroup][M][NA];
  for (int64_t r0 = 0; r0 < nr; r0 += kGroup) {
    const int64_t g = std::min<int64_t>(kGroup, nr - r0);
    for (int64_t k0 = 0; k0 < K; k0 += seg) {
      const int64_t k1 = std::min(K, k0 + seg);
      for (int64_t i = 0; i < g; ++i) {
        __m256 acc[M][NA];
        DSV3_UNROLL2
        for (int m = 0; m < M; ++m)
          DSV3_UNROLL2
          for (int a = 0; a < NA; ++a) acc[m][a] = k0 == 0 ? _mm256_setzero_ps() : part[i][m][a];
        row_span<T, kInt, M, NA>(w + size_t((r0 + i) * ldw) * esz, k0, k1, K, xs, ldxs, far_end, acc);
        if (k1 < K) {
          DSV3_UNROLL2
          for (int m = 0; m < M; ++m)
            DSV3_UNROLL2
            for (int a = 0; a < NA; ++a) part[i][m][a] = acc[m][a];
          continue;
        }
        DSV3_UNROLL2
        for (int m = 0; m < M; ++m) {
          __m256 s = acc[m][0];
          DSV3_UNROLL2
          for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[m][a]);
          y[m * ldy + r0 + i] = hsum8(s);
        }
      }
    }
  }
}

template <WT T, bool kInt>
DSV3_AVX2 void rows_direct_m(const char* w, int64_t ldw, int64_t nr, int64_t K, Rows xs, OutRows y,
                             const char* wend) {
  switch (xs.n) {
    case 1: return rows_direct<T, kInt, 1>(w, ldw, nr, K, xs, y, wend);
    case 2: return rows_direct<T, kInt, 2>(w, ldw, nr, K, xs, y, wend);
    case 3: return rows_direct<T, kInt, 3>(w, ldw, nr, K, xs, y, wend);
    case 4: return rows_direct<T, kInt, 4>(w, ldw, nr, K, xs, y, wend);
    case 5: return rows_direct<T, kInt, 5>(w, ldw, nr, K, xs, y, wend);
    case 6: return rows_direct<T, kInt, 6>(w, ldw, nr, K, xs, y, wend);
    case 7: return rows_direct<T, kInt, 7>(w, ldw, nr, K, xs, y, wend);
    default: return rows_direct<T, kInt, 8>(w, ldw, nr, K, xs, y, wend);
  }
}

// The start of a call is not covered by the kernel's look-ahead: its first 4 KB into L1, up to
// 32 KB into L2.
DSV3_AVX2 void prefetch_start(const char* p, const char* wend) {
  const size_t span = std::min(size_t(wend - p), kFarPrefetch);
  // Two loops: the hint must be a constant even where the compiler does not unroll (-O1).
  size_t off = 0;
  for (; off < std::min(span, kNearPrefetch); off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  for (; off < span; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

template <WT T>
DSV3_AVX2 void matmul_few(Rows xr, const Linear& wl, RowRange rows, OutRows yr, Scratch& s) {
  const float* x = xr.p;
  float* y = yr.p;
  const int64_t M = xr.n, ldx = xr.ld, r0 = rows.r0, nr = rows.n, ldy = yr.ld;
  constexpr size_t esz = elem_size<T>();
  const int64_t K = wl.in(), Kp = round32(K);
  const char* base = static_cast<const char*>(wl.weight.data);
  const char* wend = base + size_t((r0 + nr) * K) * esz;
  prefetch_start(base + size_t(r0 * K) * esz, wend);
  float* xs = s.get<float>(0, size_t(M * Kp));
  if constexpr (T == WT::kFp8) {
    const int64_t kb = ceil_div(K, kBlock);
    const float* sc = wl.scale.as<float>();
    float* f = s.get<float>(1, size_t(kb));
    const bool int_route = fp8_int_route();
    for (int64_t r = r0; r < r0 + nr;) {  // one 128-row scale block at a time
      const int64_t nb = r / kBlock, re = std::min(r0 + nr, (nb + 1) * kBlock);
      bool use_int = int_route;
      if (use_int) {
        for (int64_t j = 0; j < kb; ++j) f[j] = sc[nb * kb + j] * 0x1p120f;
        use_int = pack_x<Ord::kStride4>(x, M, ldx, K, f, xs, Kp);  // else x * scale * 2^120 overflows
      }
      const char* wr = base + size_t(r * K);
      if (use_int) {
        rows_direct_m<T, true>(wr, K, re - r, K, {xs, M, Kp}, {y + (r - r0), ldy}, wend);
      } else {
        for (int64_t j = 0; j < kb; ++j) f[j] = sc[nb * kb + j] * 256.f;
        pack_x<Ord::kNatural>(x, M, ldx, K, f, xs, Kp);
        rows_direct_m<T, false>(wr, K, re - r, K, {xs, M, Kp}, {y + (r - r0), ldy}, wend);
      }
      r = re;
    }
  } else {
    pack_x<order_of<T, false>()>(x, M, ldx, K, nullptr, xs, Kp);
    rows_direct_m<T, false>(base + size_t(r0 * K) * esz, K, nr, K, {xs, M, Kp}, {y, ldy}, wend);
  }
}

// --- transposed product, one token: y[c] = sum_d x[d] W[d0 + d][c] -----------------------------------
// Passes of 64 columns (8 accumulators), each reading every row's 64-column slice, with the rows
// kAhead ahead prefetched. xs[cb * ldxs + d]: x[d] times the block scale of (row d0 + d, column
// block cb) and the conversion's power of two.
template <WT T, bool kInt>
DSV3_AVX2 void t_rows1(const char* w, int64_t C, int64_t d0, int64_t nd, const float* xs, int64_t ldxs, float* y) {
  constexpr size_t esz = elem_size<T>();
  constexpr int64_t kAhead = 16;
  constexpr Ord O = order_of<T, kInt>();
  for (int64_t c0 = 0; c0 < C; c0 += 64) {
    const int64_t ncol = std::min<int64_t>(64, C - c0);
    // Both 32-column chunks lie in one 128-column block (one scale; no blocks but FP8).
    const float* xc = xs + (T == WT::kFp8 ? c0 / kBlock : 0) * ldxs;
    __m256 acc[8];
    DSV3_UNROLL2
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < nd; ++d) {
      const char* row = w + size_t((d0 + d) * C + c0) * esz;
      for (size_t off = 0; off < 64 * esz; off += 64) _mm_prefetch(row + size_t(kAhead * C) * esz + off, _MM_HINT_T0);
      DSV3_UNROLL2
      for (int h = 0; h < 2; ++h) {
        if (32 * h >= ncol) break;
        const __m256 b = _mm256_set1_ps(xc[d]);
        __m256 v[4];
        if (ncol >= 32 * (h + 1)) {
          load32<T, kInt>(row + 32 * h * esz, v);
        } else {
          load32_tail<T, kInt>(row + 32 * h * esz, ncol - 32 * h, v);
        }
        DSV3_UNROLL2
        for (int q = 0; q < 4; ++q) acc[4 * h + q] = _mm256_fmadd_ps(v[q], b, acc[4 * h + q]);
      }
    }
    alignas(32) float tmp[64];
    DSV3_UNROLL2
    for (int h = 0; h < 2; ++h) {
      __m256 a[4];
      from_order<O>(acc + 4 * h, a);
      DSV3_UNROLL2
      for (int q = 0; q < 4; ++q) _mm256_store_ps(tmp + 32 * h + 8 * q, a[q]);
    }
    std::memcpy(y + c0, tmp, size_t(ncol) * 4);
  }
}

// out[i] = x[i] * f (i < n); whether every product is finite.
DSV3_AVX2 bool mul_finite(const float* x, int64_t n, float f, float* out) {
  const __m256 fv = _mm256_set1_ps(f), abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)),
               big = _mm256_set1_ps(FLT_MAX);
  __m256 bad = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i km = tail_mask8(n - i);
    const __m256 v = _mm256_mul_ps(_mm256_maskload_ps(x + i, km), fv);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(v, abs_mask), big, _CMP_NLE_UQ));
    _mm256_maskstore_ps(out + i, km, v);
  }
  return _mm256_movemask_ps(bad) == 0;
}

template <WT T>
DSV3_AVX2 void matmul_t1(const float* x, const Linear& wl, int64_t d0, int64_t nd, float* y, Scratch& s) {
  constexpr size_t esz = elem_size<T>();
  const int64_t C = wl.in(), kb = T == WT::kFp8 ? ceil_div(C, kBlock) : 1;
  const char* w = static_cast<const char*>(wl.weight.data);
  for (int64_t d = 0; d < std::min<int64_t>(16, nd); ++d)
    for (size_t off = 0; off < std::min<size_t>(size_t(C) * esz, 64 * esz); off += 64)
      _mm_prefetch(w + size_t((d0 + d) * C) * esz + off, _MM_HINT_T0);
  // xs[cb * nd + d]: x[d] times the block scale of (row d0 + d, column block cb) and the power of two.
  float* xs = s.get<float>(3, size_t(kb * nd));
  bool use_int = T == WT::kFp8 && fp8_int_route();
  for (int pass = 0; pass < 2; ++pass) {
    const float p2 = use_int ? 0x1p120f : 256.f;
    bool finite = true;
    for (int64_t cb = 0; cb < kb; ++cb)
      for (int64_t d = 0; d < nd;) {  // runs of rows in one 128-row block
        const int64_t rb = (d0 + d) / kBlock, e = std::min(nd, (rb + 1) * kBlock - d0);
        const float f = T == WT::kFp8 ? wl.scale.as<float>()[rb * kb + cb] * p2 : 1.f;
        finite &= mul_finite(x + d, e - d, f, xs + cb * nd + d);
        d = e;
      }
    if (!use_int || finite) break;
    use_int = false;  // x * scale * 2^120 overflows: the fp16 route
  }
  if (use_int) {
    t_rows1<T, true>(w, C, d0, nd, xs, nd, y);
  } else {
    t_rows1<T, false>(w, C, d0, nd, xs, nd, y);
  }
}

// --- many tokens (prefill): a blocked float32 GEMM ---------------------------------------------------
// y(m, j) = sum_k x[m * ldx + k] A(k, j) (m < M, j < N, k < K). A is packed per (column block of
// kNC, K block of kKC) into 16-column panels, panel g at p + g * 16 * kcp (kcp = kc rounded up to
// 8), element (k, j) at k * 16 + j - 16 g, columns past the block zero: weights are converted once
// per block and reused by every token; the block (<= 128 KB) stays in L2. The tokens go in blocks
// of kMC whose activations are copied (rows of kc floats: no 4 KB aliasing between tokens) and
// stay in L2; each 16 x kc panel (16 KB) stays in L1 while the register tile (16 columns x 6
// tokens: 12 accumulators, 2 panel loads and 6 broadcasts per 12 FMAs) runs over the block's
// tokens. Partial sums over K blocks go through y.
constexpr int kTileTokens = 6;
constexpr int64_t kKC = 256, kNC = 128, kMC = 120;  // kKC: a multiple of the FP8 block
inline int64_t round8(int64_t k) { return (k + 7) / 8 * 8; }

// Output element (m, j): y[m * ldy + j], or y[j * ldy + m] (transposed).
struct Out {
  float* y;
  int64_t ldy;
  bool transposed, add;  // add: y += the product (else y =)
  float alpha;           // y = alpha * product (not with add)
};

// NT tokens x 16 columns over kc: x rows at xb + t * ldxb, the panel a; nj (<= 16) valid columns,
// written to o (its y at the tile's first element). o.add: add y's partial sums; o.alpha: scale
// the total (1 for a partial block).
template <int NT>
DSV3_AVX2 void tile16(const float* a, const float* xb, int64_t ldxb, int64_t kc, int64_t nj, Out o) {
  float* y = o.y;
  const int64_t ldy = o.ldy;
  const bool transposed = o.transposed, add = o.add;
  const float alpha = o.alpha;
  __m256 acc[NT][2];
  DSV3_UNROLL2
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  _Pragma("GCC unroll 4")
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 a0 = _mm256_load_ps(a + 16 * k), a1 = _mm256_load_ps(a + 16 * k + 8);
    DSV3_UNROLL2
    for (int t = 0; t < NT; ++t) {
      const __m256 b = _mm256_broadcast_ss(xb + t * ldxb + k);
      acc[t][0] = _mm256_fmadd_ps(a0, b, acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(a1, b, acc[t][1]);
    }
  }
  const __m256 al = _mm256_set1_ps(alpha);
  if (transposed) {
    alignas(32) float tmp[NT][16];
    DSV3_UNROLL2
    for (int t = 0; t < NT; ++t) _mm256_store_ps(tmp[t], acc[t][0]), _mm256_store_ps(tmp[t] + 8, acc[t][1]);
    for (int64_t j = 0; j < nj; ++j)
      for (int t = 0; t < NT; ++t) y[j * ldy + t] = ((add ? y[j * ldy + t] : 0.f) + tmp[t][j]) * alpha;
    return;
  }
  const __m256i m0 = tail_mask8(nj), m1 = tail_mask8(nj - 8);
  DSV3_UNROLL2
  for (int t = 0; t < NT; ++t)
    DSV3_UNROLL2
    for (int h = 0; h < 2; ++h) {
      float* yp = y + t * ldy + 8 * h;
      __m256 c = acc[t][h];
      if (nj >= 16) {
        if (add) c = _mm256_add_ps(c, _mm256_loadu_ps(yp));
        _mm256_storeu_ps(yp, _mm256_mul_ps(c, al));
      } else {
        const __m256i mk = h ? m1 : m0;
        if (add) c = _mm256_add_ps(c, _mm256_maskload_ps(yp, mk));
        _mm256_maskstore_ps(yp, mk, _mm256_mul_ps(c, al));
      }
    }
}

// pack(j0, nj, k0, kc, panel) writes A's block (columns [j0, j0 + nj), k in [k0, k0 + kc)).
template <class Pack>
DSV3_AVX2 void gemm_blocked(Rows xr, int64_t K, int64_t N, Pack&& pack, const Out& o, Scratch& s) {
  const float* x = xr.p;
  const int64_t M = xr.n, ldx = xr.ld;
  const int64_t kcmax = std::min(kKC, K);
  float* panel = s.get<float>(0, size_t(kNC * round8(kcmax)));
  float* xb = s.get<float>(1, size_t(std::min(M, kMC) * kcmax));
  for (int64_t j0 = 0; j0 < N; j0 += kNC) {
    const int64_t nj = std::min(kNC, N - j0);
    for (int64_t k0 = 0; k0 < K; k0 += kKC) {
      const int64_t kc = std::min(kKC, K - k0), kcp = round8(kc);
      const bool add = o.add || k0 > 0;
      const float alpha = k0 + kc >= K ? o.alpha : 1.f;
      pack(j0, nj, k0, kc, panel);
      for (int64_t mc = 0; mc < M; mc += kMC) {
        const int64_t mn = std::min(kMC, M - mc);
        for (int64_t m = 0; m < mn; ++m) std::memcpy(xb + m * kc, x + (mc + m) * ldx + k0, size_t(kc) * 4);
        for (int64_t g = 0; 16 * g < nj; ++g) {
          const float* a = panel + g * 16 * kcp;
          const int64_t jn = std::min<int64_t>(16, nj - 16 * g);
          for (int64_t m = 0; m < mn; m += kTileTokens) {
            const int64_t mm = mc + m, jj = j0 + 16 * g;
            float* yt = o.transposed ? o.y + jj * o.ldy + mm : o.y + mm * o.ldy + jj;
            const Out ot{yt, o.ldy, o.transposed, add, alpha};
            const float* xt = xb + m * kc;
            switch (std::min<int64_t>(kTileTokens, mn - m)) {
              case 1: tile16<1>(a, xt, kc, kc, jn, ot); break;
              case 2: tile16<2>(a, xt, kc, kc, jn, ot); break;
              case 3: tile16<3>(a, xt, kc, kc, jn, ot); break;
              case 4: tile16<4>(a, xt, kc, kc, jn, ot); break;
              case 5: tile16<5>(a, xt, kc, kc, jn, ot); break;
              default: tile16<6>(a, xt, kc, kc, jn, ot); break;
            }
          }
        }
      }
    }
  }
}

// Weights as A's source: element (r, c) at base + (r * ld + c) * esz, FP8 with the 128x128 block
// scales sc[(r / 128) * kb + c / 128].
// `len`: the rows' length (pack_rows prefetches a row's next K block while it packs this one).
struct WSrc {
  const char* base;
  int64_t ld, len;
  const float* sc = nullptr;
  int64_t kb = 0;
};

// n (1..8) weights at p as float32, times f (FP8: f includes the conversion's 2^8); zero padded.
template <WT T>
DSV3_AVX2_INLINE __m256 widen8(const char* p, int64_t n, float f) {
  constexpr size_t esz = elem_size<T>();
  alignas(32) char buf[8 * esz];
  if (n < 8) {
    std::memset(buf, 0, sizeof buf);
    std::memcpy(buf, p, size_t(n) * esz);
    p = buf;
  }
  if constexpr (T == WT::kFp8) {
    return _mm256_mul_ps(e4m3x8(reinterpret_cast<const uint8_t*>(p)), _mm256_set1_ps(f));
  } else if constexpr (T == WT::kBf16) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  } else if constexpr (T == WT::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
}

template <WT T>
DSV3_AVX2_INLINE float wscale(const WSrc& w, int64_t r, int64_t c) {
  if constexpr (T == WT::kFp8) return w.sc[(r / kBlock) * w.kb + c / kBlock] * 256.f;
  return 1.f;
}

// A(k, j) = W(r0 + j, k) (A's columns are weight rows): 8 k x 16 rows converted and transposed
// (two 8x8 transposes) into the panel.
template <WT T>
DSV3_AVX2 void pack_rows(const WSrc& w, int64_t r0, int64_t j0, int64_t nj, int64_t k0, int64_t kc, float* panel) {
  constexpr size_t esz = elem_size<T>();
  const int64_t kcp = round8(kc), kn = std::min(kc, w.len - (k0 + kc));
  for (int64_t j = 0; j < nj && kn > 0; ++j)  // the weights come from memory, 16 rows at a time
    for (int64_t off = 0; off < kn * int64_t(esz); off += 64)
      _mm_prefetch(w.base + size_t((r0 + j0 + j) * w.ld + k0 + kc) * esz + off, _MM_HINT_T1);
  for (int64_t g = 0; 16 * g < nj; ++g)
    for (int64_t kk = 0; kk < kc; kk += 8) {
      const int64_t n = std::min<int64_t>(8, kc - kk), k = k0 + kk;
      __m256 v[16], t[16];
      DSV3_UNROLL2
      for (int i = 0; i < 16; ++i) {
        const int64_t j = 16 * g + i, r = r0 + j0 + j;
        v[i] = j < nj ? widen8<T>(w.base + size_t(r * w.ld + k) * esz, n, wscale<T>(w, r, k)) : _mm256_setzero_ps();
      }
      DSV3_UNROLL2
      for (int h = 0; h < 2; ++h) {  // rows 8h..8h+7: lane i of v[8h + q] -> lane q of t[8h + i]
        __m256 lo[4], hi[4];
        transpose4_lanes(v + 8 * h, lo);
        transpose4_lanes(v + 8 * h + 4, hi);
        DSV3_UNROLL2
        for (int q = 0; q < 4; ++q) {
          t[8 * h + q] = _mm256_permute2f128_ps(lo[q], hi[q], 0x20);
          t[8 * h + 4 + q] = _mm256_permute2f128_ps(lo[q], hi[q], 0x31);
        }
      }
      float* p = panel + g * 16 * kcp + kk * 16;
      DSV3_UNROLL2
      for (int i = 0; i < 8; ++i) _mm256_store_ps(p + 16 * i, t[i]), _mm256_store_ps(p + 16 * i + 8, t[8 + i]);
    }
}

// A(k, j) = W(d0 + k, j) (A's columns are weight columns): 16 contiguous weights per panel row.
template <WT T>
DSV3_AVX2 void pack_cols(const WSrc& w, int64_t d0, int64_t j0, int64_t nj, int64_t k0, int64_t kc, float* panel) {
  constexpr size_t esz = elem_size<T>();
  const int64_t kcp = round8(kc);
  for (int64_t g = 0; 16 * g < nj; ++g) {
    const int64_t c = j0 + 16 * g, nc = std::min<int64_t>(16, nj - 16 * g);
    for (int64_t k = 0; k < kc; ++k) {
      const int64_t r = d0 + k0 + k;
      const char* p = w.base + size_t(r * w.ld + c) * esz;
      const float f = wscale<T>(w, r, c);  // 16 columns lie in one 128-column block
      float* q = panel + g * 16 * kcp + k * 16;
      _mm256_store_ps(q, widen8<T>(p, std::min<int64_t>(8, nc), f));
      _mm256_store_ps(q + 8, nc > 8 ? widen8<T>(p + 8 * esz, nc - 8, f) : _mm256_setzero_ps());
    }
  }
}

template <WT T>
WSrc wsrc(const Linear& w) {
  return {static_cast<const char*>(w.weight.data), w.in(), w.in(), T == WT::kFp8 ? w.scale.as<float>() : nullptr,
          ceil_div(w.in(), kBlock)};
}

// Row `row` of w, columns [0, w.len), as float32 (FP8 with its block scales) into out, padded
// with zeros to a multiple of 8.
template <WT T>
DSV3_AVX2 void widen_row(const WSrc& w, int64_t row, float* out) {
  constexpr size_t esz = elem_size<T>();
  const char* p = w.base + size_t(row * w.ld) * esz;
  for (int64_t k = 0; k < w.len; k += 8)
    _mm256_storeu_ps(out + k, widen8<T>(p + size_t(k) * esz, std::min<int64_t>(8, w.len - k), wscale<T>(w, row, k)));
}

// Many tokens: rows [r0, r0 + nr) of w against M tokens.
template <WT T>
DSV3_AVX2 void matmul_many(Rows x, const Linear& w, RowRange rows, OutRows y, Scratch& s) {
  const WSrc src = wsrc<T>(w);
  gemm_blocked(x, w.in(), rows.n, [&](int64_t j0, int64_t nj, int64_t k0, int64_t kc, float* p) DSV3_AVX2 {
    pack_rows<T>(src, rows.r0, j0, nj, k0, kc, p);
  }, Out{y.p, y.ld, false, false, 1.f}, s);
}

// f(WT constant) for w's weight dtype.
template <class F>
DSV3_AVX2_INLINE void by_dtype(const Linear& w, const char* op, F&& f) {
  switch (w.weight.dtype) {
    case DType::F8_E4M3: return f(std::integral_constant<WT, WT::kFp8>{});
    case DType::BF16: return f(std::integral_constant<WT, WT::kBf16>{});
    case DType::F16: return f(std::integral_constant<WT, WT::kF16>{});
    case DType::F32: return f(std::integral_constant<WT, WT::kF32>{});
    default: fail(op, ": unsupported weight dtype ", dtype_name(w.weight.dtype));
  }
}

DSV3_AVX2 void matmul_avx2(Rows x, const Linear& w, RowRange rows, OutRows y, Scratch& s) {
  if (x.n <= 0 || rows.n <= 0) return;
  by_dtype(w, "matmul", [&](auto t) DSV3_AVX2 {
    if (x.n > 8) return matmul_many<decltype(t)::value>(x, w, rows, y, s);
    matmul_few<decltype(t)::value>(x, w, rows, y, s);
  });
}

DSV3_AVX2 void axpy_avx2(float alpha, const float* x, int64_t n, float* y) {
  const __m256 av = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

DSV3_AVX2 void matmul_t_avx2(Rows xr, const Linear& w, RowRange rows, OutRows yr, Scratch& s) {
  const float* x = xr.p;
  float* y = yr.p;
  const int64_t M = xr.n, ldx = xr.ld, d0 = rows.r0, nd = rows.n, ldy = yr.ld;
  if (M <= 0 || nd <= 0) return;
  if (M == 1) return by_dtype(w, "matmul_t", [&](auto t) DSV3_AVX2 { matmul_t1<decltype(t)::value>(x, w, d0, nd, y, s); });
  const int64_t C = w.in();
  if (M > 8)
    return by_dtype(w, "matmul_t", [&](auto t) DSV3_AVX2 {
      const WSrc src = wsrc<decltype(t)::value>(w);
      gemm_blocked(xr, nd, C, [&](int64_t j0, int64_t nj, int64_t k0, int64_t kc, float* p) DSV3_AVX2 {
        pack_cols<decltype(t)::value>(src, d0, j0, nj, k0, kc, p);
      }, Out{y, ldy, false, false, 1.f}, s);
    });
  float* row = s.get<float>(0, size_t(ceil_div(C, 8) * 8));
  for (int64_t m = 0; m < M; ++m) std::fill(y + m * ldy, y + m * ldy + C, 0.f);
  by_dtype(w, "matmul_t", [&](auto t) DSV3_AVX2 {
    const WSrc src = wsrc<decltype(t)::value>(w);
    for (int64_t d = 0; d < nd; ++d) {
      widen_row<decltype(t)::value>(src, d0 + d, row);
      for (int64_t m = 0; m < M; ++m) axpy_avx2(x[m * ldx + d], row, C, y + m * ldy);
    }
  });
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

// The float32 products' own scratch (their signature has none).
Scratch& f32_scratch() {
  thread_local Scratch s;
  return s;
}

// Beyond 8 rows of a (prefill: a token's heads): b's rows are the blocked product's tokens, a
// the packed side, c written transposed.
DSV3_AVX2 void gemm_nt_f32_avx2(Rows a, Rows b, int64_t K, float alpha, OutRows c) {
  if (a.n > 8) {
    const WSrc src{reinterpret_cast<const char*>(a.p), a.ld, K};
    return gemm_blocked(b, K, a.n, [&](int64_t j0, int64_t nj, int64_t k0, int64_t kc, float* p) DSV3_AVX2 {
      pack_rows<WT::kF32>(src, 0, j0, nj, k0, kc, p);
    }, Out{c.p, c.ld, true, false, alpha}, f32_scratch());
  }
  for (int64_t i = 0; i < a.n; ++i)
    for (int64_t j = 0; j < b.n; ++j) c.p[i * c.ld + j] = alpha * dot_avx2(a.p + i * a.ld, b.p + j * b.ld, K);
}

DSV3_AVX2 void gemm_nn_acc_f32_avx2(Rows p, Rows v, int64_t J, OutRows o) {
  if (p.n > 8) {
    const WSrc src{reinterpret_cast<const char*>(v.p), v.ld, J};
    return gemm_blocked(p, v.n, J, [&](int64_t j0, int64_t nj, int64_t k0, int64_t kc, float* pn) DSV3_AVX2 {
      pack_cols<WT::kF32>(src, 0, j0, nj, k0, kc, pn);
    }, Out{o.p, o.ld, false, true, 1.f}, f32_scratch());
  }
  for (int64_t i = 0; i < p.n; ++i)
    for (int64_t n = 0; n < v.n; ++n) axpy_avx2(p.p[i * p.ld + n], v.p + n * v.ld, J, o.p + i * o.ld);
}

DSV3_AVX2 void rmsnorm_avx2(Rows x, int64_t d, const float* w, float eps, OutRows y) {
  for (int64_t i = 0; i < x.n; ++i) {
    const float* xi = x.p + i * x.ld;
    const float r = 1.f / std::sqrt(dot_avx2(xi, xi, d) / float(d) + eps);
    for (int64_t k = 0; k < d; ++k) y.p[i * y.ld + k] = xi[k] * r * w[k];
  }
}

// e^x for x in [-87.3, 88.3] (clamped outside): exp_poly.h's reduction and polynomial (as the
// AVX-512 exp_ps), 2^n built in the exponent field.
DSV3_AVX2_INLINE __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kExpLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Hi), x));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  DSV3_UNROLL2
  for (int i = 1; i < 5; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

DSV3_AVX2 void silu_mul_avx2(const float* a, const float* b, int64_t n, float* h) {
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 av = _mm256_loadu_ps(a + i);
    const __m256 sg = _mm256_div_ps(av, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), av))));
    _mm256_storeu_ps(h + i, _mm256_mul_ps(sg, _mm256_loadu_ps(b + i)));
  }
  for (; i < n; ++i) h[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
}

DSV3_AVX2 void softmax_avx2(float* x, int64_t n) {
  if (n < 8) return softmax_scalar(x, n);
  __m256 mx = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(x + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float m = _mm_cvtss_f32(m4);
  for (; i < n; ++i) m = std::max(m, x[i]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(x + i, e);
  }
  float s = hsum8(sum);
  for (; i < n; ++i) s += (x[i] = std::exp(x[i] - m));
  const __m256 inv = _mm256_set1_ps(1.f / s);
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
  for (; i < n; ++i) x[i] *= 1.f / s;
}

}  // namespace

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

void set_avx2_fp8_route(int route) { g_fp8_route.store(route, std::memory_order_relaxed); }

const Kernels kAvx2Kernels = {Isa::kAvx2,   matmul_avx2,   matmul_t_avx2, gemm_nt_f32_avx2, gemm_nn_acc_f32_avx2,
                              rmsnorm_avx2, silu_mul_avx2, axpy_avx2,     softmax_avx2};

}  // namespace dsv3::cpu
