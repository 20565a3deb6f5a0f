// The FMA GEMVs' dot products of 16-byte weight chunks with float32 activations (the streaming
// GEMVs of kernels_gemv.cu).
#pragma once
#include "backend/cuda/common.cuh"

namespace dsv3::cuda {
namespace {

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

}  // namespace
}  // namespace dsv3::cuda
