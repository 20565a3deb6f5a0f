// The absorbed decode attention (few tokens, MLA.forward's attn_impl "absorb" at decode): one
// launch per step over the latent and rope caches, split over positions (kernels_mla.cu has the
// rest of MLA). Every kernel reads the tokens' (slot, pos) from the device, so a recorded step
// replays with new positions.
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/mla_splits.cuh"
#include "backend/cuda/mma.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

constexpr int kMaxJ = 18;  // (kv_lora_rank + rope) / 32 held per lane: up to 576 (as kernels_mla.cu)
// Absorbed attention of few tokens in one launch (decode): scores against the latent and rope
// caches, float32 softmax and the weighted latent sum. Block: token i, HB heads, positions
// [z * chunk, (z + 1) * chunk) in passes of kDecPass with a running max and sum. With several
// position splits the blocks leave partial sums (part, ml) and the last one to finish for
// (i, head block), by an atomic count, combines them: no second launch. The chunk follows the
// token's length on the device (a recorded step replays at any position): the length over the
// launch's splits, rounded up to whole kDecMinChunk (a block's round of score rows), so short
// caches spread over several blocks with one short chain of loads each.
constexpr int kDecCols = 2;  // latent columns per thread (C <= 512); kDecPass etc.: mla_splits.cuh

// Token i's absorbed query and rope query of heads [h0, h0 + hb) into qs [HB][C + R] (zeros for
// heads past hb); the caller's barrier follows.
template <int HB>
__device__ __forceinline__ void stage_query(const MlaDims& d, const float* __restrict__ qa, const float* __restrict__ q,
                                            int64_t i, int h0, int hb, float* qs) {
  const int CR = d.C + d.R;
  for (int e = threadIdx.x; e < HB * CR; e += blockDim.x) {
    const int h = e / CR, j = e % CR;
    const int64_t ih = i * d.H + h0 + h;
    qs[e] = h >= hb ? 0.f : (j < d.C ? qa[ih * d.C + j] : q[ih * d.qk() + d.nope + (j - d.C)]);
  }
}

// The lane's share of two cache rows' dot products with one head's query (columns lane + 32 m).
__device__ __forceinline__ void row_dots(const float* kr, const float* kq, const float* qh, int CR, int lane, float& a,
                                         float& b) {
  a = 0.f, b = 0.f;
#pragma unroll
  for (int m = 0; m < kMaxJ; ++m) {
    const int j = lane + 32 * m;
    if (j < CR) a = fmaf(kr[m], qh[j], a), b = fmaf(kq[m], qh[j], b);
  }
}

// After a split's block of the decode attention has written its partial sums (part, ml): the
// last of the token's ns splits for this head block (an atomic count) combines them into ol, each
// split's factor exp(m_z - M) once in shared memory (fz: [hb][kDecMaxSplits]; lsum: [hb]), then
// the partial sums with loads in flight; it leaves the counter zeroed for the next launch. (Up to
// 16 splits' partial sums held in registers and loaded with the (m, l) pairs, together with one
// split for caches of up to 96 rows, measured slower on the H200: bf16 b1 463.6 against 470-473.)
__device__ void combine_splits(const MlaDims& d, int64_t n, int64_t i, int h0, int hb, int ns,
                               const float* __restrict__ part, const float* __restrict__ ml, unsigned* counters,
                               float* __restrict__ ol, float* fz, float* lsum) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (!last_to_arrive(&counters[blockIdx.x], unsigned(ns))) return;
  if (DSV3_TRACE && threadIdx.x == 0 && blockIdx.x == 0) trace_point();  // head block 0's last split
  if (warp < hb) {  // the splits' (m, l) pairs, one load each
    const float Ls = split_factors(ml, ns, n * d.H, i * d.H + h0 + warp, fz + warp * kDecMaxSplits);
    if (lane == 0) lsum[warp] = Ls;
  }
  __syncthreads();
  for (int h = 0; h < hb; ++h) {
    const int64_t ih = i * d.H + h0 + h;
    for (int col = threadIdx.x; col < d.C; col += blockDim.x)
      ol[ih * d.C + col] = split_column(part, ns, n * d.H, d.C, ih, col, fz + h * kDecMaxSplits, lsum[h]);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next launch
  if (DSV3_TRACE && threadIdx.x == 0 && blockIdx.x == 0) trace_point();
}

