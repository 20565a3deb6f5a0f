// The prefill GEMM: bf16 activations (a high part and optionally the bf16 rounding of the
// remainder, split beforehand) times bf16 weights on tensor cores, float32 accumulation.
// mma.sync form: 64x128 output tiles, K in steps of 32 through a 4-stage cp.async pipeline,
// operands read from shared memory with ldmatrix (XOR-swizzled rows, no bank conflicts).
// wgmma form (sm_90a): the same tiles (or 128x128, a warpgroup per 64 rows), K in steps of 64
// through 3 stages in the hardware's 128-byte swizzle, m64n128k16 warpgroup MMAs reading both
// operands from shared memory.
// One launch covers a plain product or every active expert of a MoE stage (the router's
// tile table picks each block's expert and rows; with swapped operands its tokens are the MMA's N).
// FP8 weights (wgmma form only): e4m3 tiles land in a staging buffer, are widened to bf16
// (exactly) into the swizzled B tile, and each 128-K block's partial product is multiplied by its
// 128x128 block scale on the way into the float32 accumulator.
#include <algorithm>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/wgmma.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

// Template parameters: TM (64 or 128 rows) and WM (rows per warp, 32 or 64): 4 warps of WM x 64
// outputs; WG: sm_90a wgmma instead of mma.sync (TM 64: the 4 warps are one warpgroup issuing
// m64n128k16 from shared memory), K steps of 64 in 128-byte swizzled rows, 3 stages.
constexpr int TN = 128, TK = 32;  // TK: K step of the mma.sync form (and tc_ok's K granule)
template <bool WG>
__host__ __device__ constexpr int kstep() { return WG ? 64 : 32; }
// Stages: mma.sync 4; wgmma 3, or 4 when one MMA group stays in flight (ASYNC) without the lo part.
// A8 (e4m3 activations): 6 (loads 5 stages ahead).
template <bool WG, bool LO = true, bool ASYNC = false, bool A8 = false>
__host__ __device__ constexpr int stages() { return WG ? (A8 ? 6 : ASYNC && !LO ? 4 : 3) : 4; }
constexpr int kLdc = TN + 4;  // epilogue tile row
// Per stage A hi, A lo when LO, B (bf16), and with F8 the e4m3 B staging tile; with A8 the e4m3
// A and B tiles (128-byte rows) and the stage's activation scales; at least the epilogue's float
// tile; + alignment slack for wgmma (its buffers start on 1024 bytes).
template <int TM, bool WG, bool LO, bool ASYNC, bool F8 = false, bool A8 = false>
constexpr int smem_bytes() {
  const int stage = A8 ? (TM + TN) * 128 + TM * 4
                       : ((LO ? 2 : 1) * TM + TN) * kstep<WG>() * 2 + (F8 ? TN * kstep<WG>() : 0);
  const int pipe = stages<WG, LO, ASYNC, A8>() * stage, epi = TM * kLdc * 4;
  return (pipe > epi ? pipe : epi) + (WG ? 1024 : 0);
}

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// Element offset of (row, 8-element chunk) in a stage buffer. mma.sync ([rows][32]): the chunk
// index XORed with bits 1-2 of the row, so the 8 rows one ldmatrix reads hit distinct banks.
// wgmma ([rows][64], 128-byte rows): the hardware's 128-byte swizzle, chunk XOR (row % 8).
template <bool WG>
__device__ __forceinline__ int swz(int row, int chunk) {
  if (WG) return row * 64 + ((chunk ^ (row & 7)) << 3);
  return row * 32 + ((chunk ^ ((row >> 1) & 3)) << 3);
}

// e4m3 -> bf16 of 16 bytes (exact: every e4m3 value is a bf16), as two 8-element chunks.
__device__ __forceinline__ void e4m3x16_to_bf16(uint4 v, uint4& lo8, uint4& hi8) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = e4m3x2_bits(w[i] & 0xffffu), b = e4m3x2_bits(w[i] >> 16);
    const __nv_bfloat162 ha = __floats2bfloat162_rn(a.x, a.y), hb = __floats2bfloat162_rn(b.x, b.y);
    o[2 * i] = *reinterpret_cast<const uint32_t*>(&ha);
    o[2 * i + 1] = *reinterpret_cast<const uint32_t*>(&hb);
  }
  lo8 = make_uint4(o[0], o[1], o[2], o[3]);
  hi8 = make_uint4(o[4], o[5], o[6], o[7]);
}

