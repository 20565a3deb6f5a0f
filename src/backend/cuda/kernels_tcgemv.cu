// Products of a few tokens (decode) on tensor cores. A warp takes 16 weight rows and a range of
// K, streams them from global memory straight into mma.sync A fragments (bf16 as stored, e4m3
// widened to f16 exactly, its 128x128 block scale applied per 128-K partial product), and takes
// the activations as B fragments (one token per MMA column, up to 8) from shared memory, where
// each block first splits them once: into three bf16 parts (hi + mid + lo: 24 bits) for bf16
// weights, into two f16 parts of the activations times a power of two per token and 128-column
// block for e4m3 weights (folded back into that block's partial product, like its weight
// scale); one token's parts take a column each instead (DSV3_TCV_COLS). float32 accumulation
// throughout: float32-grade products with ~16x fewer instructions per weight byte than the FMA
// GEMVs (kernels_gemv.cu), whose place this takes where it fits.
//
// Fragment layout (m16n8k16): lane l = 4 g + c holds rows g and g + 8 of A and token column g of
// B. An iteration covers 128 bytes of each row; lane c loads two 16-byte pieces of its two rows
// (see act_off). The k order inside an MMA is thereby permuted, the same way for A and B, which
// a dot product does not see: MMA step j of an iteration takes the lane's values 4j .. 4j + 3.
#include <algorithm>
#include <cstdlib>

#include "backend/cuda/common.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/moe_route.cuh"
#include "core/error.h"

// DSV3_TCV_ABLATE (a measurement aid, never for results; bench/results/2026-12-02-h200-cuda/run21-*):
// 1 = the weight loads alone, 2 = the MMAs without the e4m3 widening, 3 = the loads alone in the order of
// 16-row tiles stored iteration by iteration (2 KB contiguous per tile and iteration).
#ifndef DSV3_TCV_ABLATE
#define DSV3_TCV_ABLATE 0
#endif
// DSV3_TCV_ORDER (a measurement aid, never for results): read each full 16-row tile's bytes as if it
// were stored 1 = [iteration][row][128 B], 2 = [iteration][load][lane][16 B] (each warp load 512
// contiguous bytes), with the arithmetic kept: the time of that layout, wrong numbers
// (bench/results/2026-12-03-h200-cuda/run31-*, run 1).
#ifndef DSV3_TCV_ORDER
#define DSV3_TCV_ORDER (DSV3_TCV_ABLATE == 3 ? 1 : 0)
#endif
// DSV3_TCV_COLS=1: one token's activation parts go in separate columns of the MMAs' B (half or a
// third of the MMAs, shorter dependent chains); 0: each part its own MMA into the token's column.
#ifndef DSV3_TCV_COLS
#define DSV3_TCV_COLS 1
#endif
// DSV3_TRACE_BLOCKS=1 with DSV3_TRACE=1 (a measurement aid): every block of the expert GEMVs records
// when it started, when its expert was known (wait and routing done), when its activations were
// staged and when it ended, as two trace records (scripts/trace_blocks.py reads them).
#if !DSV3_TRACE
#undef DSV3_TRACE_BLOCKS
#endif
#ifndef DSV3_TRACE_BLOCKS
#define DSV3_TRACE_BLOCKS 0
#endif

// Iterations of weight loads in flight per warp (the register ring): fused w1 / w3 (4 KB of a
// warp's loads per iteration), one weight (2 KB), and one weight of one token's e4m3 product.
// Fewer bytes in flight are faster here: the memory system is saturated either way, and what
// more requests add is queueing, which every load, the dependent small reads included, then
// waits through (H200, run33: 2 / 3 -> 1 / 2: FP8 b1 +2%, b8 +3%, bf16 b8 +1%; then one token's
// e4m3 at 1, with 128-byte L2 prefetches for e4m3 (common.cuh): FP8 b1 +1%, b8 +1%). Since stage
// 1's routed blocks start first (launch_slot), one token's e4m3 at 2 measures +0.6-1% at FP8 b1
// again (run34; 3: -0.5%), so it is 2 like the rest.
#ifndef DSV3_TCV_NB_FUSED
#define DSV3_TCV_NB_FUSED 1
#endif
#ifndef DSV3_TCV_NB_PLAIN
#define DSV3_TCV_NB_PLAIN 2
#endif
#ifndef DSV3_TCV_NB_PLAIN_ONE_FP8
#define DSV3_TCV_NB_PLAIN_ONE_FP8 2
#endif
#ifndef DSV3_TCV_STAGGER  // one token's fused iterations: w1's next loads issued after w1's MMAs, then w3's (run33:
#define DSV3_TCV_STAGGER 1  // FP8 b1 +1%; at 8 tokens FP8 -0.5%, bf16 +0.3%, so there it stays off)
#endif

