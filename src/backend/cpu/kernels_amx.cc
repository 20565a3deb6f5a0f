// AMX (tile matrix multiply, bf16) matmul for FP8 and bf16 weights, used for more than 8 tokens. Weights become bf16 tiles
// exactly (e4m3 -> bf16 in registers, as in the AVX-512 kernels; bf16 weights load straight from
// the mmap); activations go in as TWO bf16 columns each, hi = bf16(x) and lo = bf16(x - hi), so
// hi + lo carries 16 significant bits (relative error <= 2^-17) and the tile unit's float32
// accumulation gives near-float32 results. At decode the extra column is free: a tile has 16
// columns and one token needs 2. FP8 block scales are applied to each 128-wide k block's partial
// sums as they leave the tiles (per row, so row tiles may straddle 128-row blocks).
//
// Tiles: 0-3 accumulate C for four 16-row tiles, 4 holds A (weights, 16 rows x 32 k), 6 holds B
// (activations, 16 k-pairs x N columns, N = 2 x tokens <= 16).
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstring>

#include "backend/cpu/kernels.h"
#include "backend/cpu/simd_avx512.h"
#include "core/dtype.h"
#include "core/error.h"

// GCC 12 warns about _mm512_undefined_* inside its own intrinsic headers; not our code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#ifndef __clang__
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define DSV3_AMX                                                                                             \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,gfni,fma,f16c,bmi,bmi2,lzcnt," \
                        "popcnt,amx-tile,amx-bf16")))
#define DSV3_AMX_INLINE DSV3_AMX inline __attribute__((always_inline))

namespace dsv3::cpu {

void matmul_avx512_entry(Rows x, const Linear& w, RowRange rows, OutRows y, Scratch& s);

bool amx_request_permission() {
  // Linux: a process must ask before its first tile instruction (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

namespace {

using namespace avx512;

constexpr int64_t kBlock = 128;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the tile configuration for N-column C and B tiles (once per thread per N).
DSV3_AMX void configure(int N) {
  static thread_local int current = -1;
  if (current == N) return;
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = uint16_t(4 * N);  // C
  c.rows[4] = 16, c.colsb[4] = 64;                                             // A
  c.rows[5] = 16, c.colsb[5] = 64;                                             // A (alternate)
  c.rows[6] = 16, c.colsb[6] = uint16_t(4 * N);                                // B
  c.rows[7] = 16, c.colsb[7] = uint16_t(4 * N);                                // B (alternate)
  // GCC does not see that ldtilecfg reads the whole struct and drops the stores above without
  // this barrier.
  __asm__ volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
  current = N;
}

// --- activations: B tiles ------------------------------------------------------------------------------
// B for k-step s (32 k values) and a group of g tokens: 16 rows (k pairs) x 2g columns of bf16
// pairs, row stride 8g bytes; column 2m holds token m's hi part, 2m+1 its lo part. The k pairs
// of a step follow the A tile's k order: FP8 (fp8_to_bf16's interleave): step 2c + h, row r ->
// k = 64c + 16(r/4) + 8h + 2(r%4); bf16 (natural): step s, row r -> k = 32s + 2r.
//
// One token, one 64-k chunk: the 32 (hi, lo) pair qwords in natural pair order p (k = 2p).
DSV3_AMX_INLINE void hi_lo_pairs(const float* x, int64_t n, float f, __m512i q[4]) {
  __m512 v[4];
  const __m512 fv = _mm512_set1_ps(f);
  DSV3_UNROLL
  for (int i = 0; i < 4; ++i)
    v[i] = _mm512_mul_ps(fv, n >= 64 ? _mm512_loadu_ps(x + 16 * i)
                                     : _mm512_maskz_loadu_ps(n > 16 * i ? tail_mask16(n - 16 * i) : 0, x + 16 * i));
  const __m512i ilo = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), ihi = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  DSV3_UNROLL
  for (int h = 0; h < 2; ++h) {
    __m512bh hi = _mm512_cvtne2ps_pbh(v[2 * h + 1], v[2 * h]);
    __m512 h0 = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)hi));
    __m512 h1 = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)hi, 1));
    __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_sub_ps(v[2 * h + 1], h1), _mm512_sub_ps(v[2 * h], h0));
    __m512i u0 = _mm512_unpacklo_epi32((__m512i)hi, (__m512i)lo);  // pairs 0,1 | 4,5 | 8,9 | 12,13
    __m512i u1 = _mm512_unpackhi_epi32((__m512i)hi, (__m512i)lo);  // pairs 2,3 | 6,7 | 10,11 | 14,15
    q[2 * h] = _mm512_permutex2var_epi64(u0, ilo, u1);             // pairs 0..7 of this half
    q[2 * h + 1] = _mm512_permutex2var_epi64(u0, ihi, u1);         // pairs 8..15
  }
}