// SW (wgmma form, 128 rows, grouped MoE stages): the weight tile is the MMA's A (a warpgroup per
// 64 weight rows) and the tile's tokens its N, rounded up to 32 (m64nNk16), so an expert's last,
// partly filled tile costs only the columns it has.
// A8 (FP8 weights, wgmma form): e4m3 activations (act_quant's bytes and scales, TcJob::a_s). Both
// tiles are e4m3 in 128-byte rows, one 128-K scale block per stage, loaded without widening;
// m64nNk32 e4m3 MMAs write each stage's partial product, which is added into the accumulator
// times the weight block's scale and each token's activation scale of that block.
template <int TM, int WM, bool WG, bool LO, bool ASYNC, bool F8 = false, bool SW = false, bool A8 = false>
__global__ void __launch_bounds__(TM / WM * 64) tc_gemm_kernel(TcJob j) {
  static_assert(!F8 || (WG && !ASYNC), "FP8 weights: the wgmma form without an in-flight group");
  static_assert(!A8 || (F8 && !LO), "e4m3 activations: FP8 weights, no lo part");
  // BK: K values per stage; BKU: a tile row in bf16-sized units; CPR: 16-byte chunks per tile row.
  constexpr int BK = A8 ? 128 : kstep<WG>(), BKU = A8 ? 64 : BK, CPR = A8 ? 8 : BK / 8,
                kS = stages<WG, LO, ASYNC, A8>();
  constexpr bool kWiden = F8 && !A8;  // e4m3 weights staged and widened to bf16
  // Loads run P stages ahead. ASYNC keeps the last wgmma group in flight, so the buffer a load
  // refills must be two iterations old: P = stages - 2.
  constexpr int P = WG && ASYNC ? kS - 2 : kS - 1;
  // F8: B rows of BK bytes in 16-byte chunks (BK / 16 per row) into the staging tile.
  constexpr int kThreads = TM / WM * 64, kAElems = TM * BKU, kBElems = TN * BKU,
                kBPer = TN * (kWiden ? BK / 16 : CPR) / kThreads, kAPer = TM * CPR / kThreads, MI = WM / 16;
  constexpr int kFElems = kWiden ? TN * BK / 2 : 0;  // the e4m3 staging tile, in bf16-sized units
  static_assert(!WG || kThreads == 2 * TM, "wgmma form: a warpgroup per 64 rows");
  static_assert(!WG || TM == 64 || !ASYNC, "wgmma form with 128 rows: no in-flight group");
  static_assert(!SW || (WG && TM == 128 && !ASYNC), "swapped operands: the wgmma form with 128 rows");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = WG ? reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023))
                           : smem_raw;
  pdl_wait();
  pdl_trigger();
  // ---- which tile
  int64_t m0, Mv, arow0;  // first job row, valid rows, row offset of the group (pair rows)
  DevLinear W0, W1;  // W1: SwiGLU's w3 (tile columns 64..127)
  // x: row tiles (fastest, so the blocks sharing a weight tile run together and it is read from
  // memory once), y: weight row tiles.
  int64_t n0 = int64_t(blockIdx.y) * (j.swiglu ? TN / 2 : TN);
  const unsigned mt = blockIdx.x;
  if (j.grouped) {
    if (int(mt) >= *j.n_tiles) return;
    const int e = j.tile_e[mt];
    m0 = j.tile_m0[mt];
    arow0 = j.off[e];
    Mv = imin(TM, j.cnt[e] - m0);
    const DevExpert& X = j.experts[e];
    W0 = j.stage == 0 ? X.w1 : X.w2;
    W1 = X.w3;
  } else {
    m0 = int64_t(mt) * TM;
    arow0 = 0;
    Mv = imin(TM, j.M - m0);
    W0 = j.w;
    W1 = j.w3;
  }
  float* cout = j.c;  // the plain output, or the pair's second
  int64_t ldc = j.ldc, ccol = j.col;
  if (j.w_pair.w) {
    const int64_t first = (j.w.rows + TN - 1) / TN * TN;  // row tiles of the first weight
    if (n0 >= first) n0 -= first, W0 = j.w_pair, cout = j.c_pair, ldc = j.ldc_pair, ccol = 0;
  }
  const int64_t N = W0.rows, K = W0.cols;
  if (n0 >= N) return;
  const int64_t bz = j.splits > 1 ? 0 : blockIdx.z;  // batch copy (z is the K split otherwise)
  constexpr int kAsz = A8 ? 1 : 2;  // bytes per activation
  const uint8_t* ahi = static_cast<const uint8_t*>(j.a_hi) + bz * j.shift.xs * kAsz;
  const uint8_t* alo = j.a_lo ? static_cast<const uint8_t*>(j.a_lo) + bz * j.shift.xs * kAsz : nullptr;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
  __nv_bfloat16* sbase = reinterpret_cast<__nv_bfloat16*>(smem);
  constexpr int kParts = LO ? 2 : 1;  // A hi (and lo)
  constexpr int kStage = kParts * kAElems + kBElems + kFElems;
  auto sA = [&](int st, int part) { return sbase + st * kStage + part * kAElems; };
  auto sB = [&](int st) { return sbase + st * kStage + kParts * kAElems; };
  auto sF = [&](int st) { return reinterpret_cast<uint8_t*>(sbase + st * kStage + kParts * kAElems + kBElems); };
  auto sS = [&](int st) { return reinterpret_cast<float*>(sbase + kS * kStage) + st * TM; };  // A8: scales

  // ---- loaders: A rows (2 chunks per thread per part), B rows (4 chunks per thread)
  const uint8_t* a_src[kAPer];  // byte addresses; k advances by BK activations
  bool a_ok[kAPer];
  int a_dst[kAPer];
  auto a_row = [&](int r) {
    int64_t row = arow0 + m0 + (r < Mv ? r : 0);
    return j.a_idx ? int64_t(j.a_idx[row]) : row;
  };
