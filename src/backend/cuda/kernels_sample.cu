// Sampling on the device (Backend::sample_rows): runtime/sampler.cc's draw, without penalties,
// on a logit row where it lives. A block of 1024 threads per row:
//   - one pass: the first NaN / +inf (an error), the largest logit and its lowest id, the first
//     and last finite ids; temperature 0 ends there (the argmax);
//   - temperature only: the inverse CDF over every finite token in the host sampler's order (the
//     most likely first, then ascending ids with the first finite id in its place), a block scan
//     of the weights in float64 and one thread walking the range that holds u;
//   - top-k / top-p / min-p: the sampler's sorted prefix. The k largest (top-k), or the 1024
//     largest (top-p / min-p alone), are found by a radix select on order-preserving keys (four
//     8-bit passes), gathered with their ties and sorted (bitonic, larger logit then lower id
//     first); one thread then applies the filters and the inverse CDF exactly as the host does.
//     A top-p / min-p prefix longer than that, more ties than fit, or top_k above 1024 leave the
//     row to the host (status 1).
// The weights are exp((z - top) / T) in float64 as on the host; the temperature-only path and
// top-p's total without top-k sum in a different order (last-bit differences), so a draw can
// differ from the host's only where u lies within rounding of a boundary.
#include "backend/cuda/common.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32;
constexpr int kSortMax = 2048;  // candidates gathered at most (the prefix and its ties)
constexpr int kPrefix = 1024;   // tokens sorted for top-p / min-p (and the largest top_k taken)

// Order-preserving key of a logit: larger logit, larger key; -inf (never drawn) 0.
__device__ __forceinline__ uint32_t logit_key(float z) {
  if (z == -INFINITY) return 0u;
  const uint32_t b = __float_as_uint(z);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// f(i, z[i]) for this thread's ids i = tid, tid + kThreads, ... below limit, eight loads in
// flight at a time (one block streams the whole row).
template <typename F>
__device__ __forceinline__ void each_logit(const float* __restrict__ z, int64_t limit, F&& f) {
  constexpr int U = 8;
  for (int64_t i0 = threadIdx.x; i0 < limit; i0 += int64_t(U) * kThreads) {
    float v[U];
#pragma unroll
    for (int q = 0; q < U; ++q) {
      const int64_t i = i0 + int64_t(q) * kThreads;
      v[q] = i < limit ? __ldg(z + i) : -INFINITY;
    }
#pragma unroll
    for (int q = 0; q < U; ++q) {
      const int64_t i = i0 + int64_t(q) * kThreads;
      if (i < limit) f(i, v[q]);
    }
  }
}

__device__ __forceinline__ double weight(float z, double top, double inv_t) {
  return exp((double(z) - top) * inv_t);
}

struct Scratch {
  unsigned long long cand[kSortMax];  // key << 32 | ~id: descending order = larger logit, lower id
  double w[kPrefix];
  double part[kWarps];
  int hist[256];
  int ival[kWarps][5];
  float fval[kWarps];
  int count, overflow, digit, remaining;
};

// A row's result: {id, status, index} (status 0 drawn, 1 left to the host, 2 a bad logit at
// index, 3 every logit -inf).
__device__ __forceinline__ void put(int32_t* o, int id, int status, int index = -1) {
  o[0] = id, o[1] = status, o[2] = index;
}

// Block-wide sum of v (every thread gets it).
__device__ double block_sum_d(double v, Scratch& S) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) S.part[warp] = v;
  __syncthreads();
  double t = 0;
  for (int w = 0; w < kWarps; ++w) t += S.part[w];  // in order: the same on every thread
  return t;
}

