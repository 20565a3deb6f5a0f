// MoE on the device: the router (Gate.forward, same choices as model/gate.cc) and the grouping
// of (token, expert) pairs by expert in one block, and the weighted un-permute.
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/moe_route.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

// mode 0: route and group in one block (few tokens); 1: route only, a warp per token over many
// blocks; 2: group only (one block).
__global__ void __launch_bounds__(kRouteWarps * 32) route_kernel(int mode, RouteArgs ra,
                                                                 const float* __restrict__ logits,
                                                                 const float* __restrict__ bias, MoeSched s,
                                                                 bool tiles, int32_t* topk_idx, float* topk_w) {
  __shared__ float sc_s[kRouteWarps][kMaxE], ch_s[kRouteWarps][kMaxE];
  __shared__ float gs_s[kRouteWarps][kMaxG];
  pdl_wait();
  pdl_trigger();
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (mode != 2) {
    const int64_t first = int64_t(blockIdx.x) * nwarps + warp, stride = int64_t(gridDim.x) * nwarps;
    for (int64_t i = first; i < s.n; i += stride)
      route_token_warp(ra, logits, bias, s, i, sc_s[warp], ch_s[warp], gs_s[warp], topk_idx, topk_w);
  }
  if (mode == 1) return;
  __syncthreads();
  group_pairs(s, tiles);
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

// combine_kernel's sum for token i, then h[i] += it and x[i] = rmsnorm(h[i]) * w (the MoE
// output, the residual add and the next layer's norm in one pass); y[i] gets the MoE output too.
__global__ void combine_add_rmsnorm_kernel(MoeSched s, const float* __restrict__ o, int64_t d, float* __restrict__ y,
                                           float* h, const float* __restrict__ w, float eps, float* x) {
  __shared__ int64_t po[kMaxK + 16];
  __shared__ float pw[kMaxK + 16];
  __shared__ float red[33];
  pdl_wait();
  pdl_trigger();
  const int64_t i = blockIdx.x;
  const int K = s.K, Kt = s.K + s.S;
  if (threadIdx.x < Kt) {
    po[threadIdx.x] = int64_t(s.pair_of[i * Kt + threadIdx.x]) * d;
    pw[threadIdx.x] = s.pw[i * Kt + threadIdx.x];
  }
  __syncthreads();
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float v[kMaxK + 16];
#pragma unroll
    for (int k = 0; k < kMaxK + 16; ++k)
      if (k < Kt) v[k] = o[po[k] + c];
    float r = 0.f, sh = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxK + 16; ++k) {
      if (k < K) r += v[k] * pw[k];
      else if (k < Kt) sh += v[k];
    }
    const float m = r + sh, hv = h[i * d + c] + m;
    y[i * d + c] = m;
    h[i * d + c] = hv;
    ss += hv * hv;
  }
  ss = block_sum(ss, red);
  const float rr = 1.f / sqrtf(ss / float(d) + eps);
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) x[i * d + c] = h[i * d + c] * rr * w[c];
}

}  // namespace

void moe_combine_add_rmsnorm(const Launch& L, const MoeSched& s, const float* o, int64_t d, float* y, float* h,
                             const float* w, float eps, float* x) {
  launch(L, combine_add_rmsnorm_kernel, dim3(unsigned(s.n)), dim3(256), 0, s, o, d, y, h, w, eps, x);
}

void moe_route(const Launch& L, const RouteArgs& r, const float* logits, const float* bias, const MoeSched& s,
               int32_t* topk_idx, float* topk_w) {
  DSV3_CHECK(r.E <= kMaxE && r.K <= kMaxK && r.G <= kMaxG && s.S <= 16 && r.G >= 1 && r.E % r.G == 0 &&
                 r.topk_groups <= r.G && r.K <= r.E,
             "MoE shape beyond the CUDA router's limits (E <= 256, K <= 16, groups <= 64)");
  const bool tiles = true;
  if (s.n <= 64) {
    const int64_t warps = std::min<int64_t>(kRouteWarps, std::max<int64_t>(s.n, 2));
    launch(L, route_kernel, dim3(1), dim3(unsigned(warps * 32)), 0, 0, r, logits, bias, s, tiles, topk_idx, topk_w);
  } else {
    launch(L, route_kernel, dim3(cdiv(s.n, kRouteWarps)), dim3(kRouteWarps * 32), 0, 1, r, logits, bias, s, tiles,
           topk_idx, topk_w);
    launch(L, route_kernel, dim3(1), dim3(kRouteWarps * 32), 0, 2, r, logits, bias, s, tiles, topk_idx, topk_w);
  }
}

void moe_combine(const Launch& L, const MoeSched& s, const float* o, int64_t d, float* y) {
  launch(L, combine_kernel, dim3(unsigned(s.n)), dim3(256), 0, s, o, d, y);
}

}  // namespace dsv3::cuda
