// Multi-head latent attention on the device (MLA.forward of the reference): RoPE, kv_norm and
// the cache write; absorbed attention over the latent cache (q absorption into wkv_b, scores,
// float32 softmax fused into the value pass, split over positions for long caches; the one-launch
// decode form is in kernels_mla_decode.cu); and the naive form over full K/V caches. Every
// kernel reads the tokens' (slot, pos) from the device, so a recorded step replays with new
// positions.
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/mla_splits.cuh"
#include "backend/cuda/mma.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

constexpr int kHB = 16;    // heads per block in the absorbed score/value kernels
constexpr int kMaxJ = 18;  // (kv_lora_rank + rope) / 32 held per lane: up to 576
constexpr int kTB = 16;    // tokens per pass in the q absorption

struct PrepArgs {
  MlaDims d;
  bool naive;
  const DevPos* pos;
  float* q;
  const float* kv;
  const float* nw;
  const float* rope;
  float *cache_kv, *cache_pe, *latent, *cache_k;
  bool qabs_bf16 = false;  // MlaPrep::qabs_bf16
};

__device__ void prep_token(const PrepArgs& P, int64_t i, float* red) {
  const MlaDims& d = P.d;
  const bool naive = P.naive;
  const DevPos* pos = P.pos;
  float* q = P.q;
  const float* kv = P.kv;
  const float* nw = P.nw;
  const float* rope = P.rope;
  float *cache_kv = P.cache_kv, *cache_pe = P.cache_pe, *latent = P.latent, *cache_k = P.cache_k;
  const DevPos p = pos[i];
  const int half = d.R / 2, qk = d.qk();
  const float* cs = rope + int64_t(p.pos) * d.R;
  const int64_t row = d.row(p.slot, p.pos);
  const float* kvi = kv + i * (d.C + d.R);
  for (int e = threadIdx.x; e < d.H * half; e += blockDim.x) {
    const int h = e / half, j = e % half;
    float* x = q + (i * d.H + h) * qk + d.nope + 2 * j;
    const float a = x[0], b = x[1], c = cs[2 * j], s = cs[2 * j + 1];
    x[0] = a * c - b * s;
    x[1] = a * s + b * c;
  }
  float ss = 0.f;
  for (int c = threadIdx.x; c < d.C; c += blockDim.x) ss += kvi[c] * kvi[c];
  ss = block_sum(ss, red);
  const float r = 1.f / sqrtf(ss / float(d.C) + d.eps);
  for (int c = threadIdx.x; c < d.C; c += blockDim.x) {
    const float x = kvi[c] * r * nw[c];
    if (naive) latent[i * d.C + c] = x;
    else cache_put(cache_kv, d.kv16, row * d.C + c, x);
  }
  for (int j = threadIdx.x; j < half; j += blockDim.x) {
    const float a = kvi[d.C + 2 * j], b = kvi[d.C + 2 * j + 1], c = cs[2 * j], s = cs[2 * j + 1];
    const float x0 = a * c - b * s, x1 = a * s + b * c;
    if (!naive) {
      cache_put(cache_pe, d.kv16, row * d.R + 2 * j, x0);
      cache_put(cache_pe, d.kv16, row * d.R + 2 * j + 1, x1);
    } else {
      for (int h = 0; h < d.H; ++h) {
        float* k = cache_k + (row * d.H + h) * qk + d.nope;
        k[2 * j] = x0;
        k[2 * j + 1] = x1;
      }
    }
  }
}

__global__ void prep_kernel(PrepArgs P) {
  __shared__ float red[33];
  pdl_wait();
  pdl_trigger();
  prep_token(P, blockIdx.x, red);
}

template <int WT>
__device__ __forceinline__ float wload(const DevLinear& w, int64_t r, int64_t c) {
  const int64_t rr = w.row0 + r, off = rr * w.ld + w.col0 + c;
  if constexpr (WT == kBF16) return bf16_bits(static_cast<const uint16_t*>(w.w)[off]);
  else if constexpr (WT == kFP8)
    return e4m3_bits(static_cast<const uint8_t*>(w.w)[off]) * w.s[(rr >> 7) * w.lds + ((w.col0 + c) >> 7)];
  else return static_cast<const float*>(w.w)[off];
}

// The q absorption blocks' two shared steps for one pass of tokens [t0, t0 + tb), TB a pass:
// head h's q_nope rows into qs [TB][nope] (zeros past tb) between barriers; and
// qa[t0 + j, h, cb + cc] = the sum of the 8 warps' partials red [8][TB][64].
__device__ __forceinline__ void stage_q_nope(const MlaDims& d, const float* __restrict__ q, int64_t t0, int tb, int TB,
                                             int h, float* qs) {
  __syncthreads();
  for (int e = threadIdx.x; e < TB * d.nope; e += blockDim.x) {
    const int j = e / d.nope, k = e % d.nope;
    qs[e] = j < tb ? q[((t0 + j) * d.H + h) * d.qk() + k] : 0.f;
  }
  __syncthreads();
}
__device__ __forceinline__ void sum_warps_to_qa(const MlaDims& d, const float* red, int64_t t0, int tb, int TB, int h,
                                                int64_t cb, float* __restrict__ qa) {
  for (int e = threadIdx.x; e < tb * 64; e += blockDim.x) {
    const int j = e / 64, cc = e % 64;
    if (cb + cc >= d.C) continue;
    float sum = 0.f;
    for (int ww = 0; ww < 8; ++ww) sum += red[(ww * TB + j) * 64 + cc];
    qa[((t0 + j) * d.H + h) * d.C + cb + cc] = sum;
  }
}

