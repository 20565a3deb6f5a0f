// The grouped MoE stages with swapped operands, weights as the wgmma's A and each tile's tokens its
// N, on a persistent, warp-specialized kernel: FP8 GEMM mode's (e4m3 experts, e4m3 activations
// with a scale per token and 128-K block) and fast mode's bf16 experts (bf16 activations, one
// pass). tc_gemm_kernel's swapped forms (kernels_tc.cu) stay its twins.
//
// Clusters of two blocks, one cluster per two SMs, work through the launch's units in turn: a unit
// is a token tile and two neighbouring weight tiles, one per block of the cluster (token tiles
// fastest, so the clusters running at once share weight tiles and read them from memory once).
// Each K block of a unit (128 e4m3 or 64 bf16 values: rows of 128 bytes) goes through a ring of
// kStages shared-memory stages: the block's
// producer thread loads its own weight tile by TMA (one box: with SwiGLU a 4-D tensor map
// interleaves w1 and w3 rows in groups of 8) and half the token tile's 32-row boxes, multicast to
// both blocks of the cluster, so each token byte crosses from L2 once per two weight tiles; the
// tokens come in pair order (act_quant_rows, split_rows with rows), so TMA can load them. With e4m3
// the producer warps copy the tokens' scales with cp.async. A stage is full when this block's weights, both halves
// of the tokens and the scales have landed; it is empty when the consumers of both blocks are
// done with it (the multicast writes into both). Warps 0-7 are two consumer warpgroups of 64 weight rows each: a
// warpgroup issues its four MMAs (m64nNk32 e4m3 or m64nNk16 bf16); with e4m3 it adds the partial
// product into its float32 accumulator times the weight block's and each token's scale, with bf16
// the MMAs accumulate; then it marks the stage empty in both blocks. The epilogue writes from
// registers (each thread holds the w1 and w3 rows of its outputs; bf16 SwiGLU outputs as bf16).
// The products, the scale factors and the order of every float32 sum are the twin's.
#include <cuda.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/wgmma.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

constexpr int kStages = 6;
constexpr int kRows = 128, kToks = 128;               // weight rows and tokens per tile
constexpr int kTileB = kRows * 128;                    // one operand tile: 128 rows of 128 e4m3 bytes
constexpr int kStageB = 2 * kTileB + 1024;             // weights | tokens | token scales (padded to 1024)
constexpr int kMapsPerExpert = 2;  // moe_persist_tmaps: w1 | w3, then w2
constexpr int kConsumers = 256, kProducers = 128, kThreads = kConsumers + kProducers;
// Registers per thread: the launch allows 65536 / 384 (168); the producer warpgroup gives most of
// its share to the consumers, whose 128-token tiles hold 64 accumulator and 64 partial-sum floats.
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
static_assert(kProducers * kProducerRegs + kConsumers * kConsumerRegs <= 65536, "the register file");
// After the ring's barriers: the two barriers of the quantised output's exchange (quant_out), then
// its floats: the warps' maxima [8][kToks], this block's [kToks], the other block's [kToks].
constexpr int kXchgFloats = 10 * kToks;
constexpr size_t kSmem = size_t(kStages) * kStageB + 2 * kStages * 8 + 16 + kXchgFloats * 4 + 1024;  // + alignment

// This warpgroup's registers per thread, lowered or raised (every thread of the warpgroup runs it).
template <int N>
__device__ __forceinline__ void set_max_regs_dec() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void set_max_regs_inc() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
__device__ __forceinline__ void mbar_init(uint32_t bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// One arrival once every cp.async this thread issued before has landed (the barrier counts it).
__device__ __forceinline__ void mbar_arrive_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// One arrival that also expects `bytes` more of asynchronous (TMA) writes in this phase.
__device__ __forceinline__ void mbar_arrive_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// The box at (c0 = column, c1 = row) of a 2-D tensor map in global memory into shared memory at
// dst, counted on the barrier's transaction bytes.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int c0, int c1, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
#endif
}
// The box at (c0, 0, 0, c3) of a 4-D tensor map (moe_persist_tmaps' w1 | w3 interleave).
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* map, int c0, int c3, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(0), "r"(c3), "r"(bar)
      : "memory");