#pragma unroll
  for (int i = 0; i < kAPer; ++i) {
    const int c = tid + i * kThreads, r = c / CPR, ch = c % CPR;
    a_ok[i] = r < Mv;
    a_src[i] = ahi + a_row(r) * j.lda * kAsz + ch * 16;
    a_dst[i] = swz<WG>(r, ch);
  }
  // A8: thread r < TM loads tile row r's activation scale of each stage's 128-K block.
  const float* s_src = A8 && tid < TM ? j.a_s + a_row(tid) * j.ldas : nullptr;
  const bool s_ok = tid < Mv;
  const uint8_t* b_src[kBPer];  // byte addresses; k advances by BK elements of the weight's size
  bool b_ok[kBPer];
  int b_dst[kBPer];  // bf16: element offset in the B tile; F8: byte offset in the staging tile
  constexpr int kCPR = kWiden ? BK / 16 : CPR, kEsz = F8 ? 1 : 2;
#pragma unroll
  for (int i = 0; i < kBPer; ++i) {
    const int c = tid + i * kThreads, r = c / kCPR, ch = c % kCPR;
    const bool second = j.swiglu && r >= TN / 2;
    const DevLinear& W = second ? W1 : W0;
    const int64_t wr = second ? n0 + r - TN / 2 : n0 + r;
    b_ok[i] = wr < N;
    const int64_t rr = W.row0 + bz * j.shift.wrows + (b_ok[i] ? wr : 0);
    b_src[i] = static_cast<const uint8_t*>(W.w) + (rr * W.ld + W.col0) * kEsz + ch * 16;
    b_dst[i] = kWiden ? r * BK + ch * 16 : swz<WG>(r, ch);
  }
  const int64_t lo_off = alo ? alo - ahi : 0;  // bytes
  auto load_stage = [&](int st, int kt) {
    const int64_t k = int64_t(kt) * BK;
#pragma unroll
    for (int i = 0; i < kAPer; ++i) {
      cp_async16(smem_addr(sA(st, 0) + a_dst[i]), a_src[i] + k * kAsz, a_ok[i]);
      if (LO) cp_async16(smem_addr(sA(st, 1) + a_dst[i]), a_src[i] + lo_off + k * kAsz, a_ok[i]);
    }
    if (A8 && tid < TM) cp_async4(smem_addr(sS(st) + tid), s_src + kt, s_ok);
#pragma unroll
    for (int i = 0; i < kBPer; ++i) {
      if (kWiden) cp_async16(smem_addr(sF(st) + b_dst[i]), b_src[i] + k, b_ok[i]);
      else cp_async16(smem_addr(sB(st) + b_dst[i]), b_src[i] + k * kEsz, b_ok[i]);
    }
  };
  // F8: the staged e4m3 tile widened into the swizzled bf16 B tile (each thread its own chunks).
  auto widen_stage = [&](int st) {
#pragma unroll
    for (int i = 0; i < kBPer; ++i) {
      const int c = tid + i * kThreads, r = c / kCPR, ch = c % kCPR;
      uint4 lo8, hi8;
      e4m3x16_to_bf16(*reinterpret_cast<const uint4*>(sF(st) + r * BK + ch * 16), lo8, hi8);
      *reinterpret_cast<uint4*>(sB(st) + swz<WG>(r, 2 * ch)) = lo8;
      *reinterpret_cast<uint4*>(sB(st) + swz<WG>(r, 2 * ch + 1)) = hi8;
    }
  };
  // F8 block scales of the tile's weight rows (one 128-row block per half: w1 | w3 for SwiGLU).
  const float *sc0 = nullptr, *sc1 = nullptr;
  int64_t sc_col0 = 0;
  if (F8) {
    const DevLinear& Wb = j.swiglu ? W1 : W0;
    sc0 = W0.s + ((W0.row0 + bz * j.shift.wrows + n0) >> 7) * W0.lds;
    sc1 = Wb.s + ((Wb.row0 + bz * j.shift.wrows + (j.swiglu ? n0 : n0 + TN / 2)) >> 7) * Wb.lds;
    sc_col0 = W0.col0;
  }

  int kt0 = 0, nk = int(K / BK);
  if (j.splits > 1) {
    const int all = nk;
    kt0 = int(int64_t(all) * blockIdx.z / j.splits);
    nk = int(int64_t(all) * (blockIdx.z + 1) / j.splits) - kt0;
  }
