// The grouped MoE stages of FP8 GEMM mode (e4m3 experts, e4m3 activations with a scale per token
// and 128-K block), weights as the wgmma's A and each tile's tokens its N: the persistent form of
// tc_gemm_kernel's swapped e4m3 form (kernels_tc.cu), which stays its twin.
//
// One block per SM works through the launch's (token tile, weight tile) pairs in turn, token tiles
// fastest (so the blocks running at once share weight tiles and read them from memory once).
// Warps 8-11 are the producer: they stream each pair's 128-K blocks into a ring of kStages
// shared-memory stages, running ahead across pairs, so the next pair's first blocks load under this
// pair's MMAs and epilogue. The weight tile (128 rows of 128 bytes) comes by TMA, 16 boxes of 8 rows
// through each expert matrix's tensor map (moe_f8_tmaps), issued by one thread; the token rows
// (gathered through the pair table) and their scales by the producers' cp.async. Warps 0-7 are two consumer warpgroups of 64 weight rows each; a
// warpgroup takes a stage when the producers mark it full (mbarrier), issues its four m64nNk32 MMAs,
// adds the partial product into its float32 accumulator times the weight block's and each token's
// scale, and marks the stage empty; there is no block-wide barrier, so one warpgroup's scaling
// overlaps the other's MMAs. The epilogue writes from registers: with SwiGLU the weight tile interleaves w1 and w3 rows
// in groups of 8, so each thread holds both halves of its outputs (MMA rows g and g + 8).
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
#ifndef DSV3_MF8_LAG
#define DSV3_MF8_LAG 4
#endif
constexpr int kLag = DSV3_MF8_LAG;  // producer: stages it issues past one before signalling it
constexpr int kConsumers = 256, kProducers = 128, kThreads = kConsumers + kProducers;
constexpr size_t kSmem = size_t(kStages) * kStageB + 2 * kStages * 8 + 1024;  // + the barriers, alignment