#endif
}
// tma_load_2d into the same offsets of every block of the cluster in `mask`, each block's barrier
// at bar's offset counting the bytes it receives.
__device__ __forceinline__ void tma_load_2d_mc(uint32_t dst, const void* map, int c0, int c1, uint32_t bar,
                                               uint16_t mask) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
      "%3}], [%4], %5;\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
      : "memory");
#endif
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}
// Every thread of both blocks of the cluster (with release / acquire of shared memory).
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
#endif
}
// One arrival on the barrier at bar's offset in block `rank` of the cluster. Its default
// (CTA-scope release) semantics suffice for the empty barriers: what the consumers read of a stage
// has reached their registers (their MMAs waited for, their scale loads used) before they arrive,
// and the async-proxy writes that refill it are issued only after the phase completes. A
// cluster-scope release here cost a memory barrier per arrival (Nsight Compute: "membar" stalls
// at 5 cycles per issued instruction, bench/results/2026-12-07-h100-cluster-moe).
__device__ __forceinline__ void mbar_arrive_in(uint32_t bar, uint32_t rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
#endif
}
// Until the barrier's phase of this parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// The same with cluster-scope acquire: the other block's writes into this one, released by its
// arrivals, are seen after it.
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred p;\nWAITC_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAITC_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}
// One arrival on the barrier at bar's offset in block `rank`, releasing this thread's earlier
// writes at cluster scope (the quantised output's exchange: its stores into that block).
__device__ __forceinline__ void mbar_arrive_release_in(uint32_t bar, uint32_t rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
#endif
}
// v into the float at `addr`'s offset of block `rank`'s shared memory.
__device__ __forceinline__ void st_cluster(uint32_t addr, uint32_t rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(remote), "f"(v) : "memory");
#endif
}
// The two consumer warpgroups (named barrier 1; the producers never wait on it).
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumers) : "memory"); }


// One (token tile, weight tile) pair of the launch, as both roles see it: unit w's token tile and
// this block's weight tile of the unit (2 (w / n_tiles) + the block's rank; with an odd number of
// weight tiles the last unit's second lies past the rows: TMA fills it with zeros, nothing is written).
struct Pair {
  bool run;          // false: an empty token tile
  int e;             // the expert
  int64_t m0, arow0;  // the token tile's first pair row within its expert, the expert's first pair row
  int Mv;            // tokens in the tile
  int64_t n0, N, K;  // first weight row (SwiGLU: first output), the stage's rows and K
  DevLinear W0, W1;  // w1 | w2, and w3 (SwiGLU)
};

__device__ __forceinline__ Pair pair_of(const TcJob& j, int64_t w, int64_t n_tiles) {
  Pair p;
  const int64_t mt = w % n_tiles, nt = 2 * (w / n_tiles) + cluster_rank();
  const int e = j.tile_e[mt];
  p.e = e;
  p.m0 = j.tile_m0[mt];
  p.arow0 = j.off[e];
  p.Mv = int(min(int64_t(kToks), int64_t(j.cnt[e]) - p.m0));
  const DevExpert& X = j.experts[e];
  p.W0 = j.stage == 0 ? X.w1 : X.w2;
  p.W1 = X.w3;
  p.N = p.W0.rows, p.K = p.W0.cols;
  p.n0 = nt * (j.swiglu ? kRows / 2 : kRows);
  p.run = p.Mv > 0;
  return p;
}

