// AVX-512 kernels: weights (FP8 e4m3 with 128x128 block scales, bf16, f16, f32) become float32
// in registers (e4m3 through GF(2) affine byte transforms and a byte permute, no tables in
// memory) and meet float32 activations in FMAs. The FP8 block scale (and the 2^8 of the
// conversion) is folded into the activations, packed once per 128-row block. Nothing dequantised
// is written back to memory except a small per-thread panel (4 rows) that the tokens of a large
// batch share. Why float32 and not bf16 dot products: on the Intel cores we measured, vdpbf16ps
// retires at half the FLOP rate of FMA, and rounding activations to bf16 misses the golden bar's
// max error (docs/cpu_backend.md).
// GCC 12 warns about _mm512_undefined_* inside its own intrinsic headers; not our code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#ifndef __clang__
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "backend/cpu/kernels.h"
#include "backend/cpu/simd_avx512.h"
#include "core/dtype.h"
#include "core/error.h"

namespace dsv3::cpu {
namespace {

using namespace avx512;

constexpr int64_t kBlock = 128;  // FP8 block size

constexpr size_t kPrefetchBytes = 8192;  // how far ahead the GEMV kernels prefetch weights

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// --- weights -> float32 in registers ------------------------------------------------------------------
enum class WT { kFp8, kBf16, kF16, kF32 };

template <WT T>
constexpr size_t elem_size() { return T == WT::kFp8 ? 1 : T == WT::kF32 ? 4 : 2; }

// The k order in which load64<T> delivers a 64-weight chunk (the activations are packed to match).
template <WT T>
constexpr const Order64& order_of() { return T == WT::kFp8 ? kOrderFp8 : T == WT::kBf16 ? kOrderPair : kOrderNatural; }

// 64 weights of one row from column k0 (n valid, zeros past them) as four vectors of 16 floats,
// in order_of<T>(). FP8 values come out times 2^-8 (the caller folds 2^8 and the block scale
// into x).
template <WT T>
DSV3_AVX512_INLINE void load64(const void* row, int64_t k0, int64_t n, const Fp8Consts& c, __m512 v[4]) {
  if constexpr (T == WT::kFp8) {
    const uint8_t* p = static_cast<const uint8_t*>(row) + k0;
    fp8_to_f32(n >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(tail_mask64(n), p), c, v);
  } else if constexpr (T == WT::kBf16) {
    const uint16_t* p = static_cast<const uint16_t*>(row) + k0;
    if (n >= 64) {
      bf16_to_f32(_mm512_loadu_si512(p), _mm512_loadu_si512(p + 32), v);
    } else {
      bf16_to_f32(_mm512_maskz_loadu_epi16(tail_mask32(n), p),
                  _mm512_maskz_loadu_epi16(n > 32 ? tail_mask32(n - 32) : 0, p + 32), v);
    }
  } else if constexpr (T == WT::kF32) {
    const float* p = static_cast<const float*>(row) + k0;
    DSV3_UNROLL
    for (int q = 0; q < 4; ++q)
      v[q] = n >= 64 ? _mm512_loadu_ps(p + 16 * q) : _mm512_maskz_loadu_ps(n > 16 * q ? tail_mask16(n - 16 * q) : 0, p + 16 * q);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(row) + k0;
    DSV3_UNROLL
    for (int q = 0; q < 4; ++q)
      v[q] = _mm512_cvtph_ps(n >= 64 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * q))
                                     : _mm256_maskz_loadu_epi16(n > 16 * q ? tail_mask16(n - 16 * q) : 0, p + 16 * q));
  }
}

inline int64_t round64(int64_t k) { return (k + 63) / 64 * 64; }

// Permutation of a 64-float chunk into an order: out_q = blend(x0:x1 [idx], x2:x3 [idx]).
struct PackPerm {
  alignas(64) int32_t idx[4][16];
  uint16_t hi[4];
};
constexpr PackPerm make_pack_perm(const Order64& o) {
  PackPerm p{};
  for (int q = 0; q < 4; ++q)
    for (int i = 0; i < 16; ++i) {
      p.idx[q][i] = o.k[16 * q + i] & 31;
      if (o.k[16 * q + i] >= 32) p.hi[q] = uint16_t(p.hi[q] | (1u << i));
    }
  return p;
}
constexpr PackPerm kPermNatural = make_pack_perm(kOrderNatural), kPermFp8 = make_pack_perm(kOrderFp8),
                   kPermPair = make_pack_perm(kOrderPair);
template <WT T>
constexpr const PackPerm& perm_of() { return T == WT::kFp8 ? kPermFp8 : T == WT::kBf16 ? kPermPair : kPermNatural; }

// xs[m][0 .. round64(K)) = x[m][k] * f[k / 128] (m < x.n; f == nullptr: 1), zero padded, each
// 64-chunk in the order of `perm`.
DSV3_AVX512 void pack_x(Rows xr, int64_t K, const float* f, OutRows xsr, const PackPerm& perm) {
  const float* x = xr.p;
  float* xs = xsr.p;
  const int64_t M = xr.n, ldx = xr.ld, ldxs = xsr.ld;
  const bool identity = &perm == &kPermNatural;
  __m512i idx[4];
  DSV3_UNROLL
  for (int q = 0; q < 4; ++q) idx[q] = _mm512_load_si512(perm.idx[q]);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
      const __m512 fv = _mm512_set1_ps(f ? f[k0 / kBlock] : 1.f);
      __m512 v[4];
      DSV3_UNROLL
      for (int q = 0; q < 4; ++q) {
        const int64_t k = k0 + 16 * q;
        v[q] = _mm512_mul_ps(k + 16 <= K ? _mm512_loadu_ps(x + m * ldx + k)
                                         : _mm512_maskz_loadu_ps(k < K ? tail_mask16(K - k) : 0, x + m * ldx + k),
                             fv);
      }
      float* out = xs + m * ldxs + k0;
      if (identity) {
        DSV3_UNROLL
        for (int q = 0; q < 4; ++q) _mm512_storeu_ps(out + 16 * q, v[q]);
      } else {
        DSV3_UNROLL
        for (int q = 0; q < 4; ++q)
          _mm512_storeu_ps(out + 16 * q, _mm512_mask_blend_ps(perm.hi[q], _mm512_permutex2var_ps(v[0], idx[q], v[1]),
                                                               _mm512_permutex2var_ps(v[2], idx[q], v[3])));
      }
    }
}

