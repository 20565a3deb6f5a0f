// MoE on the device: the router (Gate.forward, same choices as model/gate.cc) and the grouping
// of (token, expert) pairs by expert in one block, and the weighted un-permute.
#include "backend/cuda/common.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

constexpr int kMaxE = 256, kMaxK = 16, kMaxG = 64, kMaxNE = kMaxE + 16;

__global__ void __launch_bounds__(1024) route_kernel(RouteArgs ra, const float* __restrict__ logits,
                                                     const float* __restrict__ bias, MoeSched s, int32_t* topk_idx,
                                                     float* topk_w) {
  __shared__ int cnt[kMaxNE], off[kMaxNE], fill[kMaxNE];
  pdl_wait();
  pdl_trigger();
  const int E = s.E, K = s.K, S = s.S, NE = E + S, Kt = K + S, G = ra.G, per = E / G;
  const int64_t n = s.n;
  for (int e = threadIdx.x; e < NE; e += blockDim.x) cnt[e] = e < E ? 0 : int(n), fill[e] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float* lg = logits + i * E;
    float sc[kMaxE], ch[kMaxE];
    if (!ra.sigmoid) {
      float mx = -INFINITY;
      for (int e = 0; e < E; ++e) mx = fmaxf(mx, lg[e]);
      float sum = 0.f;
      for (int e = 0; e < E; ++e) sum += (sc[e] = expf(lg[e] - mx));
      for (int e = 0; e < E; ++e) sc[e] /= sum;
    } else {
      for (int e = 0; e < E; ++e) sc[e] = 1.f / (1.f + expf(-lg[e]));
    }
    for (int e = 0; e < E; ++e) ch[e] = bias ? sc[e] + bias[e] : sc[e];
    if (G > 1) {
      float gs[kMaxG];
      for (int g = 0; g < G; ++g) {
        const float* v = ch + g * per;
        if (!bias) {
          float m = v[0];
          for (int j = 1; j < per; ++j) m = fmaxf(m, v[j]);
          gs[g] = m;
        } else {
          float m1 = -INFINITY, m2 = -INFINITY;
          for (int j = 0; j < per; ++j) {
            if (v[j] > m1) m2 = m1, m1 = v[j];
            else if (v[j] > m2) m2 = v[j];
          }
          gs[g] = m1 + m2;
        }
      }
      uint64_t keep = 0;  // best topk_groups groups; ties: lower index first
      for (int r = 0; r < ra.topk_groups; ++r) {
        int best = -1;
        for (int g = 0; g < G; ++g)
          if (!((keep >> g) & 1) && (best < 0 || gs[g] > gs[best])) best = g;
        keep |= uint64_t(1) << best;
      }
      for (int g = 0; g < G; ++g)
        if (!((keep >> g) & 1))
          for (int j = 0; j < per; ++j) ch[g * per + j] = -INFINITY;
    }
    uint32_t taken[kMaxE / 32] = {};
    int idx[kMaxK];
    float w[kMaxK], sum = 0.f;
    for (int k = 0; k < K; ++k) {
      int best = -1;
      for (int e = 0; e < E; ++e)
        if (!((taken[e >> 5] >> (e & 31)) & 1) && (best < 0 || ch[e] > ch[best])) best = e;
      taken[best >> 5] |= 1u << (best & 31);
      idx[k] = best;
      w[k] = sc[best];
      sum += w[k];
    }
    for (int k = 0; k < K; ++k) {
      if (ra.norm) w[k] /= sum;
      w[k] *= ra.route_scale;
    }
    if (topk_idx)
      for (int k = 0; k < K; ++k) topk_idx[i * K + k] = idx[k], topk_w[i * K + k] = w[k];
    // Routed choices by expert index (the order the reference adds them in), expert ids for now.
    for (int a = 1; a < K; ++a)
      for (int b = a; b > 0 && idx[b - 1] > idx[b]; --b) {
        int ti = idx[b]; idx[b] = idx[b - 1]; idx[b - 1] = ti;
        float tw = w[b]; w[b] = w[b - 1]; w[b - 1] = tw;
      }
    for (int k = 0; k < K; ++k) {
      atomicAdd(&cnt[idx[k]], 1);
      s.pair_of[i * Kt + k] = idx[k];
      s.pw[i * Kt + k] = w[k];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int o = 0, na = 0, nt = 0;
    for (int e = 0; e < NE; ++e) {
      off[e] = o;
      s.off[e] = o;
      s.cnt[e] = cnt[e];
      o += cnt[e];
      if (cnt[e] > 0) {
        s.active[na++] = e;
        for (int m0 = 0; m0 < cnt[e]; m0 += 64) s.tile_e[nt] = e, s.tile_m0[nt] = m0, ++nt;
      }
    }
    *s.n_active = na;
    *s.n_tiles = nt;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    for (int k = 0; k < K; ++k) {
      const int e = s.pair_of[i * Kt + k];
      const int p = off[e] + atomicAdd(&fill[e], 1);
      s.perm[p] = int32_t(i);
      s.pair_of[i * Kt + k] = p;
    }
    for (int j = 0; j < S; ++j) {
      const int64_t p = off[E + j] + i;
      s.perm[p] = int32_t(i);
      s.pair_of[i * Kt + K + j] = int32_t(p);
      s.pw[i * Kt + K + j] = 1.f;
    }
  }
}

__global__ void combine_kernel(MoeSched s, const float* __restrict__ o, int64_t d, float* __restrict__ y) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = blockIdx.x;
  const int K = s.K, Kt = s.K + s.S;
  const int32_t* po = s.pair_of + i * Kt;
  const float* pw = s.pw + i * Kt;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float r = 0.f;
    for (int k = 0; k < K; ++k) r += o[int64_t(po[k]) * d + c] * pw[k];
    float sh = 0.f;
    for (int j = K; j < Kt; ++j) sh += o[int64_t(po[j]) * d + c];
    y[i * d + c] = r + sh;
  }
}

}  // namespace

void moe_route(const Launch& L, const RouteArgs& r, const float* logits, const float* bias, const MoeSched& s,
               int32_t* topk_idx, float* topk_w) {
  DSV3_CHECK(r.E <= kMaxE && r.K <= kMaxK && r.G <= kMaxG && s.S <= 16 && r.G >= 1 && r.E % r.G == 0 &&
                 r.topk_groups <= r.G && r.K <= r.E,
             "MoE shape beyond the CUDA router's limits (E <= 256, K <= 16, groups <= 64)");
  const int threads = s.n >= 1024 ? 1024 : int((s.n + 31) / 32 * 32);
  launch(L, route_kernel, dim3(1), dim3(unsigned(threads < 32 ? 32 : threads)), 0, r, logits, bias, s, topk_idx,
         topk_w);
}

void moe_combine(const Launch& L, const MoeSched& s, const float* o, int64_t d, float* y) {
  launch(L, combine_kernel, dim3(unsigned(s.n)), dim3(256), 0, s, o, d, y);
}

}  // namespace dsv3::cuda