// Block: 64 latent columns of one head; warp w takes d = w, w + 8, ... (loads first, then FMAs),
// lane the columns 2*lane, 2*lane + 1; the 8 warps' partial sums meet in shared memory.
template <int WT>
__device__ void qabs_block(const MlaDims& d, const DevLinear& w, const float* __restrict__ q, int64_t n,
                           float* __restrict__ qa, int h, int cblk, float* smem) {
  // smem: qs [kTB][nope], then red [8][kTB][64]
  float* qs = smem;
  float* red = smem + kTB * d.nope;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t c0 = int64_t(cblk) * 64, ca = c0 + 2 * lane, cb = ca + 1;
  const int64_t wrow = int64_t(h) * (d.nope + d.V);
  constexpr int kPer = 16;  // d values per warp: d = warp + 8 u (nope <= 128)
  // The weights do not depend on earlier kernels: load them before waiting, keep them for all tokens.
  float wa[kPer], wb[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int k = warp + 8 * u;
    wa[u] = (k < d.nope && ca < d.C) ? wload<WT>(w, wrow + k, ca) : 0.f;
    wb[u] = (k < d.nope && cb < d.C) ? wload<WT>(w, wrow + k, cb) : 0.f;
  }
  pdl_wait();
  pdl_trigger();
  for (int64_t t0 = 0; t0 < n; t0 += kTB) {
    const int tb = int(n - t0 < kTB ? n - t0 : kTB);
    stage_q_nope(d, q, t0, tb, kTB, h, qs);
    float acc[2][kTB];
#pragma unroll
    for (int j = 0; j < kTB; ++j) acc[0][j] = acc[1][j] = 0.f;
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int k = warp + 8 * u;
      if (k >= d.nope) break;
#pragma unroll
      for (int j = 0; j < kTB; ++j) {
        const float qv = qs[j * d.nope + k];
        acc[0][j] = fmaf(qv, wa[u], acc[0][j]);
        acc[1][j] = fmaf(qv, wb[u], acc[1][j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kTB; ++j) {
      red[(warp * kTB + j) * 64 + 2 * lane] = acc[0][j];
      red[(warp * kTB + j) * 64 + 2 * lane + 1] = acc[1][j];
    }
    __syncthreads();
    sum_warps_to_qa(d, red, t0, tb, kTB, h, c0, qa);
  }
}

// The same product with 16-byte weight loads (decode steps; see mla_prep_qabs): block (head h, 64
// latent columns). A thread takes CE consecutive columns (one chunk) of NU rows d = rg + RPP u;
// its partial sums over those rows meet the other row groups' by shuffles within the warp, then
// across the 8 warps in shared memory. TB tokens per pass (the weights stay in registers).
template <int WT>
struct QabsVec {
  static constexpr int CE = chunk_elems<WT>(), TPR = 64 / CE, RPP = 256 / TPR, NU = 128 / RPP;
};
template <int WT, int TB>
__device__ void qabs_vec_block(const MlaDims& d, const DevLinear& w, const float* __restrict__ q, int64_t n,
                               float* __restrict__ qa, int h, int cblk, float* smem) {
  using V = QabsVec<WT>;
  constexpr int CE = V::CE, TPR = V::TPR, RPP = V::RPP, NU = V::NU;
  float* qs = smem;                 // [TB][nope]
  float* red = smem + TB * d.nope;  // [8][TB][64]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int cg = threadIdx.x % TPR, rg = threadIdx.x / TPR;
  const int64_t cb = int64_t(cblk) * 64, wrow = int64_t(h) * (d.nope + d.V);
  // The weights do not depend on earlier kernels: load them before waiting, keep them for all tokens.
  uint4 wv[NU];
  float sc[NU];
#pragma unroll
  for (int u = 0; u < NU; ++u) {
    const int k = rg + RPP * u;
    sc[u] = 1.f;
    if (k < d.nope) {
      const int64_t r = w.row0 + wrow + k, c = w.col0 + cb + cg * CE;
      wv[u] = ld_stream(static_cast<const char*>(w.w) + (r * w.ld + c) * elem_bytes<WT>());
      if (WT == kFP8) sc[u] = w.s[(r >> 7) * w.lds + (c >> 7)];
    }
  }
  pdl_wait();
  for (int64_t t0 = 0; t0 < n; t0 += TB) {
    const int tb = int(n - t0 < TB ? n - t0 : TB);
    stage_q_nope(d, q, t0, tb, TB, h, qs);
    float acc[TB][CE];
#pragma unroll
    for (int j = 0; j < TB; ++j)
#pragma unroll
      for (int c = 0; c < CE; ++c) acc[j][c] = 0.f;
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      const int k = rg + RPP * u;
      if (k >= d.nope) break;
      float wf[CE];
      decode<WT>(wv[u], wf);
#pragma unroll
      for (int c = 0; c < CE; ++c)
        if (WT == kFP8) wf[c] *= sc[u];  // e4m3 times its block scale, as wload
#pragma unroll
      for (int j = 0; j < TB; ++j) {
        const float qv = qs[j * d.nope + k];
#pragma unroll
        for (int c = 0; c < CE; ++c) acc[j][c] = fmaf(qv, wf[c], acc[j][c]);
      }
    }
#pragma unroll
    for (int o = TPR; o < 32; o <<= 1)
#pragma unroll
      for (int j = 0; j < TB; ++j)
#pragma unroll
        for (int c = 0; c < CE; ++c) acc[j][c] += __shfl_xor_sync(0xffffffffu, acc[j][c], o);
    if (lane < TPR)
#pragma unroll
      for (int j = 0; j < TB; ++j)
#pragma unroll
        for (int c = 0; c < CE; ++c) red[(warp * TB + j) * 64 + cg * CE + c] = acc[j][c];
    __syncthreads();
    sum_warps_to_qa(d, red, t0, tb, TB, h, cb, qa);
  }
}

// The same product of many tokens (serving steps) on tensor cores: block (head h, 64 latent
// columns). The head's nope x 64 weights go to shared memory as bf16 (e4m3 widened exactly; its
// block scale, one per block: mla_prep_qabs checks, multiplies the sums). The block's work items
// are (16 tokens, 32 of the columns), warp w takes items w, w + 8, ...: q_nope's rows as the MMA's
// A, split once per 16 of nope into three bf16 parts (hi, mid, lo: float32's 24 bits; with
// hi_only, fast mode, the hi part alone: q_nope rounded to bf16 as the reference's bf16 model
// holds it), the weights as B (ldmatrix), one m16n8k16 MMA per part, 16 of nope and 8 columns.
constexpr int kQtPitch = 72;  // bf16 per staged weight row: 64 columns + 8 (conflict-free ldmatrix rows)
template <int WT>
__device__ void qabs_tc_block(const MlaDims& d, const DevLinear& w, const float* __restrict__ q, int64_t n,
                              float* __restrict__ qa, int h, int cblk, bool hi_only, char* smem) {
  uint16_t* ws = reinterpret_cast<uint16_t*>(smem);  // [nope][kQtPitch]
  const int64_t cb = int64_t(cblk) * 64, r0 = w.row0 + int64_t(h) * (d.nope + d.V), c0 = w.col0 + cb;
  // The weights do not depend on earlier kernels: staged before waiting.
  if constexpr (WT == kBF16) {
    const uint16_t* W = static_cast<const uint16_t*>(w.w);
    for (int e = threadIdx.x; e < d.nope * 8; e += blockDim.x) {
      const int r = e / 8, c8 = e % 8;
      *reinterpret_cast<uint4*>(ws + r * kQtPitch + 8 * c8) = ld_stream(W + (r0 + r) * w.ld + c0 + 8 * c8);
    }
  } else {
    const uint8_t* W = static_cast<const uint8_t*>(w.w);
    for (int e = threadIdx.x; e < d.nope * 4; e += blockDim.x) {
      const int r = e / 4, c16 = e % 4;
      const uint4 v = ld_stream(W + (r0 + r) * w.ld + c0 + 16 * c16);
      const uint32_t vw[4] = {v.x, v.y, v.z, v.w};
      uint32_t o[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {  // bytes 2k, 2k + 1: e4m3 has 4 significant bits, so bf16 holds it exactly
        const uint32_t b2 = vw[k / 2] >> (16 * (k & 1));
        o[k] = (__float_as_uint(e4m3_bits(b2 & 0xffu)) >> 16) | (__float_as_uint(e4m3_bits((b2 >> 8) & 0xffu)) & 0xffff0000u);
      }
      uint4* dst = reinterpret_cast<uint4*>(ws + r * kQtPitch + 16 * c16);
      dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
      dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
    }
  }
  const float scale = WT == kFP8 ? w.s[(r0 >> 7) * w.lds + (c0 >> 7)] : 1.f;
  pdl_wait();
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, qk = d.qk();
  const int64_t items = (n + 15) / 16 * 2;
  for (int64_t it = warp; it < items; it += blockDim.x / 32) {
    const int64_t t0 = it / 2 * 16;
    const int half = int(it % 2);  // columns [32 half, 32 half + 32) of the block's 64
    const bool va = t0 + g < n, vb = t0 + g + 8 < n;
    const float* qa_row = q + ((t0 + g) * d.H + h) * qk + 2 * t;  // tokens t0 + g and t0 + g + 8
    const float* qb_row = qa_row + 8 * int64_t(d.H) * qk;
    float c[4][4] = {};  // four n-tiles of 8 columns
    for (int kk = 0; kk < d.nope / 16; ++kk) {
      const float2 z = make_float2(0.f, 0.f);
      const float2 x0 = va ? *reinterpret_cast<const float2*>(qa_row + 16 * kk) : z;
      const float2 x1 = vb ? *reinterpret_cast<const float2*>(qb_row + 16 * kk) : z;
      const float2 x2 = va ? *reinterpret_cast<const float2*>(qa_row + 16 * kk + 8) : z;
      const float2 x3 = vb ? *reinterpret_cast<const float2*>(qb_row + 16 * kk + 8) : z;
      uint32_t A[3][4];
      bf16x2_split3(x0.x, x0.y, A[0][0], A[1][0], A[2][0]);
      bf16x2_split3(x1.x, x1.y, A[0][1], A[1][1], A[2][1]);
      bf16x2_split3(x2.x, x2.y, A[0][2], A[1][2], A[2][2]);
      bf16x2_split3(x3.x, x3.y, A[0][3], A[1][3], A[2][3]);
#pragma unroll
      for (int p2 = 0; p2 < 2; ++p2) {  // n-tiles 2 p2, 2 p2 + 1: rows kk's 16 of nope, their 16 columns
        uint32_t r[4];
        ldmatrix_x4_trans(r, smem_addr(ws + (16 * kk + (lane & 15)) * kQtPitch + 32 * half + 16 * p2 + 8 * (lane >> 4)));
#pragma unroll
        for (int part = 2; part >= 0; --part) {
          if (part > 0 && hi_only) continue;
          mma_bf16(c[2 * p2], A[part], r[0], r[1]);
          mma_bf16(c[2 * p2 + 1], A[part], r[2], r[3]);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int64_t col = cb + 32 * half + 8 * nt + 2 * t;
      if (va)
        *reinterpret_cast<float2*>(qa + ((t0 + g) * d.H + h) * d.C + col) =
            make_float2(c[nt][0] * scale, c[nt][1] * scale);
      if (vb)
        *reinterpret_cast<float2*>(qa + ((t0 + g + 8) * d.H + h) * d.C + col) =
            make_float2(c[nt][2] * scale, c[nt][3] * scale);
    }
  }
}

template <int WT>
__global__ void __launch_bounds__(256) qabs_kernel(MlaDims d, DevLinear w, const float* __restrict__ q, int64_t n,
                                                   float* __restrict__ qa) {
  extern __shared__ float smem[];
  qabs_block<WT>(d, w, q, n, qa, blockIdx.x, blockIdx.y, smem);
}

// Absorbed decode: the q absorption (reads q's nope parts) and RoPE/kv_norm/cache write (q's rope
// parts, the cache) touch disjoint data: one launch, blocks [0, G * H * C/64) absorb (group g:
// tokens [g * per, (g + 1) * per)), the rest prep. TB > 0: the 16-byte form, TB tokens per pass;
// 0: qabs_block; -1: the tensor-core form.
template <int WT, int TB>
__global__ void __launch_bounds__(256) prep_qabs_kernel(PrepArgs P, DevLinear w, int64_t n, float* __restrict__ qa,
                                                        int64_t per) {
  extern __shared__ float smem[];
  const int nq = P.d.H * int((P.d.C + 63) / 64);
  const int64_t groups = (n + per - 1) / per;
  if (int64_t(blockIdx.x) < nq * groups) {
    const int b = int(blockIdx.x % unsigned(nq));
    const int64_t t0 = int64_t(blockIdx.x / unsigned(nq)) * per, m = min(per, n - t0);
    const float* q = P.q + t0 * P.d.H * P.d.qk();
    float* qa_g = qa + t0 * P.d.H * P.d.C;
    if constexpr (TB > 0) qabs_vec_block<WT, TB>(P.d, w, q, m, qa_g, b % P.d.H, b / P.d.H, smem);
    else if constexpr (TB < 0)
      qabs_tc_block<WT>(P.d, w, q, m, qa_g, b % P.d.H, b / P.d.H, P.qabs_bf16, reinterpret_cast<char*>(smem));
    else qabs_block<WT>(P.d, w, q, m, qa_g, b % P.d.H, b / P.d.H, smem);
  } else {
    pdl_wait();
    pdl_trigger();
    prep_token(P, int64_t(blockIdx.x) - nq * groups, smem);
  }
}

// Sums v[0..3] over the warp with 6 shuffles; lane l ends with the sum of v[2 * bit4(l) + bit3(l)].
__device__ __forceinline__ float warp_sum4(const float* v, int lane) {
  const bool hi = lane & 16, b3 = lane & 8;
  const float r0 = __shfl_xor_sync(0xffffffffu, hi ? v[0] : v[2], 16);
  const float r1 = __shfl_xor_sync(0xffffffffu, hi ? v[1] : v[3], 16);
  const float k0 = (hi ? v[2] : v[0]) + r0, k1 = (hi ? v[3] : v[1]) + r1;
  float k = (b3 ? k1 : k0) + __shfl_xor_sync(0xffffffffu, b3 ? k0 : k1, 8);
  k += __shfl_xor_sync(0xffffffffu, k, 4);
  k += __shfl_xor_sync(0xffffffffu, k, 2);
  k += __shfl_xor_sync(0xffffffffu, k, 1);
  return k;
}

// Block: `ppb` positions of token i for up to 16 heads; each warp takes ppb/8 positions, four
// at a time (their cache rows in registers, each query value read once for the four).
struct ScoreBlocks {
  int ppb, hbs;  // positions and heads per block
};
__global__ void __launch_bounds__(256) scores_kernel(MlaDims d, const DevPos* __restrict__ pos, ScoreBlocks sb,
                                                     const float* __restrict__ qa, const float* __restrict__ q,
                                                     const float* __restrict__ ckv, const float* __restrict__ cpe,
                                                     float* __restrict__ S) {
  extern __shared__ float qs[];  // [hbs][C + R]
  const int ppb = sb.ppb, hbs = sb.hbs;
  pdl_wait();
  pdl_trigger();
  const int64_t i = blockIdx.x;
  const int64_t t0 = int64_t(blockIdx.y) * ppb;
  const int h0 = blockIdx.z * hbs, hb = min(hbs, d.H - h0), CR = d.C + d.R, qk = d.qk();
  const DevPos p = pos[i];
  const int64_t len = int64_t(p.pos) + 1;
  if (t0 >= len) return;
  for (int e = threadIdx.x; e < hb * CR; e += blockDim.x) {
    const int h = e / CR, j = e % CR;
    const int64_t ih = i * d.H + h0 + h;
    qs[e] = j < d.C ? qa[ih * d.C + j] : q[ih * qk + d.nope + (j - d.C)];
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, ppw = ppb / 8;
  for (int u0 = 0; u0 < ppw; u0 += 4) {
    const int64_t tb = t0 + int64_t(warp) * ppw + u0;
    if (tb >= len) break;
    float kr[4][kMaxJ];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const int64_t t = tb + g;
      const int64_t rp = t >= len ? 0 : d.row(p.slot, t);
#pragma unroll
      for (int m = 0; m < kMaxJ; ++m) {
        const int j = lane + 32 * m;
        kr[g][m] = t >= len ? 0.f
                   : (j < d.C ? cache_get(ckv, d.kv16, rp * d.C + j)
                              : (j < CR ? cache_get(cpe, d.kv16, rp * d.R + (j - d.C)) : 0.f));
      }
    }
    const int gl = 2 * ((lane >> 4) & 1) + ((lane >> 3) & 1);  // the position this lane's sum is for
    for (int h = 0; h < hb; ++h) {
      const float* qh = qs + h * CR;
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int m = 0; m < kMaxJ; ++m) {
        const int j = lane + 32 * m;
        if (j < CR) {
          const float qv = qh[j];
#pragma unroll
          for (int g = 0; g < 4; ++g) s[g] = fmaf(kr[g][m], qv, s[g]);
        }
      }
      const float tot = warp_sum4(s, lane);
      if ((lane & 7) == 0 && tb + gl < len) S[((i * d.H) + h0 + h) * d.max_len + tb + gl] = tot * d.scale;
    }
  }
}

// Positions [ts, te) of token i for up to 16 heads and 128 latent columns: local max m and sum l
// of exp(S - m), and acc = sum exp(S - m) * kv. One split: ol = acc / l. Several: the parts and
// (m, l) go to `part`/`ml` and values_reduce_kernel rescales them.
struct ValueBlocks {
  int64_t n, chunk;  // tokens, positions per split
  int nsplit, hbs;   // splits, heads per block
};
__global__ void __launch_bounds__(128) values_kernel(MlaDims d, const DevPos* __restrict__ pos, ValueBlocks vb,
                                                     const float* __restrict__ S, const float* __restrict__ ckv,
                                                     DecodeAttn a) {
  __shared__ float mx[kHB], sm[kHB], ps[kHB][32];
  const int64_t n = vb.n, chunk = vb.chunk;
  const int nsplit = vb.nsplit, hbs = vb.hbs;
  float* __restrict__ part = a.part;
  float* __restrict__ ml = a.ml;
  float* __restrict__ ol = a.ol;
  pdl_wait();
  pdl_trigger();
  const int nhb = (d.H + hbs - 1) / hbs;
  const int64_t i = blockIdx.x / nhb;
  const int h0 = (blockIdx.x % nhb) * hbs, hb = min(hbs, d.H - h0);
  const DevPos p = pos[i];
  const int64_t len = int64_t(p.pos) + 1;
  const int64_t ts = int64_t(blockIdx.z) * chunk, te = min(len, ts + chunk);
  if (ts >= len) return;  // only when split: the reduction skips this part
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int h = warp; h < hb; h += 4) {
    const float* row = S + (i * d.H + h0 + h) * d.max_len;
    float m = -INFINITY;
    for (int64_t t = ts + lane; t < te; t += 32) m = fmaxf(m, row[t]);
    m = warp_max(m);
    float l = 0.f;
    for (int64_t t = ts + lane; t < te; t += 32) l += expf(row[t] - m);
    l = warp_sum(l);
    if (lane == 0) mx[h] = m, sm[h] = l;
  }
  const int64_t c = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  float acc[kHB];
#pragma unroll
  for (int h = 0; h < kHB; ++h) acc[h] = 0.f;
  for (int64_t t = ts; t < te; t += 32) {
    const int tn = int((te - t < 32 ? te - t : 32));
    __syncthreads();
    for (int e = threadIdx.x; e < kHB * 32; e += blockDim.x) {
      const int h = e / 32, tt = e % 32;
      ps[h][tt] = (h < hb && tt < tn) ? expf(S[(i * d.H + h0 + h) * d.max_len + t + tt] - mx[h]) : 0.f;
    }
    __syncthreads();
    if (c < d.C) {
      auto kvc = [&](int64_t t) { return cache_get(ckv, d.kv16, d.row(p.slot, t) * d.C + c); };
      int tt = 0;
      for (; tt + 4 <= tn; tt += 4) {
        const float w0 = kvc(t + tt), w1 = kvc(t + tt + 1), w2 = kvc(t + tt + 2), w3 = kvc(t + tt + 3);
#pragma unroll
        for (int h = 0; h < kHB; ++h)
          acc[h] = fmaf(ps[h][tt + 3], w3, fmaf(ps[h][tt + 2], w2, fmaf(ps[h][tt + 1], w1, fmaf(ps[h][tt], w0, acc[h]))));
      }
      for (; tt < tn; ++tt) {
        const float w = kvc(t + tt);
#pragma unroll
        for (int h = 0; h < kHB; ++h) acc[h] = fmaf(ps[h][tt], w, acc[h]);
      }
    }
  }
  if (c < d.C) {
    for (int h = 0; h < hb; ++h) {
      const int64_t ih = i * d.H + h0 + h;
      if (nsplit == 1) ol[ih * d.C + c] = acc[h] / sm[h];
      else part[(int64_t(blockIdx.z) * n * d.H + ih) * d.C + c] = acc[h];
    }
  }
  if (nsplit > 1 && blockIdx.y == 0 && threadIdx.x < hb) {
    const int64_t ih = i * d.H + h0 + threadIdx.x;
    ml[(int64_t(blockIdx.z) * n * d.H + ih) * 2] = mx[threadIdx.x];
    ml[(int64_t(blockIdx.z) * n * d.H + ih) * 2 + 1] = sm[threadIdx.x];
  }
}

__global__ void values_reduce_kernel(MlaDims d, const DevPos* __restrict__ pos, int64_t n, int64_t chunk,
                                     int64_t nsplit, const float* __restrict__ part, const float* __restrict__ ml,
                                     float* __restrict__ ol) {
  pdl_wait();
  pdl_trigger();
  const int64_t ih = blockIdx.x, i = ih / d.H;
  const int64_t len = int64_t(pos[i].pos) + 1, ns = dec_splits(len, many_chunk(chunk, len, nsplit));
  float M = -INFINITY;
  for (int64_t z = 0; z < ns; ++z) M = fmaxf(M, ml[(z * n * d.H + ih) * 2]);
  float Lsum = 0.f;
  for (int64_t z = 0; z < ns; ++z) Lsum += ml[(z * n * d.H + ih) * 2 + 1] * expf(ml[(z * n * d.H + ih) * 2] - M);
  for (int64_t c = threadIdx.x; c < d.C; c += blockDim.x) {
    float s = 0.f;
    for (int64_t z = 0; z < ns; ++z) s += part[(z * n * d.H + ih) * d.C + c] * expf(ml[(z * n * d.H + ih) * 2] - M);
    ol[ih * d.C + c] = s / Lsum;
  }
}

__global__ void naive_store_kernel(MlaDims d, const DevPos* __restrict__ pos, const float* __restrict__ kvb,
                                   float* __restrict__ ck, float* __restrict__ cv) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = blockIdx.x;
  const DevPos p = pos[i];
  const int64_t row = d.row(p.slot, p.pos);
  const int w = d.nope + d.V, qk = d.qk();
  for (int e = threadIdx.x; e < d.H * w; e += blockDim.x) {
    const int h = e / w, j = e % w;
    const float v = kvb[i * d.H * w + e];
    if (j < d.nope) ck[(row * d.H + h) * qk + j] = v;
    else cv[(row * d.H + h) * d.V + (j - d.nope)] = v;
  }
}

__global__ void naive_scores_kernel(MlaDims d, const DevPos* __restrict__ pos, const float* __restrict__ q,
                                    const float* __restrict__ ck, float* __restrict__ S) {
  extern __shared__ float qs[];  // [qk]
  pdl_wait();
  pdl_trigger();
  const int64_t ih = blockIdx.x, i = ih / d.H, h = ih % d.H;
  const int64_t t0 = int64_t(blockIdx.y) * 64;
  const DevPos p = pos[i];
  const int64_t len = int64_t(p.pos) + 1;
  const int qk = d.qk();
  if (t0 >= len) return;
  for (int j = threadIdx.x; j < qk; j += blockDim.x) qs[j] = q[ih * qk + j];
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int u = 0; u < 8; ++u) {
    const int64_t t = t0 + warp * 8 + u;
    if (t >= len) break;
    const float* k = ck + (d.row(p.slot, t) * d.H + h) * qk;
    float s = 0.f;
    for (int j = lane; j < qk; j += 32) s = fmaf(qs[j], k[j], s);
    s = warp_sum(s);
    if (lane == 0) S[ih * d.max_len + t] = s * d.scale;
  }
}