namespace dsv3::cuda {
namespace {

constexpr int kTW = 8;  // warps per block

template <int WT>
struct Tcv;
template <>
struct Tcv<kBF16> {
  static constexpr int KI = 64;     // K per iteration: 128 bytes of a row
  static constexpr int PARTS = 3;   // bf16 parts per activation
  static constexpr int PAD = 16;    // bytes after each token's row of a part (S = 16 mod 128)
};
template <>
struct Tcv<kFP8> {
  static constexpr int KI = 128;    // one scale block
  static constexpr int PARTS = 2;   // f16 parts
  static constexpr int PAD = 32;    // S = 32 mod 128, with the unit swizzle below
};

struct TcvJob {
  DevLinear a, b, c;  // b: w3 (fused SwiGLU); c: a second weight whose tiles follow a's (rows 0: none)
  const float* x = nullptr;
  int64_t ldx = 0;
  const int32_t* idx = nullptr;  // token t's row is x + (idx ? idx[t] : t) * ldx
  int m = 0;                     // tokens, <= 8
  float* y = nullptr;
  int64_t ldy = 0;
  float* y2 = nullptr;
  int64_t ldy2 = 0;
  int ks = 1;  // warps per 16-row tile (each a range of K): 1, 2, 4 or 8
  // K in chunks (gridDim.z of them): chunk z takes columns [z kc, z kc + kc) of the weights and of
  // x, and writes y and y2 chunk_y floats further per chunk (partial products; chunk_sum adds them)
  int64_t kc = 0;
  int64_t chunk_y = 0;
};

template <int WT>
__host__ __device__ constexpr int64_t row_bytes(int64_t K) {  // one token's row of one part in shared memory
  return 2 * K + Tcv<WT>::PAD;
}
// The e4m3 path's per-(token, 128-column block) multipliers in shared memory.
__host__ __device__ constexpr int64_t am_bytes(int64_t m, int64_t K) { return (m * (K / 128) * 4 + 15) / 16 * 16; }
// Byte offset of activation k (a multiple of 4) inside a token's row. Lane c's weight bytes of
// an iteration are [16c, 16c + 16) and [64 + 16c, 64 + 16c + 16) of the row's 128 (two loads
// that each cover 64 contiguous bytes over the four lanes); its activations for those k are
// 16-byte units 4c .. 4c + 3 (e4m3: 8 f16 each, units 0-1 from the first load, 2-3 from the
// second; lanes 2 and 3 swap them pairwise so the four lanes of a token hit distinct banks)
// or 2c .. 2c + 1 (bf16: 8 values each).
template <int WT>
__device__ __forceinline__ int64_t act_off(int64_t k) {
  if constexpr (WT == kBF16) {
    const int64_t i = k >> 6, kl = k & 63, c = (kl & 31) >> 3, u = kl >> 5;
    return 128 * i + 16 * (2 * c + u) + 2 * (kl & 7);
  } else {
    const int64_t i = k >> 7, kl = k & 127, c = (kl & 63) >> 4, u = 2 * (kl >> 6) + ((kl >> 3) & 1);
    return 256 * i + 16 * (4 * c + (u ^ ((c >> 1) & 1))) + 2 * (kl & 7);
  }
}

__device__ __forceinline__ uint32_t pack_h2(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float2 h2f(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}
__device__ __forceinline__ uint32_t e4m3x2_h2(uint32_t v) {  // low byte -> low half; exact
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// The block's m activation rows into shared memory as PARTS parts [part][token][row_bytes]; for
// e4m3 weights each (token, 128-column block) scaled by its own power of two first (am: the
// factor back, [token][K / 128], folded into that iteration's partial product). A warp's 32
// float4 are one such block (K % 128 == 0), so its multiplier is a warp maximum: one pass.
template <int WT>
__device__ void stage_x(const TcvJob& J, int64_t K, char* act, float* am) {
  const int64_t S = row_bytes<WT>(K), q4 = K / 4, total = int64_t(J.m) * q4, PS = int64_t(J.m) * S;
  auto row = [&](int t) { return J.x + (J.idx ? int64_t(J.idx[t]) : int64_t(t)) * J.ldx; };
  for (int64_t f = threadIdx.x; f < total; f += blockDim.x) {  // warp-uniform: total % 32 == 0
    const int t = int(f / q4);
    const int64_t k = 4 * (f % q4);
    float4 v = __ldg(reinterpret_cast<const float4*>(row(t)) + f % q4);
    char* base = act + t * S + act_off<WT>(k);
    if constexpr (WT == kFP8) {
      const float mx = warp_max(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
      int e = 0;
      frexpf(mx, &e);  // mx * 2^-e < 1 (0: e = 0)
      e = max(-100, min(e, 100));
      if ((threadIdx.x & 31) == 0) am[int64_t(t) * (K / 128) + k / 128] = ldexpf(1.f, e);
      const float inv = ldexpf(1.f, -e);  // a power of two: exact
      v.x *= inv, v.y *= inv, v.z *= inv, v.w *= inv;
      const uint32_t h0 = pack_h2(v.x, v.y), h1 = pack_h2(v.z, v.w);
      const float2 g0 = h2f(h0), g1 = h2f(h1);
      *reinterpret_cast<uint2*>(base) = make_uint2(h0, h1);
      *reinterpret_cast<uint2*>(base + PS) = make_uint2(pack_h2(v.x - g0.x, v.y - g0.y), pack_h2(v.z - g1.x, v.w - g1.y));
    } else {
      uint32_t h0, m0, l0, h1, m1, l1;
      bf16x2_split3(v.x, v.y, h0, m0, l0);
      bf16x2_split3(v.z, v.w, h1, m1, l1);
      *reinterpret_cast<uint2*>(base) = make_uint2(h0, h1);
      *reinterpret_cast<uint2*>(base + PS) = make_uint2(m0, m1);
      *reinterpret_cast<uint2*>(base + 2 * PS) = make_uint2(l0, l1);
    }
  }
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// One iteration's MMAs of NM weights on the same activations: w[4 q .. 4 q + 1] = 32 bytes of
// row g of weight q, w[4 q + 2 .. 4 q + 3] of row g + 8; bp = the lane's B bytes of this
// iteration in part 0 (parts PS apart, units swizzled by sw), zeros without a token. The B units
// are read one at a time (the registers go to the weights in flight). COLS: one token whose
// parts are B's columns (lane g reads part g at bp), so one MMA per step takes them all.
template <int WT, int NM, bool COLS>
__device__ __forceinline__ void mma_iter(const uint4* w, const char* bp, int64_t PS, int sw, bool has_tok,
                                         float (&acc)[NM][4], const float (&scale)[NM], float c0, float c1) {
  constexpr int PARTS = COLS ? 1 : Tcv<WT>::PARTS, NU = WT == kFP8 ? 4 : 2;
  // A fresh partial per iteration, added to acc in float32: the tensor cores' accumulation
  // truncates, so a long K accumulated in the MMAs drifts (measured: 3e-6 relative over 3072).
  float t[NM][4];
#pragma unroll
  for (int q = 0; q < NM; ++q) t[q][0] = t[q][1] = t[q][2] = t[q][3] = 0.f;
#pragma unroll
  for (int u = 0; u < NU; ++u) {
    uint4 bu[PARTS];
#pragma unroll
    for (int p = 0; p < PARTS; ++p)
      bu[p] = has_tok ? *reinterpret_cast<const uint4*>(bp + p * PS + 16 * (u ^ sw)) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the two MMA steps of unit u: j = 2u + h
      const int j = 2 * u + h;
#pragma unroll
      for (int q = 0; q < NM; ++q) {
        const uint4* wq = w + 4 * q;
        if constexpr (WT == kFP8) {  // step j: bytes 4j .. 4j + 3 of each row
          const uint32_t wa = word(wq[j >> 2], j & 3), wb = word(wq[2 + (j >> 2)], j & 3);
#if DSV3_TCV_ABLATE == 2  // measurement only (wrong numbers): the MMAs without the e4m3 widening
          const uint32_t A[4] = {wa & 0x3bff3bffu, wb & 0x3bff3bffu, (wa >> 1) & 0x3bff3bffu, (wb >> 1) & 0x3bff3bffu};
#else
          const uint32_t A[4] = {e4m3x2_h2(wa), e4m3x2_h2(wb), e4m3x2_h2(wa >> 16), e4m3x2_h2(wb >> 16)};
#endif
#pragma unroll
          for (int p = 0; p < PARTS; ++p) mma_f16(t[q], A, word(bu[p], 2 * h), word(bu[p], 2 * h + 1));
        } else {  // step j: bf16 values 4j .. 4j + 3 (words 2j, 2j + 1) of each row
          const uint32_t A[4] = {word(wq[j >> 1], (j & 1) * 2), word(wq[2 + (j >> 1)], (j & 1) * 2),
                                 word(wq[j >> 1], (j & 1) * 2 + 1), word(wq[2 + (j >> 1)], (j & 1) * 2 + 1)};
#pragma unroll
          for (int p = 0; p < PARTS; ++p) mma_bf16(t[q], A, word(bu[p], 2 * h), word(bu[p], 2 * h + 1));
        }
      }
    }
  }
#pragma unroll
  for (int q = 0; q < NM; ++q)
#pragma unroll
    for (int i = 0; i < 4; ++i)  // (e4m3: the weights' block scale times the token column's multiplier)
      acc[q][i] = WT == kFP8 ? fmaf(t[q][i], scale[q] * (i & 1 ? c1 : c0), acc[q][i]) : acc[q][i] + t[q][i];
}

#if DSV3_TRACE_BLOCKS
__device__ __forceinline__ unsigned long long& t_staged() {  // the block's staging time (shared memory)
  __shared__ unsigned long long t;
  return t;
}
// Two trace records for this block: (start, expert known) and (staged, end), marker lines 61000 + 10 stage;
// the records' y field is the block's slot y, its z field the SM the block ran on.
__device__ __forceinline__ void trace_block(int stage, int y, unsigned long long t0, unsigned long long t1) {
  TraceBuf* b = g_trace;
  if (!b) return;
  const unsigned long long t3 = global_ns();
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  const unsigned long long where =
      blockIdx.x | (unsigned long long)(y) << 24 | (unsigned long long)(smid) << 48;  // (y: the slot; z: the SM)
  unsigned long long slot = atomicAdd(&b->ticket, 2ull);
  unsigned long long* r = b->rec[slot % kTraceRecs];
  r[0] = t0, r[1] = t1, r[2] = unsigned(61000 + 10 * stage) | (g_trace_unit << 16), r[3] = where;
  r = b->rec[(slot + 1) % kTraceRecs];
  r[0] = t_staged(), r[1] = t3, r[2] = unsigned(61001 + 10 * stage) | (g_trace_unit << 16), r[3] = where;
}
#endif

// MODE 0: y = x · a; 1: y = silu(x · a) * (x · b); 2: as 0, then c's tiles to y2. Every warp of
// the block reaches the same __syncthreads; pdl_wait comes after the first weight loads.
template <int WT, bool ONE, int MODE>
__device__ void tcv_run(const TcvJob& J, int64_t tile_base, char* smem) {
  using T = Tcv<WT>;
  constexpr bool FUSED = MODE == 1;
  constexpr int NL = FUSED ? 8 : 4;  // 16-byte loads per lane per iteration
  // iterations in the register ring; the L2 prefetch size of the weight loads
  constexpr int NB = FUSED ? DSV3_TCV_NB_FUSED : ONE && WT == kFP8 ? DSV3_TCV_NB_PLAIN_ONE_FP8 : DSV3_TCV_NB_PLAIN;
  constexpr int PF = WT == kFP8 ? DSV3_TCV_L2PF_FP8 : DSV3_TCV_L2PF;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c4 = lane & 3;
  const int ks = J.ks;
  const int64_t tile = tile_base + warp / ks;
  const int slice = warp % ks;
  const int64_t ta = (J.a.rows + 15) / 16;
  const bool second = MODE == 2 && tile >= ta;
  const void* W = second ? J.c.w : J.a.w;
  const float* Ws = second ? J.c.s : J.a.s;
  const int64_t row0 = second ? J.c.row0 : J.a.row0, ld = second ? J.c.ld : J.a.ld, lds = second ? J.c.lds : J.a.lds,
                col0 = second ? J.c.col0 : J.a.col0, rows = second ? J.c.rows : J.a.rows;
  const int64_t r0 = (second ? tile - ta : tile) * 16;
  const int64_t K = J.a.cols;
  const int nit = int(K / T::KI);
  const bool live = r0 < rows;
  const int i0 = slice * nit / ks, i1 = live ? (slice + 1) * nit / ks : i0;
  constexpr int EB = WT == kBF16 ? 2 : 1;
  const int64_t ra = min(r0 + g, rows - 1), rb = min(r0 + g + 8, rows - 1);
  const char* pa = static_cast<const char*>(W) + ((row0 + ra) * ld + col0) * EB + 16 * c4;
  const char* pb = static_cast<const char*>(W) + ((row0 + rb) * ld + col0) * EB + 16 * c4;
  const char* qa = pa;
  const char* qb = pb;
  if constexpr (FUSED) {
    qa = static_cast<const char*>(J.b.w) + ((J.b.row0 + ra) * J.b.ld + J.b.col0) * EB + 16 * c4;
    qb = static_cast<const char*>(J.b.w) + ((J.b.row0 + rb) * J.b.ld + J.b.col0) * EB + 16 * c4;
  }
  int64_t ostep = 128;  // bytes from one iteration to the next
  int64_t half = 64;    // from a lane's first piece of a row to its second
#if DSV3_TCV_ORDER
  if (r0 + 16 <= rows && col0 == 0 && ld == K && (!FUSED || (J.b.col0 == 0 && J.b.ld == K))) {
    const char* ta = static_cast<const char*>(W) + (row0 + r0) * ld * EB;
    const char* tb = FUSED ? static_cast<const char*>(J.b.w) + (J.b.row0 + r0) * J.b.ld * EB : ta;
    if (DSV3_TCV_ORDER == 1) {
      pa = ta + g * 128 + 16 * c4, pb = pa + 8 * 128, qa = tb + g * 128 + 16 * c4, qb = qa + 8 * 128;
    } else {
      pa = ta + 16 * lane, pb = pa + 1024, qa = tb + 16 * lane, qb = qa + 1024, half = 512;
    }
    ostep = 16 * 128;
  }
#endif
  // act_off's two loads per row of one weight: a's (h = 0, r[0..3]) or, fused, b's (h = 1, r[4..7])
  auto load_half = [&](int i, uint4* r, int h) {
    const int64_t o = int64_t(i) * ostep;
    const char* x = h ? qa : pa;
    const char* y = h ? qb : pb;
    r += 4 * h;
    r[0] = ld_stream_tcv<PF>(x + o), r[1] = ld_stream_tcv<PF>(x + o + half);
    r[2] = ld_stream_tcv<PF>(y + o), r[3] = ld_stream_tcv<PF>(y + o + half);
  };
  auto load = [&](int i, uint4* r) {
    load_half(i, r, 0);
    if constexpr (FUSED) load_half(i, r, 1);
  };
  uint4 buf[NB][NL];
#pragma unroll
  for (int s = 0; s < NB; ++s)
    if (i0 + s < i1) load(i0 + s, buf[s]);
  pdl_wait();
  // [activation parts][e4m3: multipliers am [m][K / 128]][K-slice partials when ks > 1]
  const int64_t act_bytes = (T::PARTS * int64_t(J.m) * row_bytes<WT>(K) + 15) / 16 * 16;
  float* am = reinterpret_cast<float*>(smem + act_bytes);
  const int nkb = int(K / 128);
  stage_x<WT>(J, K, smem, am);
  __syncthreads();
#if DSV3_TRACE_BLOCKS
  if (threadIdx.x == 0) t_staged() = global_ns();
#endif
  const int64_t S = row_bytes<WT>(K), PS = int64_t(J.m) * S;
  // One token (COLS): B column p holds its part p (part p of token 0 is where token p's row
  // would be, PS = S), so a step's one MMA covers every part; the columns are summed at the end.
  constexpr bool COLS = ONE && DSV3_TCV_COLS;
  const bool has_tok = COLS ? g < T::PARTS : ONE ? g == 0 : g < J.m;
  const char* bsrc = smem + int64_t(has_tok ? g : 0) * S + (WT == kFP8 ? 64 : 32) * c4;
  const int sw = WT == kFP8 ? (c4 >> 1) & 1 : 0;  // act_off's unit swizzle
  // Scales of this tile's 128-row block (e4m3): one per iteration.
  const float* sa = WT == kFP8 ? Ws + ((row0 + r0) >> 7) * lds + (col0 >> 7) : nullptr;
  const float* sb = WT == kFP8 && FUSED ? J.b.s + ((J.b.row0 + r0) >> 7) * J.b.lds + (J.b.col0 >> 7) : nullptr;
  constexpr int NM = FUSED ? 2 : 1;
  float acc[NM][4];
#pragma unroll
  for (int q = 0; q < NM; ++q) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.f;
  for (int i = i0; i < i1; i += NB) {
#pragma unroll
    for (int s = 0; s < NB; ++s) {
      if (i + s < i1) {
        const int it = i + s;
        float sc[NM];
        sc[0] = WT == kFP8 ? __ldg(sa + it) : 1.f;
        if constexpr (FUSED) sc[NM - 1] = WT == kFP8 ? __ldg(sb + it) : 1.f;
        float c0 = 1.f, c1 = 1.f;  // the lane's two token columns' multipliers (e4m3)
        if constexpr (WT == kFP8) {
          c0 = am[min(2 * c4, J.m - 1) * nkb + it];
          c1 = am[min(2 * c4 + 1, J.m - 1) * nkb + it];
        }
#if DSV3_TCV_ABLATE == 1 || DSV3_TCV_ABLATE == 3  // measurement only (wrong numbers): the weight loads without the arithmetic
        uint32_t xx = 0;
#pragma unroll
        for (int u = 0; u < NL; ++u) xx ^= buf[s][u].x ^ buf[s][u].y ^ buf[s][u].z ^ buf[s][u].w;
        acc[0][0] += __uint_as_float(xx & 0x3fffffffu);
#else
        if constexpr (FUSED && NB == 1 && ONE && DSV3_TCV_STAGGER) {  // w1's MMAs, its next loads, then w3's
          const char* bp = bsrc + int64_t(it) * (WT == kFP8 ? 256 : 128);
          const float s0[1] = {sc[0]}, s1[1] = {sc[NM - 1]};
          mma_iter<WT, 1, COLS>(buf[s], bp, PS, sw, has_tok, reinterpret_cast<float(&)[1][4]>(acc[0]), s0, c0, c1);
          if (it + NB < i1) load_half(it + NB, buf[s], 0);
          mma_iter<WT, 1, COLS>(buf[s] + 4, bp, PS, sw, has_tok, reinterpret_cast<float(&)[1][4]>(acc[NM - 1]), s1, c0,
                                c1);
          if (it + NB < i1) load_half(it + NB, buf[s], 1);
          continue;
        }
        mma_iter<WT, NM, COLS>(buf[s], bsrc + int64_t(it) * (WT == kFP8 ? 256 : 128), PS, sw, has_tok, acc, sc, c0, c1);
#endif
        if (it + NB < i1) load(it + NB, buf[s]);
      }
    }
  }
  // The K slices of a tile, summed in slice order by its first warp (deterministic).
  if (ks > 1) {
    constexpr int NQ = FUSED ? 8 : 4;
    float* red = reinterpret_cast<float*>(smem + act_bytes + (WT == kFP8 ? am_bytes(J.m, K) : 0));
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      red[(warp * NQ + q) * 32 + lane] = acc[0][q];
      if constexpr (FUSED) red[(warp * NQ + 4 + q) * 32 + lane] = acc[NM - 1][q];
    }
    __syncthreads();
    if (slice == 0) {
      for (int s = 1; s < ks; ++s) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc[0][q] += red[((warp + s) * NQ + q) * 32 + lane];
          if constexpr (FUSED) acc[NM - 1][q] += red[((warp + s) * NQ + 4 + q) * 32 + lane];
        }
      }
    }
  }
  if (slice != 0 || !live) return;
  if constexpr (COLS) {  // token 0 = the sum of its parts' columns: 0 and 1 here, 2 in lane c4 = 1
#pragma unroll
    for (int q = 0; q < NM; ++q)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float sum = acc[q][2 * h] + acc[q][2 * h + 1];
        if constexpr (T::PARTS == 3) sum += __shfl_down_sync(0xffffffffu, acc[q][2 * h], 1);
        acc[q][2 * h] = sum;
      }
  }
  float* Y = second ? J.y2 : J.y;
  const int64_t ldy = second ? J.ldy2 : J.ldy;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = r0 + g + 8 * h;
    if (r >= rows) continue;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = 2 * c4 + e;
      if (t >= (ONE ? 1 : J.m)) continue;
      float v = acc[0][2 * h + e];
      if constexpr (FUSED) {
        float v3 = acc[NM - 1][2 * h + e];
        v = silu(v) * v3;
      }
      Y[t * ldy + r] = v;
    }
  }
}