#pragma unroll
  for (int s = 0; s < P; ++s) {
    if (s < nk) load_stage(s, kt0 + s);
    cp_async_commit();
  }
  float* ct = reinterpret_cast<float*>(smem);  // the epilogue's tile [TM][kLdc], over the stages
  if constexpr (WG) {
    // Stage kt in shared memory for every thread (and its cp.async writes visible to wgmma), and
    // the load of stage kt + P issued into the buffer whose wgmmas are done.
    auto open_stage = [&](int kt) {
      cp_async_wait<P - 1>();
      fence_proxy_async();
      __syncthreads();
      const int nx = kt + P;
      if (nx < nk) load_stage(nx % kS, kt0 + nx);
      cp_async_commit();
    };
    // NT: SW's MMA columns (the tile's tokens rounded up to 32), else 128 (the weight rows). NA
    // accumulator floats per thread.
    auto wg_main = [&](auto ntc) {
      constexpr int NT = decltype(ntc)::value, NA = SW ? NT / 2 : 64;
      float d[NA];
      // F8: the MMAs write the current 128-K block's partial product to dp, which is scaled into
      // d at the block's end (kt0 + kt odd) or the split's end.
      float dp[NA];
#pragma unroll
      for (int i = 0; i < NA; ++i) d[i] = 0.f;
      if constexpr (kWiden) {  // each thread widens the chunks it loaded itself: no barrier before
        cp_async_wait<P - 1>();
        if (nk > 0) widen_stage(0);
      }
      if constexpr (A8) {
        // Each stage is one 128-K scale block: its MMAs write the partial sum dp, which is added
        // into d times the weight block's scale and each token's scale. The weight scales are
        // read before the MMAs are issued, so their latency hides behind them (the wait below
        // is also a compiler barrier that no load moves across).
        const int g = lane >> 2, t = lane & 3;
        for (int kt = 0; kt < nk; ++kt) {
          const int64_t kb = (sc_col0 + int64_t(kt0 + kt) * BK) >> 7;
          const float s0 = sc0[kb], s1 = sc1[kb];
          open_stage(kt);
          const int st = kt % kS, wrow = (warp >> 2) * 64 * BKU;
          const uint64_t da = wg_desc(smem_addr(sA(st, 0) + (SW ? 0 : wrow))),
                         db = wg_desc(smem_addr(sB(st) + (SW ? wrow : 0)));
#pragma unroll
          for (int i = 0; i < NA; ++i) reg_fence(dp[i]);
          wg_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {  // +32 bytes of each row: +2 in the descriptor
            if constexpr (SW) wgmma_e4m3_64xN<NT>(dp, db + 2 * kk, da + 2 * kk, kk != 0);
            else wgmma_e4m3_64xN<128>(dp, da + 2 * kk, db + 2 * kk, kk != 0);
          }
          wg_commit_wait<0>();
#pragma unroll
          for (int i = 0; i < NA; ++i) reg_fence(dp[i]);
          const float* as = sS(st);
          // accumulator i: MMA row 16 warp + g (+ 8 for i & 2), column 8 (i / 4) + 2 t + (i & 1); the
          // tokens are the rows, or with SW the columns
#pragma unroll
          for (int i = 0; i < NA; ++i) {
            const float xs = SW ? as[(i >> 2) * 8 + 2 * t + (i & 1)] : as[warp * 16 + g + (i & 2) * 4];
            d[i] = fmaf(dp[i], ((SW ? warp < 4 : i < 32) ? s0 : s1) * xs, d[i]);
          }
        }
      } else {
        for (int kt = 0; kt < nk; ++kt) {
          open_stage(kt);
          // this warpgroup's 64 rows: of A (tokens), or with SW of B (weight rows; the MMA's A)
          const int st = kt % kS, wrow = (warp >> 2) * 64 * BKU;
          const uint64_t dh = wg_desc(smem_addr(sA(st, 0) + (SW ? 0 : wrow))),
                         dl = wg_desc(smem_addr(sA(st, 1) + (SW ? 0 : wrow))),
                         db = wg_desc(smem_addr(sB(st) + (SW ? wrow : 0)));
          float (&acc)[NA] = F8 ? dp : d;
          // first K step of a 128-K block
          const bool fresh = F8 && (kt == 0 || ((kt0 + kt) & 1) == 0);
#pragma unroll
          for (int i = 0; i < NA; ++i) reg_fence(acc[i]);
          wg_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {  // +32 bytes of each row (16 bf16 / 32 e4m3): +2 in the descriptor
            if constexpr (SW) {
              wgmma_64xN<NT>(acc, db + 2 * kk, dh + 2 * kk, !(fresh && kk == 0));
              if (LO) wgmma_64xN<NT>(acc, db + 2 * kk, dl + 2 * kk, true);
            } else {
              wgmma_64x128x16(acc, dh + 2 * kk, db + 2 * kk, !(fresh && kk == 0));
              if (LO) wgmma_64x128x16(acc, dl + 2 * kk, db + 2 * kk);
            }
          }
          if constexpr (F8) {  // widen the next stage while the tensor cores work on this one
            wg_commit_wait<1>();  // commit only: the group stays in flight
            if (kt + 1 < nk) {
              cp_async_wait<P - 1>();  // stage kt + 1 (this thread's chunks) landed
              widen_stage((kt + 1) % kS);
            }
            wg_wait<0>();
          } else {
            wg_commit_wait<ASYNC ? 1 : 0>();
          }
#pragma unroll
          for (int i = 0; i < NA; ++i) reg_fence(acc[i]);
          if constexpr (F8) {
            if (((kt0 + kt) & 1) == 1 || kt == nk - 1) {
              const int64_t kb = (sc_col0 + int64_t(kt0 + kt) * BK) >> 7;
              const float s0 = sc0[kb], s1 = sc1[kb];
              // weight rows 0-63 of the tile take s0, 64-127 s1: SW by warpgroup, else columns 8 (i / 4) + ...
#pragma unroll
              for (int i = 0; i < NA; ++i) d[i] = fmaf(dp[i], (SW ? warp < 4 : i < 32) ? s0 : s1, d[i]);
            }
          }
        }
      }
      wg_wait<0>();
#pragma unroll
      for (int i = 0; i < NA; ++i) reg_fence(d[i]);
      cp_async_wait<0>();
      __syncthreads();
      // accumulator of warp w (warpgroup w / 4 holds MMA rows 64 (w / 4) ..): MMA rows 16w + g
      // (+ 8), MMA columns 8 jn + 2t (+ 1); with SW the rows are weight rows and the columns
      // tokens, so they go to ct transposed
      const int g = lane >> 2, t = lane & 3;
#pragma unroll
      for (int jn = 0; jn < NA / 4; ++jn) {
        const int r = warp * 16 + g, c = jn * 8 + 2 * t;
        auto put = [&](int row, int col, float v) { ct[SW ? col * kLdc + row : row * kLdc + col] = v; };
        put(r, c, d[4 * jn]);
        put(r, c + 1, d[4 * jn + 1]);
        put(r + 8, c, d[4 * jn + 2]);
        put(r + 8, c + 1, d[4 * jn + 3]);
      }
    };
    if constexpr (SW) {
      switch ((Mv + 31) / 32) {
        case 1: wg_main(std::integral_constant<int, 32>{}); break;
        case 2: wg_main(std::integral_constant<int, 64>{}); break;
        case 3: wg_main(std::integral_constant<int, 96>{}); break;
        default: wg_main(std::integral_constant<int, 128>{}); break;
      }
    } else {
      wg_main(std::integral_constant<int, 128>{});
    }
  } else {
    float acc[MI][8][4];
#pragma unroll
    for (int a = 0; a < MI; ++a)
#pragma unroll
      for (int b = 0; b < 8; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;
    // ldmatrix lanes: A rows (lane % 16) at chunk (lane / 16); B: two n-fragments per x4.
    const int a_r = lane & 15, a_c = lane >> 4;
    const int b_r = (lane & 7) + ((lane >> 4) << 3), b_c = (lane >> 3) & 1;
    for (int kt = 0; kt < nk; ++kt) {
      cp_async_wait<kS - 2>();
      __syncthreads();
      const int nx = kt + kS - 1;
      if (nx < nk) load_stage(nx % kS, kt0 + nx);
      cp_async_commit();
      const int st = kt % kS;
      const __nv_bfloat16* A0 = sA(st, 0);
      const __nv_bfloat16* A1 = sA(st, 1);
      const __nv_bfloat16* B = sB(st);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        uint32_t ah[MI][4], al[MI][4], bf[4][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          const int r = wm * WM + mi * 16 + a_r;
          ldmatrix_x4(ah[mi], smem_addr(A0 + swz<WG>(r, kk * 2 + a_c)));
          if (LO) ldmatrix_x4(al[mi], smem_addr(A1 + swz<WG>(r, kk * 2 + a_c)));
        }
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) {
          const int r = wn * 64 + nj * 16 + b_r;
          ldmatrix_x4(bf[nj], smem_addr(B + swz<WG>(r, kk * 2 + b_c)));
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int ni = 0; ni < 8; ++ni) {
            const uint32_t b0 = bf[ni >> 1][(ni & 1) * 2], b1 = bf[ni >> 1][(ni & 1) * 2 + 1];
            mma_bf16(acc[mi][ni], ah[mi], b0, b1);
            if (LO) mma_bf16(acc[mi][ni], al[mi], b0, b1);
          }
      }
    }
    cp_async_wait<0>();
    __syncthreads();
    // ---- epilogue through shared memory: tile [TM][128] float32
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < 8; ++ni) {
        const int r = wm * WM + mi * 16 + g, c = wn * 64 + ni * 8 + 2 * t;
        ct[r * kLdc + c] = acc[mi][ni][0];
        ct[r * kLdc + c + 1] = acc[mi][ni][1];
        ct[(r + 8) * kLdc + c] = acc[mi][ni][2];
        ct[(r + 8) * kLdc + c + 1] = acc[mi][ni][3];
      }
  }
  __syncthreads();
  if (j.swiglu) {  // out[row, n0 + c] = silu(w1 row) * (w3 row) as bf16 hi (+ lo)
    const int64_t nv = imin(TN / 2, N - n0);
    for (int e = tid; e < TM * TN / 2; e += kThreads) {
      const int r = e / (TN / 2), c = e % (TN / 2);
      if (r >= Mv || c >= nv) continue;
      const float v = silu(ct[r * kLdc + c]) * ct[r * kLdc + TN / 2 + c];
      const int64_t orow = arow0 + m0 + r, oi = orow * j.ldo + n0 + c;
      if (j.o_f32) static_cast<float*>(j.o_hi)[oi] = v;
      else split_bf16(v, static_cast<__nv_bfloat16*>(j.o_hi), static_cast<__nv_bfloat16*>(j.o_lo), oi);
    }
  } else {
    const int64_t nv = imin(TN, N - n0);
    if (j.splits > 1) {
      float* wz = j.ws + int64_t(blockIdx.z) * j.M * N;
      for (int e = tid; e < TM * TN; e += kThreads) {
        const int r = e / TN, c = e % TN;
        if (r < Mv && c < nv) wz[(m0 + r) * N + n0 + c] = ct[r * kLdc + c];
      }
      return;
    }
    float* cb = cout + bz * j.shift.ys;
    for (int e = tid; e < TM * TN; e += kThreads) {
      const int r = e / TN, c = e % TN;
      if (r >= Mv || c >= nv) continue;
      const int64_t orow = arow0 + m0 + r;
      cb[orow * ldc + ccol + n0 + c] = ct[r * kLdc + c];
    }
  }
}