__global__ void naive_values_kernel(MlaDims d, const DevPos* __restrict__ pos, const float* __restrict__ S,
                                    const float* __restrict__ cv, float* __restrict__ out) {
  __shared__ float red[33], ps[128];
  pdl_wait();
  pdl_trigger();
  const int64_t ih = blockIdx.x, i = ih / d.H, h = ih % d.H;
  const DevPos p = pos[i];
  const int64_t len = int64_t(p.pos) + 1;
  const float* row = S + ih * d.max_len;
  float m = -INFINITY;
  for (int64_t t = threadIdx.x; t < len; t += blockDim.x) m = fmaxf(m, row[t]);
  m = block_max(m, red);
  float s = 0.f;
  for (int64_t t = threadIdx.x; t < len; t += blockDim.x) s += expf(row[t] - m);
  s = block_sum(s, red);
  for (int d0 = 0; d0 < d.V; d0 += blockDim.x) {
    const int dv = d0 + threadIdx.x;
    float acc = 0.f;
    for (int64_t t = 0; t < len; t += 128) {
      const int tn = int((len - t < 128 ? len - t : 128));
      __syncthreads();
      for (int e = threadIdx.x; e < 128; e += blockDim.x) ps[e] = e < tn ? expf(row[t + e] - m) / s : 0.f;
      __syncthreads();
      if (dv < d.V)
        for (int tt = 0; tt < tn; ++tt)
          acc = fmaf(ps[tt], cv[(d.row(p.slot, t + tt) * d.H + h) * d.V + dv], acc);
    }
    if (dv < d.V) out[i * d.H * d.V + h * d.V + dv] = acc;
  }
}