// --- direct kernel (few tokens): each 64-weight chunk converted once, used by all M tokens --------------
// The weight rows a kernel streams: nr rows of K weights (of the kernel's type), row r at p + r * ld
// elements.
struct WRows {
  const void* p;
  int64_t ld, nr, K;
};

// y[m][r] = sum_k W[r][k] xs[m][k] for R rows (row stride ldw elements) and M tokens.
template <WT T, int R, int M, int NA, bool kTail>
DSV3_AVX512_INLINE void mk_direct_step(const char* wb, int64_t ldw, int64_t pf, int64_t k0, int64_t n, Rows xs,
                                       const Fp8Consts& cst, __m512 (&acc)[R][M][NA]) {
  constexpr size_t esz = elem_size<T>();
  DSV3_UNROLL
  for (int r = 0; r < R; ++r) {
    __m512 v[4];
    // A row group `pf` rows ahead, same chunk: R interleaved 2-KB streams are too short for the
    // hardware prefetcher to ramp up on (prefetching past the end is harmless).
    DSV3_UNROLL
    for (size_t off = 0; off < 64 * esz; off += 64)
      _mm_prefetch(wb + size_t((pf + r) * ldw + k0) * esz + off, _MM_HINT_T0);
    load64<T>(wb + size_t(r * ldw) * esz, k0, kTail ? n : 64, cst, v);
    DSV3_UNROLL
    for (int m = 0; m < M; ++m) {
      const float* xm = xs.p + m * xs.ld + k0;
      DSV3_UNROLL
      for (int q = 0; q < 4; ++q)
        acc[r][m][q % NA] = _mm512_fmadd_ps(v[q], _mm512_loadu_ps(xm + 16 * q), acc[r][m][q % NA]);
    }
  }
}

template <WT T, int R, int M>
DSV3_AVX512 void mk_direct(const void* w, int64_t ldw, int64_t pf, int64_t K, const float* xp, int64_t ldxs, float* y,
                           int64_t ldy) {
  const Rows xs{xp, M, ldxs};
  constexpr int NA = M <= 2 ? 2 : 1;  // two chains per (row, token) when there are few of them
  const Fp8Consts cst = fp8_consts();
  __m512 acc[R][M][NA];
  DSV3_UNROLL
  for (int r = 0; r < R; ++r)
    DSV3_UNROLL
    for (int m = 0; m < M; ++m)
      DSV3_UNROLL
      for (int a = 0; a < NA; ++a) acc[r][m][a] = _mm512_setzero_ps();
  const char* wb = static_cast<const char*>(w);
  const int64_t kfull = K / 64 * 64;
  for (int64_t k0 = 0; k0 < kfull; k0 += 64) mk_direct_step<T, R, M, NA, false>(wb, ldw, pf, k0, 64, xs, cst, acc);
  if (kfull < K) mk_direct_step<T, R, M, NA, true>(wb, ldw, pf, kfull, K - kfull, xs, cst, acc);
  DSV3_UNROLL
  for (int m = 0; m < M; ++m) {
    __m512 s[R];
    DSV3_UNROLL
    for (int r = 0; r < R; ++r) s[r] = NA == 2 ? _mm512_add_ps(acc[r][m][0], acc[r][m][NA - 1]) : acc[r][m][0];
    if constexpr (R == 4) {
      _mm_storeu_ps(y + m * ldy, hsum4(s[0], s[1], s[2], s[3]));
    } else {
      DSV3_UNROLL
      for (int r = 0; r < R; ++r) y[m * ldy + r] = hsum(s[r]);
    }
  }
}

// One token: rows one after another, so the weights are read as one sequential stream (four
// interleaved rows, as the kernel above reads them, are four short streams at 2-KB strides,
// which the hardware prefetchers follow less well: measured ~10% less bandwidth inside the
// model). Two software prefetches per 64-byte line: 4 KB ahead into L1 and 32 KB ahead into L2
// (more misses in flight than L1's fill buffers allow), the latter only up to `wend`, the end
// of the caller's rows. Four rows' sums are reduced together.
constexpr size_t kNearPrefetch = 4096, kFarPrefetch = 32768;

template <WT T>
DSV3_AVX512 void seq_rows1(const void* w, int64_t ldw, int64_t nr, int64_t K, const float* xs, float* y,
                           const char* wend) {
  constexpr size_t esz = elem_size<T>();
  const Fp8Consts cst = fp8_consts();
  const char* wb = static_cast<const char*>(w);
  const int64_t kfull = K / 64 * 64;
  // Far lines only below wend (integers: wend - kFarPrefetch may lie before the weights).
  const uintptr_t far_end = reinterpret_cast<uintptr_t>(wend) - kFarPrefetch;
  for (int64_t r0 = 0; r0 < nr; r0 += 4) {
    const int rn = int(std::min<int64_t>(4, nr - r0));
    __m512 s[4];
    for (int r = 0; r < 4; ++r) {
      if (r >= rn) {
        s[r] = _mm512_setzero_ps();
        continue;
      }
      const char* row = wb + size_t((r0 + r) * ldw) * esz;
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      int64_t k0 = 0;
      for (; k0 < kfull; k0 += 64) {
        const char* pa = row + size_t(k0) * esz;
        DSV3_UNROLL
        for (size_t off = 0; off < 64 * esz; off += 64) {
          _mm_prefetch(pa + kNearPrefetch + off, _MM_HINT_T0);
          if (reinterpret_cast<uintptr_t>(pa + off) < far_end) _mm_prefetch(pa + kFarPrefetch + off, _MM_HINT_T1);
        }
        __m512 v[4];
        load64<T>(row, k0, 64, cst, v);
        DSV3_UNROLL
        for (int q = 0; q < 4; ++q) acc[q] = _mm512_fmadd_ps(v[q], _mm512_loadu_ps(xs + k0 + 16 * q), acc[q]);
      }
      if (k0 < K) {
        __m512 v[4];
        load64<T>(row, k0, K - k0, cst, v);
        DSV3_UNROLL
        for (int q = 0; q < 4; ++q) acc[q] = _mm512_fmadd_ps(v[q], _mm512_loadu_ps(xs + k0 + 16 * q), acc[q]);
      }
      s[r] = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    }
    alignas(16) float out[4];
    _mm_store_ps(out, hsum4(s[0], s[1], s[2], s[3]));
    for (int r = 0; r < rn; ++r) y[r0 + r] = out[r];
  }
}