// Transposes 8 x 8 qwords: out[r][m] = in[m][r].
DSV3_AMX_INLINE void transpose8x8_q(const __m512i in[8], __m512i out[8]) {
  __m512i t[8], v[4], w[4];
  DSV3_UNROLL
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi64(in[2 * i], in[2 * i + 1]);      // r = 0, 2, 4, 6 of tokens 2i, 2i+1
    t[2 * i + 1] = _mm512_unpackhi_epi64(in[2 * i], in[2 * i + 1]);  // r = 1, 3, 5, 7
  }
  const __m512i e = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), o = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  // v[j]: tokens 0-3 at rows {j, j + 4}; w[j]: tokens 4-7.
  v[0] = _mm512_permutex2var_epi64(t[0], e, t[2]);
  v[1] = _mm512_permutex2var_epi64(t[1], e, t[3]);
  v[2] = _mm512_permutex2var_epi64(t[0], o, t[2]);
  v[3] = _mm512_permutex2var_epi64(t[1], o, t[3]);
  w[0] = _mm512_permutex2var_epi64(t[4], e, t[6]);
  w[1] = _mm512_permutex2var_epi64(t[5], e, t[7]);
  w[2] = _mm512_permutex2var_epi64(t[4], o, t[6]);
  w[3] = _mm512_permutex2var_epi64(t[5], o, t[7]);
  const __m512i lo = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0), hi = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
  DSV3_UNROLL
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm512_permutex2var_epi64(v[j], lo, w[j]);
    out[j + 4] = _mm512_permutex2var_epi64(v[j], hi, w[j]);
  }
}

// Packs tokens [0, g) of x (g <= 8), times f[k / 128] (f == nullptr: 1), into B for all k steps:
// b[s * 16 * g + r * g + m] (qwords).
template <bool kFp8>
DSV3_AMX void pack_b(const float* x, int64_t g, int64_t ldx, int64_t K, const float* f, uint64_t* b) {
  const int64_t chunks = (K + 63) / 64;
  const __m512i sel_lo = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0), sel_hi = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
  const __mmask8 gm = __mmask8((1u << g) - 1);
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i rows[2][2][8];  // [step in chunk][rows 0-7 | 8-15][token]
    for (int64_t m = 0; m < 8; ++m) {
      if (m >= g) {
        for (int h = 0; h < 2; ++h) rows[h][0][m] = rows[h][1][m] = _mm512_setzero_si512();
        continue;
      }
      __m512i q[4];
      hi_lo_pairs(x + m * ldx + 64 * c, K - 64 * c, f ? f[c / 2] : 1.f, q);
      if (kFp8) {
        rows[0][0][m] = _mm512_permutex2var_epi64(q[0], sel_lo, q[1]);  // pairs 0-3, 8-11
        rows[0][1][m] = _mm512_permutex2var_epi64(q[2], sel_lo, q[3]);  // pairs 16-19, 24-27
        rows[1][0][m] = _mm512_permutex2var_epi64(q[0], sel_hi, q[1]);  // pairs 4-7, 12-15
        rows[1][1][m] = _mm512_permutex2var_epi64(q[2], sel_hi, q[3]);
      } else {
        rows[0][0][m] = q[0], rows[0][1][m] = q[1], rows[1][0][m] = q[2], rows[1][1][m] = q[3];
      }
    }
    for (int h = 0; h < 2; ++h) {
      uint64_t* dst = b + (2 * c + h) * 16 * g;
      if (g == 1) {
        _mm512_storeu_si512(dst, rows[h][0][0]);
        _mm512_storeu_si512(dst + 8, rows[h][1][0]);
        continue;
      }
      for (int half = 0; half < 2; ++half) {
        __m512i t[8];
        transpose8x8_q(rows[h][half], t);
        for (int r = 0; r < 8; ++r) _mm512_mask_storeu_epi64(dst + (8 * half + r) * g, gm, t[r]);
      }
    }
  }
}