// ---- absorbed attention of many tokens (serving batches): one block per (token, 16 heads,
// position split). The split's cache rows go through shared memory kManyTP at a time (two
// buffers: the next tile's rows are on their way by cp.async while this one's are used), each
// row read once for all the block's heads: scores (the warp's lanes split the row's C + R columns,
// then a reduce-scatter of the 16 heads x 2 rows sums), a float32 online softmax, and the latent
// sums (thread: 4 columns x 8 heads). Float32 FMAs throughout. Tiles of 16 rows keep a block's
// shared memory near 110 KB, so two blocks share an SM.
constexpr int kManyTP = 16;   // cache rows per tile (the softmax's lane per row; two blocks per SM)
constexpr int kManyHG = 16;   // heads per block
constexpr int kManyThreads = 256;

size_t many_smem(const MlaDims& d) {
  return sizeof(float) * (size_t(kManyHG + 2 * kManyTP) * size_t(d.C + d.R) + kManyTP * kManyHG + 3 * kManyHG);
}

// Reduce-scatter of v[N] over the warp: one halving step (the lanes with `bit` set keep the upper
// half of the elements, the others the lower half, each adding its partner's copy).
template <int N>
__device__ __forceinline__ void halve(float* v, int lane, int bit) {
  const bool up = lane & bit;
#pragma unroll
  for (int j = 0; j < N / 2; ++j) {
    const float send = up ? v[j] : v[j + N / 2], keep = up ? v[j + N / 2] : v[j];
    v[j] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
  }
}

