// Matrix-vector products for a few tokens (decode): each warp streams one or two weight rows
// once, 16 bytes per lane per load, dequantising in registers (bf16 by a shift; e4m3 by the
// hardware conversion, times its 128x128 block scale), and dots them with up to NT tokens'
// float32 activations (read through L1). float32 accumulation throughout.
#include "backend/cuda/common.cuh"
#include "backend/cuda/mla_splits.cuh"
#include "backend/cuda/moe_route.cuh"
#include <algorithm>

#include "core/error.h"

// DSV3_GEMV_ABLATE=1 (a measurement aid, never for results): the streaming path's weight loads without
// the arithmetic (bench/results/2026-12-02-h200-cuda/run21-*).
#ifndef DSV3_GEMV_ABLATE
#define DSV3_GEMV_ABLATE 0
#endif

namespace dsv3::cuda {
namespace {

constexpr int kWarps = 8;  // 256 threads per block
// 16-byte loads in flight per row per lane: more for one token (the bandwidth-bound case), fewer
// where eight tokens' accumulators need the registers.
template <int NT>
__host__ __device__ constexpr int unroll() { return NT == 1 ? 8 : 4; }

// acc[j] += (w · x_j[k .. k + CE)) * scale for the live tokens. SX: x in shared memory (plain
// loads), else global through the read-only path.
template <int WT, int NT, bool SX = false>
__device__ __forceinline__ void chunk_dot(const float* w, float scale, const float* const* xr, int64_t k, float* acc) {
  constexpr int CE = chunk_elems<WT>();
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (!xr[j]) continue;
    const float4* xp = reinterpret_cast<const float4*>(xr[j] + k);
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < CE / 4; ++q) {
      const float4 xv = SX ? xp[q] : __ldg(xp + q);
      s = fmaf(w[4 * q], xv.x, s);
      s = fmaf(w[4 * q + 1], xv.y, s);
      s = fmaf(w[4 * q + 2], xv.z, s);
      s = fmaf(w[4 * q + 3], xv.w, s);
    }
    acc[j] = WT == kFP8 ? fmaf(s, scale, acc[j]) : acc[j] + s;
  }
}

// e4m3 elements 4q .. 4q + 3 of a 16-byte chunk as floats (unscaled): decode's arithmetic, a
// quarter of the chunk at a time.
__device__ __forceinline__ float4 e4m3_decode4(const uint4& v, int q) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
  const float2 lo = e4m3x2_bits(u[q]), hi = e4m3x2_bits(u[q] >> 16);
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// Both rows of a pair (a and, when has_b, b) dotted with the same x chunks, per row and token
// the same arithmetic as chunk_dot: acc0[j] += wa · x_j, acc1[j] += wb · x_j. Each x value is
// loaded once for both rows (two chunk_dot calls load it twice: the compiler does not merge the
// loads). Forms by register pressure: bf16 / float32 decode both chunks whole; one FP8 token
// decodes four weights at a time; eight FP8 tokens keep the two calls (fewest spills).
template <int WT, int NT, bool SX = false>
__device__ __forceinline__ void chunk_dot2(const uint4& wa4, const uint4& wb4, bool has_b, float sa, float sb,
                                           const float* const* xr, int64_t k, float* acc0, float* acc1) {
  constexpr int CE = chunk_elems<WT>();
  static_assert(NT >= 1);
  if constexpr (WT == kFP8 && NT > 1) {
    float w[CE];
    decode<WT>(wa4, w);
    chunk_dot<WT, NT, SX>(w, sa, xr, k, acc0);
    if (has_b) {
      decode<WT>(wb4, w);
      chunk_dot<WT, NT, SX>(w, sb, xr, k, acc1);
    }
    return;
  }
  if constexpr (WT != kFP8) {
    float wa[CE], wb[CE];
    decode<WT>(wa4, wa);
    if (has_b) {
      decode<WT>(wb4, wb);
    } else {
#pragma unroll
      for (int i = 0; i < CE; ++i) wb[i] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if (!xr[j]) continue;
      const float4* xp = reinterpret_cast<const float4*>(xr[j] + k);
      float s = 0.f, t = 0.f;
#pragma unroll
      for (int q = 0; q < CE / 4; ++q) {
        const float4 xv = SX ? xp[q] : __ldg(xp + q);
        s = fmaf(wa[4 * q], xv.x, s), t = fmaf(wb[4 * q], xv.x, t);
        s = fmaf(wa[4 * q + 1], xv.y, s), t = fmaf(wb[4 * q + 1], xv.y, t);
        s = fmaf(wa[4 * q + 2], xv.z, s), t = fmaf(wb[4 * q + 2], xv.z, t);
        s = fmaf(wa[4 * q + 3], xv.w, s), t = fmaf(wb[4 * q + 3], xv.w, t);
      }
      acc0[j] += s, acc1[j] += t;
    }
    return;
  }
  // One FP8 token: four weights of each row at a time.
  if (!xr[0]) return;
  const float* xp = xr[0] + k;
  float s = 0.f, t = 0.f;
#pragma unroll
  for (int q = 0; q < CE / 4; ++q) {
    const float4 a = e4m3_decode4(wa4, q), b = has_b ? e4m3_decode4(wb4, q) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 xv = SX ? reinterpret_cast<const float4*>(xp)[q] : __ldg(reinterpret_cast<const float4*>(xp) + q);
    s = fmaf(a.x, xv.x, s), t = fmaf(b.x, xv.x, t);
    s = fmaf(a.y, xv.y, s), t = fmaf(b.y, xv.y, t);
    s = fmaf(a.z, xv.z, s), t = fmaf(b.z, xv.z, t);
    s = fmaf(a.w, xv.w, s), t = fmaf(b.w, xv.w, t);
  }
  acc0[0] = fmaf(s, sa, acc0[0]);
  if (has_b) acc1[0] = fmaf(t, sb, acc1[0]);
}