// --- weights: A tiles ----------------------------------------------------------------------------------
// Converts rows [0, nrows) (nrows <= 16; the rest zero) of e4m3, 64-k chunk c, into the two A
// tiles of that chunk: a[2][16 rows][32 bf16]. kFull: 16 rows and a whole chunk (no checks).
template <bool kFull>
DSV3_AMX_INLINE void fp8_a_tiles(const uint8_t* w, int64_t ldw, int64_t nrows, int64_t K, int64_t c, const Fp8Consts& cst,
                                 uint16_t* a) {
  const int64_t n = K - 64 * c;
  const __mmask64 km = tail_mask64(n);
  DSV3_UNROLL
  for (int64_t r = 0; r < 16; ++r) {
    __m512i lo, hi;
    if (kFull || r < nrows) {
      const uint8_t* p = w + r * ldw + 64 * c;
      // 64 rows advance together, 128 bytes each per k block: far too many streams for the
      // hardware prefetcher, so fetch 4 chunks (two k blocks) ahead (past the row end: harmless).
      _mm_prefetch(reinterpret_cast<const char*>(p + 4 * 64), _MM_HINT_T0);
      fp8_to_bf16(kFull ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(km, p), cst, lo, hi);
    } else {
      lo = hi = _mm512_setzero_si512();
    }
    _mm512_store_si512(a + r * 32, lo);
    _mm512_store_si512(a + 512 + r * 32, hi);
  }
}

// bf16 rows [0, nrows), k step s (32 k): a tile copy with zero rows / columns past the edges.
DSV3_AMX_INLINE void bf16_a_tile(const uint16_t* w, int64_t ldw, int64_t nrows, int64_t K, int64_t s, uint16_t* a) {
  const int64_t n = K - 32 * s;
  const __mmask32 km = tail_mask32(n);
  for (int64_t r = 0; r < 16; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(w + r * ldw + 32 * (s + 8)), _MM_HINT_T0);  // two k blocks ahead
    _mm512_store_si512(a + r * 32, r < nrows ? _mm512_maskz_loadu_epi16(km, w + r * ldw + 32 * s) : _mm512_setzero_si512());
  }
}

// Index vectors spreading a 16-row scale vector over a flat [16][N] float tile: lane l of vector v
// gets row (16 v + l) / N.
struct SpreadIdx {
  alignas(64) int32_t idx[16][16];
};
constexpr SpreadIdx make_spread(int N) {
  SpreadIdx s{};
  for (int v = 0; v < N; ++v)
    for (int l = 0; l < 16; ++l) s.idx[v][l] = (16 * v + l) / N;
  return s;
}
constexpr SpreadIdx kSpread[9] = {make_spread(1),  make_spread(2),  make_spread(4),  make_spread(6), make_spread(8),
                                  make_spread(10), make_spread(12), make_spread(14), make_spread(16)};

// GCC's tile intrinsics paste the tile number into the assembly text: literals only.
DSV3_AMX_INLINE void zero_tiles(int nt) {
  _tile_zero(0);
  if (nt > 1) _tile_zero(1);
  if (nt > 2) _tile_zero(2);
  if (nt > 3) _tile_zero(3);
}
DSV3_AMX_INLINE void dp_tile(int t) {
  switch (t) {
    case 0: _tile_dpbf16ps(0, 4, 6); break;
    case 1: _tile_dpbf16ps(1, 4, 6); break;
    case 2: _tile_dpbf16ps(2, 4, 6); break;
    default: _tile_dpbf16ps(3, 4, 6); break;
  }
}
DSV3_AMX_INLINE void store_tile(int t, float* c, int N) {
  switch (t) {
    case 0: _tile_stored(0, c, 4 * N); break;
    case 1: _tile_stored(1, c, 4 * N); break;
    case 2: _tile_stored(2, c, 4 * N); break;
    default: _tile_stored(3, c, 4 * N); break;
  }
}