// Cache rows [t0, t0 + tn) of sequence `slot` (latent | rope key) into dst [kManyTP][CR4] by
// cp.async (a bf16 cache: loads widened to float32), zeros past tn; one commit group. Lane l looks up row t0 + l in the block table once;
// a thread's rows come from its warp's lanes (no table load between copies).
__device__ __forceinline__ void many_stage_rows(const MlaDims& d, int32_t slot, int64_t t0, int tn,
                                                const DecodeAttn& a, float4* dst) {
  const int CR4 = (d.C + d.R) / 4, C4 = d.C / 4, R4 = d.R / 4, lane = threadIdx.x & 31;
  const float4* kv4 = reinterpret_cast<const float4*>(a.cache_kv);
  const float4* pe4 = reinterpret_cast<const float4*>(a.cache_pe);
  const int64_t mine = lane < tn ? d.row(slot, t0 + lane) : 0;
  const int total = kManyTP * CR4, dr = kManyThreads / CR4, dk = kManyThreads % CR4;
  int r = threadIdx.x / CR4, k4 = threadIdx.x % CR4;  // of element e = base + threadIdx.x
  for (int base = 0; base < total; base += kManyThreads) {  // (warp-uniform trips: the shuffle)
    const int64_t row = __shfl_sync(0xffffffffu, mine, min(r, kManyTP - 1));
    if (base + int(threadIdx.x) < total && d.kv16) {  // bf16 rows, widened on the way (no cp.async)
      const uint2* src = reinterpret_cast<const uint2*>(k4 < C4 ? a.cache_kv : a.cache_pe) +
                         (k4 < C4 ? row * C4 + k4 : row * R4 + (k4 - C4));
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (r < tn) {
        const uint2 u = *src;
        const float2 lo = bf16x2_bits(u.x), hi = bf16x2_bits(u.y);
        v = make_float4(lo.x, lo.y, hi.x, hi.y);
      }
      dst[base + threadIdx.x] = v;
    } else if (base + int(threadIdx.x) < total) {
      const float4* src = k4 < C4 ? kv4 + row * C4 + k4 : pe4 + row * R4 + (k4 - C4);
      cp_async16(smem_addr(dst + base + threadIdx.x), src, r < tn);
    }
    r += dr, k4 += dk;
    if (k4 >= CR4) k4 -= CR4, ++r;
  }
  cp_async_commit();
}

