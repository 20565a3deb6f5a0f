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
//     first); one thread then applies the filters and the inverse CDF exactly as the host does;
//   - a top-p / min-p prefix longer than that, more ties than fit, or top_k above 1024 (long_draw):
//     no sort at all. The kept set is the sampler's prefix of `keep` tokens, keep the least of k,
//     the min-p count and the rank where the mass reaches top_p; ranks and masses come from radix
//     selects over the keys (by count, or by mass in fixed point: deterministic), ties by id.
// The weights are exp((z - top) / T) in float64 as on the host; the temperature-only path,
// top-p's total without top-k and the long draw's fixed-point masses sum in a different order
// (last-bit differences, ~1e-12 in the long draw), so a draw can differ from the host's only
// where u (or top_p) lies within rounding of a boundary.
#include "backend/cuda/common.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32;
constexpr int kSortMax = 2048;  // candidates gathered at most (the prefix and its ties)
constexpr int kPrefix = 1024;   // tokens sorted for top-p / min-p (and the largest top_k taken)

// Order-preserving key of a logit: larger logit, larger key; -inf (never drawn) 0; -0 as +0 (the
// host's order sees them equal: ties by id).
__device__ __forceinline__ uint32_t logit_key(float z) {
  if (z == -INFINITY) return 0u;
  const uint32_t b = z == 0.f ? 0u : __float_as_uint(z);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_logit(uint32_t k) {  // logit_key's inverse on finite keys
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
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
  unsigned long long mhist[256], upart[kWarps], mbase;
  int hist[256];
  int ival[kWarps][5];
  float fval[kWarps];
  int count, overflow, digit, remaining, above, gcount, found, flag;
};

// A row's result: {id, status, index} (status 0 drawn, 1 left to the host, 2 a bad logit at
// index, 3 every logit -inf).
__device__ __forceinline__ void put(int32_t* o, int id, int status, int index = -1) {
  o[0] = id, o[1] = status, o[2] = index;
}

// Block-wide sum of v (every thread gets it; the warps' sums in order: the same on every
// thread). part: kWarps of scratch (S.part for double, S.upart for the exact 64-bit sums).
template <typename T>
__device__ T block_sum(T v, T* part) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  T t = 0;
  for (int w = 0; w < kWarps; ++w) t += part[w];
  return t;
}