struct Job {
  DevLinear a, b;  // b: second row source (w3 when fused, else a)
  bool fused;
  const float* x;
  int64_t ldx;
  const int32_t* idx;
  int64_t m;
  float* y;
  int64_t ldy;
  bool vec;
  // A second weight on the same activations (streaming path, not fused): its row pairs follow
  // a's, its outputs go to y2. c.rows == 0: none.
  DevLinear c;
  float* y2 = nullptr;
  int64_t ldy2 = 0;
};

// One warp: rows ra of a and rb of b (rb < 0: none) for all m tokens, NT at a time.
template <int WT, int NT>
__device__ void warp_rows(const Job& J, int64_t ra, int64_t rb) {
  constexpr int CE = chunk_elems<WT>();
  const int lane = threadIdx.x & 31;
  const DevLinear& A = J.a;
  const DevLinear& B = J.b;
  const int64_t K = A.cols;
  const bool has_b = rb >= 0;
  for (int64_t t0 = 0; t0 < J.m; t0 += NT) {
    const float* xr[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int64_t t = t0 + j;
      xr[j] = t < J.m ? J.x + (J.idx ? int64_t(J.idx[t]) : t) * J.ldx : nullptr;
    }
    float a0[NT], a1[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) a0[j] = a1[j] = 0.f;
    if (J.vec) {
      const int64_t nch = K / CE;
      const uint4* pa = reinterpret_cast<const uint4*>(static_cast<const char*>(A.w) +
                                                       ((A.row0 + ra) * A.ld + A.col0) * elem_bytes<WT>());
      const uint4* pb = has_b ? reinterpret_cast<const uint4*>(static_cast<const char*>(B.w) +
                                                               ((B.row0 + rb) * B.ld + B.col0) * elem_bytes<WT>())
                              : pa;
      const float* sa = WT == kFP8 ? A.s + ((A.row0 + ra) >> 7) * A.lds : nullptr;
      const float* sb = WT == kFP8 && has_b ? B.s + ((B.row0 + rb) >> 7) * B.lds : nullptr;
      constexpr int kUnroll = unroll<NT>();
      for (int64_t c0 = lane; c0 < nch; c0 += 32 * kUnroll) {
        uint4 wa[kUnroll], wb[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t c = c0 + 32 * u;
          if (c < nch) {
            wa[u] = ld_stream(pa + c);
            if (has_b) wb[u] = ld_stream(pb + c);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t c = c0 + 32 * u;
          if (c < nch) {
            const int64_t k = c * CE;
            chunk_dot2<WT, NT>(wa[u], wb[u], has_b, WT == kFP8 ? sa[(A.col0 + k) >> 7] : 1.f,
                               WT == kFP8 && has_b ? sb[(B.col0 + k) >> 7] : 1.f, xr, k, a0, a1);
          }
        }
      }
    } else {
      for (int64_t k = lane; k < K; k += 32) {
        const float wa = w_at(A, ra, k), wb = has_b ? w_at(B, rb, k) : 0.f;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          if (!xr[j]) continue;
          const float xv = xr[j][k];
          a0[j] = fmaf(wa, xv, a0[j]);
          a1[j] = fmaf(wb, xv, a1[j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      a0[j] = warp_sum(a0[j]);
      a1[j] = warp_sum(a1[j]);
    }
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (!xr[j]) continue;
        float* yj = J.y + (t0 + j) * J.ldy;
        if (J.fused) {
          yj[ra] = silu(a0[j]) * a1[j];
        } else {
          yj[ra] = a0[j];
          if (has_b) yj[rb] = a1[j];
        }
      }
    }
  }
}

// The streaming path (16-byte weights, m <= NT tokens): the warp walks its row groups (a row pair,
// or w1/w3 rows when fused) in batches of PU chunks per row and lane, loading batch i + 1 while it
// computes batch i, so its loads stay in flight back to back. The first batch may be loaded
// before pdl_wait (weights never depend on the previous kernel): `first_loaded`.
#ifndef DSV3_GEMV_PU1  // chunks per row and lane per batch of a one-token stream
#define DSV3_GEMV_PU1 4
#endif
template <int NT>
__host__ __device__ constexpr int pipe_unroll() { return NT == 1 ? DSV3_GEMV_PU1 : 2; }

template <int WT, int NT, bool TWO = false, bool SX = false>  // TWO: a second weight J.c after J.a's row
struct Stream {                                                // groups; SX: x in shared memory
  static constexpr int CE = chunk_elems<WT>(), PU = pipe_unroll<NT>();
  const Job& J;
  int64_t nch, nb, ngroups, stride;
  int lane;
  int64_t g1;  // row groups of a (those of J.c follow)
  __device__ Stream(const Job& j, int64_t first, int64_t stride_) : J(j), stride(stride_), lane(threadIdx.x & 31) {
    nch = J.a.cols / CE;
    nb = (nch + 32 * PU - 1) / (32 * PU);
    g1 = J.fused ? J.a.rows : (J.a.rows + 1) / 2;
    ngroups = g1 + (TWO ? (J.c.rows + 1) / 2 : 0);
    (void)first;
  }
  // The fields of row group g's weight (J.a or J.b; J.c past g1), selected field by field so the
  // structs stay in parameter space (a reference to one of them would copy both to the stack).
  struct Src {
    const void* w;
    const float* s;
    int64_t row0, ld, lds, col0, rows;
  };
  __device__ Src src(int64_t g, bool b) const {
    const bool c = TWO && g >= g1;
    const DevLinear& L = b ? J.b : J.a;
    return {c ? J.c.w : L.w, c ? J.c.s : L.s, c ? J.c.row0 : L.row0, c ? J.c.ld : L.ld, c ? J.c.lds : L.lds,
            c ? J.c.col0 : L.col0, c ? J.c.rows : L.rows};
  }
  __device__ void rows_of(int64_t g, int64_t& ra, int64_t& rb) const {
    if (J.fused) {
      ra = rb = g;
    } else {
      const bool c = TWO && g >= g1;
      const int64_t r = 2 * (c ? g - g1 : g), rows = c ? J.c.rows : J.a.rows;
      ra = r, rb = r + 1 < rows ? r + 1 : -1;
    }
  }
  __device__ const uint4* row_ptr(const Src& L, int64_t r) const {
    return reinterpret_cast<const uint4*>(static_cast<const char*>(L.w) + ((L.row0 + r) * L.ld + L.col0) * elem_bytes<WT>());
  }
  __device__ void load(int64_t g, int64_t b, uint4* wa, uint4* wb) const {
    int64_t ra, rb;
    rows_of(g, ra, rb);
    const uint4* pa = row_ptr(src(g, false), ra);
    const uint4* pb = rb >= 0 ? row_ptr(src(g, true), rb) : pa;
#pragma unroll
    for (int u = 0; u < PU; ++u) {
      const int64_t c = b * 32 * PU + 32 * u + lane;
      if (c < nch) {
        wa[u] = ld_stream(pa + c);
        if (rb >= 0) wb[u] = ld_stream(pb + c);
      }
    }
  }
  __device__ void compute(int64_t g, int64_t b, const uint4* wa, const uint4* wb, const float* const* xr, float* a0,
                          float* a1) const {
#if DSV3_GEMV_ABLATE == 1  // measurement only (wrong numbers): the weight loads without the arithmetic
    uint32_t xx = 0;
#pragma unroll
    for (int u = 0; u < PU; ++u) xx ^= wa[u].x ^ wa[u].y ^ wa[u].z ^ wa[u].w ^ wb[u].x ^ wb[u].y ^ wb[u].z ^ wb[u].w;
    a0[0] += __uint_as_float(xx & 0x3fffffffu);
    return;
#endif
    int64_t ra, rb;
    rows_of(g, ra, rb);
    const Src A = src(g, false), B = src(g, true);
    const float* sa = WT == kFP8 ? A.s + ((A.row0 + ra) >> 7) * A.lds : nullptr;
    const float* sb = WT == kFP8 && rb >= 0 ? B.s + ((B.row0 + rb) >> 7) * B.lds : nullptr;
#pragma unroll
    for (int u = 0; u < PU; ++u) {
      const int64_t c = b * 32 * PU + 32 * u + lane;
      if (c < nch) {
        const int64_t k = c * CE;
        chunk_dot2<WT, NT, SX>(wa[u], wb[u], rb >= 0, WT == kFP8 ? sa[(A.col0 + k) >> 7] : 1.f,
                               WT == kFP8 && rb >= 0 ? sb[(B.col0 + k) >> 7] : 1.f, xr, k, a0, a1);
      }
    }
  }
  __device__ void finish(int64_t g, float* a0, float* a1) const {
    int64_t ra, rb;
    rows_of(g, ra, rb);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      a0[j] = warp_sum(a0[j]);
      a1[j] = warp_sum(a1[j]);
    }
    if (lane == 0) {
      const bool second = TWO && g >= g1;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (j >= J.m) break;
        float* yj = second ? J.y2 + j * J.ldy2 : J.y + j * J.ldy;
        if (J.fused) {
          yj[ra] = silu(a0[j]) * a1[j];
        } else {
          yj[ra] = a0[j];
          if (rb >= 0) yj[rb] = a1[j];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) a0[j] = a1[j] = 0.f;
  }
};

struct NoStaging {
  __device__ void operator()() const {}
};

// Row groups first, first + stride, ... of one job; calls pdl_wait before reading activations,
// then stage() (every thread of the block: it may sync the block, e.g. to stage x in shared memory).
template <int WT, int NT, bool TWO = false, bool SX = false, class Stage = NoStaging>
__device__ void run_stream(const Job& J, int64_t first, int64_t stride, bool prefetch, Stage stage = Stage()) {
  Stream<WT, NT, TWO, SX> S(J, first, stride);
  constexpr int PU = Stream<WT, NT, TWO, SX>::PU;
  if (first >= S.ngroups) {
    pdl_wait();
    stage();
    return;
  }
  uint4 ca[PU], cb[PU], na[PU], nb_[PU];
  int64_t g = first, b = 0;
  if (prefetch) S.load(g, b, ca, cb);
  pdl_wait();
  stage();
  if (!prefetch) S.load(g, b, ca, cb);
  const float* xr[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) xr[j] = j < J.m ? J.x + (J.idx ? int64_t(J.idx[j]) : int64_t(j)) * J.ldx : nullptr;
  float a0[NT], a1[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) a0[j] = a1[j] = 0.f;
  while (true) {
    int64_t g2 = g, b2 = b + 1;
    if (b2 == S.nb) b2 = 0, g2 = g + stride;
    const bool more = g2 < S.ngroups;
    if (more) S.load(g2, b2, na, nb_);
    S.compute(g, b, ca, cb, xr, a0, a1);
    if (b == S.nb - 1) S.finish(g, a0, a1);
    if (!more) break;
    g = g2, b = b2;
#pragma unroll
    for (int u = 0; u < PU; ++u) ca[u] = na[u], cb[u] = nb_[u];
  }
}

// The general path (any layout, any number of tokens): one row group per warp, NT tokens at a time.
template <int WT, int NT>
__device__ void run_general(const Job& J, int64_t first, int64_t stride) {
  pdl_wait();
  const int64_t rows = J.a.rows;
  const int64_t groups = J.fused ? rows : (rows + 1) / 2;
  for (int64_t g = first; g < groups; g += stride) {
    if (J.fused) warp_rows<WT, NT>(J, g, g);
    else warp_rows<WT, NT>(J, 2 * g, 2 * g + 1 < rows ? 2 * g + 1 : -1);
  }
}

template <int WT, int NT, bool TWO = false>  // TWO: streaming only (gemv2_ok)
__device__ __forceinline__ void run_job(const Job& J, bool prefetch) {
  const int64_t first = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5), stride = int64_t(gridDim.x) * kWarps;
  if (TWO || (J.vec && J.m <= NT)) run_stream<WT, NT, TWO>(J, first, stride, prefetch);
  else run_general<WT, NT>(J, first, stride);
}

template <int WT, int NT, bool TWO = false>
__global__ void __launch_bounds__(kWarps * 32, 2) gemv_kernel(Job J, GemvShift sh) {
  const int64_t b = blockIdx.y;
  J.x += b * sh.xs;
  J.y += b * sh.ys;
  J.a.row0 += b * sh.wrows;
  J.b.row0 += b * sh.wrows;
  run_job<WT, NT, TWO>(J, true);  // waits inside, after its first weight loads
  pdl_trigger();
}

constexpr int kSplitsMaxC = 512;  // gemv_splits: the widest x staged in shared memory

// One token's value absorption, its decode attention's position splits combined here
// (blockIdx.y: head b): x_b in shared memory (the splits weighted as combine_splits does, or ol
// where the token's length took one split), then the streaming GEMV of head b's rows on it.
template <int WT>
__global__ void __launch_bounds__(kWarps * 32, 2) gemv_splits_kernel(Job J, GemvShift sh, const DevPos* pos, int nsplit,
                                                                     const float* part, const float* ml,
                                                                     const float* ol) {
  __shared__ __align__(16) float xs[kSplitsMaxC];
  __shared__ float fz[kDecMaxSplits];
  __shared__ float lsum;
  const int64_t b = blockIdx.y, C = J.a.cols, heads = gridDim.y;
  J.y += b * sh.ys;
  J.a.row0 += b * sh.wrows;
  J.b.row0 += b * sh.wrows;
  J.x = xs;
  auto stage = [&] {
    const int64_t len = int64_t(pos[0].pos) + 1;  // (pos: copied before the step's first kernel)
    const int ns = dec_splits(len, dec_chunk(len, nsplit));
    if (ns == 1) {
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) xs[c] = __ldcg(ol + b * C + c);
    } else {
      if (threadIdx.x < 32) {
        const float L = split_factors(ml, ns, heads, b, fz);
        if (threadIdx.x == 0) lsum = L;
      }
      __syncthreads();
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) xs[c] = split_column(part, ns, heads, C, b, c, fz, lsum);
    }
    __syncthreads();
  };
  const int64_t first = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5), stride = int64_t(gridDim.x) * kWarps;
  run_stream<WT, 1, false, true>(J, first, stride, true, stage);
  pdl_trigger();
}