// c[i * ldc + col + r] = sum over the splits of ws[z, i, r].
__global__ void splitk_sum_kernel(const float* __restrict__ ws, int splits, int64_t M, int64_t N, float* c, int64_t ldc,
                                  int64_t col) {
  pdl_wait();
  pdl_trigger();
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < M * N; e += int64_t(gridDim.x) * blockDim.x) {
    float v = 0.f;
    for (int z = 0; z < splits; ++z) v += ws[z * M * N + e];
    const int64_t i = e / N, r = e - i * N;
    c[i * ldc + col + r] = v;
  }
}

// hi = bf16(x), lo = bf16(x - hi) for rows of `cols` floats `ldx` apart (row r: x's row idx[r]
// where idx is given), into [rows, cols].
__global__ void split_rows_kernel(const float* __restrict__ x, const int32_t* __restrict__ idx, int64_t rows,
                                  int64_t cols, int64_t ldx, __nv_bfloat16* __restrict__ hi,
                                  __nv_bfloat16* __restrict__ lo) {
  pdl_wait();
  pdl_trigger();
  const int64_t total = rows * cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols, xr = idx ? int64_t(idx[r]) : r;
    split_bf16(x[xr * ldx + c], hi, lo, i);
  }
}

// The same split, 8 columns per thread: two float4 loads, one 16-byte store per part (cols and
// ldx multiples of 8, every pointer 16-byte aligned: split_rows checks).
__global__ void split_rows8_kernel(const float* __restrict__ x, const int32_t* __restrict__ idx, int64_t rows,
                                   int64_t cols, int64_t ldx, __nv_bfloat16* __restrict__ hi,
                                   __nv_bfloat16* __restrict__ lo) {
  pdl_wait();
  pdl_trigger();
  const int64_t cpr = cols / 8, total = rows * cpr;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cpr, c = (i - r * cpr) * 8;
    const float* xr = x + (idx ? int64_t(idx[r]) : r) * ldx;
    const float4 a = *reinterpret_cast<const float4*>(xr + c), b = *reinterpret_cast<const float4*>(xr + c + 4);
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    __align__(16) __nv_bfloat16 h[8], l[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) split_bf16(v[u], h, lo ? l : nullptr, u);
    *reinterpret_cast<uint4*>(hi + r * cols + c) = *reinterpret_cast<const uint4*>(h);
    if (lo) *reinterpret_cast<uint4*>(lo + r * cols + c) = *reinterpret_cast<const uint4*>(l);
  }
}

