// MoE on the device: the router (Gate.forward, same choices as model/gate.cc) and the grouping
// of (token, expert) pairs by expert in one block, and the weighted un-permute.
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/moe_route.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

// mode 0: route and group in one block (few tokens); 1: route only, a warp per token over many
// blocks (group_kernel groups).
__global__ void __launch_bounds__(kRouteWarps * 32) route_kernel(int mode, RouteArgs ra,
                                                                 const float* __restrict__ logits,
                                                                 const float* __restrict__ bias, MoeSched s,
                                                                 bool tiles, int32_t* topk_idx, float* topk_w) {
  __shared__ float sc_s[kRouteWarps][kMaxE], ch_s[kRouteWarps][kMaxE];
  __shared__ float gs_s[kRouteWarps][kMaxG];
  pdl_wait();
  pdl_trigger();
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (mode == 0 && s.n == 1 && int(blockDim.x) >= s.E) {  // one token: the block routes it
    route_one_block(ra, logits, bias, s, topk_idx, topk_w);
    return;
  }
  const int64_t first = int64_t(blockIdx.x) * nwarps + warp, stride = int64_t(gridDim.x) * nwarps;
  for (int64_t i = first; i < s.n; i += stride)
    route_token_warp(ra, logits, bias, s, i, {sc_s[warp], ch_s[warp], gs_s[warp]}, topk_idx, topk_w);
  if (mode == 1) return;
  __syncthreads();
  group_pairs(s, tiles);
}

// group_pairs alone, a thread per token in a block of 1024 (after route_kernel's mode 1).
__global__ void __launch_bounds__(1024) group_kernel(MoeSched s) {
  pdl_wait();
  pdl_trigger();
  group_pairs(s, true);
}

// The gate's logits of many tokens in float32 FMAs, the routing's float32-grade input:
// logits[i, e] = x[i, :] · W[e, :], W bf16 or float32 [E, D]. A block takes kGateTok tokens and
// every expert; warp w takes experts w, w + 8, ... eight at a time, lane l columns 8 l + 256 j
// (16-byte weight loads; the tokens' rows from L1, shared by the warps), then a butterfly over
// the warp leaves lane l the sum of its (expert l / 4, token l % 4).
constexpr int kGateTok = 4;
template <int WT>
__global__ void __launch_bounds__(256) gate_logits_kernel(DevLinear w, const float* __restrict__ x, int64_t n,
                                                          float* __restrict__ logits) {
  pdl_wait();
  pdl_trigger();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t i0 = int64_t(blockIdx.x) * kGateTok, D = w.cols, E = w.rows;
  for (int64_t e0 = warp; e0 < E; e0 += 64) {  // experts e0 + 8 m, m < 8
    float v[32];  // v[4 m + t]: expert e0 + 8 m, token i0 + t
#pragma unroll
    for (int c = 0; c < 32; ++c) v[c] = 0.f;
    for (int64_t k = 8 * lane; k + 8 <= D; k += 256) {
      float xs[kGateTok][8];
#pragma unroll
      for (int t = 0; t < kGateTok; ++t) {
        const bool ok = i0 + t < n;
        const float4* xp = reinterpret_cast<const float4*>(x + (ok ? i0 + t : 0) * D + k);
        const float4 a = ok ? xp[0] : make_float4(0.f, 0.f, 0.f, 0.f), b = ok ? xp[1] : make_float4(0.f, 0.f, 0.f, 0.f);
        xs[t][0] = a.x, xs[t][1] = a.y, xs[t][2] = a.z, xs[t][3] = a.w;
        xs[t][4] = b.x, xs[t][5] = b.y, xs[t][6] = b.z, xs[t][7] = b.w;
      }
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const int64_t e = e0 + 8 * m;
        if (e >= E) break;
        float wv[8];
        if constexpr (WT == kBF16) {
          const uint4 q = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(w.w) + (w.row0 + e) * w.ld +
                                                          w.col0 + k);
          const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
          for (int c = 0; c < 4; ++c) wv[2 * c] = bf16_bits(qw[c] & 0xffffu), wv[2 * c + 1] = bf16_bits(qw[c] >> 16);
        } else {
          const float4* wp = reinterpret_cast<const float4*>(static_cast<const float*>(w.w) + (w.row0 + e) * w.ld +
                                                             w.col0 + k);
          const float4 a = wp[0], b = wp[1];
          wv[0] = a.x, wv[1] = a.y, wv[2] = a.z, wv[3] = a.w, wv[4] = b.x, wv[5] = b.y, wv[6] = b.z, wv[7] = b.w;
        }
#pragma unroll
        for (int t = 0; t < kGateTok; ++t)
#pragma unroll
          for (int c = 0; c < 8; ++c) v[4 * m + t] = fmaf(xs[t][c], wv[c], v[4 * m + t]);
      }
    }
    // Butterfly: after the step of offset 16 >> s, lane l holds in v[0, 16 >> s) the partial sums of
    // the values whose index agrees with l in the bits above; at the end v[0] is value l's sum.
