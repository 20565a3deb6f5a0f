// The absorbed decode attention (few tokens, MLA.forward's attn_impl "absorb" at decode): one
// launch per step over the latent and rope caches, split over positions (kernels_mla.cu has the
// rest of MLA). Every kernel reads the tokens' (slot, pos) from the device, so a recorded step
// replays with new positions.
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/mla_splits.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

constexpr int kMaxJ = 18;  // (kv_lora_rank + rope) / 32 held per lane: up to 576 (as kernels_mla.cu)
// Absorbed attention of few tokens in one launch (decode): scores against the latent and rope
// caches, float32 softmax and the weighted latent sum. Block: token i, HB heads, positions
// [z * chunk, (z + 1) * chunk), each warp folding its rows into a running softmax. With several
// position splits the blocks leave partial sums (part, ml) and the last one to finish for
// (i, head block), by an atomic count, combines them: no second launch. The chunk follows the
// token's length on the device (a recorded step replays at any position): the length over the
// launch's splits, rounded up to whole kDecMinChunk, so short caches spread over several blocks
// with one short chain of loads each. Cache rows are read through the step's block tables.
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

// A block's rows [ts, te) of token i's cache (decode, split z of the launch's gridDim.z) and
// their fold into the warps' running softmax states: warp w takes the positions w, w + 8, ...
// two at a time, keeps a running max, sum and latent-weighted sum per head in registers (its
// lanes' columns) and leaves them in shared memory for the block's merge (dec_merge). One token
// (preload): the cache rows before its own position were written by earlier steps, so a warp's
// first two go out before the wait.
template <int HB, bool KV16>
struct DecRows {
  const MlaDims& d;
  const float* __restrict__ ckv;
  const float* __restrict__ cpe;
  int64_t len, chunk, ts, te;
  int32_t slot;
  int warp, lane, CR;
  bool pre = false;
  float kr[kMaxJ], kq[kMaxJ];
  __device__ DecRows(const MlaDims& d_, DevPos p, const float* ckv_, const float* cpe_)
      : d(d_), ckv(ckv_), cpe(cpe_), warp(int(threadIdx.x >> 5)), lane(int(threadIdx.x & 31)), CR(d_.C + d_.R) {
    len = int64_t(p.pos) + 1, chunk = dec_chunk(len, gridDim.z);
    ts = int64_t(blockIdx.z) * chunk, te = min(len, ts + chunk);
    slot = p.slot;
  }
  __device__ int splits() const { return dec_splits(len, chunk); }  // of this token's length
  // A bf16 cache's values land as raw bits (nothing waits on a load here, so a row's loads all
  // go out together) and widen() makes them float32 once both rows are loaded. (Widened as each
  // loaded, one token's attention over 512 positions took 3.2x the float32 cache's time, H100.)
  __device__ void load_row(int64_t t, float* k) const {
    const int64_t r = d.row(slot, t);
    auto get = [&](const float* c, int64_t idx) {
      return KV16 ? __uint_as_float(reinterpret_cast<const uint16_t*>(c)[idx]) : c[idx];
    };
#pragma unroll
    for (int m = 0; m < kMaxJ; ++m) {
      const int j = lane + 32 * m;
      k[m] = j < d.C ? get(ckv, r * d.C + j) : (j < CR ? get(cpe, r * d.R + (j - d.C)) : 0.f);
    }
  }
  __device__ static void widen(float* k) {
    if constexpr (KV16) {
#pragma unroll
      for (int m = 0; m < kMaxJ; ++m) k[m] = __uint_as_float(__float_as_uint(k[m]) << 16);
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
      widen(kr);
      if (two) widen(kq);
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

// The same attention with each warp's rows folded in as they arrive (decode steps; DecRows): one
// round of cache loads per 16 positions instead of a score pass, a softmax pass and a value pass
// over shared scores, the 8 warps merged in shared memory, several splits combined by the last.
template <int HB, bool PRE, bool KV16>
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
  DecRows<HB, KV16> R(d, pos[i], ckv, cpe);
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
void launch_decode_attn(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const DecodeAttn& a) {
  const dim3 grid(unsigned(n * cdiv(d.H, HB)), 1, unsigned(a.nsplit));
  const size_t smem = sizeof(float) * size_t(HB) * size_t(d.C + d.R + 8 * d.C + kDecMaxSplits);
  // (38.4 KB at C 512 and two heads: within the default 48 KB; mla_decode_ok caps C at 512)
  auto go = [&](auto kernel) {
    launch(L, kernel, grid, dim3(256), smem, d, pos, n, a.qa, a.q, a.cache_kv, a.cache_pe, a.part, a.ml, a.counters,
           a.ol, a.combine);
  };
  if (n == 1) d.kv16 ? go(decode_attn_warps_kernel<HB, true, true>) : go(decode_attn_warps_kernel<HB, true, false>);
  else d.kv16 ? go(decode_attn_warps_kernel<HB, false, true>) : go(decode_attn_warps_kernel<HB, false, false>);
}
}  // namespace

void mla_decode_attn(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const DecodeAttn& a) {
  DSV3_CHECK(a.nsplit >= 1 && a.nsplit <= kDecMaxSplits, "mla_decode_attn: ", a.nsplit, " position splits");
  DSV3_CHECK(a.hb == 1 || a.hb == 2, "mla_decode_attn: ", a.hb, " heads per block");
  if (a.hb == 1) launch_decode_attn<1>(L, d, pos, n, a);
  else launch_decode_attn<2>(L, d, pos, n, a);
}

}  // namespace dsv3::cuda