// One block per score row; see causal_softmax_rows.
__global__ void causal_softmax_kernel(float* S, int64_t ld, int64_t Lk, const DevPos* __restrict__ pos, int64_t i0,
                                      int H) {
  __shared__ float red[33];
  pdl_wait();
  pdl_trigger();
  const int64_t r = blockIdx.x;
  float* row = S + r * ld;
  const int64_t len = int64_t(pos[i0 + r / H].pos) + 1;
  float m = -INFINITY;
  for (int64_t t = threadIdx.x; t < len; t += blockDim.x) m = fmaxf(m, row[t]);
  m = block_max(m, red);
  float sum = 0.f;
  for (int64_t t = threadIdx.x; t < len; t += blockDim.x) {
    const float e = expf(row[t] - m);
    row[t] = e;
    sum += e;
  }
  sum = block_sum(sum, red);
  const float inv = 1.f / sum;
  for (int64_t t = threadIdx.x; t < Lk; t += blockDim.x) row[t] = t < len ? row[t] * inv : 0.f;
}

}  // namespace

void causal_softmax_rows(const Launch& L, float* S, int64_t rows, int64_t ld, int64_t Lk, const DevPos* pos,
                         int64_t i0, int H) {
  launch(L, causal_softmax_kernel, dim3(unsigned(rows)), dim3(256), 0, S, ld, Lk, pos, i0, H);
}