__global__ void __launch_bounds__(kManyThreads, 2) many_kernel(MlaDims d, const DevPos* __restrict__ pos, int64_t n,
                                                               DecodeAttn a, int64_t chunk) {
  extern __shared__ float4 sm4[];
  const int CR = d.C + d.R, CR4 = CR / 4, C4 = d.C / 4;
  float4* qs = sm4;                                          // [kManyHG][CR4] queries (qa | q_pe)
  float4* kbuf = qs + kManyHG * CR4;                         // [2][kManyTP][CR4] cache rows (latent | rope key)
  float* ps = reinterpret_cast<float*>(kbuf + 2 * kManyTP * CR4);  // [kManyTP][kManyHG] scores, then weights
  float* mrun = ps + kManyTP * kManyHG;                      // [kManyHG] running max, sum, this tile's rescale
  float* lrun = mrun + kManyHG;
  float* alpha = lrun + kManyHG;
  pdl_wait();
  pdl_trigger();
  const int64_t i = blockIdx.x;
  const int h0 = blockIdx.y * kManyHG, hb = min(kManyHG, d.H - h0), z = blockIdx.z;
  const DevPos p = pos[i];
  const int64_t len = int64_t(p.pos) + 1, ck = many_chunk(chunk, len, a.nsplit), ts = int64_t(z) * ck,
                te = min(len, ts + ck);
  if (ts >= len) return;  // (the reduction skips this split)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  many_stage_rows(d, p.slot, ts, int(min(int64_t(kManyTP), te - ts)), a, kbuf);
  float* qf = reinterpret_cast<float*>(qs);
  for (int e = tid; e < kManyHG * CR; e += kManyThreads) {
    const int h = e / CR, j = e % CR;
    const int64_t ih = i * d.H + h0 + h;
    qf[e] = h >= hb ? 0.f : (j < d.C ? a.qa[ih * d.C + j] : a.q[ih * d.qk() + d.nope + (j - d.C)]);
  }
  if (tid < kManyHG) mrun[tid] = -INFINITY, lrun[tid] = 0.f;
  const int c4 = tid & 127, hq = (tid >> 7) * 8;  // value pass: columns 4 c4.., heads hq..hq + 7
  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  int buf = 0;
  for (int64_t t0 = ts; t0 < te; t0 += kManyTP, buf ^= 1) {
    const int tn = int(min(int64_t(kManyTP), te - t0));
    if (t0 + kManyTP < te) {  // the next tile into the other buffer (free since the last barrier)
      many_stage_rows(d, p.slot, t0 + kManyTP, int(min(int64_t(kManyTP), te - t0 - kManyTP)), a,
                      kbuf + (buf ^ 1) * kManyTP * CR4);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const float4* ks = kbuf + buf * kManyTP * CR4;
    {  // scores: warp w, rows 2w, 2w + 1, all heads; lanes over the columns
      float s[kManyHG * 2];
#pragma unroll
      for (int e = 0; e < kManyHG * 2; ++e) s[e] = 0.f;
      for (int k4 = lane; k4 < CR4; k4 += 32) {
        float4 kr[2];
#pragma unroll
        for (int g = 0; g < 2; ++g) kr[g] = ks[(warp * 2 + g) * CR4 + k4];
#pragma unroll
        for (int h = 0; h < kManyHG; ++h) {
          const float4 qv = qs[h * CR4 + k4];
#pragma unroll
          for (int g = 0; g < 2; ++g)
            s[h * 2 + g] = fmaf(qv.x, kr[g].x, fmaf(qv.y, kr[g].y, fmaf(qv.z, kr[g].z, fmaf(qv.w, kr[g].w, s[h * 2 + g]))));
        }
      }
      halve<32>(s, lane, 16);
      halve<16>(s, lane, 8);
      halve<8>(s, lane, 4);
      halve<4>(s, lane, 2);
      halve<2>(s, lane, 1);
      // s[0]: the sum of element `lane` of [head][2 rows] (the lane's bits 4..0 say which halves it kept)
      const int h = lane >> 1, r = warp * 2 + (lane & 1);
      ps[r * kManyHG + h] = r < tn ? s[0] * d.scale : -INFINITY;
    }
    __syncthreads();
    // online softmax: warp w, heads w and w + 8; lane = row
    for (int h = warp; h < kManyHG; h += kManyThreads / 32) {
      const float sv = lane < kManyTP ? ps[lane * kManyHG + h] : -INFINITY;
      const float mt = warp_max(sv), mnew = fmaxf(mrun[h], mt);
      const float e = lane < tn ? expf(sv - mnew) : 0.f;
      const float sum = warp_sum(e);
      if (lane < kManyTP) ps[lane * kManyHG + h] = e;
      if (lane == 0) {
        const float al = expf(mrun[h] - mnew);
        alpha[h] = al, lrun[h] = lrun[h] * al + sum, mrun[h] = mnew;
      }
    }
    __syncthreads();
    if (c4 < C4) {  // latent sums: acc[j] = acc[j] * alpha + sum_r w[r, hq + j] * kv[r, 4 c4..]
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float al = alpha[hq + j];
        acc[j][0] *= al, acc[j][1] *= al, acc[j][2] *= al, acc[j][3] *= al;
      }
      const float4* ps4 = reinterpret_cast<const float4*>(ps);
      for (int r = 0; r < tn; ++r) {
        const float4 v = ks[r * CR4 + c4], wa = ps4[r * (kManyHG / 4) + hq / 4], wb = ps4[r * (kManyHG / 4) + hq / 4 + 1];
        const float w[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc[j][0] = fmaf(w[j], v.x, acc[j][0]);
          acc[j][1] = fmaf(w[j], v.y, acc[j][1]);
          acc[j][2] = fmaf(w[j], v.z, acc[j][2]);
          acc[j][3] = fmaf(w[j], v.w, acc[j][3]);
        }
      }
    }
    __syncthreads();  // (this buffer and ps are free for the next tile)
  }
  const bool split = gridDim.z > 1;
  if (c4 < C4) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int h = hq + j;
      if (h >= hb) continue;
      const int64_t ih = i * d.H + h0 + h;
      const float inv = split ? 1.f : 1.f / lrun[h];
      const float4 o = make_float4(acc[j][0] * inv, acc[j][1] * inv, acc[j][2] * inv, acc[j][3] * inv);
      float* dst = split ? a.part + (int64_t(z) * n * d.H + ih) * d.C : a.ol + ih * d.C;
      reinterpret_cast<float4*>(dst)[c4] = o;
    }
  }
  if (split && tid < hb) {
    const int64_t ih = i * d.H + h0 + tid;
    a.ml[(int64_t(z) * n * d.H + ih) * 2] = mrun[tid];
    a.ml[(int64_t(z) * n * d.H + ih) * 2 + 1] = lrun[tid];
  }
}

}  // namespace