template <WT T, int M>
DSV3_AVX512 void direct_rows(const void* w, int64_t ldw, int64_t nr, int64_t K, Rows xs, OutRows y) {
  constexpr size_t esz = elem_size<T>();
  const char* wb = static_cast<const char*>(w);
  // Prefetch at least ~8 KB ahead: one 4-row group of long rows, several of short ones.
  const int64_t pf = 4 * std::max<int64_t>(1, int64_t(kPrefetchBytes / (4 * size_t(ldw) * esz)));
  int64_t r = 0;
  for (; r + 4 <= nr; r += 4) mk_direct<T, 4, M>(wb + size_t(r * ldw) * esz, ldw, pf, K, xs.p, xs.ld, y.p + r, y.ld);
  for (; r < nr; ++r) mk_direct<T, 1, M>(wb + size_t(r * ldw) * esz, ldw, pf, K, xs.p, xs.ld, y.p + r, y.ld);
}

// Up to 8 tokens: passes of at most 4 over 64-row groups (the second pass finds them in cache).
template <WT T>
DSV3_AVX512 void direct_tokens(WRows wr, Rows xr, OutRows yr, const char* wend, bool first) {
  const void* w = wr.p;
  const float* xs = xr.p;
  float* y = yr.p;
  const int64_t ldw = wr.ld, nr = wr.nr, K = wr.K, ldxs = xr.ld, M = xr.n, ldy = yr.ld;
  constexpr size_t esz = elem_size<T>();
  // The start of a call is not covered by the kernels' look-ahead prefetch (later row blocks of
  // the same call are: `first` is false for them at one token).
  if (first || M > 1) {
    const char* p = static_cast<const char*>(w);
    if (M == 1) {
      const size_t span = std::min(size_t(wend - p), kFarPrefetch);
      for (size_t off = 0; off < span; off += 64) {
        if (off < kNearPrefetch) {
          _mm_prefetch(p + off, _MM_HINT_T0);
        } else {
          _mm_prefetch(p + off, _MM_HINT_T1);
        }
      }
    } else {
      const size_t span = size_t(std::min<int64_t>(8, nr) * ldw) * esz;
      for (size_t off = 0; off < span; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    }
  }
  if (M == 1) return seq_rows1<T>(w, ldw, nr, K, xs, y, wend);
  for (int64_t rb = 0; rb < nr; rb += 64) {
    const void* wb = static_cast<const char*>(w) + size_t(rb * ldw) * esz;
    const int64_t n = std::min<int64_t>(64, nr - rb);
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t mn = std::min<int64_t>(4, M - m);
      const Rows xm{xs + m * ldxs, mn, ldxs};
      const OutRows ym{y + m * ldy + rb, ldy};
      switch (mn) {
        case 1: direct_rows<T, 1>(wb, ldw, n, K, xm, ym); break;
        case 2: direct_rows<T, 2>(wb, ldw, n, K, xm, ym); break;
        case 3: direct_rows<T, 3>(wb, ldw, n, K, xm, ym); break;
        default: direct_rows<T, 4>(wb, ldw, n, K, xm, ym); break;
      }
    }
  }
}

// --- panel kernel (many tokens): R float32 rows x T tokens, 24 accumulators -----------------------------
// y[t][r] (+)= sum_{k < Kp} p[r][k] xs[t][k]; add: onto y's partial sums.
template <int R, int T>
DSV3_AVX512 void mk_panel(const float* p, int64_t ldp, Rows xr, int64_t Kp, OutRows yr, bool add) {
  const float* xs = xr.p;
  const int64_t ldxs = xr.ld, ldy = yr.ld;
  float* y = yr.p;
  __m512 acc[R][T];
  DSV3_UNROLL
  for (int r = 0; r < R; ++r)
    DSV3_UNROLL
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += 16) {
    __m512 wv[R];
    DSV3_UNROLL
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(p + r * ldp + k);
    DSV3_UNROLL
    for (int t = 0; t < T; ++t) {
      const __m512 xv = _mm512_loadu_ps(xs + t * ldxs + k);
      DSV3_UNROLL
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  DSV3_UNROLL
  for (int t = 0; t < T; ++t) {
    if constexpr (R == 4) {
      const __m128 h = hsum4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]);
      _mm_storeu_ps(y + t * ldy, add ? _mm_add_ps(_mm_loadu_ps(y + t * ldy), h) : h);
    } else {
      DSV3_UNROLL
      for (int r = 0; r < R; ++r) y[t * ldy + r] = (add ? y[t * ldy + r] : 0.f) + hsum(acc[r][t]);
    }
  }
}