// The job of this block's chunk of K (blockIdx.z; J.kc > 0).
template <int MODE>
__device__ __forceinline__ void take_chunk(TcvJob& J) {
  const int64_t z = blockIdx.z, k0 = z * J.kc, len = min(J.kc, J.a.cols - k0);
  J.a.col0 += k0, J.b.col0 += k0, J.c.col0 += k0;
  J.a.cols = J.b.cols = J.c.cols = len;
  J.x += k0;
  J.y += z * J.chunk_y;
  if (MODE == 2) J.y2 += z * J.chunk_y;
}

template <int WT, bool ONE, int MODE>
__global__ void __launch_bounds__(kTW * 32, 2) tcv_kernel(TcvJob J, GemvShift sh) {
  extern __shared__ __align__(16) char smem[];
  if (J.kc) take_chunk<MODE>(J);
  const int64_t b = blockIdx.y;
  J.x += b * sh.xs;
  J.y += b * sh.ys;
  J.a.row0 += b * sh.wrows;
  J.b.row0 += b * sh.wrows;
  tcv_run<WT, ONE, MODE>(J, int64_t(blockIdx.x) * (kTW / J.ks), smem);
  pdl_trigger();
}

// Stage 0 in chunks of K (blockIdx.z): w1's and w3's partial products apart, chunk z's at
// out + z * chunk_y, w3's `second` floats after w1's (chunk_sum applies the SwiGLU).
struct MoeChunks {
  int64_t kc = 0, chunk_y = 0, second = 0;
};