// One pass of a radix select over the row: S.hist[d] += 1 for each token that digit_of(i, z[i])
// puts in bucket d >= 0 (and S.mhist[d] += mass_of(i) when MASS). A warp's lanes that share
// a bucket add once, through their leader: a row's keys crowd into a few buckets, and
// same-address shared atomics serialise. The warp walks the row in step (no lane leaves early).
// The last pass's S.hist[digit] is how many tokens share the selected key.
template <bool MASS, typename D, typename W>
__device__ void hist_pass(const float* __restrict__ z, int64_t limit, Scratch& S, D digit_of, W mass_of) {
  for (int b = threadIdx.x; b < 256; b += kThreads) {
    S.hist[b] = 0;
    if (MASS) S.mhist[b] = 0;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  constexpr int U = 4;
  for (int64_t b0 = int64_t(threadIdx.x & ~31); b0 < limit; b0 += int64_t(U) * kThreads) {
    float v[U];
#pragma unroll
    for (int q = 0; q < U; ++q) {
      const int64_t i = b0 + int64_t(q) * kThreads + lane;
      v[q] = i < limit ? __ldg(z + i) : -INFINITY;
    }
#pragma unroll
    for (int q = 0; q < U; ++q) {
      const int64_t i = b0 + int64_t(q) * kThreads + lane;
      const int d = i < limit ? digit_of(i, v[q]) : -1;
      if (!__any_sync(0xffffffffu, d >= 0)) continue;  // (later passes: most warps hold none)
      const unsigned peers = __match_any_sync(0xffffffffu, d);
      if (d < 0) continue;
      const bool lead = lane == __ffs(peers) - 1;
      if constexpr (MASS) {  // the group's sum in three 18-bit parts (32 of them fit 32 bits)
        const unsigned long long m = mass_of(i);
        const unsigned p0 = __reduce_add_sync(peers, unsigned(m & 0x3ffffu));
        const unsigned p1 = __reduce_add_sync(peers, unsigned((m >> 18) & 0x3ffffu));
        const unsigned p2 = __reduce_add_sync(peers, unsigned(m >> 36));
        if (lead)
          atomicAdd(&S.mhist[d], static_cast<unsigned long long>(p0) + (static_cast<unsigned long long>(p1) << 18) +
                                     (static_cast<unsigned long long>(p2) << 36));
      }
      if (lead) atomicAdd(&S.hist[d], __popc(peers));
    }
  }
  __syncthreads();
}

// A prefix of the sampler's order (larger logit, then lower id) as a cut: every key above `key`,
// and the ids up to `id` of that key. {1, INT32_MAX}: every finite token.
struct Cut {
  uint32_t key;
  int id;
};
__device__ __forceinline__ bool in_cut(uint32_t k, int64_t i, Cut c) {
  return k > c.key || (k == c.key && i <= c.id);
}

// A key pass's bucket for token (i, v): its key's digit at `shift` when the key is finite, in cut
// c and carries the digits chosen so far (prefix under mask); else -1.
__device__ __forceinline__ int key_digit(int64_t i, float v, Cut c, uint32_t prefix, uint32_t mask, int shift) {
  const uint32_t k = logit_key(v);
  return k > 0 && in_cut(k, i, c) && (k & mask) == prefix ? int((k >> shift) & 255) : -1;
}

// Thread 0, after a counting pass: the bucket in which the count S.remaining is reached, walking
// from the top (larger keys first) or from the bottom (lower ids first); S.remaining becomes the
// rank left inside it.
__device__ __forceinline__ void pick_by_count(Scratch& S, bool from_top) {
  if (threadIdx.x != 0) return;
  const int step = from_top ? -1 : 1, end = from_top ? 0 : 255;
  int cum = 0, b = from_top ? 255 : 0;
  for (; b != end; b += step) {
    if (cum + S.hist[b] >= S.remaining) break;
    cum += S.hist[b];
  }
  S.digit = b, S.remaining -= cum;
}

// Radix selects over a row's tokens inside a cut (every thread calls each; they synchronise the
// block): four 8-bit passes over the keys from the top, thread 0 picking each digit.
struct LongRow {
  const float* z;
  int64_t limit;
  const double* w;          // the row's weights (long_draw fills them: 0 for -inf)
  double top, inv_t, scale;  // scale: the weights' fixed point (2^45 for 2^17 tokens: a row sums below 2^62)
  Scratch& S;
  __device__ unsigned long long fix(double x) const { return static_cast<unsigned long long>(x * scale + 0.5); }
  __device__ unsigned long long wfix(int64_t i) const { return fix(w[i]); }
  // The key of the M-th token (1-based) of cut c in the sampler's order, which of its key's
  // tokens it is (j, 1-based, in id order) and how many share the key in c (n).
  __device__ uint32_t count_select(int M, Cut c, int& j, int& n) const {
    uint32_t prefix = 0, mask = 0;
    if (threadIdx.x == 0) S.remaining = M;
    for (int shift = 24; shift >= 0; shift -= 8) {
      hist_pass<false>(
          z, limit, S, [&](int64_t i, float v) { return key_digit(i, v, c, prefix, mask, shift); },
          [](int64_t) { return 0ull; });
      pick_by_count(S, true);
      __syncthreads();
      prefix |= uint32_t(S.digit) << shift, mask |= 255u << shift;
    }
    j = S.remaining, n = S.hist[S.digit];
    __syncthreads();
    return prefix;
  }
  // The j-th lowest id (1-based) among the n tokens of key `key` in cut c.
  __device__ int select_id(uint32_t key, int j, int n, Cut c) const {
    if (n == 1) {  // the only one: a single pass
      each_logit(z, limit, [&](int64_t i, float v) {
        if (logit_key(v) == key && in_cut(key, i, c)) S.remaining = int(i);
      });
      __syncthreads();
      const int id = S.remaining;
      __syncthreads();
      return id;
    }
    uint32_t prefix = 0, mask = 0;
    if (threadIdx.x == 0) S.remaining = j;
    const int top_shift = limit > (1 << 24) ? 24 : limit > (1 << 16) ? 16 : limit > 256 ? 8 : 0;
    for (int shift = top_shift; shift >= 0; shift -= 8) {
      hist_pass<false>(
          z, limit, S,
          [&](int64_t i, float v) {
            return logit_key(v) == key && in_cut(key, i, c) && (uint32_t(i) & mask) == prefix
                       ? int((uint32_t(i) >> shift) & 255)
                       : -1;
          },
          [](int64_t) { return 0ull; });
      pick_by_count(S, false);
      __syncthreads();
      prefix |= uint32_t(S.digit) << shift, mask |= 255u << shift;
    }
    __syncthreads();
    return int(prefix);
  }
  // The first token of cut c, in the sampler's order, whose running fixed-point mass (its own
  // included) reaches thr (exceeds it when strict): its key, which of its key's tokens it is (t,
  // 0-based), how many tokens come before that key and how many share it (n). False when the
  // whole cut stays short.
  __device__ bool mass_select(unsigned long long thr, bool strict, Cut c, uint32_t& key, int& t, int& above,
                              int& n) const {
    uint32_t prefix = 0, mask = 0;
    if (threadIdx.x == 0) S.mbase = 0, S.above = 0, S.found = 1;
    for (int shift = 24; shift >= 0; shift -= 8) {
      hist_pass<true>(
          z, limit, S, [&](int64_t i, float v) { return key_digit(i, v, c, prefix, mask, shift); },
          [&](int64_t i) { return wfix(i); });
      if (threadIdx.x == 0) {
        unsigned long long base = S.mbase;
        int b = 255;
        for (; b >= 0; --b) {
          const unsigned long long m = base + S.mhist[b];
          if (strict ? m > thr : m >= thr) break;
          base = m, S.above += S.hist[b];
        }
        if (b < 0) S.found = 0, b = 0;
        S.digit = b, S.mbase = base, S.gcount = S.hist[b];
      }
      __syncthreads();
      if (!S.found) return false;  // (uniform)
      prefix |= uint32_t(S.digit) << shift, mask |= 255u << shift;
    }
    key = prefix, above = S.above;
    // The key's tokens all weigh the same: the first whose mass reaches thr, by division.
    const unsigned long long wk = fix(weight(key_logit(key), top, inv_t)), rem = thr - S.mbase;
    const long long tt = wk == 0 ? 0 : strict ? (long long)(rem / wk) : (long long)((rem + wk - 1) / wk) - 1;
    n = S.gcount, t = int(max(0ll, min(tt, (long long)n - 1)));
    __syncthreads();
    return true;
  }
};

// The draw when the sorted prefix does not hold it (long top-p / min-p prefixes, many ties,
// top_k > kPrefix): the host's candidates C (every finite token, or the first k), their total
// `all`, the kept prefix K of `keep` tokens (k, the min-p count, the rank where the mass reaches
// top_p: the least of them), then the token where the running mass of K passes u of its total.
__device__ __noinline__ int long_draw(const float* z, int64_t limit, const DevSample& sp, int nfin, double top,
                                      double inv_t, double u, double* w, Scratch& S) {
  int bits = 0;
  while ((int64_t(1) << bits) < limit) ++bits;
  const LongRow R{z, limit, w, top, inv_t, ldexp(1.0, min(52, 62 - bits)), S};
  const Cut every{1u, INT32_MAX};
  Cut C = every;
  int nC = nfin;
  if (sp.top_k > 0 && sp.top_k < nfin) {
    int j = 0, n = 0;
    const uint32_t k = R.count_select(sp.top_k, every, j, n);
    C = {k, R.select_id(k, j, n, every)}, nC = sp.top_k;
  }
  // Every token's weight once (the passes below read them), and the candidates' total.
  double mine = 0;
  each_logit(z, limit, [&](int64_t i, float v) {
    const uint32_t k = logit_key(v);
    const double wi = k > 0 ? weight(v, top, inv_t) : 0.0;
    w[i] = wi;
    if (k > 0 && in_cut(k, i, C)) mine += wi;
  });
  const double all = block_sum(mine, S.part);  // (its barriers make the weights visible to the block)
  int keep = nC;
  Cut K = C;
  bool have_k = true;  // K is the cut of the first `keep`
  if (sp.top_p < 1.f || sp.min_p > 0.f) {
    if (sp.min_p > 0.f) {  // tokens at least min_p times as likely as the first (which always stays)
      const double floor = double(sp.min_p) * 1.0 / all;  // (the first's weight is exp(0))
      int n = 0;
      each_logit(z, limit, [&](int64_t i, float v) {
        const uint32_t k = logit_key(v);
        if (k > 0 && in_cut(k, i, C) && !(w[i] / all < floor)) ++n;
      });
      n = max(1, int(block_sum(static_cast<unsigned long long>(n), S.upart)));
      if (n < keep) keep = n, have_k = false;
    }
    if (sp.top_p < 1.f) {  // the first token whose mass, its own included, reaches top_p is the last kept
      uint32_t k = 0;
      int t = 0, above = 0, n = 0;
      const auto thr = static_cast<unsigned long long>(double(sp.top_p) * all * R.scale);
      if (R.mass_select(thr, false, C, k, t, above, n) && above + t + 1 <= keep) {
        keep = above + t + 1;
        K = {k, R.select_id(k, t + 1, n, C)}, have_k = true;
      }
    }
  }
  if (!have_k) {
    int j = 0, n = 0;
    const uint32_t k = R.count_select(keep, C, j, n);
    K = {k, R.select_id(k, j, n, C)};
  }
  unsigned long long kept = 0;
  each_logit(z, limit, [&](int64_t i, float v) {
    const uint32_t k = logit_key(v);
    if (k > 0 && in_cut(k, i, K)) kept += R.wfix(i);
  });
  const unsigned long long sum = block_sum(kept, S.upart);
  uint32_t k = 0;
  int t = 0, above = 0, n = 0;
  if (R.mass_select(static_cast<unsigned long long>(u * double(sum)), true, K, k, t, above, n))
    return R.select_id(k, t + 1, n, K);
  // Rounding left u at the top: the last kept token, as the host does.
  int j = 0;
  const uint32_t kl = R.count_select(keep, K, j, n);
  return R.select_id(kl, j, n, K);
}

// The host's filters and draw over the sorted prefix S.w [n] (one thread); false once drawn, true
// when the kept prefix may go on past n.
template <typename IdOf>
__device__ bool prefix_draw(Scratch& S, int n, const DevSample& sp, bool top_k, int nfin, double all, double u,
                            int32_t* o, IdOf id_of) {
  const bool filt = sp.top_p < 1.f || sp.min_p > 0.f;
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
    if (open && n < (top_k ? sp.top_k : nfin)) return true;
  }
  double sum = 0;
  for (int i = 0; i < keep; ++i) sum += S.w[i];
  double cum = 0;
  for (int i = 0; i + 1 < keep; ++i) {
    cum += S.w[i] / sum;
    if (u < cum) {
      put(o, id_of(i), 0);
      return false;
    }
  }
  put(o, id_of(keep - 1), 0);
  return false;
}