bool mla_many_ok(const MlaDims& d) {
  return d.C % 4 == 0 && d.R % 4 == 0 && d.C <= 512 && many_smem(d) <= size_t(220) << 10;
}

int mla_many_splits(const MlaDims& d, int64_t n, int64_t len_max) {
  const int64_t len = len_max > 0 ? len_max : d.max_len, blocks = n * cdiv(d.H, kManyHG);
  const int64_t s = std::min<int64_t>((2 * int64_t(device_sms()) + blocks / 2) / blocks, (len + 63) / 64);
  return int(std::max<int64_t>(s, 1));
}

void mla_decode_many(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const DecodeAttn& a) {
  DSV3_CHECK(mla_many_ok(d), "many-token decode attention: kv_lora_rank ", d.C, " and rope dim ", d.R,
             " must be multiples of 4, kv_lora_rank at most 512");
  DSV3_CHECK(a.nsplit >= 1 && (a.nsplit == 1 || (a.part && a.ml)), "many-token decode attention: split buffers");
  DSV3_CHECK(a.len_max <= d.max_len, "many-token decode attention: len_max ", a.len_max, " past ", d.max_len);
  const bool tc = !a.simple && mla_many_tc_ok(d);
  // Each split's positions: whole tiles covering len_max over nsplit, or without len_max (a step
  // that may be recorded) each token's own length over nsplit (many_chunk: chunk -tile).
  const int64_t tile = tc ? kManyTcRows : kManyTP;
  const int64_t chunk = a.len_max > 0 ? split_tiles(a.len_max, a.nsplit, tile) : -tile;
  if (tc) {
    mla_many_tc(L, d, pos, n, a, chunk);
  } else {
    const size_t smem = many_smem(d);
    allow_smem(many_kernel, smem);
    launch(L, many_kernel, dim3(unsigned(n), cdiv(d.H, kManyHG), unsigned(a.nsplit)), dim3(kManyThreads), smem, d,
           pos, n, a, chunk);
  }
  if (a.nsplit > 1)
    launch(L, values_reduce_kernel, dim3(unsigned(n * d.H)), dim3(128), 0, d, pos, n, chunk, int64_t(a.nsplit),
           a.part, a.ml, a.ol);
}

void mla_prep(const Launch& L, const MlaDims& d, bool naive, const MlaPrep& p) {
  DSV3_CHECK(d.R % 2 == 0);
  const PrepArgs P{d, naive, p.pos, p.q, p.kv, p.kv_norm_w, p.rope, p.cache_kv, p.cache_pe, p.latent, p.cache_k};
  launch(L, prep_kernel, dim3(unsigned(p.n)), dim3(256), 0, P);
}

// The tensor-core q absorption from this many tokens: one 16-row MMA tile or more.
constexpr int64_t kQabsTcMin = 16;
// Whether it takes w: bf16 or e4m3 weights, nope a multiple of 32 up to 128, and for e4m3 every
// head's nope rows within one 128-row scale block (one scale per block of 64 columns).
static bool qabs_tc_ok(const MlaDims& d, const DevLinear& w) {
  if ((w.t != kBF16 && w.t != kFP8) || d.nope % 32 != 0 || d.nope > 128) return false;
  if (w.t == kFP8)
    for (int64_t h = 0; h < d.H; ++h) {
      const int64_t r0 = w.row0 + h * (d.nope + d.V);
      if (r0 / 128 != (r0 + d.nope - 1) / 128) return false;
    }
  return true;
}

