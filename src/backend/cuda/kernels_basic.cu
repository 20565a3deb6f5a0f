// Elementwise kernels: embedding gather, RMSNorm, residual add, bf16 hi/lo split, random fill.
#include <climits>

#include "backend/cuda/common.cuh"
#include "core/error.h"

namespace dsv3::cuda {

void check(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return;
  throw Error(str(file, ":", line, ": CUDA error ", int(e), " (", cudaGetErrorName(e), ": ", cudaGetErrorString(e),
                  ") from ", what));
}

namespace {

__global__ void embed_kernel(const int32_t* __restrict__ tok, EmbedTable t, float* __restrict__ y) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = blockIdx.x, row = int64_t(tok[i]) - t.row0, d = t.d;
  float* yi = y + i * d;
  if (row < 0 || row >= t.rows) {  // another rank's token: its rows are zero here
    for (int64_t k = threadIdx.x; k < d; k += blockDim.x) yi[k] = 0.f;
  } else if (t.type == kBF16) {
    const uint16_t* w = static_cast<const uint16_t*>(t.data) + row * d;
    for (int64_t k = threadIdx.x; k < d; k += blockDim.x) yi[k] = bf16_bits(w[k]);
  } else {
    const float* w = static_cast<const float*>(t.data) + row * d;
    for (int64_t k = threadIdx.x; k < d; k += blockDim.x) yi[k] = w[k];
  }
}

__global__ void rmsnorm_kernel(const float* x, int64_t d, int64_t stride, const float* __restrict__ w, float eps,
                               float* y) {
  __shared__ float red[33];
  pdl_wait();
  pdl_trigger();
  const float* xi = x + blockIdx.x * stride;
  float* yi = y + blockIdx.x * stride;
  float ss = 0.f;
  for (int64_t k = threadIdx.x; k < d; k += blockDim.x) ss += xi[k] * xi[k];
  ss = block_sum(ss, red);
  const float r = 1.f / sqrtf(ss / float(d) + eps);  // as the reference: x * r * w
  for (int64_t k = threadIdx.x; k < d; k += blockDim.x) yi[k] = xi[k] * r * w[k];
}

// h += r, then y = rmsnorm(h) (the residual add and the next layer's norm in one pass).
__global__ void add_rmsnorm_kernel(float* h, const float* __restrict__ r, int64_t d, const float* __restrict__ w,
                                   float eps, float* y) {
  __shared__ float red[33];
  // Before the wait: the norm weights (never from a kernel) and, in a decode step, the residual
  // h — the kernel that last wrote it (the MoE combine, or the previous norm) ran at least three
  // kernels back, and every kernel triggers only after its own wait, so it is complete by now.
  // Rows of up to kPre * blockDim values stay in registers (one round of loads after the wait).
  constexpr int kPre = 4;
  float* hi = h + blockIdx.x * d;
  const float* ri = r + blockIdx.x * d;
  float* yi = y + blockIdx.x * d;
  const bool regs = d <= int64_t(kPre) * blockDim.x;
  float wp[kPre], hv[kPre];
#pragma unroll
  for (int j = 0; j < kPre; ++j) {
    const int64_t k = threadIdx.x + int64_t(j) * blockDim.x;
    wp[j] = k < d ? w[k] : 0.f;
    hv[j] = regs && k < d ? __ldcg(hi + k) : 0.f;
  }
  pdl_wait();
  pdl_trigger();
  float ss = 0.f;
  if (regs) {
    float rv[kPre];
#pragma unroll
    for (int j = 0; j < kPre; ++j) {
      const int64_t k = threadIdx.x + int64_t(j) * blockDim.x;
      rv[j] = k < d ? ri[k] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kPre; ++j) {
      const int64_t k = threadIdx.x + int64_t(j) * blockDim.x;
      hv[j] += rv[j];
      if (k < d) hi[k] = hv[j];
      ss += hv[j] * hv[j];  // (0 past d)
    }
  } else {
    for (int64_t k = threadIdx.x; k < d; k += blockDim.x) {
      const float v = hi[k] + ri[k];
      hi[k] = v;
      ss += v * v;
    }
  }
  ss = block_sum(ss, red);
  const float rr = 1.f / sqrtf(ss / float(d) + eps);
#pragma unroll
  for (int j = 0; j < kPre; ++j) {
    const int64_t k = threadIdx.x + int64_t(j) * blockDim.x;
    if (k < d) yi[k] = (regs ? hv[j] : hi[k]) * rr * wp[j];
  }
  for (int64_t k = threadIdx.x + int64_t(kPre) * blockDim.x; k < d; k += blockDim.x) yi[k] = hi[k] * rr * w[k];
}

// y += x over n values: the first n4 * 4 as float4 (n4 = 0 where the buffers are not 16-byte
// aligned), the rest one at a time.
__global__ void add_kernel(float* __restrict__ y, const float* __restrict__ x, int64_t n, int64_t n4) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    float4 a = reinterpret_cast<float4*>(y)[i];
    const float4 b = reinterpret_cast<const float4*>(x)[i];
    a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
    reinterpret_cast<float4*>(y)[i] = a;
  }
  for (int64_t i = n4 * 4 + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] += x[i];
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void fill_kernel(void* p, int32_t t, int64_t n, float a, uint64_t seed, bool const_value) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = mix64(seed * 0x9e3779b97f4a7c15ull + uint64_t(i));
    const float u = float(int64_t(h >> 40) - (int64_t(1) << 23)) * (1.f / float(1 << 23));  // [-1, 1)
    const float v = const_value ? a : a * u;
    if (t == kBF16) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
    else if (t == kFP8) static_cast<uint8_t*>(p)[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
    else static_cast<float*>(p)[i] = v;
  }
}