// One token's paired GEMV (gemv2) whose x is the MoE layer's pending output made into the next
// layer's input by each block (CombineStage), then the streaming GEMV of both weights on it.
template <int WT>
__global__ void __launch_bounds__(kWarps * 32, 2) gemv2_combine_kernel(Job J, CombineNorm cn) {
  static_assert(kWarps * 32 == kCombThreads);
  __shared__ __align__(16) float xs[kCombMaxD];
  CombineStage cs(cn, xs);
  cs.load();
  J.x = xs;
  const int64_t first = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5), stride = int64_t(gridDim.x) * kWarps;
  run_stream<WT, 1, true, true>(J, first, stride, true, [&] { cs.run(); });
  pdl_trigger();
}

// blockIdx.y: an expert slot (launch_slot, expert_slot).
template <int WT, int NT>
__global__ void __launch_bounds__(kWarps * 32, 2) moe_gemv_kernel(int stage, const DevExpert* __restrict__ table,
                                                                  MoeSched s, const float* in, int64_t ldin, bool xvec,
                                                                  float* out, int64_t ldout) {
  int e;
  int64_t off, cnt;
  const int y = launch_slot<NT == 1>(s, stage);
  if (!expert_slot<NT == 1>(s, stage, y, e, off, cnt)) return;
  const DevExpert& X = table[e];
  Job J;
  if (stage == 0) {
    J.a = X.w1, J.b = X.w3, J.fused = true;
    J.x = in, J.ldx = ldin, J.idx = slot_tokens(s, y, off);
    J.vec = X.vec13 && xvec;
  } else {
    J.a = X.w2, J.b = X.w2, J.fused = false;
    J.x = in + off * ldin, J.ldx = ldin, J.idx = nullptr;
    J.vec = X.vec2 && xvec;
  }
  J.m = cnt;
  J.y = out + off * ldout;
  J.ldy = ldout;
  run_job<WT, NT>(J, true);  // (a second pdl_wait is a no-op)
  pdl_trigger();
}