template <int HB>
__global__ void __launch_bounds__(256) decode_attn_kernel(MlaDims d, const DevPos* __restrict__ pos, int64_t n,
                                                          const float* __restrict__ qa, const float* __restrict__ q,
                                                          const float* __restrict__ ckv, const float* __restrict__ cpe,
                                                          float* __restrict__ part,
                                                          float* __restrict__ ml, unsigned* __restrict__ counters,
                                                          float* __restrict__ ol) {
  extern __shared__ float dsm[];  // q [HB][C + R], p [HB][kDecPass]
  __shared__ float m_run[HB], l_run[HB], alpha[HB];
  pdl_wait();
  pdl_trigger();
  const int nhb = (d.H + HB - 1) / HB, CR = d.C + d.R;
  const int64_t i = blockIdx.x / nhb;
  const int h0 = int(blockIdx.x % nhb) * HB, hb = min(HB, d.H - h0);
  const DevPos p = pos[i];
  const int64_t len = int64_t(p.pos) + 1, chunk = dec_chunk(len, gridDim.z);
  const int64_t ts = int64_t(blockIdx.z) * chunk, te = min(len, ts + chunk);
  if (ts >= len) return;  // not one of this token's splits
  const int ns = dec_splits(len, chunk);
  float* qs = dsm;
  float* ps = dsm + HB * CR;
  stage_query<HB>(d, qa, q, i, h0, hb, qs);
  if (threadIdx.x < HB) m_run[threadIdx.x] = -INFINITY, l_run[threadIdx.x] = 0.f;
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row0 = int64_t(p.slot) * d.max_len;
  float acc[HB][kDecCols];
#pragma unroll
  for (int h = 0; h < HB; ++h)
#pragma unroll
    for (int c = 0; c < kDecCols; ++c) acc[h][c] = 0.f;
  for (int64_t t0 = ts; t0 < te; t0 += kDecPass) {
    const int tn = int(te - t0 < kDecPass ? te - t0 : kDecPass);
    // Scores: a warp takes positions tt and tt + 8, both cache rows in registers (their loads in
    // flight together: at short contexts this loop is a chain of round trips).
    for (int tt = warp; tt < tn; tt += 16) {
      const bool two = tt + 8 < tn;
      const int64_t rp = row0 + t0 + tt, rq = rp + 8;
      float kr[kMaxJ], kq[kMaxJ];
#pragma unroll
      for (int m = 0; m < kMaxJ; ++m) {
        const int j = lane + 32 * m;
        kr[m] = j < d.C ? ckv[rp * d.C + j] : (j < CR ? cpe[rp * d.R + (j - d.C)] : 0.f);
        kq[m] = !two ? 0.f : (j < d.C ? ckv[rq * d.C + j] : (j < CR ? cpe[rq * d.R + (j - d.C)] : 0.f));
      }
#pragma unroll
      for (int h = 0; h < HB; ++h) {
        float sh, sq;
        row_dots(kr, kq, qs + h * CR, CR, lane, sh, sq);
        sh = warp_sum(sh);
        sq = warp_sum(sq);
        if (lane == 0) {
          ps[h * kDecPass + tt] = sh * d.scale;
          if (two) ps[h * kDecPass + tt + 8] = sq * d.scale;
        }
      }
    }
    __syncthreads();
    if (warp < hb) {  // running softmax of head `warp`; ps becomes exp(s - m)
      float* pr = ps + warp * kDecPass;
      float mx = -INFINITY;
      for (int tt = lane; tt < tn; tt += 32) mx = fmaxf(mx, pr[tt]);
      mx = warp_max(mx);
      const float mo = m_run[warp], mn = fmaxf(mo, mx);
      float l = 0.f;
      for (int tt = lane; tt < tn; tt += 32) {
        const float e = expf(pr[tt] - mn);
        pr[tt] = e;
        l += e;
      }
      l = warp_sum(l);
      if (lane == 0) {
        const float a = expf(mo - mn);  // 0 on the first pass
        alpha[warp] = a, l_run[warp] = l_run[warp] * a + l, m_run[warp] = mn;
      }
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kDecCols; ++c) {
      const int col = int(threadIdx.x) + 256 * c;
      if (col >= d.C) continue;
#pragma unroll
      for (int h = 0; h < HB; ++h) acc[h][c] *= h < hb ? alpha[h] : 0.f;
      const float* kvp = ckv + (row0 + t0) * d.C + col;
      int tt = 0;
      for (; tt + 8 <= tn; tt += 8) {  // eight cache rows' loads in flight
        float w[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) w[u] = kvp[int64_t(tt + u) * d.C];
#pragma unroll
        for (int h = 0; h < HB; ++h) {
          const float* pr = ps + h * kDecPass + tt;
          float a = acc[h][c];
#pragma unroll
          for (int u = 0; u < 8; ++u) a = fmaf(pr[u], w[u], a);
          acc[h][c] = a;
        }
      }
      for (; tt < tn; ++tt) {
        const float w = kvp[int64_t(tt) * d.C];
#pragma unroll
        for (int h = 0; h < HB; ++h) acc[h][c] = fmaf(ps[h * kDecPass + tt], w, acc[h][c]);
      }
    }
    __syncthreads();  // ps is rewritten by the next pass
  }
  if (ns == 1) {
#pragma unroll
    for (int c = 0; c < kDecCols; ++c) {
      const int col = int(threadIdx.x) + 256 * c;
      if (col >= d.C) continue;
      for (int h = 0; h < hb; ++h) ol[(i * d.H + h0 + h) * d.C + col] = acc[h][c] / l_run[h];
    }
    return;
  }
  const int64_t z = blockIdx.z;
#pragma unroll
  for (int c = 0; c < kDecCols; ++c) {
    const int col = int(threadIdx.x) + 256 * c;
    if (col >= d.C) continue;
    for (int h = 0; h < hb; ++h) part[(z * n * d.H + i * d.H + h0 + h) * d.C + col] = acc[h][c];
  }
  if (threadIdx.x < hb) {
    const int64_t ih = i * d.H + h0 + threadIdx.x;
    ml[(z * n * d.H + ih) * 2] = m_run[threadIdx.x], ml[(z * n * d.H + ih) * 2 + 1] = l_run[threadIdx.x];
  }
  combine_splits(d, n, i, h0, hb, ns, part, ml, counters, ol, ps, l_run);
}