// R rows against up to 6 tokens (xr.n).
template <int R>
DSV3_AVX512 void panel_group(const float* p, int64_t ldp, Rows xr, int64_t Kp, OutRows yr, bool add) {
  switch (xr.n) {
    case 6: return mk_panel<R, 6>(p, ldp, xr, Kp, yr, add);
    case 5: return mk_panel<R, 5>(p, ldp, xr, Kp, yr, add);
    case 4: return mk_panel<R, 4>(p, ldp, xr, Kp, yr, add);
    case 3: return mk_panel<R, 3>(p, ldp, xr, Kp, yr, add);
    case 2: return mk_panel<R, 2>(p, ldp, xr, Kp, yr, add);
    case 1: return mk_panel<R, 1>(p, ldp, xr, Kp, yr, add);
    default: return;
  }
}

// Rows [0, nr) of float32 rows (stride ldp, Kp padded columns) for the xs.n tokens, (+)= into y:
// tokens in groups of 6, each group against every row (its activations stay in L1 meanwhile).
DSV3_AVX512 void panel_rows(const float* p, int64_t ldp, int64_t nr, Rows xs, int64_t Kp, OutRows y, bool add = false) {
  for (int64_t m = 0; m < xs.n; m += 6) {
    const Rows xm{xs.p + m * xs.ld, std::min<int64_t>(6, xs.n - m), xs.ld};
    float* ym = y.p + m * y.ld;
    int64_t r = 0;
    for (; r + 4 <= nr; r += 4) panel_group<4>(p + r * ldp, ldp, xm, Kp, {ym + r, y.ld}, add);
    for (; r < nr; ++r) panel_group<1>(p + r * ldp, ldp, xm, Kp, {ym + r, y.ld}, add);
  }
}

template <WT T>
DSV3_AVX512 void to_panel(const void* w, int64_t ldw, int64_t nr, int64_t K, float* panel, int64_t ldp) {
  constexpr size_t esz = elem_size<T>();
  const Fp8Consts cst = fp8_consts();
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t k0 = 0; k0 < ldp; k0 += 64) {
      __m512 v[4];
      load64<T>(static_cast<const char*>(w) + size_t(r * ldw) * esz, k0, K - k0, cst, v);
      DSV3_UNROLL
      for (int q = 0; q < 4; ++q) _mm512_storeu_ps(panel + r * ldp + k0 + 16 * q, v[q]);
    }
}

// Token tile for many tokens: enough to amortise a panel conversion, few enough that their packed
// activations stay in L2.
int64_t token_tile(int64_t M, int64_t Kp) {
  int64_t t = (512 * 1024) / std::max<int64_t>(1, Kp * 4);
  t = std::clamp<int64_t>(t, 12, 96) / 6 * 6;
  return std::min(M, t);
}

// Many tokens: blocks of kPanelRows rows converted once into a float32 panel (in L2), then per
// kPanelK columns of it (in L1 with a 6-token group's activations) every token against every row,
// partial sums added into y.
constexpr int64_t kPanelRows = 32, kPanelK = 256;

template <WT T>
DSV3_AVX512 void rows_any(WRows w, Rows xs, OutRows y, Scratch& s, const char* wend, bool first) {
  if (xs.n <= 8) {
    direct_tokens<T>(w, xs, y, wend, first);
    return;
  }
  constexpr size_t esz = elem_size<T>();
  const int64_t Kp = round64(w.K);
  float* panel = s.get<float>(2, size_t(kPanelRows * Kp));
  for (int64_t p = 0; p < w.nr; p += kPanelRows) {
    const int64_t np = std::min<int64_t>(kPanelRows, w.nr - p);
    to_panel<T>(static_cast<const char*>(w.p) + size_t(p * w.ld) * esz, w.ld, np, w.K, panel, Kp);
    for (int64_t k0 = 0; k0 < Kp; k0 += kPanelK)
      panel_rows(panel + k0, Kp, np, {xs.p + k0, xs.n, xs.ld}, std::min(kPanelK, Kp - k0), {y.p + p, y.ld}, k0 > 0);
  }
}

template <WT T>
DSV3_AVX512 void matmul_dt(Rows xr, const Linear& wl, RowRange rows, OutRows yr, Scratch& s) {
  const float* x = xr.p;
  float* y = yr.p;
  const int64_t M = xr.n, ldx = xr.ld, r0 = rows.r0, nr = rows.n, ldy = yr.ld;
  const int64_t K = wl.in(), Kp = round64(K), mt = M <= 8 ? M : token_tile(M, Kp);
  float* xs = s.get<float>(0, size_t(mt * Kp));
  if constexpr (T == WT::kFp8) {
    const int64_t kb = ceil_div(K, kBlock);
    const uint8_t* w = wl.weight.as<uint8_t>();
    const float* sc = wl.scale.as<float>();
    float* f = s.get<float>(1, size_t(kb));
    for (int64_t r = r0; r < r0 + nr;) {  // one 128-row scale block at a time
      const int64_t nb = r / kBlock, re = std::min(r0 + nr, (nb + 1) * kBlock);
      for (int64_t j = 0; j < kb; ++j) f[j] = sc[nb * kb + j] * 256.f;
      for (int64_t m0 = 0; m0 < M; m0 += mt) {
        const int64_t mm = std::min(mt, M - m0);
        pack_x({x + m0 * ldx, mm, ldx}, K, f, {xs, Kp}, perm_of<T>());
        rows_any<T>({w + r * K, K, re - r, K}, {xs, mm, Kp}, {y + m0 * ldy + (r - r0), ldy}, s,
                    reinterpret_cast<const char*>(w + (r0 + nr) * K), r == r0);
      }
      r = re;
    }
  } else {
    constexpr size_t esz = elem_size<T>();
    const char* w = static_cast<const char*>(wl.weight.data) + size_t(r0 * K) * esz;
    for (int64_t m0 = 0; m0 < M; m0 += mt) {
      const int64_t mm = std::min(mt, M - m0);
      pack_x({x + m0 * ldx, mm, ldx}, K, nullptr, {xs, Kp}, perm_of<T>());
      rows_any<T>({w, K, nr, K}, {xs, mm, Kp}, {y + m0 * ldy, ldy}, s, w + size_t(nr * K) * esz, true);
    }
  }
}

