// The decode attention's position splits (kernels_mla_decode.cu) and their combination, shared
// with the value absorption that combines one token's splits itself (kernels_gemv.cu): the same
// device functions on both sides, so either gives the same bits.
#pragma once
#include "backend/cuda/common.cuh"

namespace dsv3::cuda {
namespace {

constexpr int kDecPass = 128;               // positions per pass of the decode attention
constexpr int kDecMaxSplits = kDecPass;     // the split factors reuse its score buffer
constexpr int kDecMinChunk = 16;

// Positions per split: `len` positions over `nsplit` splits, rounded up to whole tiles of `tile`.
__host__ __device__ __forceinline__ int64_t split_tiles(int64_t len, int64_t nsplit, int64_t tile) {
  return ((len + nsplit - 1) / nsplit + tile - 1) / tile * tile;
}
// Positions per split for a token of `len` positions over `nsplit` launched splits, in whole
// kDecMinChunk (a block's round of score rows).
__device__ __forceinline__ int64_t dec_chunk(int64_t len, int64_t nsplit) { return split_tiles(len, nsplit, kDecMinChunk); }
// The many-token attention's positions per split (kernels_mla.cu, kernels_mla_many.cu): `chunk` for
// every token, or where chunk < 0 (a step that may be recorded: no host lengths) the token's own
// length over the nsplit splits in whole tiles of -chunk rows, so a short sequence keeps every split.
__device__ __forceinline__ int64_t many_chunk(int64_t chunk, int64_t len, int64_t nsplit) {
  return chunk > 0 ? chunk : split_tiles(len, nsplit, -chunk);
}
// The splits that hold positions of a token of `len` positions, `chunk` (dec_chunk) per split.
__device__ __forceinline__ int dec_splits(int64_t len, int64_t chunk) { return int((len + chunk - 1) / chunk); }

// One warp: the ns splits' factors exp(m_z - M) into fz[0, ns) and their weighted sum of l_z
// (returned in every lane) for row ih of ml [ns][rows][2] (rows = n * H).
__device__ __forceinline__ float split_factors(const float* __restrict__ ml, int ns, int64_t rows, int64_t ih,
                                               float* fz) {
  const int lane = threadIdx.x & 31;
  float2 mz[(kDecMaxSplits + 31) / 32];
#pragma unroll
  for (int u = 0; u < (kDecMaxSplits + 31) / 32; ++u) {
    const int zz = lane + 32 * u;
    mz[u] = zz < ns ? __ldcg(reinterpret_cast<const float2*>(ml + (zz * rows + ih) * 2)) : make_float2(-INFINITY, 0.f);
  }
  float M = -INFINITY;
#pragma unroll
  for (int u = 0; u < (kDecMaxSplits + 31) / 32; ++u) M = fmaxf(M, mz[u].x);
  M = warp_max(M);
  float Ls = 0.f;
#pragma unroll
  for (int u = 0; u < (kDecMaxSplits + 31) / 32; ++u) {
    const int zz = lane + 32 * u;
    if (zz >= ns) break;
    const float f = expf(mz[u].x - M);
    fz[zz] = f;
    Ls += mz[u].y * f;
  }
  return warp_sum(Ls);
}

// Column col of row ih combined from the splits' partial sums part [ns][rows][C].
__device__ __forceinline__ float split_column(const float* __restrict__ part, int ns, int64_t rows, int64_t C,
                                              int64_t ih, int64_t col, const float* fz, float lsum) {
  float sum = 0.f;
#pragma unroll 4
  for (int zz = 0; zz < ns; ++zz) sum += __ldcg(part + (zz * rows + ih) * C + col) * fz[zz];
  return sum / lsum;
}

}  // namespace
}  // namespace dsv3::cuda