// The warp's share of gate row r in 16-byte chunks: [lo, hi) of kWarps equal slices, from pa.
template <int WT>
__device__ __forceinline__ const uint4* gate_chunks(const Job& J, int64_t r, int64_t& lo, int64_t& hi) {
  const int64_t nch = J.a.cols / chunk_elems<WT>(), per = (nch + kWarps - 1) / kWarps;
  lo = (threadIdx.x >> 5) * per, hi = lo + per < nch ? lo + per : nch;
  return reinterpret_cast<const uint4*>(static_cast<const char*>(J.a.w) +
                                        ((J.a.row0 + r) * J.a.ld + J.a.col0) * elem_bytes<WT>());
}
constexpr int kGateU = 4;  // chunks per lane per batch
// The lane's first batch of them (the kernel loads it before its wait: weights never come from
// a kernel).
template <int WT>
__device__ __forceinline__ void gate_first(const Job& J, int64_t r, uint4* w4) {
  int64_t lo, hi;
  const uint4* pa = gate_chunks<WT>(J, r, lo, hi);
  const int64_t c0 = lo + (threadIdx.x & 31);
#pragma unroll
  for (int u = 0; u < kGateU; ++u)
    if (c0 + 32 * u < hi) w4[u] = ld_stream(pa + c0 + 32 * u);
}