DSV3_AVX512 void matmul_avx512(Rows x, const Linear& wl, RowRange rows, OutRows y, Scratch& s) {
  if (x.n <= 0 || rows.n <= 0) return;
  switch (wl.weight.dtype) {
    case DType::F8_E4M3: return matmul_dt<WT::kFp8>(x, wl, rows, y, s);
    case DType::BF16: return matmul_dt<WT::kBf16>(x, wl, rows, y, s);
    case DType::F16: return matmul_dt<WT::kF16>(x, wl, rows, y, s);
    case DType::F32: return matmul_dt<WT::kF32>(x, wl, rows, y, s);
    default: fail("matmul: unsupported weight dtype ", dtype_name(wl.weight.dtype));
  }
}

// --- transposed product: y[m][c] = sum_d x[m][d] W[d0 + d][c] -------------------------------------------
// Few tokens: each row chunk is converted once and meets the broadcast x[m][d] (times the block
// scale of (d, c), folded per 128-column block) in M tokens' accumulators.
template <WT T, int M>
DSV3_AVX512 void t_direct(Rows xr, const Linear& wl, RowRange rows, OutRows yr, Scratch& s) {
  const float* x = xr.p;
  float* y = yr.p;
  const int64_t ldx = xr.ld, d0 = rows.r0, nd = rows.n, ldy = yr.ld;
  constexpr size_t esz = elem_size<T>();
  const int64_t C = wl.in(), kb = ceil_div(C, kBlock);
  const char* w = static_cast<const char*>(wl.weight.data);
  const Fp8Consts cst = fp8_consts();
  float* xs = s.get<float>(3, size_t(M * nd));
  const int64_t nblocks = T == WT::kFp8 ? kb : 1;
  for (int64_t cb = 0; cb < nblocks; ++cb) {
    DSV3_UNROLL
    for (int m = 0; m < M; ++m)
      for (int64_t d = 0; d < nd; ++d)
        xs[m * nd + d] = T == WT::kFp8 ? x[m * ldx + d] * wl.scale.as<float>()[((d0 + d) / kBlock) * kb + cb] * 256.f
                                       : x[m * ldx + d];
    const int64_t c_end = T == WT::kFp8 ? std::min(C, (cb + 1) * kBlock) : C;
    for (int64_t c0 = T == WT::kFp8 ? cb * kBlock : 0; c0 < c_end; c0 += 64) {
      const int64_t ncol = std::min<int64_t>(64, C - c0);
      __m512 acc[M][4];
      DSV3_UNROLL
      for (int m = 0; m < M; ++m)
        DSV3_UNROLL
        for (int q = 0; q < 4; ++q) acc[m][q] = _mm512_setzero_ps();
      for (int64_t d = 0; d < nd; ++d) {
        __m512 v[4];
        load64<T>(w + size_t((d0 + d) * C) * esz, c0, ncol, cst, v);
        DSV3_UNROLL
        for (int m = 0; m < M; ++m) {
          const __m512 b = _mm512_set1_ps(xs[m * nd + d]);
          DSV3_UNROLL
          for (int q = 0; q < 4; ++q) acc[m][q] = _mm512_fmadd_ps(v[q], b, acc[m][q]);
        }
      }
      constexpr const Order64& ord = order_of<T>();
      DSV3_UNROLL
      for (int m = 0; m < M; ++m) {
        alignas(64) float tmp[64];
        DSV3_UNROLL
        for (int q = 0; q < 4; ++q) _mm512_store_ps(tmp + 16 * q, acc[m][q]);
        float* ym = y + m * ldy + c0;
        for (int p = 0; p < 64; ++p)
          if (ord.k[p] < ncol) ym[ord.k[p]] = tmp[p];
      }
    }
  }
}

// One token: passes of 256 columns (16 accumulators), each reading every row's 256-column slice
// once, contiguously, with the rows a few ahead prefetched (the generic form above reads 64
// columns of each row per pass: 64-byte pieces at the row stride, which no prefetcher follows).
template <WT T, bool kFull>
DSV3_AVX512_INLINE void t_one_pass(const char* w, int64_t C, RowRange rows, int64_t p0, int64_t pc, const float* xs,
                                   const Fp8Consts& cst, float* y) {
  const int64_t d0 = rows.r0, nd = rows.n;
  constexpr size_t esz = elem_size<T>();
  constexpr int64_t kAhead = 12;  // rows
  // (The first rows are prefetched before the loop.)
  const size_t pf_bytes = 256 * esz;
  for (int64_t d = 0; d < std::min(kAhead, nd); ++d)
    for (size_t off = 0; off < pf_bytes; off += 64) _mm_prefetch(w + size_t((d0 + d) * C + p0) * esz + off, _MM_HINT_T0);
  __m512 acc[4][4];
  DSV3_UNROLL
  for (int q = 0; q < 4; ++q)
    DSV3_UNROLL
    for (int i = 0; i < 4; ++i) acc[q][i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < nd; ++d) {
    const char* row = w + size_t((d0 + d) * C + p0) * esz;
    if (d + kAhead < nd) {
      const char* pre = row + size_t(kAhead * C) * esz;
      for (size_t off = 0; off < pf_bytes; off += 64) _mm_prefetch(pre + off, _MM_HINT_T0);
    }
    const __m512 b0 = _mm512_set1_ps(xs[2 * d]), b1 = _mm512_set1_ps(xs[2 * d + 1]);
    DSV3_UNROLL
    for (int q = 0; q < 4; ++q) {
      if (!kFull && 64 * q >= pc) break;
      __m512 v[4];
      load64<T>(row, 64 * q, kFull ? 64 : pc - 64 * q, cst, v);
      DSV3_UNROLL
      for (int i = 0; i < 4; ++i) acc[q][i] = _mm512_fmadd_ps(v[i], q < 2 ? b0 : b1, acc[q][i]);
    }
  }
  constexpr const Order64& ord = order_of<T>();
  DSV3_UNROLL
  for (int q = 0; q < 4; ++q) {
    if (!kFull && 64 * q >= pc) break;
    alignas(64) float tmp[64];
    DSV3_UNROLL
    for (int i = 0; i < 4; ++i) _mm512_store_ps(tmp + 16 * i, acc[q][i]);
    const int64_t ncol = std::min<int64_t>(64, pc - 64 * q);
    float* yq = y + p0 + 64 * q;
    if (ncol == 64 && &ord == &kOrderNatural) {
      std::memcpy(yq, tmp, sizeof tmp);
    } else {
      for (int p = 0; p < 64; ++p)
        if (ord.k[p] < ncol) yq[ord.k[p]] = tmp[p];
    }
  }
}