// blockIdx.y: an expert slot (launch_slot, expert_slot), as moe_gemv_kernel; TILES: a tile of
// the router's table (expert_tile), whose pair rows all read their tokens through the permutation.
template <int WT, bool ONE, bool CHUNKS = false, bool TILES = false>
__global__ void __launch_bounds__(kTW * 32, 2) tcv_moe_kernel(int stage, const DevExpert* __restrict__ table,
                                                              MoeSched s, const float* in, int64_t ldin, float* out,
                                                              int64_t ldout, int ks, MoeChunks ch) {
  extern __shared__ __align__(16) char smem[];
  int e;
  int64_t off, cnt;
#if DSV3_TRACE_BLOCKS
  const unsigned long long t0 = global_ns();
#endif
  const int y = TILES ? int(blockIdx.y) : launch_slot<ONE>(s, stage);
  if (TILES ? !expert_tile(s, stage, y, e, off, cnt) : !expert_slot<ONE>(s, stage, y, e, off, cnt)) return;
  const int32_t* tokens = TILES ? s.perm + off : slot_tokens(s, y, off);
#if DSV3_TRACE_BLOCKS
  const unsigned long long t1 = global_ns();
#endif
  TcvJob J;
  J.ks = ks;
  J.m = int(cnt);
  J.y = out + off * ldout, J.ldy = ldout;
  J.ldx = ldin;
  const int64_t tb = int64_t(blockIdx.x) * (kTW / ks);
  if (CHUNKS) {  // (stage 0)
    J.a = table[e].w1, J.b = J.c = table[e].w3;
    J.x = in, J.idx = tokens;
    J.y2 = J.y + ch.second, J.ldy2 = ldout;
    J.kc = ch.kc, J.chunk_y = ch.chunk_y;
    take_chunk<2>(J);
    tcv_run<WT, ONE, 2>(J, tb, smem);
  } else if (stage == 0) {
    J.a = table[e].w1, J.b = table[e].w3;
    J.x = in, J.idx = tokens;
    tcv_run<WT, ONE, 1>(J, tb, smem);
  } else {
    J.a = table[e].w2;
    J.x = in + off * ldin;
    tcv_run<WT, ONE, 0>(J, tb, smem);
  }
#if DSV3_TRACE_BLOCKS
  __syncthreads();
  if (threadIdx.x == 0) trace_block(stage, y, t0, t1);
#endif
  pdl_trigger();
}