// Gate row r's partial dot products with NT tokens over the warp's share of K (kWarps equal
// slices of the 16-byte chunks; elements when not vectorisable): acc[j] for token t0 + j.
// first: the lane's first batch already loaded (gate_first), or null. SX: x in shared memory.
template <int WT, int NT, bool SX = false>
__device__ __forceinline__ void gate_slice(const Job& J, int64_t r, int64_t t0, float* acc, const uint4* first) {
  constexpr int CE = chunk_elems<WT>(), U = kGateU;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const DevLinear& A = J.a;
  const float* xr[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) xr[j] = t0 + j < J.m ? J.x + (t0 + j) * J.ldx : nullptr;
  if (J.vec) {
    int64_t lo, hi;
    const uint4* pa = gate_chunks<WT>(J, r, lo, hi);
    for (int64_t c0 = lo + lane; c0 < hi; c0 += 32 * U) {
      uint4 w4[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (c0 + 32 * u < hi) w4[u] = first && c0 == lo + lane ? first[u] : ld_stream(pa + c0 + 32 * u);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (c0 + 32 * u >= hi) break;
        float w[CE];
        decode<WT>(w4[u], w);
        chunk_dot<WT, NT, SX>(w, 1.f, xr, (c0 + 32 * u) * CE, acc);
      }
    }
  } else {
    const int64_t per = (A.cols + kWarps - 1) / kWarps, lo = warp * per, hi = lo + per < A.cols ? lo + per : A.cols;
    for (int64_t k = lo + lane; k < hi; k += 32) {
      const float wv = w_at(A, r, k);
#pragma unroll
      for (int j = 0; j < NT; ++j)
        if (xr[j]) acc[j] = fmaf(wv, xr[j][k], acc[j]);
    }
  }
}

constexpr int kNormPer = 8;                       // gate_route's residual add + norm: values per thread
constexpr int kNormMaxD = kWarps * 32 * kNormPer;  // ... and rows of up to this many