#pragma unroll
    for (int half = 16; half >= 1; half >>= 1) {
      const bool up = lane & half;
#pragma unroll
      for (int c = 0; c < half; ++c) {
        const float send = up ? v[c] : v[c + half], keep = up ? v[c + half] : v[c];
        v[c] = keep + __shfl_xor_sync(0xffffffffu, send, half);
      }
    }
    const int64_t e = e0 + 8 * (lane >> 2), i = i0 + (lane & 3);
    if (e < E && i < n) logits[i * E + e] = v[0];
  }
}

__global__ void combine_kernel(MoeSched s, const float* __restrict__ o, int64_t d, float* __restrict__ y) {
  __shared__ int64_t po[kMaxK + 16];
  __shared__ float pw[kMaxK + 16];
  pdl_wait();
  pdl_trigger();
  const int64_t i = blockIdx.x;
  const int K = s.K, Kt = s.K + s.S;
  if (threadIdx.x < Kt) {
    po[threadIdx.x] = int64_t(s.pair_of[i * Kt + threadIdx.x]) * d;
    pw[threadIdx.x] = s.pw[i * Kt + threadIdx.x];
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float v[kMaxK + 16];
#pragma unroll
    for (int k = 0; k < kMaxK + 16; ++k)
      if (k < Kt) v[k] = o[po[k] + c];  // all loads first
    float r = 0.f, sh = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxK + 16; ++k) {
      if (k < K) r += v[k] * pw[k];
      else if (k < Kt) sh += v[k];
    }
    y[i * d + c] = r + sh;
  }
}

// Four consecutive floats at p (only the first `rem` when fewer remain; V4: one aligned float4).
template <bool V4>
__device__ __forceinline__ float4 load4(const float* p, int64_t rem) {
  if (V4) return *reinterpret_cast<const float4*>(p);
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (rem > 0) v.x = p[0];
  if (rem > 1) v.y = p[1];
  if (rem > 2) v.z = p[2];
  if (rem > 3) v.w = p[3];
  return v;
}
template <bool V4>
__device__ __forceinline__ void store4(float* p, int64_t rem, float4 v) {
  if (V4) {
    *reinterpret_cast<float4*>(p) = v;
    return;
  }
  if (rem > 0) p[0] = v.x;
  if (rem > 1) p[1] = v.y;
  if (rem > 2) p[2] = v.z;
  if (rem > 3) p[3] = v.w;
}

// combine_kernel's sum for token i, then h[i] += it and x[i] = rmsnorm(h[i]) * w (the MoE
// output, the residual add and the next layer's norm in one pass); y[i] gets the MoE output too.
// Each thread takes four consecutive columns at a time (float4 when V4: d % 4 == 0 and aligned)
// and has 8 pair rows' loads in flight.
template <bool V4>
__global__ void __launch_bounds__(1024) combine_add_rmsnorm_kernel(MoeSched s, const float* __restrict__ o, int64_t d,
                                                                   float* __restrict__ y, float* h,
                                                                   const float* __restrict__ w, float eps, float* x) {
  __shared__ int64_t po[kMaxK + 16];
  __shared__ float pw[kMaxK + 16];
  __shared__ float red[33];
  const int64_t i = blockIdx.x;
  const int K = s.K, Kt = s.K + s.S;
  // Before the wait: the norm weights of the thread's first columns, the token's pair rows and
  // weights, and the residual of those columns — the router (or for one token the first routed
  // block of stage 0) wrote the pairs at least two kernels back (both expert stages run between),
  // the residual's last writer (the attention's add + norm, for one token the gate kernel doing
  // it) three or four, so with every kernel triggering only after its own wait they are complete.
  const int64_t c0 = int64_t(threadIdx.x) * 4;
  const float4 w0 = c0 < d ? load4<V4>(w + c0, d - c0) : make_float4(0.f, 0.f, 0.f, 0.f);
  float4 h0 = make_float4(0.f, 0.f, 0.f, 0.f);  // (through L2: written by another kernel)
  if (c0 < d) h0 = V4 ? __ldcg(reinterpret_cast<const float4*>(h + i * d + c0)) : load4<V4>(h + i * d + c0, d - c0);
  if (threadIdx.x < Kt) {
    po[threadIdx.x] = int64_t(s.pair_of[i * Kt + threadIdx.x]) * d;
    pw[threadIdx.x] = s.pw[i * Kt + threadIdx.x];
  }
  pdl_wait();
  pdl_trigger();
  __syncthreads();
  float ss = 0.f;
  for (int64_t c = int64_t(threadIdx.x) * 4; c < d; c += int64_t(blockDim.x) * 4) {
    const int64_t rem = d - c;
    const float4 m = combine4(o, po, pw, K, Kt, c, [&](const float* p) { return load4<V4>(p, rem); });
    float4 hv = c == c0 ? h0 : load4<V4>(h + i * d + c, rem);
    hv.x += m.x, hv.y += m.y, hv.z += m.z, hv.w += m.w;
    if (c == c0) h0 = hv;  // kept for the norm's pass
    store4<V4>(y + i * d + c, rem, m);
    store4<V4>(h + i * d + c, rem, hv);
    ss += hv.x * hv.x + hv.y * hv.y + hv.z * hv.z + hv.w * hv.w;  // columns past d are 0
  }
  ss = block_sum(ss, red);
  const float rr = 1.f / sqrtf(ss / float(d) + eps);
  for (int64_t c = int64_t(threadIdx.x) * 4; c < d; c += int64_t(blockDim.x) * 4) {
    const int64_t rem = d - c;
    const float4 hv = c == c0 ? h0 : load4<V4>(h + i * d + c, rem), wv = c == c0 ? w0 : load4<V4>(w + c, rem);
    store4<V4>(x + i * d + c, rem, make_float4(hv.x * rr * wv.x, hv.y * rr * wv.y, hv.z * rr * wv.z, hv.w * rr * wv.w));
  }
}

}  // namespace