__device__ __forceinline__ void mbar_init(uint32_t bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
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
// Until the barrier's phase of this parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Byte offset of (row, 16-byte chunk) in a 128-byte-row tile in the hardware's 128-byte swizzle.
__device__ __forceinline__ int swz128(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// One (token tile, weight tile) pair of the launch, as both roles see it.
struct Pair {
  bool run;
  int e;             // the expert          // false: the weight tile lies past this expert's rows
  int64_t m0, arow0;  // the token tile's first pair row within its expert, the expert's first pair row
  int Mv;            // tokens in the tile
  int64_t n0, N, K;  // first weight row (SwiGLU: first output), the stage's rows and K
  DevLinear W0, W1;  // w1 | w2, and w3 (SwiGLU)
};

__device__ __forceinline__ Pair pair_of(const TcJob& j, int64_t w, int64_t n_tiles) {
  Pair p;
  const int64_t mt = w % n_tiles, nt = w / n_tiles;
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
  p.run = p.n0 < p.N && p.Mv > 0;
  return p;
}

// The producer warpgroup: every pair's K blocks into the ring. Its first thread issues the weight
// tile's 16 TMA boxes (8 rows each: with SwiGLU w1 and w3 rows alternate in groups of 8, box b
// holding outputs 8 (b / 2) .. of w1 (b even) or w3), counted on the stage's full barrier. Thread p
// copies 16-byte chunk p % 8 of token rows p / 8 + 16 i (i < 8) and token p's scale; at a pair's
// start it works out those rows' addresses once. Each warp signals stage s full once its copies of
// stage s have landed (and are made visible to the async proxy), kLag stages behind the newest it
// issued.
__device__ void produce(const TcJob& j, int64_t total, int64_t n_tiles, uint8_t* smem, uint32_t full, uint32_t empty) {
  constexpr int kPer = kRows * 8 / kProducers;  // rows per thread
  const int pt = int(threadIdx.x) - kConsumers, ch = pt & 7, r0 = pt >> 3;
  const uint8_t* xa = static_cast<const uint8_t*>(j.a_hi);
  int it = 0;
  for (int64_t w = blockIdx.x; w < total; w += gridDim.x) {
    const Pair p = pair_of(j, w, n_tiles);
    if (!p.run) continue;
    const int NT = (p.Mv + 31) / 32 * 32;
    const uint8_t* xp[kPer];
    const CUtensorMap* maps = static_cast<const CUtensorMap*>(j.tmaps) + 3 * p.e;
    auto token_row = [&](int r) {
      const int64_t pr = p.arow0 + p.m0 + min(r, p.Mv - 1);
      return int64_t(j.a_idx ? j.a_idx[pr] : int32_t(pr));
    };
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      xp[i] = xa + token_row(r0 + 16 * i) * j.lda + ch * 16;
    }
    const float* sp = j.a_s + token_row(pt) * j.ldas;
    const int nk = int(p.K / 128);
    for (int kt = 0; kt < nk; ++kt, ++it) {
      const int st = it % kStages;
      if (it >= kStages) mbar_wait(empty + 8 * st, unsigned((it / kStages - 1) & 1));
      uint8_t* sw = smem + st * kStageB;
      uint8_t* sx = sw + kTileB;
      const int64_t k = int64_t(kt) * 128;
      if (pt == 0) {
        const uint32_t bar = full + 8 * st;
        mbar_arrive_expect(bar, kTileB);
        if (j.swiglu) {
#pragma unroll 1
          for (int b = 0; b < kRows / 8; ++b)  // w1 | w3
            tma_load_2d(smem_addr(sw + b * 1024), maps + (b & 1), int(k), int(p.n0 + (b >> 1) * 8), bar);
        } else {
          tma_load_2d(smem_addr(sw), maps + 2, int(k), int(p.n0), bar);  // w2: one box of 128 rows
        }
      }
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if (r0 + 16 * i < NT) cp_async16(smem_addr(sx + swz128(r0 + 16 * i, ch)), xp[i] + k, r0 + 16 * i < p.Mv);
      if (pt < NT) cp_async4(smem_addr(sx + kTileB + 4 * pt), sp + kt, pt < p.Mv);
      cp_async_commit();
      if (it >= kLag) {
        cp_async_wait<kLag>();
        fence_proxy_async();
        __syncwarp();  // (the warp's copies landed: one arrival for the warp)
        if ((threadIdx.x & 31) == 0) mbar_arrive(full + 8 * ((it - kLag) % kStages));
      }
    }
  }
  cp_async_wait<0>();
  fence_proxy_async();
  __syncwarp();
  if ((threadIdx.x & 31) == 0)
    for (int s = it > kLag ? it - kLag : 0; s < it; ++s) mbar_arrive(full + 8 * (s % kStages));
}

// What a consumer warpgroup keeps of a pair: the weight blocks' scale rows (w1 | w3 with SwiGLU),
// K blocks, tokens, and where the outputs go.
struct Work {
  const float *sc0, *sc1;
  int64_t col0;  // the weights' first column (for the scale block of each K block)
  int nk, Mv;
  int64_t n0, N, orow;  // first weight row (SwiGLU: output), the stage's rows, the tile's first output row
};

__device__ __forceinline__ Work work_of(const TcJob& j, const Pair& p) {
  const DevLinear& Wb = j.swiglu ? p.W1 : p.W0;
  Work k;
  k.sc0 = p.W0.s + ((p.W0.row0 + p.n0) >> 7) * p.W0.lds;
  k.sc1 = Wb.s + ((Wb.row0 + p.n0) >> 7) * Wb.lds;  // (the same 128-row block: n0 % 64 == 0)
  k.col0 = p.W0.col0;
  k.nk = int(p.K / 128), k.Mv = p.Mv;
  k.n0 = p.n0, k.N = p.N, k.orow = p.arow0 + p.m0;
  return k;
}

// A consumer warpgroup's share of one pair: weight rows 64 q .. 64 q + 63 against the NT token
// columns, then the epilogue. it: the ring position of the pair's first K block (advanced).
template <int NT>
__device__ void consume(const TcJob& j, const Work& p, int& it, uint8_t* smem, uint32_t full, uint32_t empty) {
  constexpr int NA = NT / 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = warp >> 2, g = lane >> 2, t = lane & 3;
  float d[NA], dp[NA];
#pragma unroll
  for (int i = 0; i < NA; ++i) d[i] = 0.f;
  const int64_t kb0 = p.col0 >> 7;
  float s0 = p.sc0[kb0], s1 = p.sc1[kb0];  // this K block's weight scales (the next ones load under its MMAs)
  for (int kt = 0; kt < p.nk; ++kt, ++it) {
    const int st = it % kStages;
    const int kn = kt + 1 < p.nk ? kt + 1 : kt;
    const float nx0 = p.sc0[kb0 + kn], nx1 = p.sc1[kb0 + kn];
    mbar_wait(full + 8 * st, unsigned((it / kStages) & 1));
    uint8_t* sw = smem + st * kStageB;
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
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + 8 * st);
    s0 = nx0, s1 = nx1;
  }
  const int r = q * 64 + (warp & 3) * 16 + g;  // tile row of accumulators i with !(i & 2)
  if (j.swiglu) {  // output column n0 + (r / 16) * 8 + g: silu(w1 row) * (w3 row), float32
    const int64_t o = p.n0 + (r >> 4) * 8 + g;
    if (o >= p.N) return;
    float* out = static_cast<float*>(j.o_hi) + p.orow * j.ldo + o;
#pragma unroll
    for (int jn = 0; jn < NA / 4; ++jn)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int tok = jn * 8 + 2 * t + c;
        if (tok < p.Mv) out[tok * j.ldo] = silu(d[4 * jn + c]) * d[4 * jn + 2 + c];
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

__global__ void __launch_bounds__(kThreads, 1) moe_f8_kernel(TcJob j, int64_t n_wtiles) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t full = smem_addr(smem + kStages * kStageB), empty = full + 8 * kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(full + 8 * s, kProducers / 32 + 1), mbar_init(empty + 8 * s, kConsumers / 32);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  pdl_wait();
  pdl_trigger();
  const int64_t n_tiles = *j.n_tiles, total = n_tiles * n_wtiles;
  if (threadIdx.x >= kConsumers) {
    produce(j, total, n_tiles, smem, full, empty);
    return;
  }
  int it = 0;
  for (int64_t w = blockIdx.x; w < total; w += gridDim.x) {
    const Pair pr = pair_of(j, w, n_tiles);
    if (!pr.run) continue;
    const Work p = work_of(j, pr);
    switch ((p.Mv + 31) / 32) {
      case 1: consume<32>(j, p, it, smem, full, empty); break;
      case 2: consume<64>(j, p, it, smem, full, empty); break;
      case 3: consume<96>(j, p, it, smem, full, empty); break;
      default: consume<128>(j, p, it, smem, full, empty); break;
    }
  }
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

void* moe_f8_tmaps(const DevExpert* experts, int n) {
  const EncodeTiled encode = encode_tiled();
  if (!encode) return nullptr;
  std::vector<CUtensorMap> maps(size_t(n) * 3);
  std::memset(maps.data(), 0, maps.size() * sizeof(CUtensorMap));
  for (int e = 0; e < n; ++e) {
    const DevLinear* ws[3] = {&experts[e].w1, &experts[e].w3, &experts[e].w2};
    for (int m = 0; m < 3; ++m) {
      const DevLinear& W = *ws[m];
      if (!W.w) continue;  // another rank's expert
      if (W.t != kFP8) return nullptr;
      const cuuint64_t dims[2] = {cuuint64_t(W.cols), cuuint64_t(W.rows)}, strides[1] = {cuuint64_t(W.ld)};
      const cuuint32_t box[2] = {128, m == 2 ? 128u : 8u}, step[2] = {1, 1};
      void* base = const_cast<uint8_t*>(static_cast<const uint8_t*>(W.w)) + W.row0 * W.ld + W.col0;
      if (encode(&maps[size_t(e) * 3 + size_t(m)], CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, dims, strides, box, step,
                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return nullptr;
    }
  }
  void* d = nullptr;
  if (cudaMalloc(&d, maps.size() * sizeof(CUtensorMap)) != cudaSuccess) return nullptr;
  if (cudaMemcpy(d, maps.data(), maps.size() * sizeof(CUtensorMap), cudaMemcpyHostToDevice) != cudaSuccess) {
    cudaFree(d);
    return nullptr;
  }
  return d;
}

void moe_f8_gemm(const Launch& L, const TcJob& j, int64_t grid_m, int64_t max_n) {
  DSV3_CHECK(j.tmaps, "moe_f8_gemm: the experts' tensor maps (moe_f8_tmaps)");
  DSV3_CHECK(j.grouped && j.swap && j.a_s && j.fp8 && !j.a_lo && j.splits == 1 && !j.w_pair.w &&
                 (!j.swiglu || j.o_f32) && j.tm == kToks,
             "moe_f8_gemm: grouped FP8 GEMM-mode stages with swapped operands, 128-token tiles, float32 output");
  const int64_t n_wtiles = (max_n + (j.swiglu ? kRows / 2 : kRows) - 1) / (j.swiglu ? kRows / 2 : kRows);
  const int64_t blocks = std::min<int64_t>(device_sms(), std::max<int64_t>(1, grid_m * n_wtiles));
  allow_smem(moe_f8_kernel, kSmem);
  launch(L, moe_f8_kernel, dim3(unsigned(blocks)), dim3(kThreads), kSmem, j, n_wtiles);
}

}  // namespace dsv3::cuda