// The MoE gate for a few tokens (logits to J.y) with the router run by whichever block finishes
// last (a device counter, reset by it): one launch instead of two. A block per gate row, its
// warps splitting K, so the gate's few rows are read by many SMs at once; one token is routed
// by the whole last block (route_one_block), more by a warp each and grouped (group_pairs).
// NORM (one token): the layer's residual add and norm before it (add_rmsnorm's arithmetic) done
// by every block for its own row into shared memory, block 0 writing h and x for the kernels after.
template <int WT, int NT, bool NORM = false>
__global__ void __launch_bounds__(kWarps * 32, 2) gate_route_kernel(Job J, RouteArgs ra, const float* bias, MoeSched s,
                                                                    unsigned* counter, bool route, GateNorm an) {
  __shared__ float sc_s[kWarps][kMaxE], ch_s[kWarps][kMaxE];
  __shared__ float gs_s[kWarps][kMaxG];
  __shared__ float part[kWarps][NT];
  __shared__ __align__(16) float xs[NORM ? kNormMaxD : 4];
  __shared__ float red[33];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r = blockIdx.x;
  uint4 first[kGateU];
  if (J.vec) gate_first<WT>(J, r, first);
  float hv[kNormPer], wv[kNormPer];
  if (NORM) {  // before the wait: the norm weights and h (last written several kernels back, as add_rmsnorm)
#pragma unroll
    for (int j = 0; j < kNormPer; ++j) {
      const int64_t k = threadIdx.x + int64_t(j) * blockDim.x;
      wv[j] = k < an.d ? an.w[k] : 0.f;
      hv[j] = k < an.d ? __ldcg(an.h + k) : 0.f;
    }
  }
  // The trigger comes right after the wait: the expert kernel's blocks may start and load the
  // shared experts' first weights while the last block routes.
  pdl_wait();
  pdl_trigger();
  if (NORM) {
    float rv[kNormPer], ss = 0.f;
#pragma unroll
    for (int j = 0; j < kNormPer; ++j) {
      const int64_t k = threadIdx.x + int64_t(j) * blockDim.x;
      rv[j] = k < an.d ? an.r[k] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kNormPer; ++j) {
      hv[j] += rv[j];
      ss += hv[j] * hv[j];  // (0 past d)
    }
    ss = block_sum(ss, red);
    const float rr = 1.f / sqrtf(ss / float(an.d) + an.eps);
#pragma unroll
    for (int j = 0; j < kNormPer; ++j) {
      const int64_t k = threadIdx.x + int64_t(j) * blockDim.x;
      if (k >= an.d) break;
      const float xv = hv[j] * rr * wv[j];
      xs[k] = xv;
      if (blockIdx.x == 0) an.h[k] = hv[j], an.x[k] = xv;
    }
    __syncthreads();
    J.x = xs;
  }
  for (int64_t t0 = 0; t0 < J.m; t0 += NT) {
    float acc[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j] = 0.f;
    gate_slice<WT, NT, NORM>(J, r, t0, acc, J.vec && t0 == 0 ? first : nullptr);
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j] = warp_sum(acc[j]);
    if (lane == 0)
#pragma unroll
      for (int j = 0; j < NT; ++j) part[warp][j] = acc[j];
    __syncthreads();
    if (threadIdx.x < NT && t0 + threadIdx.x < J.m) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) v += part[w][threadIdx.x];
      J.y[(t0 + threadIdx.x) * J.ldy + r] = v;
    }
    __syncthreads();
  }
  if (DSV3_TRACE && threadIdx.x == 0 && blockIdx.x == 0) trace_point();  // block 0's gate row written
  if (route && last_to_arrive(counter, gridDim.x)) {
    if (DSV3_TRACE && threadIdx.x == 0) trace_point();  // the last block: routing starts
    if (s.n == 1) {  // one token: the block routes it and writes the schedule (no grouping)
      route_one_block(ra, J.y, bias, s, nullptr, nullptr);
    } else {
      for (int64_t i = warp; i < s.n; i += kWarps)
        route_token_warp(ra, J.y, bias, s, i, {sc_s[warp], ch_s[warp], gs_s[warp]}, nullptr, nullptr);
      __syncthreads();
      group_pairs(s, true);
    }
    if (threadIdx.x == 0) *counter = 0;
    if (DSV3_TRACE && threadIdx.x == 0) trace_point();  // routed
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }


// Blocks for `groups` row groups: every group its own warp when that fits in two blocks per SM,
// else two blocks per SM whose warps loop (the streaming path pipelines across groups).
// (Eight tokens: one group per warp and many blocks, which measured faster there.)
unsigned gemv_blocks(int64_t groups, int64_t batch, int nt) {
  const int64_t want = (groups + kWarps - 1) / kWarps, cap = std::max<int64_t>(1, 2 * device_sms() / std::max<int64_t>(batch, 1));
  return unsigned(std::max<int64_t>(1, nt == 1 ? std::min(want, cap) : want));
}

template <int WT, int NT>
void launch_gemv(const Launch& L, const Job& J, int batch, GemvShift sh) {
  const bool two = J.c.rows > 0;
  const int64_t groups = J.fused ? J.a.rows : (J.a.rows + 1) / 2 + (J.c.rows + 1) / 2;
  const dim3 grid(gemv_blocks(groups, batch, NT), unsigned(batch));
  if (two) launch(L, gemv_kernel<WT, NT, true>, grid, dim3(kWarps * 32), 0, J, sh);
  else launch(L, gemv_kernel<WT, NT>, grid, dim3(kWarps * 32), 0, J, sh);
}

template <int WT>
void dispatch_nt(const Launch& L, const Job& J, int batch, GemvShift sh) {
  if (J.m == 1) launch_gemv<WT, 1>(L, J, batch, sh);
  else launch_gemv<WT, 8>(L, J, batch, sh);
}

}  // namespace

int device_sms() {
  static const int n = [] {
    int dev = 0, v = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    return v > 0 ? v : 132;
  }();
  return n;
}

