// AVX-512 building blocks shared by the AVX-512 kernel files: the e4m3 -> bf16 conversion in
// registers, activation packing to bf16, horizontal sums and a vector exp. Every function carries
// its own target attribute (DSV3_AVX512), so the rest of the build stays generic; include this
// only from kernel files and call these only after cpu::isa_supported(Isa::kAvx512).
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "backend/cpu/exp_poly.h"

#define DSV3_AVX512                                                                                  \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,gfni,fma,f16c,bmi,bmi2," \
                        "lzcnt,popcnt")))
#define DSV3_AVX512_INLINE DSV3_AVX512 inline __attribute__((always_inline))
// Loops over register-array indices must be unrolled, or the arrays live in memory.
#define DSV3_UNROLL _Pragma("GCC unroll 32")

namespace dsv3::cpu::avx512 {

// --- e4m3 -> bf16 -------------------------------------------------------------------------------
// An e4m3 byte s.eeee.mmm becomes the bf16 of its value times 2^-8 (exact; the caller folds 2^8
// into the block scale): bf16 = s | (0x70 + e) << 7 | m << 4 for e > 0. Both bytes of that bf16
// are bit selections of the input byte, so one GF(2) affine transform (gf2p8affineqb) each makes
// them. Subnormal codes (e == 0: +-m * 2^-9, including zero) need a different exponent; they are
// rare in real weights, so a test-and-branch patches them from a 16-entry table.
struct Fp8Consts {
  __m512i mat_hi, mat_lo, exp_mask, sign, low3, fix_hi, fix_lo;
};

// Bit matrix for gf2p8affineqb: result bit i = source bit src[i] (or 0 when src[i] < 0).
constexpr uint64_t gf2_matrix(const int (&src)[8]) {
  uint64_t m = 0;
  for (int i = 0; i < 8; ++i)
    if (src[i] >= 0) m |= uint64_t(1u << src[i]) << (8 * (7 - i));
  return m;
}

DSV3_AVX512_INLINE Fp8Consts fp8_consts() {
  constexpr int hi_src[8] = {4, 5, 6, -1, -1, -1, -1, 7};  // e1 e2 e3, constant 0x38, sign
  constexpr int lo_src[8] = {-1, -1, -1, -1, 0, 1, 2, 3};  // m0 m1 m2 e0 in the top nibble
  // value * 2^-8 for subnormal codes m = 0..7 (m * 2^-17) as bf16 bytes, sign added separately.
  const __m128i fh = _mm_setr_epi8(0x00, 0x37, 0x37, 0x37, 0x38, 0x38, 0x38, 0x38, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m128i fl = _mm_setr_epi8(0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x20, 0x40, 0x60, 0, 0, 0, 0, 0, 0, 0, 0);
  Fp8Consts c;
  c.mat_hi = _mm512_set1_epi64(int64_t(gf2_matrix(hi_src)));
  c.mat_lo = _mm512_set1_epi64(int64_t(gf2_matrix(lo_src)));
  c.exp_mask = _mm512_set1_epi8(0x78);
  c.sign = _mm512_set1_epi8(char(0x80));
  c.low3 = _mm512_set1_epi8(0x07);
  c.fix_hi = _mm512_broadcast_i32x4(fh);
  c.fix_lo = _mm512_broadcast_i32x4(fl);
  return c;
}

// 64 e4m3 bytes -> the high and low bytes of their bf16 (value * 2^-8).
DSV3_AVX512_INLINE void fp8_hi_lo(__m512i w, const Fp8Consts& c, __m512i& hi, __m512i& lo) {
  hi = _mm512_gf2p8affine_epi64_epi8(w, c.mat_hi, 0x38);
  lo = _mm512_gf2p8affine_epi64_epi8(w, c.mat_lo, 0);
  __mmask64 sub = _mm512_testn_epi8_mask(w, c.exp_mask);
  if (__builtin_expect(sub != 0, 0)) {
    __m512i idx = _mm512_and_si512(w, c.low3);
    __m512i fh = _mm512_ternarylogic_epi32(_mm512_shuffle_epi8(c.fix_hi, idx), w, c.sign, 0xF8);  // a | (b & c)
    hi = _mm512_mask_mov_epi8(hi, sub, fh);
    lo = _mm512_mask_mov_epi8(lo, sub, _mm512_shuffle_epi8(c.fix_lo, idx));
  }
}

// 64 e4m3 bytes (k = 0..63) -> two vectors of 32 bf16 in "fp8 order": a holds k = 0-7, 16-23,
// 32-39, 48-55 and b holds k = 8-15, 24-31, 40-47, 56-63 (the in-lane byte interleave). The
// activations are packed in the same order (pack_fp8_order).
DSV3_AVX512_INLINE void fp8_to_bf16(__m512i w, const Fp8Consts& c, __m512i& a, __m512i& b) {
  __m512i hi, lo;
  fp8_hi_lo(w, c, hi, lo);
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}

// 64 e4m3 bytes (k = 0..63) -> four vectors of 16 float32 (value * 2^-8). A float32 is its bf16
// shifted left by 16, so after the byte interleave the even words become float32 by a 16-bit
// shift and the odd ones by clearing their low half: 8 vector operations per 64 weights. The
// result is in "fp8 order" (kOrderFp8 below): vector q, lane 4L + j holds
// k = 16L + 2j + {0, 1, 8, 9}[q]; the activations are packed in the same order.
DSV3_AVX512_INLINE void fp8_to_f32(__m512i w, const Fp8Consts& c, __m512 v[4]) {
  __m512i a, b;
  fp8_to_bf16(w, c, a, b);
  const __m512i hm = _mm512_set1_epi32(int(0xFFFF0000u));
  v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
  v[1] = _mm512_castsi512_ps(_mm512_and_si512(a, hm));
  v[2] = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
  v[3] = _mm512_castsi512_ps(_mm512_and_si512(b, hm));
}

// 64 bf16 (k = 0..63) -> four vectors of float32 in "pair order": vector q, lane i holds
// k = 32 * (q / 2) + 2i + (q % 2).
DSV3_AVX512_INLINE void bf16_to_f32(__m512i lo32, __m512i hi32, __m512 v[4]) {
  const __m512i hm = _mm512_set1_epi32(int(0xFFFF0000u));
  v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(lo32, 16));
  v[1] = _mm512_castsi512_ps(_mm512_and_si512(lo32, hm));
  v[2] = _mm512_castsi512_ps(_mm512_slli_epi32(hi32, 16));
  v[3] = _mm512_castsi512_ps(_mm512_and_si512(hi32, hm));
}

// The k held by position p (= 16 q + lane) of a converted 64-weight chunk, per order.
struct Order64 {
  int k[64];
};
constexpr Order64 make_order(int kind) {  // 0 natural, 1 fp8, 2 pair
  Order64 o{};
  for (int q = 0; q < 4; ++q)
    for (int i = 0; i < 16; ++i) {
      int k = 16 * q + i;
      if (kind == 1) k = 16 * (i / 4) + 2 * (i % 4) + (q == 0 ? 0 : q == 1 ? 1 : q == 2 ? 8 : 9);
      if (kind == 2) k = 32 * (q / 2) + 2 * i + (q % 2);
      o.k[16 * q + i] = k;
    }
  return o;
}
inline constexpr Order64 kOrderNatural = make_order(0), kOrderFp8 = make_order(1), kOrderPair = make_order(2);

DSV3_AVX512_INLINE __mmask64 tail_mask64(int64_t n) { return n >= 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1; }
DSV3_AVX512_INLINE __mmask32 tail_mask32(int64_t n) { return n >= 32 ? ~__mmask32(0) : (__mmask32(1u) << n) - 1; }
DSV3_AVX512_INLINE __mmask16 tail_mask16(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// 16 floats from x[0..n) (zeros past n), times f.
DSV3_AVX512_INLINE __m512 load16_scaled(const float* x, int64_t n, __m512 f) {
  return _mm512_mul_ps(n >= 16 ? _mm512_loadu_ps(x) : _mm512_maskz_loadu_ps(tail_mask16(n), x), f);
}

// 32 floats -> 32 bf16 (round to nearest even) in natural order.
DSV3_AVX512_INLINE __m512i cvt32(__m512 lo16, __m512 hi16) { return (__m512i)_mm512_cvtne2ps_pbh(hi16, lo16); }

// Packs one 64-value chunk of x (n valid values, scaled by f) in fp8 order into out[0..64).
DSV3_AVX512_INLINE void pack_fp8_chunk(const float* x, int64_t n, __m512 f, uint16_t* out) {
  const __m512i idx_a = _mm512_set_epi16(55, 54, 53, 52, 51, 50, 49, 48, 39, 38, 37, 36, 35, 34, 33, 32, 23, 22, 21,
                                         20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i idx_b = _mm512_add_epi16(idx_a, _mm512_set1_epi16(8));
  __m512 v0 = n > 0 ? load16_scaled(x, n, f) : _mm512_setzero_ps();
  __m512 v1 = n > 16 ? load16_scaled(x + 16, n - 16, f) : _mm512_setzero_ps();
  __m512 v2 = n > 32 ? load16_scaled(x + 32, n - 32, f) : _mm512_setzero_ps();
  __m512 v3 = n > 48 ? load16_scaled(x + 48, n - 48, f) : _mm512_setzero_ps();
  __m512i c01 = cvt32(v0, v1), c23 = cvt32(v2, v3);
  _mm512_storeu_si512(out, _mm512_permutex2var_epi16(c01, idx_a, c23));
  _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(c01, idx_b, c23));
}

// Packs one 32-value chunk of x (n valid, times f) in natural order.
DSV3_AVX512_INLINE void pack_nat_chunk(const float* x, int64_t n, __m512 f, uint16_t* out) {
  __m512 v0 = n > 0 ? load16_scaled(x, n, f) : _mm512_setzero_ps();
  __m512 v1 = n > 16 ? load16_scaled(x + 16, n - 16, f) : _mm512_setzero_ps();
  _mm512_storeu_si512(out, cvt32(v0, v1));
}

// Sums of four vectors: [sum a, sum b, sum c, sum d].
DSV3_AVX512_INLINE __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m256 a2 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
  __m256 c2 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  __m256 d2 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
  __m256 ab = _mm256_hadd_ps(a2, b2), cd = _mm256_hadd_ps(c2, d2);
  __m256 abcd = _mm256_hadd_ps(ab, cd);  // [a b c d | a b c d] partial sums
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

DSV3_AVX512_INLINE float hsum(__m512 a) { return _mm512_reduce_add_ps(a); }

// exp(x) for float32 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial
// (relative error ~2e-7); x < -87.3 gives 0, x > 88.7 gives inf.
DSV3_AVX512_INLINE __m512 exp_ps(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(kExpLog2e);
  const __m512 ln2_hi = _mm512_set1_ps(kExpLn2Hi), ln2_lo = _mm512_set1_ps(kExpLn2Lo);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.4f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_lo, _mm512_fnmadd_ps(n, ln2_hi, x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  DSV3_UNROLL
  for (int i = 1; i < 5; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace dsv3::cpu::avx512