// The producer warpgroup: every unit's K blocks into the ring. Its first thread issues, per stage,
// the expectation of the stage's bytes (this block's weight tile and the whole token tile), the
// weight tile's TMA and this block's token boxes (32 rows each: box b from rank b % 2), multicast to
// both blocks. Thread p copies token p's scale by cp.async, which arrives on the stage's barrier
// when it lands (every producer thread arrives, with or without a copy). Before reusing a stage
// the producers wait until the consumers of both blocks have emptied it.
template <bool BF>
__device__ void produce(const TcJob& j, const CUtensorMap* tok, int64_t total, int64_t n_tiles, uint8_t* smem,
                        uint32_t full, uint32_t empty) {
  constexpr int KB = BF ? 64 : 128;  // K values per block
  const int pt = int(threadIdx.x) - kConsumers;
  const uint32_t rank = cluster_rank();
  int it = 0;
  for (int64_t w = int64_t(blockIdx.x) / 2; w < total; w += int64_t(gridDim.x) / 2) {
    const Pair p = pair_of(j, w, n_tiles);
    if (!p.run) continue;
    const int NT = (p.Mv + 31) / 32 * 32;
    const CUtensorMap* maps = static_cast<const CUtensorMap*>(j.tmaps) + kMapsPerExpert * p.e;
    const int64_t row0 = p.arow0 + p.m0;  // the tile's first row of the pair-ordered tokens
    const float* sp = BF ? nullptr : j.a_s + (row0 + min(pt, p.Mv - 1)) * j.ldas;
    const int nk = int(p.K / KB);
    for (int kt = 0; kt < nk; ++kt, ++it) {
      const int st = it % kStages;
      if (it >= kStages) mbar_wait(empty + 8 * st, unsigned((it / kStages - 1) & 1));
      uint8_t* sw = smem + st * kStageB;
      uint8_t* sx = sw + kTileB;
      const int k = kt * KB;
      if (pt == 0) {
        const uint32_t bar = full + 8 * st;
        mbar_arrive_expect(bar, uint32_t(kTileB + NT * 128));
        if (j.swiglu) tma_load_4d(smem_addr(sw), maps, k, int(p.n0 / 8), bar);
        else tma_load_2d(smem_addr(sw), maps + 1, k, int(p.n0), bar);
        for (int b = int(rank); b < NT / 32; b += 2)
          tma_load_2d_mc(smem_addr(sx + b * 4096), tok, k, int(row0 + 32 * b), bar, uint16_t(3));
      }
      if (!BF && pt < NT) cp_async4(smem_addr(sx + kTileB + 4 * pt), sp + kt, pt < p.Mv);
      mbar_arrive_copies(full + 8 * st);  // (bf16: no copies, it arrives at once)
    }
  }
  cp_async_wait<0>();
}

// What a consumer warpgroup keeps of a pair: the weight blocks' scale rows (w1 | w3 with SwiGLU),
// K blocks, tokens, and where the outputs go.
struct Work {
  const float *sc0, *sc1;
  int64_t col0;  // the weights' first column (for the scale block of each K block)
  int nk, Mv;
  int64_t n0, N, orow;  // first weight row (SwiGLU: output), the stage's rows, the tile's first output row
};

template <bool BF>
__device__ __forceinline__ Work work_of(const TcJob& j, const Pair& p) {
  const DevLinear& Wb = j.swiglu ? p.W1 : p.W0;
  Work k;
  const int64_t n0 = min(p.n0, p.N - 1);  // (a weight tile past the rows reads the last block's scales)
  k.sc0 = BF ? nullptr : p.W0.s + ((p.W0.row0 + n0) >> 7) * p.W0.lds;
  k.sc1 = BF ? nullptr : Wb.s + ((Wb.row0 + n0) >> 7) * Wb.lds;  // (the same 128-row block: n0 % 64 == 0)
  k.col0 = p.W0.col0;
  k.nk = int(p.K / (BF ? 64 : 128)), k.Mv = p.Mv;
  k.n0 = p.n0, k.N = p.N, k.orow = p.arow0 + p.m0;
  return k;
}

// The consumers' side of the ring: wait until the stage of ring position `it` is full, and return it.
__device__ __forceinline__ uint8_t* stage_take(uint8_t* smem, uint32_t full, int it) {
  const int st = it % kStages;
  mbar_wait(full + 8 * st, unsigned((it / kStages) & 1));
  return smem + st * kStageB;
}
// ... and mark it empty in both blocks of the cluster (this warp's MMAs on it and reads of it done).
__device__ __forceinline__ void stage_give(uint32_t empty, int it) {
  const uint32_t bar = empty + 8 * (it % kStages);
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive_in(bar, 0), mbar_arrive_in(bar, 1);
}