// Whether a weight rectangle can be read in 16-byte chunks.
bool vec_ok(const DevLinear& w) {
  const int ce = w.t == kBF16 ? 8 : (w.t == kFP8 ? 16 : 4);
  return aligned16(w.w) && w.cols % ce == 0 && w.ld % ce == 0 && w.col0 % ce == 0;
}

void gemv(const Launch& L, const DevLinear& w, const DevLinear* w3, const ProductRows& io) {
  if (io.m <= 0 || w.rows <= 0) return;
  if (tcv_gemv(L, w, w3, io)) return;
  const int batch = io.batch;
  const GemvShift shift = io.shift;
  Job J;
  J.a = w;
  J.fused = w3 != nullptr;
  J.b = w3 ? *w3 : w;
  DSV3_CHECK(!w3 || (w3->t == w.t && w3->rows == w.rows && w3->cols == w.cols));
  J.x = io.x, J.ldx = io.ldx, J.idx = io.idx, J.m = io.m, J.y = io.y, J.ldy = io.ldy;
  // Activation rows must be float4-aligned for the vector path (also after the batch shift).
  const bool xvec = aligned16(io.x) && io.ldx % 4 == 0 && shift.xs % 4 == 0;
  J.vec = xvec && vec_ok(w) && (!w3 || vec_ok(*w3));
  switch (w.t) {
    case kBF16: dispatch_nt<kBF16>(L, J, batch, shift); break;
    case kFP8: dispatch_nt<kFP8>(L, J, batch, shift); break;
    default: dispatch_nt<kF32>(L, J, batch, shift); break;
  }
}

void gemv2(const Launch& L, const DevLinear& w, float* y, const DevLinear& w2, float* y2, const float* x, int64_t m) {
  DSV3_CHECK(gemv2_ok(w, w2, x, m), "gemv2: weights that cannot share one launch");
  if (tcv_gemv2(L, w, y, w2, y2, x, m)) return;
  Job J;
  J.a = J.b = w;
  J.fused = false;
  J.x = x, J.ldx = w.cols, J.idx = nullptr, J.m = m, J.y = y, J.ldy = w.rows;
  J.vec = true;
  J.c = w2, J.y2 = y2, J.ldy2 = w2.rows;
  switch (w.t) {
    case kBF16: dispatch_nt<kBF16>(L, J, 1, GemvShift{}); break;
    case kFP8: dispatch_nt<kFP8>(L, J, 1, GemvShift{}); break;
    default: dispatch_nt<kF32>(L, J, 1, GemvShift{}); break;
  }
}

bool gate_norm_ok(int64_t d) { return d >= 1 && d <= kNormMaxD && d % 4 == 0; }

// Whether the FMA streaming GEMV takes w for one token (the tensor-core GEMV would not).
static bool fma_takes(const Launch& L, const DevLinear& w) {
  const bool tcv = L.tcv_max >= 1 && ((w.t == kFP8 && !L.fp8_linear_on_fma(1)) || (w.t == kBF16 && L.tcv_bf16_min == 1));
  return !tcv && vec_ok(w);
}

bool gemv2_combine_ok(const Launch& L, const DevLinear& w, const DevLinear& w2, const CombineNorm& cn) {
  const bool al = ((reinterpret_cast<uintptr_t>(cn.o) | reinterpret_cast<uintptr_t>(cn.y) |
                    reinterpret_cast<uintptr_t>(cn.h) | reinterpret_cast<uintptr_t>(cn.w) |
                    reinterpret_cast<uintptr_t>(cn.x)) & 15) == 0;
  return cn.s.n == 1 && cn.s.K + cn.s.S <= kMaxK + 16 && cn.d >= 1 && cn.d <= kCombMaxD && cn.d % 4 == 0 &&
         w.cols == cn.d && al && gemv2_ok(w, w2, cn.x, 1) && fma_takes(L, w) && fma_takes(L, w2);
}

void gemv2_combine(const Launch& L, const DevLinear& w, float* y, const DevLinear& w2, float* y2,
                   const CombineNorm& cn) {
  DSV3_CHECK(gemv2_combine_ok(L, w, w2, cn), "gemv2_combine: weights or a MoE output it cannot take");
  Job J;
  J.a = J.b = w;
  J.fused = false;
  J.x = nullptr, J.ldx = w.cols, J.idx = nullptr, J.m = 1, J.y = y, J.ldy = w.rows;
  J.vec = true;
  J.c = w2, J.y2 = y2, J.ldy2 = w2.rows;
  const dim3 grid(gemv_blocks((w.rows + 1) / 2 + (w2.rows + 1) / 2, 1, 1));
  switch (w.t) {
    case kBF16: launch(L, gemv2_combine_kernel<kBF16>, grid, dim3(kWarps * 32), 0, J, cn); break;
    case kFP8: launch(L, gemv2_combine_kernel<kFP8>, grid, dim3(kWarps * 32), 0, J, cn); break;
    default: launch(L, gemv2_combine_kernel<kF32>, grid, dim3(kWarps * 32), 0, J, cn); break;
  }
}

bool gemv_splits_ok(const Launch& L, const DevLinear& w) {
  // Where the tensor-core GEMV would take the weights, the attention combines its splits as before.
  return fma_takes(L, w) && w.cols <= kSplitsMaxC && w.cols % 16 == 0;
}