// A block's rows [ts, te) of token i's cache (decode, split z of the launch's gridDim.z) and
// their fold into the warps' running softmax states: warp w takes the positions w, w + 8, ...
// two at a time, keeps a running max, sum and latent-weighted sum per head in registers (its
// lanes' columns) and leaves them in shared memory for the block's merge (dec_merge). One token
// (preload): the cache rows before its own position were written by earlier steps, so a warp's
// first two go out before the wait. NEWROW (decode_attn_prep_kernel): the token's own row
// (position len - 1) comes from nrow in shared memory, made by the block itself.
template <int HB, bool NEWROW = false>
struct DecRows {
  const MlaDims& d;
  const float* __restrict__ ckv;
  const float* __restrict__ cpe;
  int64_t len, chunk, ts, te, row0;
  int warp, lane, CR;
  bool pre = false;
  const float* nrow = nullptr;
  float kr[kMaxJ], kq[kMaxJ];
  __device__ DecRows(const MlaDims& d_, DevPos p, const float* ckv_, const float* cpe_)
      : d(d_), ckv(ckv_), cpe(cpe_), warp(int(threadIdx.x >> 5)), lane(int(threadIdx.x & 31)), CR(d_.C + d_.R) {
    len = int64_t(p.pos) + 1, chunk = dec_chunk(len, gridDim.z);
    ts = int64_t(blockIdx.z) * chunk, te = min(len, ts + chunk);
    row0 = int64_t(p.slot) * d.max_len;
  }
  __device__ int splits() const { return dec_splits(len, chunk); }  // of this token's length
  __device__ void load_row(int64_t t, float* k) const {
    if (NEWROW && t == len - 1) {
#pragma unroll
      for (int m = 0; m < kMaxJ; ++m) {
        const int j = lane + 32 * m;
        k[m] = j < CR ? nrow[j] : 0.f;
      }
      return;
    }
#pragma unroll
    for (int m = 0; m < kMaxJ; ++m) {
      const int j = lane + 32 * m;
      k[m] = j < d.C ? ckv[(row0 + t) * d.C + j] : (j < CR ? cpe[(row0 + t) * d.R + (j - d.C)] : 0.f);
    }
  }
  __device__ void preload() {
    const int64_t t = ts + warp;
    if (t + 8 < len - 1 && t < te) {  // both of the first rows written by earlier steps
      load_row(t, kr);
      if (t + 8 < te) load_row(t + 8, kq);
      pre = true;
    }
  }
  // qs [HB][C + R]: the staged queries. Writes ws [8][HB][C], wm / wl [8][HB]; the caller syncs.
  __device__ void fold(const float* qs, float* ws, float (*wm)[HB], float (*wl)[HB]) {
    float mx[HB], l[HB], acc[HB][kMaxJ];
#pragma unroll
    for (int h = 0; h < HB; ++h) {
      mx[h] = -INFINITY, l[h] = 0.f;
#pragma unroll
      for (int m = 0; m < kMaxJ; ++m) acc[h][m] = 0.f;
    }
    for (int64_t t = ts + warp; t < te; t += 16) {
      const bool two = t + 8 < te;
      if (!pre) {
        load_row(t, kr);
        if (two) load_row(t + 8, kq);
      }
      pre = false;
#pragma unroll
      for (int h = 0; h < HB; ++h) {
        float sa, sb;
        row_dots(kr, kq, qs + h * CR, CR, lane, sa, sb);
        sa = warp_sum(sa) * d.scale;
        sb = two ? warp_sum(sb) * d.scale : -INFINITY;
        const float mn = fmaxf(mx[h], fmaxf(sa, sb));
        const float f = expf(mx[h] - mn), pa = expf(sa - mn), pb = two ? expf(sb - mn) : 0.f;
        l[h] = l[h] * f + pa + pb;
        mx[h] = mn;
#pragma unroll
        for (int m = 0; m < kMaxJ; ++m) acc[h][m] = acc[h][m] * f + pa * kr[m] + pb * (two ? kq[m] : 0.f);
      }
    }
#pragma unroll
    for (int h = 0; h < HB; ++h) {
#pragma unroll
      for (int m = 0; m < kMaxJ; ++m) {
        const int j = lane + 32 * m;
        if (j < d.C) ws[(warp * HB + h) * d.C + j] = acc[h][m];
      }
      if (lane == 0) wm[warp][h] = mx[h], wl[warp][h] = l[h];
    }
  }
};