// A consumer warpgroup's K loop over one pair (weight rows 64 q .. 64 q + 63 against the NT token
// columns) into d, e4m3: each 128-K block's four MMAs write the partial product dp, added into d
// times the weight block's and each token's scale. it: the ring position of the pair's first K
// block (advanced).
template <int NT>
__device__ __forceinline__ void k_loop_e4m3(const TcJob& j, const Work& p, int& it, uint8_t* smem, uint32_t full,
                                            uint32_t empty, float (&d)[NT / 2]) {
  constexpr int NA = NT / 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = warp >> 2, t = lane & 3;
  float dp[NA];
  const int64_t kb0 = p.col0 >> 7;
  float s0 = p.sc0[kb0], s1 = p.sc1[kb0];  // this K block's weight scales (the next ones load under its MMAs)
  for (int kt = 0; kt < p.nk; ++kt, ++it) {
    const int kn = kt + 1 < p.nk ? kt + 1 : kt;
    const float nx0 = p.sc0[kb0 + kn], nx1 = p.sc1[kb0 + kn];
    uint8_t* sw = stage_take(smem, full, it);
    const uint64_t da = wg_desc(smem_addr(sw + kTileB)), db = wg_desc(smem_addr(sw + q * 64 * 128));
#pragma unroll
    for (int i = 0; i < NA; ++i) reg_fence(dp[i]);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_e4m3_64xN<NT>(dp, db + 2 * kk, da + 2 * kk, kk != 0);
    wg_commit_wait<0>();
#pragma unroll
    for (int i = 0; i < NA; ++i) reg_fence(dp[i]);
    const float* as = reinterpret_cast<const float*>(sw + 2 * kTileB);
    // accumulator i: MMA row 16 (warp % 4) + g (+ 8 for i & 2), token column 8 (i / 4) + 2 t + (i & 1)
    const float r0 = j.swiglu || q == 0 ? s0 : s1, r1 = j.swiglu ? s1 : r0;  // the twin's scale of rows g, g + 8
#pragma unroll
    for (int i = 0; i < NA; ++i) d[i] = fmaf(dp[i], ((i & 2) ? r1 : r0) * as[(i >> 2) * 8 + 2 * t + (i & 1)], d[i]);
    stage_give(empty, it);
    s0 = nx0, s1 = nx1;
  }
}

// The same K loop over bf16 weights and tokens (64-K blocks): every block's four MMAs accumulate
// into d, as the twin's do.
template <int NT>
__device__ __forceinline__ void k_loop_bf16(const Work& p, int& it, uint8_t* smem, uint32_t full, uint32_t empty,
                                            float (&d)[NT / 2]) {
  constexpr int NA = NT / 2;
  const int q = int(threadIdx.x >> 7);
  for (int kt = 0; kt < p.nk; ++kt, ++it) {
    uint8_t* sw = stage_take(smem, full, it);
    const uint64_t da = wg_desc(smem_addr(sw + kTileB)), db = wg_desc(smem_addr(sw + q * 64 * 128));
#pragma unroll
    for (int i = 0; i < NA; ++i) reg_fence(d[i]);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_64xN<NT>(d, db + 2 * kk, da + 2 * kk, true);
    wg_commit_wait<0>();
#pragma unroll
    for (int i = 0; i < NA; ++i) reg_fence(d[i]);
    stage_give(empty, it);
  }
}

// Stage 0's SwiGLU outputs quantised for stage 1 as act_quant quantises them (TcJob::o_q). A
// unit's two blocks hold the 128 columns of one scale block, 64 each, so each block takes its
// tokens' absolute maxima over its columns (the warp's 8 by shuffles, the 8 warps' through `part`)
// and the blocks swap them through distributed shared memory: a block's first 128 consumer threads
// store its maxima into the other's `peer` and arrive on the other's `full` (cluster-scope
// release); once a block has read `peer` it arrives on the other's `empty`, which the other waits
// on before its next stores. The scale is act_quant's: max(amax, 1e-4) / 448 (a power of two
// with ue8m0), each value divided by it and converted with saturation.
struct Xchg {
  float *part, *mine, *peer;  // [8][kToks], [kToks], [kToks] (this block's shared memory)
  uint32_t full, empty;       // this block's barriers: `peer` written by the other block; our maxima read by it
  int k = 0;                  // the units this block has quantised (the barriers' phases)
};