bool tc_ok(const DevLinear& w) {
  return w.t == kBF16 && w.cols > 0 && w.cols % TK == 0 && w.ld % 8 == 0 && w.col0 % 8 == 0 &&
         reinterpret_cast<uintptr_t>(w.w) % 16 == 0;
}

bool tc_ok_fp8(const DevLinear& w) {
  return w.t == kFP8 && w.cols > 0 && w.cols % 64 == 0 && w.ld % 16 == 0 && w.col0 % 128 == 0 &&
         w.row0 % 128 == 0 && reinterpret_cast<uintptr_t>(w.w) % 16 == 0;
}

namespace {

template <int TM, int WM, bool WG, bool LO, bool ASYNC, bool F8 = false, bool SW = false, bool A8 = false>
void tc_launch_lo(const Launch& L, const TcJob& j, int64_t grid_m, int64_t max_n, int batch) {
  constexpr size_t smem = size_t(smem_bytes<TM, WG, LO, ASYNC, F8, A8>());
  allow_smem(tc_gemm_kernel<TM, WM, WG, LO, ASYNC, F8, SW, A8>, smem);
  const int64_t tn = j.swiglu ? TN / 2 : TN;
  launch(L, tc_gemm_kernel<TM, WM, WG, LO, ASYNC, F8, SW, A8>,
         dim3(unsigned(grid_m), cdiv(max_n, tn), unsigned(j.splits > 1 ? j.splits : batch)), dim3(TM / WM * 64), smem,
         j);
}
template <int TM, int WM, bool WG>
void tc_launch(const Launch& L, const TcJob& j, int64_t grid_m, int64_t max_n, int batch) {
  if constexpr (WG && TM == 128) {
    if (j.a_s) {  // e4m3 activations (tc_gemm checked the rest)
      if (j.swap) tc_launch_lo<TM, WM, WG, false, false, true, true, true>(L, j, grid_m, max_n, batch);
      else tc_launch_lo<TM, WM, WG, false, false, true, false, true>(L, j, grid_m, max_n, batch);
      return;
    }
    if (j.swap) {
      if (j.fp8) {
        if (j.a_lo) tc_launch_lo<TM, WM, WG, true, false, true, true>(L, j, grid_m, max_n, batch);
        else tc_launch_lo<TM, WM, WG, false, false, true, true>(L, j, grid_m, max_n, batch);
      } else {
        if (j.a_lo) tc_launch_lo<TM, WM, WG, true, false, false, true>(L, j, grid_m, max_n, batch);
        else tc_launch_lo<TM, WM, WG, false, false, false, true>(L, j, grid_m, max_n, batch);
      }
      return;
    }
  }
  if constexpr (WG) {
    if (j.fp8) {
      if (j.a_lo) tc_launch_lo<TM, WM, WG, true, false, true>(L, j, grid_m, max_n, batch);
      else tc_launch_lo<TM, WM, WG, false, false, true>(L, j, grid_m, max_n, batch);
      return;
    }
    if constexpr (TM == 64) {
      if (j.wg_async) {
        if (j.a_lo) tc_launch_lo<TM, WM, WG, true, true>(L, j, grid_m, max_n, batch);
        else tc_launch_lo<TM, WM, WG, false, true>(L, j, grid_m, max_n, batch);
        return;
      }
    }
  }
  if (j.a_lo) tc_launch_lo<TM, WM, WG, true, false>(L, j, grid_m, max_n, batch);
  else tc_launch_lo<TM, WM, WG, false, false>(L, j, grid_m, max_n, batch);
}

}  // namespace