constexpr size_t kMaxSmem = 200 * 1024;

size_t smem_bytes(int32_t t, int64_t K, int m, int ks, bool fused) {
  const int64_t S = t == kFP8 ? row_bytes<kFP8>(K) : row_bytes<kBF16>(K);
  const int parts = t == kFP8 ? Tcv<kFP8>::PARTS : Tcv<kBF16>::PARTS;
  const size_t act = (size_t(parts) * size_t(m) * size_t(S) + 15) / 16 * 16 + (t == kFP8 ? am_bytes(m, K) : 0);
  return act + (ks > 1 ? size_t(kTW) * (fused ? 8 : 4) * 32 * sizeof(float) : 0);
}

// Blocks per SM that the K split aims for, and the most warps per tile (measured on the H200).
constexpr int kTargetBlocksPerSm = 1;
constexpr int kKsMax = 8;

// Warps per tile: the fewest that give every SM the target blocks, at most one per iteration.
int choose_ks(int64_t tiles, int nit) {
  int best = 1;
  for (int ks : {1, 2, 4, 8}) {
    if (ks > nit || ks > kKsMax) break;
    best = ks;
    if ((tiles * ks + kTW - 1) / kTW >= kTargetBlocksPerSm * device_sms()) break;
  }
  return best;
}