template <int NT>
__device__ void quant_out(const TcJob& j, const Work& p, const float (&d)[NT / 2], Xchg& x) {
  constexpr int NV = NT / 8;  // accumulator groups: tokens 8 jn + 2 t + c
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const uint32_t other = cluster_rank() ^ 1u;
  float v[NV][2];
#pragma unroll
  for (int jn = 0; jn < NV; ++jn)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      v[jn][c] = silu(d[4 * jn + c]) * d[4 * jn + 2 + c];  // column n0 + 8 warp + g (zero past the rows)
      float m = fabsf(v[jn][c]);
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
      if (g == 0) x.part[warp * kToks + jn * 8 + 2 * t + c] = m;
    }
  consumers_sync();
  if (tid < kToks) {
    float m = 0.f;
    if (tid < NT)
#pragma unroll
      for (int w = 0; w < kConsumers / 32; ++w) m = fmaxf(m, x.part[w * kToks + tid]);
    x.mine[tid] = m;
    if (x.k > 0) mbar_wait_cluster(x.empty, unsigned((x.k - 1) & 1));  // the other has read our last maxima
    st_cluster(smem_addr(x.peer + tid), other, m);
    mbar_arrive_release_in(x.full, other);
  }
  consumers_sync();  // (x.mine complete)
  mbar_wait_cluster(x.full, unsigned(x.k & 1));
  const int64_t o = p.n0 + 8 * warp + g, nblk = j.ldo / 128;
#pragma unroll
  for (int jn = 0; jn < NV; ++jn)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int tok = jn * 8 + 2 * t + c;
      float sc = __fmul_rn(fmaxf(fmaxf(x.mine[tok], x.peer[tok]), 1e-4f), 1.f / 448.f);
      if (j.ue8m0) sc = exp2f(ceilf(log2f(sc)));
      if (tok >= p.Mv) continue;
      if (o < p.N)
        j.o_q[(p.orow + tok) * j.ldo + o] =
            uint8_t(__nv_cvt_float_to_fp8(__fdiv_rn(v[jn][c], sc), __NV_SATFINITE, __NV_E4M3));
      if (other == 1 && tid < 32 && g == 0) j.o_qs[(p.orow + tok) * nblk + p.n0 / 128] = sc;  // (block 0, warp 0)
    }
  consumers_sync();  // every consumer has read x.peer
  if (tid == 0) mbar_arrive_release_in(x.empty, other);
  ++x.k;
}

// A consumer warpgroup's share of one pair: the K loop, then the epilogue.
template <int NT, bool BF>
__device__ void consume(const TcJob& j, const Work& p, int& it, uint8_t* smem, uint32_t full, uint32_t empty,
                        Xchg& x) {
  constexpr int NA = NT / 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = warp >> 2, g = lane >> 2, t = lane & 3;
  float d[NA];
#pragma unroll
  for (int i = 0; i < NA; ++i) d[i] = 0.f;
  if constexpr (BF) k_loop_bf16<NT>(p, it, smem, full, empty, d);
  else k_loop_e4m3<NT>(j, p, it, smem, full, empty, d);
  const int r = q * 64 + (warp & 3) * 16 + g;  // tile row of accumulators i with !(i & 2)
  if constexpr (!BF) {
    if (j.o_q && j.swiglu) {
      quant_out<NT>(j, p, d, x);
      return;
    }
  }
  if (j.swiglu) {  // output column n0 + (r / 16) * 8 + g: silu(w1 row) * (w3 row), float32 (bf16: bf16)
    const int64_t o = p.n0 + (r >> 4) * 8 + g;
    if (o >= p.N) return;
    float* out = static_cast<float*>(j.o_hi) + p.orow * j.ldo + o;
    __nv_bfloat16* out16 = static_cast<__nv_bfloat16*>(j.o_hi) + p.orow * j.ldo + o;
#pragma unroll
    for (int jn = 0; jn < NA / 4; ++jn)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int tok = jn * 8 + 2 * t + c;
        if (tok >= p.Mv) continue;
        const float v = silu(d[4 * jn + c]) * d[4 * jn + 2 + c];
        if constexpr (BF) out16[tok * j.ldo] = __float2bfloat16_rn(v);
        else out[tok * j.ldo] = v;
      }
  } else {
    float* out = j.c + p.orow * j.ldc + j.col + p.n0 + r;
#pragma unroll
    for (int jn = 0; jn < NA / 4; ++jn)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (p.n0 + r + 8 * h >= p.N) continue;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int tok = jn * 8 + 2 * t + c;
          if (tok < p.Mv) out[tok * j.ldc + 8 * h] = d[4 * jn + 2 * h + c];
        }
      }
  }
}