// The block's max M and sum L for head h from its warps' states, and each warp's factor fw[w]
// (a warp without rows has max -inf, sum 0: factor 0).
template <int HB>
__device__ __forceinline__ float dec_merge(const float (*wm)[HB], const float (*wl)[HB], int h, float* fw, float& L) {
  float M = -INFINITY;
#pragma unroll
  for (int w = 0; w < 8; ++w) M = fmaxf(M, wm[w][h]);
  L = 0.f;
#pragma unroll
  for (int w = 0; w < 8; ++w) fw[w] = expf(wm[w][h] - M), L += wl[w][h] * fw[w];
  return M;
}

// After the fold (ws: the warps' sums [8][HB][C], wm / wl their states): each head's merged
// output, to ol for one split, else the split's partial sums and (m, l) pair, which the last of
// the splits combines unless the value absorption will (combine false).
template <int HB>
__device__ __forceinline__ void dec_finish(const MlaDims& d, int64_t n, int64_t i, int h0, int hb, int ns,
                                           const float* ws, const float (*wm)[HB], const float (*wl)[HB],
                                           float* __restrict__ part, float* __restrict__ ml, unsigned* counters,
                                           float* __restrict__ ol, float* fz, float* lsum, bool combine, bool b0) {
  const int64_t z = blockIdx.z;
  for (int h = 0; h < hb; ++h) {
    float fw[8], L;
    const float M = dec_merge<HB>(wm, wl, h, fw, L);
    const int64_t ih = i * d.H + h0 + h;
    for (int col = threadIdx.x; col < d.C; col += blockDim.x) {
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) o += ws[(w * HB + h) * d.C + col] * fw[w];
      if (ns == 1) ol[ih * d.C + col] = o / L;
      else part[(z * n * d.H + ih) * d.C + col] = o;
    }
    if (ns > 1 && threadIdx.x == 0) ml[(z * n * d.H + ih) * 2] = M, ml[(z * n * d.H + ih) * 2 + 1] = L;
  }
  if (b0) trace_point();
  if (ns == 1 || !combine) return;  // (!combine: the value absorption combines them, gemv_splits)
  combine_splits(d, n, i, h0, hb, ns, part, ml, counters, ol, fz, lsum);
}