int nit_of(int32_t t, int64_t K) { return int(K / (t == kFP8 ? Tcv<kFP8>::KI : Tcv<kBF16>::KI)); }

template <int WT, int MODE>
void launch_tcv(const Launch& L, TcvJob J, int batch, GemvShift sh) {
  const int64_t tiles = (J.a.rows + 15) / 16 + (MODE == 2 ? (J.c.rows + 15) / 16 : 0);
  const int64_t K = J.kc ? J.kc : J.a.cols, nc = J.kc ? (J.a.cols + J.kc - 1) / J.kc : 1;
  J.ks = choose_ks(tiles * batch * nc, nit_of(J.a.t, K));
  const size_t smem = smem_bytes(WT, K, J.m, J.ks, MODE == 1);
  const dim3 grid(cdiv(tiles * J.ks, kTW), unsigned(batch), unsigned(nc));
  auto go = [&](auto kernel) {
    allow_smem(kernel, smem);
    launch(L, kernel, grid, dim3(kTW * 32), smem, J, sh);
  };
  J.m == 1 ? go(tcv_kernel<WT, true, MODE>) : go(tcv_kernel<WT, false, MODE>);
}

template <int MODE>
void dispatch_tcv(const Launch& L, const TcvJob& J, int batch, GemvShift sh) {
  if (J.a.t == kFP8) launch_tcv<kFP8, MODE>(L, J, batch, sh);
  else launch_tcv<kBF16, MODE>(L, J, batch, sh);
}

bool bf16_ok(const Launch& L, int64_t m) { return L.tcv_bf16_min > 0 && m >= L.tcv_bf16_min; }