template <WT T>
DSV3_AVX512 void t_direct1(const float* x, const Linear& wl, RowRange rows, float* y, Scratch& s) {
  const int64_t d0 = rows.r0, nd = rows.n;
  const int64_t C = wl.in(), kb = ceil_div(C, kBlock);
  const char* w = static_cast<const char*>(wl.weight.data);
  const Fp8Consts cst = fp8_consts();
  float* xs = s.get<float>(3, size_t(2 * nd));
  for (int64_t p0 = 0; p0 < C; p0 += 256) {
    const int64_t pc = std::min<int64_t>(256, C - p0);
    // xs[2d + h]: x[d] times the block scale of (row d0 + d, columns p0 + 128h ..) and 2^8.
    for (int64_t d = 0; d < nd; ++d)
      for (int h = 0; h < 2; ++h) {
        if constexpr (T == WT::kFp8) {
          const int64_t cb = p0 / kBlock + h;
          xs[2 * d + h] = cb < kb ? x[d] * wl.scale.as<float>()[((d0 + d) / kBlock) * kb + cb] * 256.f : 0.f;
        } else {
          xs[2 * d + h] = x[d];
        }
      }
    if (pc == 256) {
      t_one_pass<T, true>(w, C, rows, p0, pc, xs, cst, y);
    } else {
      t_one_pass<T, false>(w, C, rows, p0, pc, xs, cst, y);
    }
  }
}

template <WT T>
DSV3_AVX512 void t_direct_tokens(Rows x, const Linear& wl, RowRange rows, OutRows y, Scratch& s) {
  if (x.n == 1) return t_direct1<T>(x.p, wl, rows, y.p, s);
  for (int64_t m = 0; m < x.n; m += 4) {
    const int64_t mn = std::min<int64_t>(4, x.n - m);
    const Rows xm{x.p + m * x.ld, mn, x.ld};
    const OutRows ym{y.p + m * y.ld, y.ld};
    switch (mn) {
      case 1: t_direct<T, 1>(xm, wl, rows, ym, s); break;
      case 2: t_direct<T, 2>(xm, wl, rows, ym, s); break;
      case 3: t_direct<T, 3>(xm, wl, rows, ym, s); break;
      default: t_direct<T, 4>(xm, wl, rows, ym, s); break;
    }
  }
}

// Many tokens: the block's rows as float32 (scales applied; a row-major copy in L2), then an
// outer-product tile per 32 columns x up to 12 tokens: each row d's two column vectors meet the
// tokens' x[m][d] broadcast (24 accumulators, no reductions; the 32-column slice of the copy stays
// in L1 while the token tiles pass over it).
constexpr int kOuterTokens = 12;

// y[m][c0 + j] = sum_d x[m][d] w[d][c0 + j] for NT tokens and j < nc (<= 32; w's rows zero padded
// to 32 columns past the end).
template <int NT>
DSV3_AVX512 void outer_tile(const float* w, int64_t ldw, int64_t nd, Rows xr, int64_t nc, float* y, int64_t ldy) {
  __m512 acc[NT][2];
  DSV3_UNROLL
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < nd; ++d) {
    const __m512 w0 = _mm512_loadu_ps(w + d * ldw), w1 = _mm512_loadu_ps(w + d * ldw + 16);
    DSV3_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m512 b = _mm512_set1_ps(xr.p[t * xr.ld + d]);
      acc[t][0] = _mm512_fmadd_ps(w0, b, acc[t][0]);
      acc[t][1] = _mm512_fmadd_ps(w1, b, acc[t][1]);
    }
  }
  const __mmask16 m0 = tail_mask16(nc), m1 = nc > 16 ? tail_mask16(nc - 16) : 0;
  DSV3_UNROLL
  for (int t = 0; t < NT; ++t) {
    _mm512_mask_storeu_ps(y + t * ldy, m0, acc[t][0]);
    _mm512_mask_storeu_ps(y + t * ldy + 16, m1, acc[t][1]);
  }
}

template <int... NT>
DSV3_AVX512 void outer_tokens(const float* w, int64_t ldw, int64_t nd, Rows xr, int64_t nc, float* y, int64_t ldy,
                              std::integer_sequence<int, NT...>) {
  ((xr.n == NT + 1 ? outer_tile<NT + 1>(w, ldw, nd, xr, nc, y, ldy) : void()), ...);
}

// 16 e4m3 bytes (n valid, zeros past them) -> 16 floats in order, times f: a byte's low 7 bits
// shifted into a float32's exponent and mantissa fields are its value * 2^-120 (subnormal codes
// become float32 subnormals, exact; needs MXCSR.DAZ clear), times 2^120 (exact), then f (the one
// rounding, as e4m3_to_f32(b) * f). Codes 0x7F / 0xFF are NaN, as e4m3_to_f32 says.
DSV3_AVX512_INLINE __m512 e4m3x16(const uint8_t* p, int64_t n, float f) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(tail_mask16(n), p));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(mag, 20), _mm512_slli_epi32(_mm512_srli_epi32(b, 7), 31));
  const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f)), _mm512_set1_ps(f));
  return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), _mm512_set1_ps(NAN));
}