template <bool BF>
__global__ void __launch_bounds__(kThreads, 1) moe_persist_kernel(TcJob j, const __grid_constant__ CUtensorMap tok,
                                                                  int64_t n_units) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t full = smem_addr(smem + kStages * kStageB), empty = full + 8 * kStages;
  Xchg x;
  x.full = empty + 8 * kStages, x.empty = x.full + 8;
  x.part = reinterpret_cast<float*>(smem + kStages * kStageB + 2 * kStages * 8 + 16);
  x.mine = x.part + 8 * kToks, x.peer = x.mine + kToks;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s)
      mbar_init(full + 8 * s, kProducers + 1), mbar_init(empty + 8 * s, 2 * kConsumers / 32);
    mbar_init(x.full, kToks), mbar_init(x.empty, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  cluster_sync();  // both blocks' barriers exist before either block's TMA or arrivals reach them
  pdl_wait();
  pdl_trigger();
  const int64_t n_tiles = *j.n_tiles, total = n_tiles * n_units;
  if (threadIdx.x >= kConsumers) {
    set_max_regs_dec<kProducerRegs>();
    produce<BF>(j, &tok, total, n_tiles, smem, full, empty);
  } else {
    set_max_regs_inc<kConsumerRegs>();
    int it = 0;
    for (int64_t w = int64_t(blockIdx.x) / 2; w < total; w += int64_t(gridDim.x) / 2) {
      const Pair pr = pair_of(j, w, n_tiles);
      if (!pr.run) continue;
      const Work p = work_of<BF>(j, pr);
      switch ((p.Mv + 31) / 32) {
        case 1: consume<32, BF>(j, p, it, smem, full, empty, x); break;
        case 2: consume<64, BF>(j, p, it, smem, full, empty, x); break;
        case 3: consume<96, BF>(j, p, it, smem, full, empty, x); break;
        default: consume<128, BF>(j, p, it, smem, full, empty, x); break;
      }
    }
  }
  cluster_sync();  // neither block leaves while the other may still write into it or arrive on its barriers
}

}  // namespace

namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_tiled() {  // the driver's cuTensorMapEncodeTiled, through the runtime (no -lcuda)
  static const EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    const bool ok = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) ==
                        cudaSuccess &&
                    q == cudaDriverEntryPointSuccess;
    return ok ? reinterpret_cast<EncodeTiled>(p) : nullptr;
  }();
  return fn;
}

}  // namespace

