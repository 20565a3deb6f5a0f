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

void moe_combine(const Launch& L, const MoeSched& s, const float* o, int64_t d, float* y) {
  launch(L, combine_kernel, dim3(unsigned(s.n)), dim3(256), 0, s, o, d, y);
}

}  // namespace dsv3::cuda