// The same attention with each warp's rows folded in as they arrive (decode steps; DecRows): one
// round of cache loads per 16 positions instead of a score pass, a softmax pass and a value pass
// over shared scores, the 8 warps merged in shared memory, several splits combined by the last.
template <int HB, bool PRE>
__global__ void __launch_bounds__(256) decode_attn_warps_kernel(MlaDims d, const DevPos* __restrict__ pos, int64_t n,
                                                                const float* __restrict__ qa,
                                                                const float* __restrict__ q,
                                                                const float* __restrict__ ckv,
                                                                const float* __restrict__ cpe,
                                                                float* __restrict__ part, float* __restrict__ ml,
                                                                unsigned* __restrict__ counters,
                                                                float* __restrict__ ol, bool combine) {
  extern __shared__ float dsm[];  // q [HB][C + R], the warps' sums [8][HB][C], split factors [HB][kDecMaxSplits]
  __shared__ float wm[8][HB], wl[8][HB], lsum[HB];
  const int nhb = (d.H + HB - 1) / HB, CR = d.C + d.R;
  const int64_t i = blockIdx.x / nhb;
  const int h0 = int(blockIdx.x % nhb) * HB, hb = min(HB, d.H - h0);
  // (pos: the step's metadata, copied before the step's first kernel)
  DecRows<HB> R(d, pos[i], ckv, cpe);
  float* qs = dsm;
  float* ws = dsm + HB * CR;
  float* fz = ws + 8 * HB * d.C;
  if (PRE) R.preload();
  pdl_wait();
  if (R.ts >= R.len) return;  // not one of this token's splits
  const int ns = R.splits();
  stage_query<HB>(d, qa, q, i, h0, hb, qs);
  __syncthreads();
  const bool b0 = DSV3_TRACE && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.z == 0;
  if (b0) trace_point();
  R.fold(qs, ws, wm, wl);
  __syncthreads();
  if (b0) trace_point();
  dec_finish<HB>(d, n, i, h0, hb, ns, ws, wm, wl, part, ml, counters, ol, fz, lsum, combine, b0);
}

// Shared memory of decode_attn_prep_kernel, in floats before the weights: qs [C + R], ws [8][C],
// fz [kDecMaxSplits], nrow [C + R], qn [nope] (rounded up to 16 bytes); then head h's nope rows of
// wkv_b's latent columns [nope][C] as stored.
constexpr int kPrepScales = 16;  // e4m3 scale blocks of one head's nope rows (nope <= 256, C <= 512: 3 x 5)
__host__ __device__ inline int64_t prep_attn_floats(const MlaDims& d) {
  return (2 * int64_t(d.C + d.R) + 8 * int64_t(d.C) + kDecMaxSplits + d.nope + 3) / 4 * 4;
}