// acc[16 N] += scale[row] * c[16 N] (flat [16][N] tiles).
DSV3_AMX_INLINE void scale_acc(const float* c, const float* scale16, int N, float* acc) {
  const __m512 sv = _mm512_loadu_ps(scale16);
  const SpreadIdx& sp = kSpread[N / 2];
  for (int v = 0; v < N; ++v) {
    const __m512 s = _mm512_permutexvar_ps(_mm512_load_si512(sp.idx[v]), sv);
    _mm512_storeu_ps(acc + 16 * v, _mm512_fmadd_ps(s, _mm512_loadu_ps(c + 16 * v), _mm512_loadu_ps(acc + 16 * v)));
  }
}

// y[m * ldy + row] = acc[row][2m] + acc[row][2m + 1] for rows [0, nrows) of one tile.
DSV3_AMX_INLINE void write_y(const float* acc, int64_t nrows, int64_t g, float* y, int64_t ldy) {
  const int N = int(2 * g);
  for (int64_t r = 0; r < nrows; ++r)
    for (int64_t m = 0; m < g; ++m) y[m * ldy + r] = acc[r * N + 2 * m] + acc[r * N + 2 * m + 1];
}

// Four C tiles x one token group for one 128-k block (steps [s0, s1)): products with A tiles
// from `a` ([tile][step][16][32]) and B from `bg`, alternating tile registers (A: 4/5, B: 6/7) so
// that a load need not wait for the product still reading the register's previous contents.
DSV3_AMX_INLINE void tdp_block(const uint16_t* a, const uint64_t* bg, int64_t g, int64_t s0, int64_t s1, int ntiles) {
  const int N = int(2 * g);
  for (int64_t st = s0; st < s1; ++st) {
    const uint16_t* as = a + (st - s0) * 512;
    const bool odd = (st - s0) & 1;
    if (odd) _tile_loadd(7, bg + st * 16 * g, 4 * N);
    else _tile_loadd(6, bg + st * 16 * g, 4 * N);
    if (ntiles == 4) {
      if (odd) {
        _tile_loadd(4, as, 64);
        _tile_dpbf16ps(0, 4, 7);
        _tile_loadd(5, as + 2048, 64);
        _tile_dpbf16ps(1, 5, 7);
        _tile_loadd(4, as + 4096, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, as + 6144, 64);
        _tile_dpbf16ps(3, 5, 7);
      } else {
        _tile_loadd(4, as, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, as + 2048, 64);
        _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(4, as + 4096, 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(5, as + 6144, 64);
        _tile_dpbf16ps(3, 5, 6);
      }
    } else {
      for (int t = 0; t < ntiles; ++t) {
        _tile_loadd(4, as + t * 2048, 64);
        if (odd) {
          switch (t) {
            case 0: _tile_dpbf16ps(0, 4, 7); break;
            case 1: _tile_dpbf16ps(1, 4, 7); break;
            default: _tile_dpbf16ps(2, 4, 7); break;
          }
        } else {
          dp_tile(t);
        }
      }
    }
  }
}

// Up to 64 tokens' activations packed as B (pack_b), in groups of up to 8: group g (g < n) holds
// size[g] tokens at buf[g].
struct PackedGroups {
  const uint64_t* buf[8] = {};
  int64_t size[8] = {};
  int n = 0;
};

// Rows [r0, r0 + nr) for the packed token groups. Row groups of 64 (four C tiles) x 128-k blocks:
// the block's A tiles are converted once, one block ahead of the products that read them (double
// buffer: the vector stores have landed by then), and shared by every token group. Each block's
// partial sums leave the tiles and are scaled into float32 accumulators (the FP8 scale of (row
// block, k block)); the tile unit does the rest.
template <bool kFp8>
DSV3_AMX void rows_amx(const Linear& wl, RowRange range, const PackedGroups& groups, OutRows yr, Scratch& s) {
  const int64_t r0 = range.r0, nr = range.n, ldy = yr.ld;
  float* y = yr.p;
  const uint64_t* const* bufs = groups.buf;
  const int64_t* gsize = groups.size;
  const int ngroups = groups.n;
  const int64_t K = wl.in();
  const int64_t steps = kFp8 ? 2 * ((K + 63) / 64) : (K + 31) / 32;
  const int64_t kblocks = (K + kBlock - 1) / kBlock;
  const Fp8Consts cst = fp8_consts();
  // A tiles of one k block for four row tiles: [parity][tile][4 steps][16][32] bf16.
  uint16_t* abuf = static_cast<uint16_t*>(s.get(5, 2 * 4 * 4 * 1024));
  float* cbuf = static_cast<float*>(s.get(6, 4 * 256 * 4));
  float* acc = static_cast<float*>(s.get(7, size_t(ngroups) * 4 * 256 * 4));
  alignas(64) float scale16[16];
  for (int64_t rg = 0; rg < nr; rg += 64) {
    const int64_t rows = std::min<int64_t>(64, nr - rg), ntiles = (rows + 15) / 16;
    std::memset(acc, 0, size_t(ngroups) * 4 * 256 * 4);
    auto convert = [&](int64_t kb) DSV3_AMX {
      const int64_t s0 = 4 * kb, s1 = std::min(steps, s0 + 4);
      uint16_t* dst = abuf + (kb & 1) * 4 * 4 * 512;
      for (int64_t t = 0; t < ntiles; ++t) {
        const int64_t tr = std::min<int64_t>(16, rows - 16 * t), row = r0 + rg + 16 * t;
        for (int64_t st = s0; st < s1; ++st) {
          uint16_t* a = dst + (t * 4 + (st - s0)) * 512;
          if (kFp8) {
            if ((st & 1) == 0) {
              const uint8_t* w = wl.weight.as<uint8_t>() + row * K;
              if (tr == 16 && 64 * (st / 2 + 1) <= K) fp8_a_tiles<true>(w, K, 16, K, st / 2, cst, a);
              else fp8_a_tiles<false>(w, K, tr, K, st / 2, cst, a);
            }
          } else {
            bf16_a_tile(wl.weight.as<uint16_t>() + row * K, K, tr, K, st, a);
          }
        }
      }
    };
    convert(0);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      if (kb + 1 < kblocks) convert(kb + 1);
      const int64_t s0 = 4 * kb, s1 = std::min(steps, s0 + 4);
      const uint16_t* a = abuf + (kb & 1) * 4 * 4 * 512;
      for (int g = 0; g < ngroups; ++g) {
        const int N = int(2 * gsize[g]);
        configure(N);
        zero_tiles(int(ntiles));
        tdp_block(a, bufs[g], gsize[g], s0, s1, int(ntiles));
        for (int64_t t = 0; t < ntiles; ++t) {
          store_tile(int(t), cbuf + t * 256, N);
          const int64_t row = r0 + rg + 16 * t, last = row + std::min<int64_t>(16, rows - 16 * t) - 1;
          float* at = acc + (g * 4 + t) * 256;
          const float* ct = cbuf + t * 256;
          if (!kFp8 || row / kBlock == last / kBlock) {  // one scale for the whole tile
            const __m512 sv = _mm512_set1_ps(kFp8 ? wl.scale.as<float>()[(row / kBlock) * kblocks + kb] * 256.f : 1.f);
            for (int v = 0; v < N; ++v)
              _mm512_storeu_ps(at + 16 * v, _mm512_fmadd_ps(sv, _mm512_loadu_ps(ct + 16 * v), _mm512_loadu_ps(at + 16 * v)));
          } else {
            for (int i = 0; i < 16; ++i)
              scale16[i] = row + i <= last ? wl.scale.as<float>()[((row + i) / kBlock) * kblocks + kb] * 256.f : 0.f;
            scale_acc(ct, scale16, N, at);
          }
        }
      }
    }
    int64_t m0 = 0;
    for (int g = 0; g < ngroups; ++g) {
      for (int64_t t = 0; t < ntiles; ++t)
        write_y(acc + (g * 4 + t) * 256, std::min<int64_t>(16, rows - 16 * t), gsize[g], y + m0 * ldy + rg + 16 * t, ldy);
      m0 += gsize[g];
    }
  }
}