void* moe_persist_tmaps(const DevExpert* experts, int n, std::string* why) {
  auto refuse = [&](const char* m) -> void* {
    *why = m;
    return nullptr;
  };
  const EncodeTiled encode = encode_tiled();
  if (!encode) return refuse("the driver has no cuTensorMapEncodeTiled");
  std::vector<CUtensorMap> maps(size_t(n) * kMapsPerExpert);
  std::memset(maps.data(), 0, maps.size() * sizeof(CUtensorMap));
  int first = 0;  // the first expert of this rank
  while (first < n && !experts[first].w1.w) ++first;
  if (first == n) return refuse("no expert on this rank");
  const int32_t wt = experts[first].w1.t;
  if (wt != kFP8 && wt != kBF16) return refuse("the experts are neither e4m3 nor bf16");
  // Weights as elements of their size (e4m3 bytes, bf16 pairs): rows of 128 bytes per box.
  const int64_t esz = wt == kFP8 ? 1 : 2;
  const cuuint32_t kb = cuuint32_t(128 / esz);
  const CUtensorMapDataType dt = wt == kFP8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  auto base = [&](const DevLinear& W) {
    return const_cast<uint8_t*>(static_cast<const uint8_t*>(W.w)) + (W.row0 * W.ld + W.col0) * esz;
  };
  const cuuint32_t step[4] = {1, 1, 1, 1};
  for (int e = 0; e < n; ++e) {
    const DevLinear &w1 = experts[e].w1, &w3 = experts[e].w3, &w2 = experts[e].w2;
    if (!w1.w) continue;  // another rank's expert
    if (w1.t != wt || w3.t != wt || w2.t != wt) return refuse("the expert matrices differ in dtype");
    // w1 | w3 as one 4-D tensor [groups of 8 rows][w1, w3][8 rows][cols]: a box of 8 groups is the
    // tile's 128 rows with w1 and w3 alternating every 8 (w3 must lie after w1, 16-byte aligned).
    const int64_t delta = base(w3) - base(w1);
    if (w1.rows != w3.rows || w1.cols != w3.cols || w1.ld != w3.ld || w1.rows % 8 != 0)
      return refuse("w1 and w3 differ in shape or row stride, or have rows not in whole groups of 8");
    if (delta <= 0) return refuse("w3 lies before w1 in device memory");
    if (delta % 16 != 0 || delta >= (int64_t(1) << 40)) return refuse("w3 lies too far from w1, or not 16-byte aligned");
    const cuuint64_t d13[4] = {cuuint64_t(w1.cols), 8, 2, cuuint64_t(w1.rows / 8)},
                     s13[3] = {cuuint64_t(w1.ld * esz), cuuint64_t(delta), cuuint64_t(8 * w1.ld * esz)};
    const cuuint32_t b13[4] = {kb, 8, 2, 8};
    const cuuint64_t d2[2] = {cuuint64_t(w2.cols), cuuint64_t(w2.rows)}, s2[1] = {cuuint64_t(w2.ld * esz)};
    const cuuint32_t b2[2] = {kb, 128};
    if (encode(&maps[size_t(e) * kMapsPerExpert], dt, 4, base(w1), d13, s13, b13, step,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS ||
        encode(&maps[size_t(e) * kMapsPerExpert + 1], dt, 2, base(w2), d2, s2, b2, step,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return refuse("the driver refused an expert's tensor map");
  }
  void* d = nullptr;
  if (cudaMalloc(&d, maps.size() * sizeof(CUtensorMap)) != cudaSuccess) return refuse("out of device memory");
  if (cudaMemcpy(d, maps.data(), maps.size() * sizeof(CUtensorMap), cudaMemcpyHostToDevice) != cudaSuccess) {
    cudaFree(d);
    return refuse("the tensor maps' copy failed");
  }
  return d;
}

void moe_persist_gemm(const Launch& L, const TcJob& j, int64_t grid_m, int64_t max_n) {
  DSV3_CHECK(j.tmaps, "moe_persist_gemm: the experts' tensor maps (moe_persist_tmaps)");
  const bool bf = !j.a_s;  // bf16 weights and tokens (fast mode), else FP8 GEMM mode's e4m3
  DSV3_CHECK(j.grouped && j.swap && j.fp8 == !bf && !j.a_lo && !j.a_idx && j.M > 0 && j.lda % 16 == 0 &&
                 j.splits == 1 && !j.w_pair.w && (!j.swiglu || (bf ? !j.o_f32 && !j.o_q : j.o_f32 != !!j.o_q)) &&
                 (!j.o_q || (j.swiglu && j.o_qs && j.ldo % 128 == 0)) && j.tm == kToks,
             "moe_persist_gemm: grouped stages with swapped operands (FP8 GEMM mode's e4m3 or fast mode's bf16), "
             "pair-ordered tokens (M rows), 128-token tiles, SwiGLU output in float32 or quantised in 128-column "
             "blocks (bf16: bf16)");
  // The tokens [M pair rows, lda] in 32-row boxes of 128 bytes (rows past M read as zeros).
  CUtensorMap tok;
  const cuuint64_t dims[2] = {cuuint64_t(j.lda), cuuint64_t(j.M)}, strides[1] = {cuuint64_t(j.lda * (bf ? 2 : 1))};
  const cuuint32_t box[2] = {bf ? 64u : 128u, 32}, step[2] = {1, 1};
  const EncodeTiled encode = encode_tiled();
  DSV3_CHECK(encode && encode(&tok, bf ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
                              const_cast<void*>(j.a_hi), dims, strides, box,
                              step, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS,
             "moe_persist_gemm: the tokens' tensor map");
  const int64_t rows = j.swiglu ? kRows / 2 : kRows, n_wtiles = (max_n + rows - 1) / rows,
                n_units = (n_wtiles + 1) / 2;
  const int64_t clusters = std::min<int64_t>(device_sms() / 2, std::max<int64_t>(1, grid_m * n_units));
  auto kernel = bf ? moe_persist_kernel<true> : moe_persist_kernel<false>;
  allow_smem(kernel, kSmem);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(2 * clusters));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmem;
  cfg.stream = L.stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = L.pdl ? 2 : 1;
  DSV3_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, j, tok, n_units));
}

}  // namespace dsv3::cuda