// One token's decode attention with the token's MLA prep in the same launch (CudaOptions::
// prep_in_attn; one head per block): block (head h, split z) does for itself what mla_prep_qabs
// does for the token — head h's rope query and q absorption (head h's nope rows of wkv_b loaded
// into shared memory before the wait), and, where its split holds the token's own position, the
// kv_norm and key rope of the token's cache row (prep_token's arithmetic), which its fold then
// reads from shared memory; head 0's block writes that row to the caches for later steps. Then
// the attention as decode_attn_warps_kernel. q is the raw query (its rope part not rotated: no
// kernel writes q here); kv the token's raw [C + R] row.
template <int WT, bool PRE>
__global__ void __launch_bounds__(256) decode_attn_prep_kernel(MlaDims d, const DevPos* __restrict__ pos,
                                                               const float* __restrict__ q,
                                                               const float* __restrict__ kv,
                                                               const float* __restrict__ nw,
                                                               const float* __restrict__ rope, DevLinear wkv_b,
                                                               float* __restrict__ ckv, float* __restrict__ cpe,
                                                               float* __restrict__ part, float* __restrict__ ml,
                                                               unsigned* __restrict__ counters,
                                                               float* __restrict__ ol, bool combine) {
  extern __shared__ __align__(16) float dsm[];
  __shared__ float wm[8][1], wl[8][1], lsum[1], red[33];
  __shared__ float sws[kPrepScales];  // e4m3: the block scales of head h's nope rows, [rows][cols]
  constexpr int CE = chunk_elems<WT>(), EB = elem_bytes<WT>();
  const int CR = d.C + d.R, h = int(blockIdx.x), tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  float* qs = dsm;
  float* ws = qs + CR;
  float* fz = ws + 8 * d.C;
  float* nrow = fz + kDecMaxSplits;
  float* qn = nrow + CR;
  uint4* wk = reinterpret_cast<uint4*>(dsm + prep_attn_floats(d));
  const DevPos p = pos[0];  // (the step's metadata, copied before the step's first kernel)
  DecRows<1, true> R(d, p, ckv, cpe);
  R.nrow = nrow;
  const bool live = R.ts < R.len;
  const int64_t cpr = d.C / CE;  // 16-byte chunks per row of the latent columns
  const int64_t wrow = wkv_b.row0 + int64_t(h) * (d.nope + d.V);
  const int half = d.R / 2;
  const bool own = R.te == R.len;  // this split holds the token's own position: it makes its cache row
  // Before the wait (no earlier kernel writes these): head h's nope rows of wkv_b (cp.async) and
  // their e4m3 scales, the earlier steps' first cache rows, the rope row of the token's position
  // and the norm weights, so that one round of loads follows the wait.
  const ScaleTile wsc(sws, wkv_b, wrow - wkv_b.row0, d.nope, WT == kFP8 && live);
  float rc = 0.f, rs = 0.f, nw0 = 0.f, nw1 = 0.f;
  if (live) {
    if (PRE) R.preload();
    copy_rows_async<EB>(wkv_b, wrow - wkv_b.row0, d.nope, wk);
    cp_async_commit();
    const float* cs = rope + int64_t(p.pos) * d.R;
    if (tid < half) rc = cs[2 * tid], rs = cs[2 * tid + 1];
    if (own) nw0 = tid < d.C ? nw[tid] : 0.f, nw1 = tid + 256 < d.C ? nw[tid + 256] : 0.f;
  }
  pdl_wait();
  if (!live) return;  // not one of this token's splits
  const int ns = R.splits();
  // The pair GEMV's outputs: head h's raw query and the token's kv row, one load each per thread.
  const float* qh = q + int64_t(h) * d.qk();
  const float qv = tid < d.nope ? qh[tid] : 0.f;
  const float qa = tid < half ? qh[d.nope + 2 * tid] : 0.f, qb = tid < half ? qh[d.nope + 2 * tid + 1] : 0.f;
  float kv0 = 0.f, kv1 = 0.f, ka = 0.f, kb = 0.f;
  if (own) {
    kv0 = tid < d.C ? kv[tid] : 0.f, kv1 = tid + 256 < d.C ? kv[tid + 256] : 0.f;
    ka = tid < half ? kv[d.C + 2 * tid] : 0.f, kb = tid < half ? kv[d.C + 2 * tid + 1] : 0.f;
  }
  if (tid < d.nope) qn[tid] = qv;
  if (tid < half) {
    const float2 qr = rope_pair(qa, qb, rc, rs);
    qs[d.C + 2 * tid] = qr.x, qs[d.C + 2 * tid + 1] = qr.y;
  }
  if (own) {  // kv_norm and the key rope (prep_token's arithmetic)
    const int64_t row = int64_t(p.slot) * d.max_len + p.pos;
    float ss = 0.f;
    if (tid < d.C) ss += kv0 * kv0;
    if (tid + 256 < d.C) ss += kv1 * kv1;
    ss = block_sum(ss, red);
    const float r = 1.f / sqrtf(ss / float(d.C) + d.eps);
    if (tid < d.C) {
      const float v = kv0 * r * nw0;
      nrow[tid] = v;
      if (h == 0) ckv[row * d.C + tid] = v;
    }
    if (tid + 256 < d.C) {
      const float v = kv1 * r * nw1;
      nrow[tid + 256] = v;
      if (h == 0) ckv[row * d.C + tid + 256] = v;
    }
    if (tid < half) {
      const float2 k = rope_pair(ka, kb, rc, rs);
      nrow[d.C + 2 * tid] = k.x, nrow[d.C + 2 * tid + 1] = k.y;
      if (h == 0) cpe[row * d.R + 2 * tid] = k.x, cpe[row * d.R + 2 * tid + 1] = k.y;
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  // The absorbed query qs[c] = sum_k qn[k] wkv_b[wrow + k, c]: warp w the rows w, w + 8, ...; a lane
  // its chunks lane, lane + 32 (e4m3 times its block scale, as wload); the warps' partials (in ws)
  // summed in warp order.
  {
    constexpr int NV = WT == kFP8 ? 1 : 2;  // chunks per lane (C <= 512)
    float acc[NV][CE];
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < CE; ++e) acc[v][e] = 0.f;
    for (int k = warp; k < d.nope; k += 8) {
      const float qv = qn[k];
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        const int64_t c = lane + 32 * v;
        if (c >= cpr) break;
        float wf[CE];
        decode<WT>(wk[k * cpr + c], wf);
        const float sc = WT == kFP8 ? wsc.at(wrow + k, wkv_b.col0 + c * CE) : 1.f;
#pragma unroll
        for (int e = 0; e < CE; ++e) acc[v][e] = fmaf(qv, WT == kFP8 ? wf[e] * sc : wf[e], acc[v][e]);
      }
    }
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const int64_t c = lane + 32 * v;
      if (c >= cpr) break;
#pragma unroll
      for (int e = 0; e < CE; ++e) ws[warp * d.C + c * CE + e] = acc[v][e];
    }
    __syncthreads();
    for (int c = tid; c < d.C; c += 256) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) sum += ws[w * d.C + c];
      qs[c] = sum;
    }
    __syncthreads();
  }
  const bool b0 = DSV3_TRACE && tid == 0 && blockIdx.x == 0 && blockIdx.z == 0;
  if (b0) trace_point();
  R.fold(qs, ws, wm, wl);
  __syncthreads();
  if (b0) trace_point();
  dec_finish<1>(d, 1, 0, h, 1, ns, ws, wm, wl, part, ml, counters, ol, fz, lsum, combine, b0);
}

}  // namespace