bool x_ok(const float* x, int64_t ldx, int64_t xs) {
  return reinterpret_cast<uintptr_t>(x) % 16 == 0 && ldx % 4 == 0 && xs % 4 == 0;
}

}  // namespace

bool tcv_ok(const DevLinear& w) {
  if (w.rows <= 0 || reinterpret_cast<uintptr_t>(w.w) % 16 != 0) return false;
  if (w.t == kBF16) return w.cols % Tcv<kBF16>::KI == 0 && w.ld % 8 == 0 && w.col0 % 8 == 0;
  // e4m3: iterations on scale blocks, 16-row tiles inside one 128-row block
  if (w.t == kFP8) return w.cols % Tcv<kFP8>::KI == 0 && w.ld % 16 == 0 && w.col0 % 128 == 0 && w.row0 % 16 == 0;
  return false;
}

static bool tcv_fits(const Launch& L, const DevLinear& w, int64_t m) {
  return m >= 1 && m <= L.tcv_max && m <= 8 && (w.t != kBF16 || bf16_ok(L, m)) &&
         !(w.t == kFP8 && L.fp8_linear_on_fma(m)) && tcv_ok(w) &&
         smem_bytes(w.t, w.cols, int(m), 8, true) <= kMaxSmem;
}

bool tcv_holds(int32_t wtype, int64_t K, int64_t m) {
  return m >= 1 && m <= 8 && smem_bytes(wtype, K, int(m), kKsMax, true) <= kMaxSmem;
}

// Chunks are sized for two blocks per multiprocessor (their activations at most kChunkSmem): the
// blocks of all chunks go out in one launch, and each stages only its chunk's activations.
constexpr size_t kChunkSmem = 96 * 1024;

int64_t tcv_chunk(int32_t wtype, int64_t K, int64_t m) {
  const int64_t ki = wtype == kFP8 ? Tcv<kFP8>::KI : Tcv<kBF16>::KI, its = K / ki;
  if (m < 1 || m > 8 || K < ki || K % ki != 0) return 0;
  if (tcv_holds(wtype, K, m)) return K;
  for (int64_t nc = 2; nc <= its; ++nc) {
    const int64_t kc = (its + nc - 1) / nc * ki;
    if (smem_bytes(wtype, kc, int(m), kKsMax, true) <= kChunkSmem) return kc;
  }
  return 0;
}

namespace {

__global__ void chunk_sum_kernel(const float* __restrict__ part, int nc, int64_t m, int64_t rows, bool swiglu,
                                 float* __restrict__ y, int64_t ldy) {
  pdl_wait();
  const int64_t n = m * rows, stride = swiglu ? 2 * n : n;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float a = 0.f, b = 0.f;
    for (int c = 0; c < nc; ++c) {
      a += part[c * stride + i];
      if (swiglu) b += part[c * stride + n + i];
    }
    y[(i / rows) * ldy + i % rows] = swiglu ? silu(a) * b : a;
  }
  pdl_trigger();
}

}  // namespace

void chunk_sum(const Launch& L, const float* part, int nc, int64_t m, int64_t rows, bool swiglu, float* y, int64_t ldy) {
  const int64_t n = m * rows;
  launch(L, chunk_sum_kernel, dim3(unsigned(std::min<int64_t>((n + 255) / 256, 4 * device_sms()))), dim3(256), 0, part,
         nc, m, rows, swiglu, y, ldy);
}

bool tcv_gemv(const Launch& L, const DevLinear& w, const DevLinear* w3, const ProductRows& io) {
  const int batch = io.batch;
  const GemvShift shift = io.shift;
  if (!tcv_fits(L, w, io.m) || !x_ok(io.x, io.ldx, shift.xs)) return false;
  if (w3 && (!tcv_ok(*w3) || w3->t != w.t || w3->rows != w.rows || w3->cols != w.cols)) return false;
  if (w.t == kFP8 && batch > 1 && shift.wrows % 16 != 0) return false;
  TcvJob J;
  J.a = w;
  J.b = w3 ? *w3 : w;
  J.x = io.x, J.ldx = io.ldx, J.idx = io.idx, J.m = int(io.m), J.y = io.y, J.ldy = io.ldy;
  if (w3) dispatch_tcv<1>(L, J, batch, shift);
  else dispatch_tcv<0>(L, J, batch, shift);
  return true;
}

bool tcv_gemv_chunks(const Launch& L, const DevLinear& w, const DevLinear* w2, const ProductRows& io, float* y2,
                     int64_t kc, int64_t chunk_y) {
  DevLinear one = w;  // (what one chunk asks of the kernel)
  one.cols = kc;
  if (kc <= 0 || io.batch != 1 || !tcv_fits(L, one, io.m) || !tcv_ok(w) || !x_ok(io.x, io.ldx, 0)) return false;
  if (w2 && (!tcv_ok(*w2) || w2->t != w.t || w2->cols != w.cols)) return false;
  TcvJob J;
  J.a = J.b = w;
  J.x = io.x, J.ldx = io.ldx, J.idx = io.idx, J.m = int(io.m), J.y = io.y, J.ldy = io.ldy;
  J.kc = kc, J.chunk_y = chunk_y;
  if (w2) {
    J.c = *w2, J.y2 = y2, J.ldy2 = w2->rows;
    dispatch_tcv<2>(L, J, 1, GemvShift{});
  } else {
    dispatch_tcv<0>(L, J, 1, GemvShift{});
  }
  return true;
}