unsigned grid_for(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  return unsigned(b < 1 ? 1 : (b > 4096 ? 4096 : b));
}

}  // namespace

void embed(const Launch& L, const int32_t* tok, int64_t n, const EmbedTable& table, float* y) {
  launch(L, embed_kernel, dim3(unsigned(n)), dim3(256), 0, tok, table, y);
}

void rmsnorm(const Launch& L, const float* x, int64_t n, int64_t d, int64_t stride, const float* w, float eps,
             float* y) {
  const int threads = d >= 1024 ? 512 : (d >= 256 ? 256 : 128);
  launch(L, rmsnorm_kernel, dim3(unsigned(n)), dim3(threads), 0, x, d, stride, w, eps, y);
}

void add_rmsnorm(const Launch& L, float* h, const float* r, int64_t n, int64_t d, const float* w, float eps, float* y) {
  const int threads = d >= 1024 ? 512 : (d >= 256 ? 256 : 128);
  launch(L, add_rmsnorm_kernel, dim3(unsigned(n)), dim3(threads), 0, h, r, d, w, eps, y);
}

namespace {
// Block per row: the lowest index of the largest value in [0, limit) (ties to the lower index,
// as the host sampler's greedy argmax), the first NaN / +inf index (or -1), and whether every
// value was -inf. out: [rows][3].
__global__ void __launch_bounds__(1024) argmax_kernel(const float* __restrict__ x, int64_t cols, int64_t limit,
                                                      int32_t* __restrict__ out) {
  __shared__ float sv[32];
  __shared__ int si[32], sb[32];
  pdl_wait();
  const float* r = x + int64_t(blockIdx.x) * cols;
  float bv = -INFINITY;
  int bi = -1, bad = INT_MAX;
  for (int64_t k = threadIdx.x; k < limit; k += blockDim.x) {
    const float v = r[k];
    if (isnan(v) || v == INFINITY) bad = min(bad, int(k));
    else if (bi < 0 || v > bv) bv = v, bi = int(k);  // k rises: the first of equal values stays
  }
  auto better = [](float v, int i, float v2, int i2) { return i2 >= 0 && (i < 0 || v2 > v || (v2 == v && i2 < i)); };
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, bv, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, bi, o), b2 = __shfl_xor_sync(0xffffffffu, bad, o);
    if (better(bv, bi, v2, i2)) bv = v2, bi = i2;
    bad = min(bad, b2);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) sv[warp] = bv, si[warp] = bi, sb[warp] = bad;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < nw; ++w) {
      if (better(bv, bi, sv[w], si[w])) bv = sv[w], bi = si[w];
      bad = min(bad, sb[w]);
    }
    int32_t* o = out + 3 * int64_t(blockIdx.x);
    o[0] = bi, o[1] = bad == INT_MAX ? -1 : bad, o[2] = bi < 0 || bv == -INFINITY;
  }
}
}  // namespace