int mla_decode_heads(int64_t n) { return n == 1 ? 1 : 2; }

int mla_decode_splits(const MlaDims& d, int64_t n, int cap, int hb) {
  // As many splits as keep the blocks few (at most 512, 256 for one token: bounded partials and
  // a short combine), no more than the combining block's factor table holds or the cache has
  // chunks of kDecMinChunk (nor `cap`). On the H200 at one token, one head per block: 16 splits
  // against 32 are even at 80 positions, +7% at 1024 and at 4096 (tok/s of the whole step).
  const int64_t blocks = n * ((d.H + hb - 1) / hb), by_len = (d.max_len + kDecMinChunk - 1) / kDecMinChunk;
  const int64_t budget = n == 1 ? 256 : 512;
  int64_t s = std::min<int64_t>({by_len, budget / std::max<int64_t>(blocks, 1), kDecMaxSplits});
  if (cap > 0) s = std::min<int64_t>(s, cap);
  return int(std::max<int64_t>(1, s));
}

bool mla_decode_ok(const MlaDims& d, int64_t n, int64_t counters, int hb) {
  static_assert(kDecMaxSplits <= kDecPass, "split factors live in the score buffer");
  return d.C <= 256 * kDecCols && d.C + d.R <= 32 * kMaxJ && n * ((d.H + hb - 1) / hb) <= counters &&
         (hb == 1 || hb == 2);
}

namespace {
template <int HB>
void launch_decode_attn(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const float* qa,
                        const float* q, const float* cache_kv, const float* cache_pe, int nsplit, float* part,
                        float* ml, unsigned* counters, float* ol, bool warps, bool combine) {
  const dim3 grid(unsigned(n * cdiv(d.H, HB)), 1, unsigned(nsplit));
  if (warps) {
    const size_t smem = sizeof(float) * size_t(HB) * size_t(d.C + d.R + 8 * d.C + kDecMaxSplits);
    // (38.4 KB at C 512 and two heads: within the default 48 KB; mla_decode_ok caps C at 512)
    if (n == 1) launch(L, decode_attn_warps_kernel<HB, true>, grid, dim3(256), smem, d, pos, n, qa, q, cache_kv, cache_pe,
                       part, ml, counters, ol, combine);
    else launch(L, decode_attn_warps_kernel<HB, false>, grid, dim3(256), smem, d, pos, n, qa, q, cache_kv, cache_pe,
                part, ml, counters, ol, combine);
    return;
  }
  const size_t smem = sizeof(float) * size_t(HB) * size_t(d.C + d.R + kDecPass);
  launch(L, decode_attn_kernel<HB>, grid, dim3(256), smem, d, pos, n, qa, q, cache_kv, cache_pe, part, ml, counters, ol);
}
}  // namespace