template <bool kFp8>
DSV3_AMX void matmul_amx_t(Rows xr, const Linear& wl, RowRange rows, OutRows yr, Scratch& s) {
  const float* x = xr.p;
  float* y = yr.p;
  const int64_t M = xr.n, ldx = xr.ld, ldy = yr.ld;
  const int64_t K = wl.in();
  const int64_t steps = 2 * ((K + 63) / 64);  // B packs whole 64-k chunks
  constexpr int64_t kTokenTile = 64;          // eight groups of eight tokens share each converted A block
  // B depends only on x (no scale): all tokens are packed once and reused while the same
  // activations come back (the next row tile of the same expert, w3 after w1); the backend
  // invalidates the key between ops.
  const Scratch::PackKey key{x, M, ldx, K, kFp8 ? 1 : 2};
  const bool cached = s.packed_is(key);
  uint64_t* ball = static_cast<uint64_t*>(cached ? s.get(4, 0) : s.get(4, size_t(steps * 16 * M) * 8));
  if (!cached) {
    for (int64_t m = 0; m < M; m += 8) pack_b<kFp8>(x + m * ldx, std::min<int64_t>(8, M - m), ldx, K, nullptr, ball + steps * 16 * m);
    s.set_packed(key);
  }
  for (int64_t m0 = 0; m0 < M; m0 += kTokenTile) {
    const int64_t mt = std::min(kTokenTile, M - m0);
    PackedGroups groups;
    groups.n = int((mt + 7) / 8);
    for (int g = 0; g < groups.n; ++g) {
      groups.size[g] = std::min<int64_t>(8, mt - 8 * g);
      groups.buf[g] = ball + steps * 16 * (m0 + 8 * g);
    }
    rows_amx<kFp8>(wl, rows, groups, {y + m0 * ldy, ldy}, s);
  }
}

}  // namespace