DSV3_AVX512 void matmul_t_generic(Rows xr, const Linear& wl, RowRange rows, OutRows yr, Scratch& s) {
  const int64_t M = xr.n, d0 = rows.r0, nd = rows.n;
  const int64_t C = wl.in(), ldw = (C + 31) / 32 * 32;
  float* w = s.get<float>(3, size_t(nd * ldw));
  const int64_t kb = ceil_div(C, kBlock);
  const bool daz_clear = (_mm_getcsr() & 0x40) == 0;
  for (int64_t d = 0; d < nd; ++d) {
    const int64_t row = d0 + d;
    float* wr = w + d * ldw;
    if (wl.fp8()) {
      const uint8_t* q = wl.weight.as<uint8_t>() + row * C;
      const float* sr = wl.scale.as<float>() + (row / kBlock) * kb;
      if (daz_clear) {
        for (int64_t c = 0; c < C; c += 16) _mm512_storeu_ps(wr + c, e4m3x16(q + c, C - c, sr[c / kBlock]));
      } else {
        for (int64_t c = 0; c < C; ++c) wr[c] = e4m3_to_f32(q[c]) * sr[c / kBlock];
      }
    } else {
      for (int64_t c = 0; c < C; ++c) wr[c] = load_f32(wl.weight, row * C + c);
    }
    std::fill(wr + C, wr + ldw, 0.f);
  }
  for (int64_t c0 = 0; c0 < C; c0 += 32)
    for (int64_t m = 0; m < M; m += kOuterTokens) {
      const Rows xm{xr.p + m * xr.ld, std::min<int64_t>(kOuterTokens, M - m), xr.ld};
      outer_tokens(w + c0, ldw, nd, xm, std::min<int64_t>(32, C - c0), yr.p + m * yr.ld + c0, yr.ld,
                   std::make_integer_sequence<int, kOuterTokens>{});
    }
}

DSV3_AVX512 void matmul_t_avx512(Rows x, const Linear& wl, RowRange rows, OutRows y, Scratch& s) {
  if (x.n <= 0 || rows.n <= 0) return;
  if (x.n > 8) return matmul_t_generic(x, wl, rows, y, s);
  switch (wl.weight.dtype) {
    case DType::F8_E4M3: return t_direct_tokens<WT::kFp8>(x, wl, rows, y, s);
    case DType::BF16: return t_direct_tokens<WT::kBf16>(x, wl, rows, y, s);
    case DType::F16: return t_direct_tokens<WT::kF16>(x, wl, rows, y, s);
    case DType::F32: return t_direct_tokens<WT::kF32>(x, wl, rows, y, s);
    default: fail("matmul_t: unsupported weight dtype ", dtype_name(wl.weight.dtype));
  }
}

// --- float32 products for attention ------------------------------------------------------------------
template <int BM, int BN>
DSV3_AVX512 void nt_block(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float alpha, float* c,
                          int64_t ldc) {
  __m512 acc[BM][BN];
  DSV3_UNROLL
  for (int i = 0; i < BM; ++i)
    DSV3_UNROLL
    for (int j = 0; j < BN; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 bv[BN];
    DSV3_UNROLL
    for (int j = 0; j < BN; ++j) bv[j] = _mm512_loadu_ps(b + j * ldb + k);
    DSV3_UNROLL
    for (int i = 0; i < BM; ++i) {
      __m512 av = _mm512_loadu_ps(a + i * lda + k);
      DSV3_UNROLL
      for (int j = 0; j < BN; ++j) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const __mmask16 km = tail_mask16(K - k);
    __m512 bv[BN];
    DSV3_UNROLL
    for (int j = 0; j < BN; ++j) bv[j] = _mm512_maskz_loadu_ps(km, b + j * ldb + k);
    DSV3_UNROLL
    for (int i = 0; i < BM; ++i) {
      __m512 av = _mm512_maskz_loadu_ps(km, a + i * lda + k);
      DSV3_UNROLL
      for (int j = 0; j < BN; ++j) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
  DSV3_UNROLL
  for (int i = 0; i < BM; ++i) {
    if constexpr (BN == 4) {
      _mm_storeu_ps(c + i * ldc, _mm_mul_ps(hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), _mm_set1_ps(alpha)));
    } else {
      DSV3_UNROLL
      for (int j = 0; j < BN; ++j) c[i * ldc + j] = alpha * hsum(acc[i][j]);
    }
  }
}

DSV3_AVX512 void gemm_nt_f32_avx512(Rows ar, Rows br, int64_t K, float alpha, OutRows cr) {
  const float *a = ar.p, *b = br.p;
  float* c = cr.p;
  const int64_t lda = ar.ld, ldb = br.ld, ldc = cr.ld, M = ar.n, N = br.n;
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) {
    int64_t j = 0;
    for (; j + 4 <= N; j += 4) nt_block<4, 4>(a + i * lda, lda, b + j * ldb, ldb, K, alpha, c + i * ldc + j, ldc);
    for (; j < N; ++j) nt_block<4, 1>(a + i * lda, lda, b + j * ldb, ldb, K, alpha, c + i * ldc + j, ldc);
  }
  for (; i < M; ++i) {
    int64_t j = 0;
    for (; j + 4 <= N; j += 4) nt_block<1, 4>(a + i * lda, lda, b + j * ldb, ldb, K, alpha, c + i * ldc + j, ldc);
    for (; j < N; ++j) nt_block<1, 1>(a + i * lda, lda, b + j * ldb, ldb, K, alpha, c + i * ldc + j, ldc);
  }
}

template <int BM>
DSV3_AVX512 void nn_block(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t N, int64_t J, float* o,
                          int64_t ldo) {
  // o[i][0..J) (J <= 64) += sum_n p[i][n] v[n][0..J)
  __m512 acc[BM][4];
  __mmask16 km[4];
  DSV3_UNROLL
  for (int j = 0; j < 4; ++j) km[j] = J > 16 * j ? tail_mask16(J - 16 * j) : 0;
  DSV3_UNROLL
  for (int i = 0; i < BM; ++i)
    DSV3_UNROLL
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_maskz_loadu_ps(km[j], o + i * ldo + 16 * j);
  for (int64_t n = 0; n < N; ++n) {
    __m512 vv[4];
    DSV3_UNROLL
    for (int j = 0; j < 4; ++j) vv[j] = _mm512_maskz_loadu_ps(km[j], v + n * ldv + 16 * j);
    DSV3_UNROLL
    for (int i = 0; i < BM; ++i) {
      __m512 pv = _mm512_set1_ps(p[i * ldp + n]);
      DSV3_UNROLL
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(pv, vv[j], acc[i][j]);
    }
  }
  DSV3_UNROLL
  for (int i = 0; i < BM; ++i)
    DSV3_UNROLL
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(o + i * ldo + 16 * j, km[j], acc[i][j]);
}

DSV3_AVX512 void gemm_nn_acc_f32_avx512(Rows pr, Rows vr, int64_t J, OutRows out) {
  const float *p = pr.p, *v = vr.p;
  float* o = out.p;
  const int64_t ldp = pr.ld, ldv = vr.ld, ldo = out.ld, M = pr.n, N = vr.n;
  for (int64_t j0 = 0; j0 < J; j0 += 64) {
    const int64_t jj = std::min<int64_t>(64, J - j0);
    int64_t i = 0;
    for (; i + 4 <= M; i += 4) nn_block<4>(p + i * ldp, ldp, v + j0, ldv, N, jj, o + i * ldo + j0, ldo);
    for (; i < M; ++i) nn_block<1>(p + i * ldp, ldp, v + j0, ldv, N, jj, o + i * ldo + j0, ldo);
  }
}

// --- element-wise ------------------------------------------------------------------------------------
DSV3_AVX512 void rmsnorm_avx512(Rows x, int64_t d, const float* w, float eps, OutRows y) {
  for (int64_t i = 0; i < x.n; ++i) {
    const float* xi = x.p + i * x.ld;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= d; k += 32) {
      __m512 v0 = _mm512_loadu_ps(xi + k), v1 = _mm512_loadu_ps(xi + k + 16);
      a0 = _mm512_fmadd_ps(v0, v0, a0);
      a1 = _mm512_fmadd_ps(v1, v1, a1);
    }
    for (; k < d; k += 16) {
      __m512 v = _mm512_maskz_loadu_ps(tail_mask16(d - k), xi + k);
      a0 = _mm512_fmadd_ps(v, v, a0);
    }
    const float r = 1.f / std::sqrt(hsum(_mm512_add_ps(a0, a1)) / float(d) + eps);
    const __m512 rv = _mm512_set1_ps(r);
    float* yi = y.p + i * y.ld;
    for (k = 0; k < d; k += 16) {
      const __mmask16 km = tail_mask16(d - k);
      _mm512_mask_storeu_ps(yi + k, km,
                            _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(km, xi + k), rv), _mm512_maskz_loadu_ps(km, w + k)));
    }
  }
}