namespace {
constexpr size_t kPrepAttnMaxSmem = 100 * 1024;  // two blocks per SM
size_t prep_attn_smem(const MlaDims& d, int32_t t) {
  return size_t(prep_attn_floats(d)) * 4 + size_t(d.nope) * size_t(d.C) * (t == kFP8 ? 1 : 2);
}
template <int WT>
void launch_prep_attn(const Launch& L, dim3 grid, size_t smem, const MlaDims& d, const DevPos* pos, const float* q,
                      const float* kv, const float* nw, const float* rope, const DevLinear& wkv_b, float* ckv,
                      float* cpe, float* part, float* ml, unsigned* counters, float* ol, bool combine) {
  allow_smem(decode_attn_prep_kernel<WT, true>, smem);
  launch(L, decode_attn_prep_kernel<WT, true>, grid, dim3(256), smem, d, pos, q, kv, nw, rope, wkv_b, ckv, cpe, part,
         ml, counters, ol, combine);
}
}  // namespace

bool mla_decode_prep_ok(const MlaDims& d, const DevLinear& wkv_b, int64_t counters, bool wide) {
  if (wkv_b.t != kFP8 && wkv_b.t != kBF16) return false;
  const int64_t ce = wkv_b.t == kFP8 ? 16 : 8;
  return mla_decode_ok(d, 1, counters, 1) && d.R % 2 == 0 && d.R / 2 <= 256 && d.nope <= 256 && d.C % ce == 0 &&
         wkv_b.cols == d.C && wkv_b.rows >= d.H * (d.nope + d.V) && vec_ok(wkv_b) &&
         prep_attn_smem(d, wkv_b.t) <= (wide ? device_smem_optin() : kPrepAttnMaxSmem);
}

void mla_decode_attn_prep(const Launch& L, const MlaDims& d, const DevPos* pos, const float* q, const float* kv,
                          const float* kv_norm_w, const float* rope, const DevLinear& wkv_b, float* cache_kv,
                          float* cache_pe, int nsplit, float* part, float* ml, unsigned* counters, float* ol,
                          bool combine) {
  DSV3_CHECK(nsplit >= 1 && nsplit <= kDecMaxSplits, "mla_decode_attn_prep: ", nsplit, " position splits");
  // (the counters' capacity and the blocks per SM are the caller's to choose: mla_decode_prep_ok)
  DSV3_CHECK(mla_decode_prep_ok(d, wkv_b, d.H, true), "mla_decode_attn_prep: shape or weight type it does not take");
  const dim3 grid(unsigned(d.H), 1, unsigned(nsplit));
  const size_t smem = prep_attn_smem(d, wkv_b.t);
  if (wkv_b.t == kFP8)
    launch_prep_attn<kFP8>(L, grid, smem, d, pos, q, kv, kv_norm_w, rope, wkv_b, cache_kv, cache_pe, part, ml,
                           counters, ol, combine);
  else
    launch_prep_attn<kBF16>(L, grid, smem, d, pos, q, kv, kv_norm_w, rope, wkv_b, cache_kv, cache_pe, part, ml,
                            counters, ol, combine);
}

void mla_decode_attn(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const float* qa, const float* q,
                     const float* cache_kv, const float* cache_pe, int nsplit, float* part, float* ml,
                     unsigned* counters, float* ol, bool warps, int hb, bool combine) {
  DSV3_CHECK(nsplit >= 1 && nsplit <= kDecMaxSplits, "mla_decode_attn: ", nsplit, " position splits");
  DSV3_CHECK(combine || warps, "mla_decode_attn: the split partial sums alone from the warps form only");
  DSV3_CHECK(hb == 1 || hb == 2, "mla_decode_attn: ", hb, " heads per block");
  if (hb == 1) launch_decode_attn<1>(L, d, pos, n, qa, q, cache_kv, cache_pe, nsplit, part, ml, counters, ol, warps, combine);
  else launch_decode_attn<2>(L, d, pos, n, qa, q, cache_kv, cache_pe, nsplit, part, ml, counters, ol, warps, combine);
}

}  // namespace dsv3::cuda