void argmax_rows(const Launch& L, const float* x, int64_t rows, int64_t cols, int64_t limit, int32_t* out) {
  DSV3_CHECK(limit > 0 && limit <= cols && limit <= INT32_MAX, "argmax_rows: limit ", limit, " of ", cols);
  launch(L, argmax_kernel, dim3(unsigned(rows)), dim3(1024), 0, x, cols, limit, out);
}

void add(const Launch& L, float* y, const float* x, int64_t n) {
  // float4 where both buffers are 16-byte aligned (device allocations are; a view into a row may not be).
  const bool aligned = reinterpret_cast<uintptr_t>(y) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const int64_t n4 = aligned ? n / 4 : 0;
  launch(L, add_kernel, dim3(grid_for(n / 4 + 1, 256)), dim3(256), 0, y, x, n, n4);
}

namespace {
// One warp per 128 values: s = max(amax, 1e-4) * (1/448) (ue8m0: 2^ceil(log2 s)), y = e4m3(x / s)
// rounded to nearest even, saturated — kernel.py's act_quant, operation for operation.
// idx (may be null): output row r quantises row idx[r] of x (cpr 128-column blocks per row).
__global__ void act_quant_kernel(const float* __restrict__ x, int64_t blocks, bool ue8m0, uint8_t* __restrict__ y,
                                 float* __restrict__ s, const int32_t* __restrict__ idx, int64_t cpr) {
  pdl_wait();
  pdl_trigger();
  const int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (b >= blocks) return;  // the whole warp
  const int64_t src = idx ? int64_t(idx[b / cpr]) * cpr + b % cpr : b;
  const float4 v = reinterpret_cast<const float4*>(x + src * 128)[lane];
  float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
  amax = fmaxf(warp_max(amax), 1e-4f);
  float sc = __fmul_rn(amax, 1.f / 448.f);
  if (ue8m0) sc = exp2f(ceilf(log2f(sc)));
  if (lane == 0) s[b] = sc;
  auto q = [&](float f) { return uint32_t(__nv_cvt_float_to_fp8(__fdiv_rn(f, sc), __NV_SATFINITE, __NV_E4M3)); };
  reinterpret_cast<uint32_t*>(y + b * 128)[lane] = q(v.x) | q(v.y) << 8 | q(v.z) << 16 | q(v.w) << 24;
}
}  // namespace

void act_quant(const Launch& L, const float* x, int64_t rows, int64_t cols, bool ue8m0, uint8_t* y, float* s) {
  act_quant_rows(L, x, nullptr, rows, cols, ue8m0, y, s);
}

void act_quant_rows(const Launch& L, const float* x, const int32_t* idx, int64_t rows, int64_t cols, bool ue8m0,
                    uint8_t* y, float* s) {
  DSV3_CHECK(cols % 128 == 0, "act_quant needs cols % 128 == 0, got ", cols);
  const int64_t blocks = rows * cols / 128;
  launch(L, act_quant_kernel, dim3(unsigned((blocks + 7) / 8)), dim3(256), 0, x, blocks, ue8m0, y, s, idx, cols / 128);
}

void fill_random(const Launch& L, void* p, int32_t t, int64_t n, float a, uint64_t seed, bool const_value) {
  launch(L, fill_kernel, dim3(grid_for(n, 256)), dim3(256), 0, p, t, n, a, seed, const_value);
}

}  // namespace dsv3::cuda