void tc_gemm(const Launch& L, const TcJob& j, int64_t grid_m, int64_t max_n, int batch) {
  if (j.splits > 1) DSV3_CHECK(batch == 1 && !j.grouped && !j.swiglu && j.ws, "split-K: plain single products only");
  if (j.w_pair.w)
    DSV3_CHECK(batch == 1 && j.splits == 1 && !j.grouped && !j.swiglu && j.c_pair && j.w_pair.cols == j.w.cols &&
                   j.w_pair.t == j.w.t && max_n == tc_pair_rows(j),
               "tc_gemm pair: two plain products of the same activations and weight type, max_n tc_pair_rows");
  DSV3_CHECK(!j.fp8 || j.wgmma, "FP8 weights in the pipelined kernel: wgmma form only");
  DSV3_CHECK(!j.a_s || (j.fp8 && j.tm == 128 && !j.a_lo && batch == 1 && j.w.cols % 128 == 0 && j.ldas * 128 == j.lda),
             "e4m3 activations: FP8 weights in the wgmma form, 128-row tiles, no lo part, one product, K % 128 == 0, "
             "a scale per 128 columns");
  DSV3_CHECK(!j.swap || (j.wgmma && j.tm == 128 && j.grouped && !j.wg_async),
             "swapped operands: grouped MoE stages in the wgmma form with 128-row tiles");
  if (j.wgmma) {
    DSV3_CHECK(j.tm == 64 || (j.tm == 128 && !j.wg_async), "the wgmma form: 64-row tiles, or 128 without wg_async");
    if (j.tm == 128) tc_launch<128, 32, true>(L, j, grid_m, max_n, batch);
    else tc_launch<64, 32, true>(L, j, grid_m, max_n, batch);
  } else if (j.tm == 128) {
    tc_launch<128, 64, false>(L, j, grid_m, max_n, batch);
  } else {
    tc_launch<64, 32, false>(L, j, grid_m, max_n, batch);
  }
  if (j.splits > 1) {
    const int64_t total = j.M * j.w.rows;
    launch(L, splitk_sum_kernel, dim3(unsigned(std::min<int64_t>((total + 255) / 256, 132 * 8))), dim3(256), 0,
           static_cast<const float*>(j.ws), j.splits, j.M, j.w.rows, j.c, j.ldc, j.col);
  }
}

int64_t tc_out_tiles(int64_t M, int64_t N, bool swiglu, int tm) {
  return (M + tm - 1) / tm * ((N + (swiglu ? TN / 2 : TN) - 1) / (swiglu ? TN / 2 : TN));
}

int64_t tc_tiles(int64_t M, int tm) { return (M + tm - 1) / tm; }

int64_t tc_pair_rows(const TcJob& j) { return (j.w.rows + TN - 1) / TN * TN + j.w_pair.rows; }

void split_rows(const Launch& L, const float* x, int64_t rows, int64_t cols, int64_t ldx, void* hi, void* lo,
                const int32_t* idx) {
  const bool v8 = cols % 8 == 0 && ldx % 4 == 0 &&
                  ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(hi) | reinterpret_cast<uintptr_t>(lo)) & 15) == 0;
  if (v8) {
    const int64_t total = rows * cols / 8;
    const unsigned blocks = unsigned(std::min<int64_t>((total + 255) / 256, 132 * 8));
    launch(L, split_rows8_kernel, dim3(blocks), dim3(256), 0, x, idx, rows, cols, ldx,
           static_cast<__nv_bfloat16*>(hi), static_cast<__nv_bfloat16*>(lo));
    return;
  }
  const int64_t total = rows * cols;
  const unsigned blocks = unsigned(std::min<int64_t>((total + 255) / 256, 132 * 16));
  launch(L, split_rows_kernel, dim3(blocks), dim3(256), 0, x, idx, rows, cols, ldx, static_cast<__nv_bfloat16*>(hi),
         static_cast<__nv_bfloat16*>(lo));
}

}  // namespace dsv3::cuda