DSV3_AVX512 void silu_mul_avx512(const float* a, const float* b, int64_t n, float* h) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 km = tail_mask16(n - i);
    __m512 av = _mm512_maskz_loadu_ps(km, a + i), bv = _mm512_maskz_loadu_ps(km, b + i);
    __m512 sg = _mm512_div_ps(av, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), av))));
    _mm512_mask_storeu_ps(h + i, km, _mm512_mul_ps(sg, bv));
  }
}

DSV3_AVX512 void axpy_avx512(float alpha, const float* x, int64_t n, float* y) {
  const __m512 av = _mm512_set1_ps(alpha);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 km = tail_mask16(n - i);
    _mm512_mask_storeu_ps(y + i, km, _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(km, x + i), _mm512_maskz_loadu_ps(km, y + i)));
  }
}

DSV3_AVX512 void softmax_avx512(float* x, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask16(n - i), x + i));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 km = tail_mask16(n - i);
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(km, x + i), m));
    e = _mm512_maskz_mov_ps(km, e);
    sum = _mm512_add_ps(sum, e);
    _mm512_mask_storeu_ps(x + i, km, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / hsum(sum));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 km = tail_mask16(n - i);
    _mm512_mask_storeu_ps(x + i, km, _mm512_mul_ps(_mm512_maskz_loadu_ps(km, x + i), inv));
  }
}

}  // namespace

// --- peaks for dsv3 bench ------------------------------------------------------------------------------
DSV3_AVX512 double fma_peak_avx512(long iters) {
  __m512 acc[24];
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_setzero_ps();
  __m512 a = _mm512_set1_ps(1.f), b = _mm512_set1_ps(1e-8f);
  for (long it = 0; it < iters; ++it) {
    DSV3_UNROLL
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  __m512 s = acc[0];
  for (int i = 1; i < 24; ++i) s = _mm512_add_ps(s, acc[i]);
  return hsum(s);
}

DSV3_AVX512 float read_sum_avx512(const float* p, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  float s = hsum(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  for (; i < n; ++i) s += p[i];
  return s;
}

// The AVX-512 table with AMX tiles for FP8 / bf16 products (kernels_amx.cc).
void matmul_amx(Rows x, const Linear& w, RowRange rows, OutRows y, Scratch& s);
void matmul_avx512_entry(Rows x, const Linear& w, RowRange rows, OutRows y, Scratch& s) {
  matmul_avx512(x, w, rows, y, s);
}

const Kernels kAmxKernels = {Isa::kAmx,     matmul_amx,      matmul_t_avx512, gemm_nt_f32_avx512, gemm_nn_acc_f32_avx512,
                             rmsnorm_avx512, silu_mul_avx512, axpy_avx512,     softmax_avx512};

const Kernels kAvx512Kernels = {Isa::kAvx512,   matmul_avx512,   matmul_t_avx512, gemm_nt_f32_avx512, gemm_nn_acc_f32_avx512,
                                rmsnorm_avx512, silu_mul_avx512, axpy_avx512,     softmax_avx512};

}  // namespace dsv3::cpu