void mla_prep_qabs(const Launch& L, const MlaDims& d, const MlaPrep& p, const DevLinear& w, float* qa, bool qabs_vec) {
  DSV3_CHECK(d.R % 2 == 0 && d.nope <= 8 * 16, "MLA shape beyond the fused prep/absorption kernel");
  const int64_t n = p.n;
  const PrepArgs P{d, false, p.pos, p.q, p.kv, p.kv_norm_w, p.rope, p.cache_kv, p.cache_pe, nullptr, nullptr,
                   p.qabs_bf16};
  const unsigned nq = unsigned(d.H) * cdiv(d.C, 64);
  // The 16-byte form: whole 64-column blocks, 16-byte aligned rows (and 128-row FP8 scale blocks
  // that a 64-column block never straddles: col0 % 64 == 0).
  const bool vec = qabs_vec && d.C % 64 == 0 && w.col0 % 64 == 0 && vec_ok(w);
  const bool tc = vec && n >= kQabsTcMin && qabs_tc_ok(d, w);
  // Many tokens (serving batches): the absorption's blocks split them in groups of 32 (128 on
  // tensor cores).
  const int64_t per = tc ? std::min<int64_t>(n, 128) : n > 32 ? 32 : std::max<int64_t>(n, 1);
  const dim3 grid(nq * cdiv(n, per) + unsigned(n));
  if (tc) {
    const size_t smem = sizeof(uint16_t) * size_t(d.nope) * kQtPitch;
    if (w.t == kBF16) launch(L, prep_qabs_kernel<kBF16, -1>, grid, dim3(256), smem, P, w, n, qa, per);
    else launch(L, prep_qabs_kernel<kFP8, -1>, grid, dim3(256), smem, P, w, n, qa, per);
    return;
  }
  const int tb = !vec ? kTB : (n == 1 ? 1 : 4);
  const size_t smem = sizeof(float) * tb * (size_t(d.nope) + 8 * 64);
  auto go = [&](auto k1, auto k4, auto k0) {
    launch(L, !vec ? k0 : (n == 1 ? k1 : k4), grid, dim3(256), smem, P, w, n, qa, per);
  };
  if (w.t == kBF16) go(prep_qabs_kernel<kBF16, 1>, prep_qabs_kernel<kBF16, 4>, prep_qabs_kernel<kBF16, 0>);
  else if (w.t == kFP8) go(prep_qabs_kernel<kFP8, 1>, prep_qabs_kernel<kFP8, 4>, prep_qabs_kernel<kFP8, 0>);
  else go(prep_qabs_kernel<kF32, 1>, prep_qabs_kernel<kF32, 4>, prep_qabs_kernel<kF32, 0>);
}

void mla_qabs(const Launch& L, const MlaDims& d, const DevLinear& w, const float* q, int64_t n, float* qa) {
  const dim3 grid(unsigned(d.H), cdiv(d.C, 64));
  const size_t smem = sizeof(float) * kTB * (size_t(d.nope) + 8 * 64);
  DSV3_CHECK(d.nope <= 8 * 16, "qk_nope_head_dim above 128");
  if (w.t == kBF16) launch(L, qabs_kernel<kBF16>, grid, dim3(256), smem, d, w, q, n, qa);
  else if (w.t == kFP8) launch(L, qabs_kernel<kFP8>, grid, dim3(256), smem, d, w, q, n, qa);
  else launch(L, qabs_kernel<kF32>, grid, dim3(256), smem, d, w, q, n, qa);
}

// Heads per block of the score and value kernels: few for decode (more blocks over a short
// cache), all 16 when many tokens fill the GPU anyway.
static int heads_per_block(int64_t n) { return n <= 4 ? 2 : (n <= 16 ? 4 : kHB); }

void mla_scores(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const DecodeAttn& a, float* S) {
  DSV3_CHECK(d.C + d.R <= 32 * kMaxJ, "kv_lora_rank + qk_rope_head_dim above ", 32 * kMaxJ);
  const int ppb = n >= 64 ? 128 : 32;  // positions per block: fewer for decode, to spread the cache
  const int hbs = heads_per_block(n);
  const dim3 grid(unsigned(n), cdiv(d.max_len, ppb), cdiv(d.H, hbs));
  const size_t smem = sizeof(float) * size_t(std::min(d.H, hbs)) * size_t(d.C + d.R);
  launch(L, scores_kernel, grid, dim3(256), smem, d, pos, ScoreBlocks{ppb, hbs}, a.qa, a.q, a.cache_kv, a.cache_pe, S);
}

int mla_splits(const MlaDims& d, int64_t n) {
  const int hbs = heads_per_block(n);
  const int64_t blocks = n * ((d.H + hbs - 1) / hbs) * ((d.C + 127) / 128);
  int64_t s = (264 + blocks - 1) / blocks;
  s = std::min<int64_t>(s, (d.max_len + 63) / 64);
  return int(std::max<int64_t>(s, 1));
}

void mla_values(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const float* S, const DecodeAttn& a) {
  const int64_t chunk = (d.max_len + a.nsplit - 1) / a.nsplit;
  const int hbs = heads_per_block(n);
  const dim3 grid(unsigned(n * cdiv(d.H, hbs)), cdiv(d.C, 128), unsigned(a.nsplit));
  launch(L, values_kernel, grid, dim3(128), 0, d, pos, ValueBlocks{n, chunk, a.nsplit, hbs}, S, a.cache_kv, a);
  if (a.nsplit > 1)
    launch(L, values_reduce_kernel, dim3(unsigned(n * d.H)), dim3(128), 0, d, pos, n, chunk, int64_t(a.nsplit),
           a.part, a.ml, a.ol);
}

namespace {
// Block: one cache row of the sequence (blockIdx.x = position); its C + R values.
__global__ void gather_rows_kernel(MlaDims d, int32_t slot, const float* __restrict__ ckv,
                                   const float* __restrict__ cpe, float* __restrict__ kv, float* __restrict__ pe) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = blockIdx.x, r = d.row(slot, t);
  for (int j = threadIdx.x; j < d.C; j += blockDim.x) kv[t * d.C + j] = cache_get(ckv, d.kv16, r * d.C + j);
  for (int j = threadIdx.x; j < d.R; j += blockDim.x) pe[t * d.R + j] = cache_get(cpe, d.kv16, r * d.R + j);
}
}  // namespace

void gather_cache_rows(const Launch& L, const MlaDims& d, int32_t slot, int64_t len, const float* cache_kv,
                       const float* cache_pe, float* kv, float* pe) {
  if (len > 0) launch(L, gather_rows_kernel, dim3(unsigned(len)), dim3(128), 0, d, slot, cache_kv, cache_pe, kv, pe);
}

void mla_naive_store(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const float* kvb, float* cache_k,
                     float* cache_v) {
  launch(L, naive_store_kernel, dim3(unsigned(n)), dim3(256), 0, d, pos, kvb, cache_k, cache_v);
}

void mla_naive_scores(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const float* q,
                      const float* cache_k, float* S) {
  launch(L, naive_scores_kernel, dim3(unsigned(n * d.H), cdiv(d.max_len, 64)), dim3(256),
         sizeof(float) * size_t(d.qk()), d, pos, q, cache_k, S);
}

void mla_naive_values(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const float* S,
                      const float* cache_v, float* out) {
  launch(L, naive_values_kernel, dim3(unsigned(n * d.H)), dim3(128), 0, d, pos, S, cache_v, out);
}

}  // namespace dsv3::cuda