void gemv_splits(const Launch& L, const DevLinear& w, int heads, GemvShift shift, const DevPos* pos,
                 const DecodeAttn& a, float* y) {
  const int nsplit = a.nsplit;
  const float *part = a.part, *ml = a.ml, *ol = a.ol;
  DSV3_CHECK(gemv_splits_ok(L, w) && nsplit >= 1 && nsplit <= kDecMaxSplits && heads >= 1, "gemv_splits: ", w.cols,
             " columns, ", nsplit, " splits");
  Job J;
  J.a = J.b = w;
  J.fused = false;
  J.x = nullptr, J.ldx = w.cols, J.idx = nullptr, J.m = 1, J.y = y, J.ldy = 0;
  J.vec = true;
  const dim3 grid(gemv_blocks((w.rows + 1) / 2, heads, 1), unsigned(heads));
  switch (w.t) {
    case kBF16: launch(L, gemv_splits_kernel<kBF16>, grid, dim3(kWarps * 32), 0, J, shift, pos, nsplit, part, ml, ol); break;
    case kFP8: launch(L, gemv_splits_kernel<kFP8>, grid, dim3(kWarps * 32), 0, J, shift, pos, nsplit, part, ml, ol); break;
    default: launch(L, gemv_splits_kernel<kF32>, grid, dim3(kWarps * 32), 0, J, shift, pos, nsplit, part, ml, ol); break;
  }
}

bool gemv2_ok(const DevLinear& w, const DevLinear& w2, const float* x, int64_t m) {
  return m >= 1 && m <= 8 && w.t == w2.t && w.cols == w2.cols && w.cols % 4 == 0 && aligned16(x) && vec_ok(w) &&
         vec_ok(w2);
}

void moe_gemv(const Launch& L, const MoeStage& st, const MoeSched& s) {
  const int64_t groups = st.stage == 0 ? st.max_rows : (st.max_rows + 1) / 2;
  const int64_t max_active = s.max_slots();
  const dim3 grid(gemv_blocks(groups, max_active, s.n == 1 ? 1 : 8), unsigned(max_active));
  const bool xvec = aligned16(st.in) && st.ldin % 4 == 0;
  const bool one = s.n == 1;  // each expert then sees exactly one token
  auto go = [&](auto k1, auto k8) {
    launch(L, one ? k1 : k8, grid, dim3(kWarps * 32), 0, st.stage, st.table, s, st.in, st.ldin, xvec, st.out, st.ldout);
  };
  switch (st.wtype) {
    case kBF16: go(moe_gemv_kernel<kBF16, 1>, moe_gemv_kernel<kBF16, 8>); break;
    case kFP8: go(moe_gemv_kernel<kFP8, 1>, moe_gemv_kernel<kFP8, 8>); break;
    default: go(moe_gemv_kernel<kF32, 1>, moe_gemv_kernel<kF32, 8>); break;
  }
}

void gate_route(const Launch& L, const DevLinear& gate, const RouteArgs& r, const MoeSched& s, const GateRoute& g) {
  const float *x = g.x, *bias = g.bias;
  const int64_t n = g.n;
  float* logits = g.logits;
  unsigned* counter = g.counter;
  const bool route = g.route;
  const GateNorm* an = g.norm;
  DSV3_CHECK(n <= 8 && r.E <= kMaxE && r.K <= kMaxK && r.G <= kMaxG && s.S <= 16 && r.E % r.G == 0);
  Job J;
  J.a = J.b = gate;
  J.fused = false;
  J.x = x, J.ldx = gate.cols, J.idx = nullptr, J.m = n, J.y = logits, J.ldy = gate.rows;
  J.vec = aligned16(x) && gate.cols % 4 == 0 && vec_ok(gate);
  const bool norm = an != nullptr;
  DSV3_CHECK(!norm || (n == 1 && gate_norm_ok(an->d)), "gate_route: the residual add + norm of ", an ? an->d : 0,
             " values at ", n, " tokens");
  const GateNorm N = norm ? *an : GateNorm{};
  const dim3 grid(unsigned(gate.rows));  // a block per row
  const bool one = n == 1;
  if (gate.t == kBF16) {
    if (norm) launch(L, gate_route_kernel<kBF16, 1, true>, grid, dim3(kWarps * 32), 0, J, r, bias, s, counter, route, N);
    else if (one) launch(L, gate_route_kernel<kBF16, 1>, grid, dim3(kWarps * 32), 0, J, r, bias, s, counter, route, N);
    else launch(L, gate_route_kernel<kBF16, 8>, grid, dim3(kWarps * 32), 0, J, r, bias, s, counter, route, N);
  } else {
    DSV3_CHECK(gate.t == kF32, "MoE gate weight must be bf16 or float32 on the device");
    if (norm) launch(L, gate_route_kernel<kF32, 1, true>, grid, dim3(kWarps * 32), 0, J, r, bias, s, counter, route, N);
    else if (one) launch(L, gate_route_kernel<kF32, 1>, grid, dim3(kWarps * 32), 0, J, r, bias, s, counter, route, N);
    else launch(L, gate_route_kernel<kF32, 8>, grid, dim3(kWarps * 32), 0, J, r, bias, s, counter, route, N);
  }
}

}  // namespace dsv3::cuda