// A tight loop of tile products (four independent C tiles, no memory traffic): FLOP/s of one core.
DSV3_AMX double amx_peak_1thread(long iters) {
  configure(16);
  alignas(64) static thread_local uint16_t buf[512];
  std::memset(buf, 0, sizeof buf);
  zero_tiles(4);
  _tile_loadd(4, buf, 64);
  _tile_loadd(6, buf, 64);
  timespec ts0, ts1;  // thread CPU time: the hardware's peak, whatever else runs on the machine
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts0);
  for (long i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 6);
    _tile_dpbf16ps(3, 4, 6);
  }
  alignas(64) float c[256];
  _tile_stored(0, c, 64);
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts1);
  const double dt = double(ts1.tv_sec - ts0.tv_sec) + double(ts1.tv_nsec - ts0.tv_nsec) * 1e-9;
  return c[0] == 0.f ? double(iters) * 4 * 16 * 16 * 32 * 2 / dt : 0.0;
}

DSV3_AMX void matmul_amx(Rows x, const Linear& w, RowRange rows, OutRows y, Scratch& s) {
  if (x.n <= 0 || rows.n <= 0) return;
  // Up to 8 tokens (decode) the weights stream from memory and the AVX-512 FMA kernel keeps more
  // of the bandwidth (dsv3_kernel_bench, FP8 [488192 x 2048] from memory, 2 threads: M = 1: 9.5
  // vs 10.3 GB/s; M = 4: 8.1 vs 5.8; M = 8: 5.0 vs 5.9; bf16 M = 4: 12.3 vs 6.8); the tiles pay
  // once a converted block is shared by more tokens (prefill: 3x the FMA path's FLOP rate).
  if (x.n <= 8) return matmul_avx512_entry(x, w, rows, y, s);
  if (w.weight.dtype == DType::F8_E4M3) return matmul_amx_t<true>(x, w, rows, y, s);
  if (w.weight.dtype == DType::BF16) return matmul_amx_t<false>(x, w, rows, y, s);
  matmul_avx512_entry(x, w, rows, y, s);
}

}  // namespace dsv3::cpu
