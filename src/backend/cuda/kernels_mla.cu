// Multi-head latent attention on the device (MLA.forward of the reference): RoPE, kv_norm and
// the cache write; absorbed attention over the latent cache (q absorption into wkv_b, scores,
// float32 softmax fused into the value pass, split over positions for long caches; the one-launch
// decode form is in kernels_mla_decode.cu); and the naive form over full K/V caches. Every
// kernel reads the tokens' (slot, pos) from the device, so a recorded step replays with new
// positions.
#include <algorithm>

#include "backend/cuda/common.cuh"
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
  float* dst = naive ? latent + i * d.C : cache_kv + row * d.C;
  for (int c = threadIdx.x; c < d.C; c += blockDim.x) dst[c] = kvi[c] * r * nw[c];
  for (int j = threadIdx.x; j < half; j += blockDim.x) {
    const float a = kvi[d.C + 2 * j], b = kvi[d.C + 2 * j + 1], c = cs[2 * j], s = cs[2 * j + 1];
    const float x0 = a * c - b * s, x1 = a * s + b * c;
    if (!naive) {
      cache_pe[row * d.R + 2 * j] = x0;
      cache_pe[row * d.R + 2 * j + 1] = x1;
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

template <int WT>
__global__ void __launch_bounds__(256) qabs_kernel(MlaDims d, DevLinear w, const float* __restrict__ q, int64_t n,
                                                   float* __restrict__ qa) {
  extern __shared__ float smem[];
  qabs_block<WT>(d, w, q, n, qa, blockIdx.x, blockIdx.y, smem);
}

// Absorbed decode: the q absorption (reads q's nope parts) and RoPE/kv_norm/cache write (q's rope
// parts, the cache) touch disjoint data: one launch, blocks [0, H * C/64) absorb, the rest prep.
// TB > 0: the 16-byte form, TB tokens per pass; 0: qabs_block.
template <int WT, int TB>
__global__ void __launch_bounds__(256) prep_qabs_kernel(PrepArgs P, DevLinear w, int64_t n, float* __restrict__ qa) {
  extern __shared__ float smem[];
  const int nq = P.d.H * int((P.d.C + 63) / 64);
  if (int(blockIdx.x) < nq) {
    if constexpr (TB > 0) qabs_vec_block<WT, TB>(P.d, w, P.q, n, qa, blockIdx.x % P.d.H, blockIdx.x / P.d.H, smem);
    else qabs_block<WT>(P.d, w, P.q, n, qa, blockIdx.x % P.d.H, blockIdx.x / P.d.H, smem);
  } else {
    pdl_wait();
    pdl_trigger();
    prep_token(P, blockIdx.x - nq, smem);
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
__global__ void __launch_bounds__(256) scores_kernel(MlaDims d, const DevPos* __restrict__ pos, int ppb, int hbs,
                                                     const float* __restrict__ qa, const float* __restrict__ q,
                                                     const float* __restrict__ ckv, const float* __restrict__ cpe,
                                                     float* __restrict__ S) {
  extern __shared__ float qs[];  // [hbs][C + R]
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
        kr[g][m] = t >= len ? 0.f : (j < d.C ? ckv[rp * d.C + j] : (j < CR ? cpe[rp * d.R + (j - d.C)] : 0.f));
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
__global__ void __launch_bounds__(128) values_kernel(MlaDims d, const DevPos* __restrict__ pos, int64_t n,
                                                     const float* __restrict__ S, const float* __restrict__ ckv,
                                                     int nsplit, int64_t chunk, int hbs, float* __restrict__ part,
                                                     float* __restrict__ ml, float* __restrict__ ol) {
  __shared__ float mx[kHB], sm[kHB], ps[kHB][32];
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
      const float* kvc = ckv + c;  // row r of the cache: kvc[r * C]
      int tt = 0;
      for (; tt + 4 <= tn; tt += 4) {
        const float w0 = kvc[d.row(p.slot, t + tt) * d.C], w1 = kvc[d.row(p.slot, t + tt + 1) * d.C],
                    w2 = kvc[d.row(p.slot, t + tt + 2) * d.C], w3 = kvc[d.row(p.slot, t + tt + 3) * d.C];
#pragma unroll
        for (int h = 0; h < kHB; ++h)
          acc[h] = fmaf(ps[h][tt + 3], w3, fmaf(ps[h][tt + 2], w2, fmaf(ps[h][tt + 1], w1, fmaf(ps[h][tt], w0, acc[h]))));
      }
      for (; tt < tn; ++tt) {
        const float w = kvc[d.row(p.slot, t + tt) * d.C];
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
                                     const float* __restrict__ part, const float* __restrict__ ml,
                                     float* __restrict__ ol) {
  pdl_wait();
  pdl_trigger();
  const int64_t ih = blockIdx.x, i = ih / d.H;
  const int64_t len = int64_t(pos[i].pos) + 1, ns = (len + chunk - 1) / chunk;
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

}  // namespace

void mla_prep(const Launch& L, const MlaDims& d, bool naive, const DevPos* pos, int64_t n, float* q, const float* kv,
              const float* kv_norm_w, const float* rope, float* cache_kv, float* cache_pe, float* latent,
              float* cache_k) {
  DSV3_CHECK(d.R % 2 == 0);
  const PrepArgs P{d, naive, pos, q, kv, kv_norm_w, rope, cache_kv, cache_pe, latent, cache_k};
  launch(L, prep_kernel, dim3(unsigned(n)), dim3(256), 0, P);
}

void mla_prep_qabs(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, float* q, const float* kv,
                   const float* kv_norm_w, const float* rope, float* cache_kv, float* cache_pe, const DevLinear& w,
                   float* qa, bool qabs_vec) {
  DSV3_CHECK(d.R % 2 == 0 && d.nope <= 8 * 16, "MLA shape beyond the fused prep/absorption kernel");
  const PrepArgs P{d, false, pos, q, kv, kv_norm_w, rope, cache_kv, cache_pe, nullptr, nullptr};
  const unsigned nq = unsigned(d.H) * cdiv(d.C, 64);
  const dim3 grid(nq + unsigned(n));
  // The 16-byte form: whole 64-column blocks, 16-byte aligned rows (and 128-row FP8 scale blocks
  // that a 64-column block never straddles: col0 % 64 == 0).
  const bool vec = qabs_vec && d.C % 64 == 0 && w.col0 % 64 == 0 && vec_ok(w);
  const int tb = !vec ? kTB : (n == 1 ? 1 : 4);
  const size_t smem = sizeof(float) * tb * (size_t(d.nope) + 8 * 64);
  auto go = [&](auto k1, auto k4, auto k0) {
    launch(L, !vec ? k0 : (n == 1 ? k1 : k4), grid, dim3(256), smem, P, w, n, qa);
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

void mla_scores(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const float* qa, const float* q,
                const float* cache_kv, const float* cache_pe, float* S) {
  DSV3_CHECK(d.C + d.R <= 32 * kMaxJ, "kv_lora_rank + qk_rope_head_dim above ", 32 * kMaxJ);
  const int ppb = n >= 64 ? 128 : 32;  // positions per block: fewer for decode, to spread the cache
  const int hbs = heads_per_block(n);
  const dim3 grid(unsigned(n), cdiv(d.max_len, ppb), cdiv(d.H, hbs));
  const size_t smem = sizeof(float) * size_t(std::min(d.H, hbs)) * size_t(d.C + d.R);
  launch(L, scores_kernel, grid, dim3(256), smem, d, pos, ppb, hbs, qa, q, cache_kv, cache_pe, S);
}

int mla_splits(const MlaDims& d, int64_t n) {
  const int hbs = heads_per_block(n);
  const int64_t blocks = n * ((d.H + hbs - 1) / hbs) * ((d.C + 127) / 128);
  int64_t s = (264 + blocks - 1) / blocks;
  s = std::min<int64_t>(s, (d.max_len + 63) / 64);
  return int(std::max<int64_t>(s, 1));
}

void mla_values(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const float* S, const float* cache_kv,
                int nsplit, float* part, float* ml, float* ol) {
  const int64_t chunk = (d.max_len + nsplit - 1) / nsplit;
  const int hbs = heads_per_block(n);
  const dim3 grid(unsigned(n * cdiv(d.H, hbs)), cdiv(d.C, 128), unsigned(nsplit));
  launch(L, values_kernel, grid, dim3(128), 0, d, pos, n, S, cache_kv, nsplit, chunk, hbs, part, ml, ol);
  if (nsplit > 1)
    launch(L, values_reduce_kernel, dim3(unsigned(n * d.H)), dim3(128), 0, d, pos, n, chunk, part, ml, ol);
}

namespace {
// Block: one cache row of the sequence (blockIdx.x = position); its C + R values.
__global__ void gather_rows_kernel(MlaDims d, int32_t slot, const float* __restrict__ ckv,
                                   const float* __restrict__ cpe, float* __restrict__ kv, float* __restrict__ pe) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = blockIdx.x, r = d.row(slot, t);
  for (int j = threadIdx.x; j < d.C; j += blockDim.x) kv[t * d.C + j] = ckv[r * d.C + j];
  for (int j = threadIdx.x; j < d.R; j += blockDim.x) pe[t * d.R + j] = cpe[r * d.R + j];
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