__global__ void __launch_bounds__(kThreads) sample_kernel(const float* __restrict__ x, int64_t cols, int64_t limit,
                                                          const DevSample* __restrict__ spec, int32_t* __restrict__ out) {
  __shared__ Scratch S;
  const int64_t r = blockIdx.x;
  const float* z = x + r * cols;
  int32_t* o = out + r * 3;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const DevSample sp = spec[r];
  pdl_wait();
  if (sp.host) {
    if (tid == 0) put(o, -1, 1);
    return;
  }
  // Pass 1: first bad index, max with its lowest id, first and last finite ids, finite count.
  float best = -INFINITY;
  int bi = INT32_MAX, bad = INT32_MAX, f0 = INT32_MAX, fl = -1, nfin = 0;
  each_logit(z, limit, [&](int64_t i, float v) {
    if (isnan(v) || v == INFINITY) {
      bad = min(bad, int(i));
    } else if (v != -INFINITY) {
      ++nfin, f0 = min(f0, int(i)), fl = max(fl, int(i));
      if (v > best) best = v, bi = int(i);  // a thread's ids ascend: ties keep the lowest
    }
  });
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, s);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, s);
    if (ob > best || (ob == best && oi < bi)) best = ob, bi = oi;
    bad = min(bad, __shfl_xor_sync(0xffffffffu, bad, s));
    f0 = min(f0, __shfl_xor_sync(0xffffffffu, f0, s));
    fl = max(fl, __shfl_xor_sync(0xffffffffu, fl, s));
    nfin += __shfl_xor_sync(0xffffffffu, nfin, s);
  }
  if (lane == 0) {
    S.fval[warp] = best;
    S.ival[warp][0] = bi, S.ival[warp][1] = bad, S.ival[warp][2] = f0, S.ival[warp][3] = fl, S.ival[warp][4] = nfin;
  }
  __syncthreads();
  best = -INFINITY, bi = INT32_MAX, bad = INT32_MAX, f0 = INT32_MAX, fl = -1, nfin = 0;
  for (int w = 0; w < kWarps; ++w) {
    const float ob = S.fval[w];
    const int oi = S.ival[w][0];
    if (ob > best || (ob == best && oi < bi)) best = ob, bi = oi;
    bad = min(bad, S.ival[w][1]), f0 = min(f0, S.ival[w][2]), fl = max(fl, S.ival[w][3]);
    nfin += S.ival[w][4];
  }
  __syncthreads();
  if (bad != INT32_MAX || nfin == 0) {
    if (tid == 0) put(o, -1, bad != INT32_MAX ? 2 : 3, bad != INT32_MAX ? bad : -1);
    return;
  }
  auto done = [&](int id) {
    if (tid == 0) put(o, id, 0);
  };
  if (sp.temperature == 0.f) return done(bi);
  const double inv_t = 1.0 / double(sp.temperature), top = double(best), u = sp.u;
  const bool top_k = sp.top_k > 0 && sp.top_k < nfin, filt = sp.top_p < 1.f || sp.min_p > 0.f;

  if (!top_k && !filt) {
    // The host's order: bi first, then the finite ids ascending with f0 in bi's place.
    const bool swap = bi != f0;
    const int64_t per = (limit + kThreads - 1) / kThreads, lo = tid * per, hi = min(limit, lo + per);
    auto wt_of = [&](int64_t i, float v) -> double {  // the weight at id i's place in that order (v = z[i])
      if (swap && i == f0) return 0.0;
      if (swap && i == bi) v = z[f0];
      return v == -INFINITY ? 0.0 : weight(v, top, inv_t);
    };
    auto wt = [&](int64_t i) { return wt_of(i, z[i]); };
    double mine = 0;
    for (int64_t i0 = lo; i0 < hi; i0 += 8) {  // eight loads in flight
      float v[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) v[q] = i0 + q < hi ? __ldg(z + i0 + q) : -INFINITY;
#pragma unroll
      for (int q = 0; q < 8; ++q)
        if (i0 + q < hi) mine += wt_of(i0 + q, v[q]);
    }
    // Exclusive scan of the threads' sums: warp scan, then the warps' totals.
    double inc = mine;
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
      const double t = __shfl_up_sync(0xffffffffu, inc, s);
      if (lane >= s) inc += t;
    }
    if (lane == 31) S.part[warp] = inc;
    __syncthreads();
    double base = swap ? weight(best, top, inv_t) : 0.0, total = base;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) base += S.part[w];
      total += S.part[w];
    }
    const double start = base + inc - mine, target = u * total, w0 = swap ? weight(best, top, inv_t) : 0.0;
    S.w[tid] = start;  // the threads' ranges partition [w0, total) by these starts
    if (tid == 0) S.digit = INT32_MAX;  // the place where the running sum passes the target
    __syncthreads();
    const bool first = swap && target < w0;
    // One thread walks its range: the one whose [start, next start) holds the target.
    if (!first && target >= start && (tid == kThreads - 1 || target < S.w[tid + 1])) {
      double run = start;
      int last = -1;
      for (int64_t i = lo; i < hi; ++i) {
        const double w = wt(i);
        if (w == 0.0) continue;
        run += w, last = int(i);
        if (target < run) break;
      }
      if (last >= 0 && (target < run || tid < kThreads - 1)) S.digit = last;  // (rounding: its last token)
    }
    __syncthreads();
    if (first) return done(bi);
    if (S.digit != INT32_MAX) return done(swap && S.digit == bi ? f0 : S.digit);
    // Rounding left the target at the top: the last token of the order, as the host does.
    return done(swap && fl == bi ? f0 : fl);
  }

  // The sorted prefix: the k (top-k) or kPrefix largest, with ties at the boundary.
  if (top_k && sp.top_k > kPrefix) {
    if (tid == 0) put(o, -1, 1);
    return;
  }
  const int M = top_k ? sp.top_k : min(nfin, kPrefix);
  uint32_t tau = 1u;  // gather keys >= tau (every finite one when all fit)
  if (M < nfin) {
    uint32_t prefix = 0, mask = 0;
    if (tid == 0) S.remaining = M;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = tid; b < 256; b += kThreads) S.hist[b] = 0;
      __syncthreads();
      each_logit(z, limit, [&](int64_t, float v) {
        const uint32_t k = logit_key(v);
        if ((k & mask) == prefix) atomicAdd(&S.hist[(k >> shift) & 255], 1);
      });
      __syncthreads();
      if (tid == 0) {
        int cum = 0, b = 255;
        for (; b > 0; --b) {
          if (cum + S.hist[b] >= S.remaining) break;
          cum += S.hist[b];
        }
        S.digit = b, S.remaining -= cum;
      }
      __syncthreads();
      prefix |= uint32_t(S.digit) << shift, mask |= 255u << shift;
    }
    tau = prefix;  // the M-th largest key
  }
  if (tid == 0) S.count = 0, S.overflow = 0;
  __syncthreads();
  each_logit(z, limit, [&](int64_t i, float v) {
    const uint32_t k = logit_key(v);
    if (k >= tau && k > 0) {
      const int slot = atomicAdd(&S.count, 1);
      if (slot < kSortMax) S.cand[slot] = (static_cast<unsigned long long>(k) << 32) | (0xffffffffu - uint32_t(i));
      else S.overflow = 1;
    }
  });
  __syncthreads();
  if (S.overflow) {  // more ties than fit: the host sorts
    if (tid == 0) put(o, -1, 1);
    return;
  }
  const int cnt = S.count;
  int N = 2;
  while (N < cnt) N <<= 1;
  for (int i = cnt + tid; i < N; i += kThreads) S.cand[i] = 0ull;
  __syncthreads();
  for (int k = 2; k <= N; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = tid; i < N; i += kThreads) {
        const int p = i ^ j;
        if (p > i) {
          const unsigned long long a = S.cand[i], b = S.cand[p];
          if (((i & k) == 0) ? a < b : a > b) S.cand[i] = b, S.cand[p] = a;  // descending overall
        }
      }
      __syncthreads();
    }
  const int n = min(cnt, M);
  auto id_of = [&](int i) { return int(0xffffffffu - uint32_t(S.cand[i] & 0xffffffffull)); };
  for (int i = tid; i < n; i += kThreads) S.w[i] = weight(z[id_of(i)], top, inv_t);
  double all = 0;
  if (filt && !top_k) {  // top-p's total is over every finite token
    double mine = 0;
    each_logit(z, limit, [&](int64_t, float v) {
      if (v != -INFINITY) mine += weight(v, top, inv_t);
    });
    all = block_sum_d(mine, S);
  }
  __syncthreads();
  if (tid != 0) return;
  // From here the host's loop, one thread, over the sorted prefix.
  int keep = n;
  if (filt) {
    if (top_k)
      for (int i = 0; i < n; ++i) all += S.w[i];
    double mass = 0;
    keep = 0;
    const double floor = double(sp.min_p) * S.w[0] / all;
    while (keep < n && (sp.top_p >= 1.f || mass < double(sp.top_p))) {
      const double q = S.w[keep] / all;
      if (keep > 0 && sp.min_p > 0.f && q < floor) break;
      mass += q, ++keep;
    }
    const bool open = keep == n && (sp.top_p >= 1.f || mass < double(sp.top_p));
    if (open && n < (top_k ? sp.top_k : nfin)) {  // the prefix goes on past what was sorted
      put(o, -1, 1);
      return;
    }
  }
  double sum = 0;
  for (int i = 0; i < keep; ++i) sum += S.w[i];
  double cum = 0;
  for (int i = 0; i + 1 < keep; ++i) {
    cum += S.w[i] / sum;
    if (u < cum) {
      put(o, id_of(i), 0);
      return;
    }
  }
  put(o, id_of(keep - 1), 0);
}

}  // namespace

void sample_rows(const Launch& L, const float* x, int64_t rows, int64_t cols, int64_t limit, const DevSample* spec,
                 int32_t* out) {
  DSV3_CHECK(limit >= 1 && limit <= cols && limit < INT32_MAX, "sample_rows: limit ", limit, " of ", cols);
  launch(L, sample_kernel, dim3(unsigned(rows)), dim3(kThreads), 0, x, cols, limit, spec, out);
}

}  // namespace dsv3::cuda