void moe_combine_add_rmsnorm(const Launch& L, const CombineNorm& cn) {
  const MoeSched& s = cn.s;
  const float *o = cn.o, *w = cn.w;
  const int64_t d = cn.d;
  float *y = cn.y, *h = cn.h, *x = cn.x;
  const float eps = cn.eps;
  const bool v4 = d % 4 == 0 && ((reinterpret_cast<uintptr_t>(o) | reinterpret_cast<uintptr_t>(y) |
                                  reinterpret_cast<uintptr_t>(h) | reinterpret_cast<uintptr_t>(w) |
                                  reinterpret_cast<uintptr_t>(x)) & 15) == 0;
  const unsigned threads = unsigned(std::clamp<int64_t>((d / 4 + 31) / 32 * 32, 64, 1024));
  if (v4) launch(L, combine_add_rmsnorm_kernel<true>, dim3(unsigned(s.n)), dim3(threads), 0, s, o, d, y, h, w, eps, x);
  else launch(L, combine_add_rmsnorm_kernel<false>, dim3(unsigned(s.n)), dim3(threads), 0, s, o, d, y, h, w, eps, x);
}

void moe_route(const Launch& L, const RouteArgs& r, const float* logits, const float* bias, const MoeSched& s,
               int32_t* topk_idx, float* topk_w) {
  DSV3_CHECK(r.E <= kMaxE && r.K <= kMaxK && r.G <= kMaxG && s.S <= 16 && r.G >= 1 && r.E % r.G == 0 &&
                 r.topk_groups <= r.G && r.K <= r.E,
             "MoE shape beyond the CUDA router's limits (E <= 256, K <= 16, groups <= 64)");
  const bool tiles = true;
  if (s.n <= 16) {
    const int64_t warps = s.n == 1 ? kRouteWarps : std::min<int64_t>(kRouteWarps, std::max<int64_t>(s.n, 2));
    launch(L, route_kernel, dim3(1), dim3(unsigned(warps * 32)), 0, 0, r, logits, bias, s, tiles, topk_idx, topk_w);
  } else {
    launch(L, route_kernel, dim3(cdiv(s.n, kRouteWarps)), dim3(kRouteWarps * 32), 0, 1, r, logits, bias, s, tiles,
           topk_idx, topk_w);
    launch(L, group_kernel, dim3(1), dim3(1024), 0, s);
  }
}

bool gate_logits_ok(const DevLinear& gate) {
  return (gate.t == kBF16 || gate.t == kF32) && vec_ok(gate) && gate.cols % 8 == 0;
}

void gate_logits(const Launch& L, const DevLinear& gate, const float* x, int64_t n, float* logits) {
  DSV3_CHECK(gate_logits_ok(gate) && n > 0, "gate_logits: bf16 or float32 gate rows of whole 16-byte pieces");
  const dim3 grid(unsigned((n + kGateTok - 1) / kGateTok));
  if (gate.t == kBF16) launch(L, gate_logits_kernel<kBF16>, grid, dim3(256), 0, gate, x, n, logits);
  else launch(L, gate_logits_kernel<kF32>, grid, dim3(256), 0, gate, x, n, logits);
}

void moe_combine(const Launch& L, const MoeSched& s, const float* o, int64_t d, float* y) {
  launch(L, combine_kernel, dim3(unsigned(s.n)), dim3(256), 0, s, o, d, y);
}

}  // namespace dsv3::cuda