bool tcv_gemv2(const Launch& L, const DevLinear& w, float* y, const DevLinear& w2, float* y2, const float* x,
               int64_t m, int64_t ldx) {
  if (ldx == 0) ldx = w.cols;
  if (!tcv_fits(L, w, m) || !tcv_ok(w2) || w2.t != w.t || w2.cols != w.cols || !x_ok(x, ldx, 0)) return false;
  TcvJob J;
  J.a = J.b = w;
  J.c = w2;
  J.x = x, J.ldx = ldx, J.m = int(m), J.y = y, J.ldy = w.rows, J.y2 = y2, J.ldy2 = w2.rows;
  dispatch_tcv<2>(L, J, 1, GemvShift{});
  return true;
}

int64_t moe_chunk_floats(int32_t wtype, int64_t K, int64_t n, int64_t P, int64_t ldout) {
  const int64_t kc = tcv_chunk(wtype, K, n);
  return kc == 0 || kc == K ? 0 : (K + kc - 1) / kc * 2 * P * ldout;
}

// An expert launch's block rows (gridDim.y) and the most tokens one takes: the launch slots of
// at most 8 tokens, or the router's tiles of 8 pairs (more tokens, MoeSched::tile_rows = 8).
struct MoeRows {
  int64_t rows, m;
  bool tiles;
};
static MoeRows moe_rows(const MoeSched& s) {
  const bool tiles = s.n > 8;
  return {tiles ? s.max_tiles() : s.max_slots(), tiles ? 8 : s.n, tiles};
}

// tcv_moe's stage 0 with K too long to stage whole: w1's and w3's tiles in one grid (MODE 2),
// K in chunks over blockIdx.z, into st.parts; then their sums, SwiGLU, into st.out.
static bool tcv_moe_chunks(const Launch& L, const MoeStage& st, const MoeSched& s) {
  const int32_t wtype = st.wtype;
  const MoeRows R = moe_rows(s);
  const int64_t K = st.ldin, kc = tcv_chunk(wtype, K, R.m);
  if (kc == 0 || kc == K) return false;
  const int64_t nc = (K + kc - 1) / kc, P = s.P();
  const int64_t row_tiles = 2 * ((st.max_rows + 15) / 16);
  const int ks = choose_ks(row_tiles * R.rows * nc, nit_of(wtype, kc));
  const size_t smem = smem_bytes(wtype, kc, int(R.m), ks, false);
  const MoeChunks ch{kc, 2 * P * st.ldout, P * st.ldout};
  const dim3 grid(cdiv(row_tiles * ks, kTW), unsigned(R.rows), unsigned(nc));
  auto go = [&](auto kernel) {
    allow_smem(kernel, smem);
    launch(L, kernel, grid, dim3(kTW * 32), smem, 0, st.table, s, st.in, st.ldin, st.parts, st.ldout, ks, ch);
  };
  if (wtype == kFP8) R.tiles ? go(tcv_moe_kernel<kFP8, false, true, true>) : go(tcv_moe_kernel<kFP8, false, true>);
  else R.tiles ? go(tcv_moe_kernel<kBF16, false, true, true>) : go(tcv_moe_kernel<kBF16, false, true>);
  chunk_sum(L, st.parts, int(nc), P, st.ldout, true, st.out, st.ldout);
  return true;
}

bool tcv_moe_tiles(const Launch& L, int32_t wtype, int64_t dim, int64_t inter) {
  const bool type_ok = wtype == kFP8 || (wtype == kBF16 && bf16_ok(L, 8));
  return L.tcv_max >= 8 && type_ok && tcv_chunk(wtype, dim, 8) > 0 && tcv_holds(wtype, inter, 8);
}

bool tcv_moe(const Launch& L, const MoeStage& st, const MoeSched& s) {
  const int32_t wtype = st.wtype;
  const int64_t K = st.ldin, max_rows = st.max_rows;  // x or h rows: as wide as the largest K of the stage
  const MoeRows R = moe_rows(s);
  if (R.tiles && s.tile_rows != 8) return false;
  if (R.m > L.tcv_max || !(wtype == kFP8 || (wtype == kBF16 && bf16_ok(L, R.m))) || !x_ok(st.in, K, 0)) return false;
  if (wtype == kFP8 && L.fp8_experts_on_fma(s.n)) return false;
  const int64_t row_tiles = (max_rows + 15) / 16;
  const int ks = choose_ks(row_tiles * R.rows, nit_of(wtype, K));
  const size_t smem = smem_bytes(wtype, K, int(R.m), ks, st.stage == 0);
  if (smem > kMaxSmem) return st.stage == 0 && st.parts && tcv_moe_chunks(L, st, s);
  const dim3 grid(cdiv(row_tiles * ks, kTW), unsigned(R.rows));
  auto go = [&](auto kernel) {
    allow_smem(kernel, smem);
    launch(L, kernel, grid, dim3(kTW * 32), smem, st.stage, st.table, s, st.in, st.ldin, st.out, st.ldout, ks, MoeChunks{});
  };
  if (R.tiles) {
    if (wtype == kFP8) go(tcv_moe_kernel<kFP8, false, false, true>);
    else go(tcv_moe_kernel<kBF16, false, false, true>);
    return true;
  }
  const bool one = s.n == 1;
  if (wtype == kFP8) one ? go(tcv_moe_kernel<kFP8, true>) : go(tcv_moe_kernel<kFP8, false>);
  else one ? go(tcv_moe_kernel<kBF16, true>) : go(tcv_moe_kernel<kBF16, false>);
  return true;
}

}  // namespace dsv3::cuda