__global__ void __launch_bounds__(kThreads) sample_kernel(const float* __restrict__ x, int64_t cols, int64_t limit,
                                                          const DevSample* __restrict__ spec, int32_t* __restrict__ out,
                                                          double* __restrict__ w) {
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
        const double wi = wt(i);
        if (wi == 0.0) continue;
        run += wi, last = int(i);
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

  auto long_done = [&] { done(long_draw(z, limit, sp, nfin, top, inv_t, u, w + r * limit, S)); };
  // The sorted prefix: the k (top-k) or kPrefix largest, with ties at the boundary.
  if (top_k && sp.top_k > kPrefix) return long_done();
  const int M = top_k ? sp.top_k : min(nfin, kPrefix);
  uint32_t tau = 1u;  // gather keys >= tau (every finite one when all fit)
  if (M < nfin) {
    int j = 0, n = 0;
    const LongRow R{z, limit, nullptr, top, inv_t, 1.0, S};
    tau = R.count_select(M, Cut{1u, INT32_MAX}, j, n);  // the M-th largest key
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
  if (S.overflow) return long_done();  // more ties than fit
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
    all = block_sum(mine, S.part);
  }
  if (tid == 0) S.flag = 0;
  __syncthreads();
  if (tid == 0) {  // the host's loop, one thread, over the sorted prefix
    S.flag = prefix_draw(S, n, sp, top_k, nfin, all, u, o, id_of);
  }
  __syncthreads();
  if (S.flag) long_done();  // the prefix goes on past what was sorted
}

}  // namespace

void sample_rows(const Launch& L, const float* x, int64_t rows, int64_t cols, int64_t limit, const DevSample* spec,
                 int32_t* out, double* w) {
  DSV3_CHECK(limit >= 1 && limit <= cols && limit < INT32_MAX, "sample_rows: limit ", limit, " of ", cols);
  launch(L, sample_kernel, dim3(unsigned(rows)), dim3(kThreads), 0, x, cols, limit, spec, out, w);
}

}  // namespace dsv3::cuda
