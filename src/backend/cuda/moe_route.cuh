// The MoE router's device functions (Gate.forward with gate.cc's choices, and the grouping of
// (token, expert) pairs by expert), shared by the route kernel and the fused gate + route kernel.
#pragma once
#include "backend/cuda/common.cuh"

namespace dsv3::cuda {
namespace {

constexpr int kMaxE = 256, kMaxK = 16, kMaxG = 64, kMaxNE = kMaxE + 16;

constexpr int kRouteWarps = 16;

// Best (value, index) of two candidates: higher value, then lower index (gate.cc's order).
__device__ __forceinline__ void better_of(float& v, int& i, float v2, int i2) {
  if (i2 >= 0 && (i < 0 || v2 > v || (v2 == v && i2 < i))) v = v2, i = i2;
}
__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
    better_of(v, i, v2, i2);
  }
}

// gate.cc's score of a group from its `per` choice scores c: the max, or with a bias the sum of
// the top two.
__device__ __forceinline__ float group_score(const float* c, int per, bool bias) {
  if (!bias) {
    float m = c[0];
    for (int j = 1; j < per; ++j) m = fmaxf(m, c[j]);
    return m;
  }
  float m1 = -INFINITY, m2 = -INFINITY;
  for (int j = 0; j < per; ++j) {
    if (c[j] > m1) m2 = m1, m1 = c[j];
    else if (c[j] > m2) m2 = c[j];
  }
  return m1 + m2;
}

// Whether routed expert (or shared slice) e is run on this rank (MoeSched::local0 / local1).
__device__ __forceinline__ bool runs_here(const MoeSched& s, int e) {
  return e >= s.E || (e >= s.local0 && e < s.local1);
}

// Pair row p of a one-token schedule: expert (or shared slice) e's only pair, weight w; when the
// expert runs here (a >= 0), active slot and tile a (a == p unless another rank holds experts).
__device__ __forceinline__ void one_token_slot(const MoeSched& s, int p, int a, int e, float w) {
  s.off[e] = p, s.cnt[e] = 1, s.perm[p] = 0;
  s.pair_of[p] = p, s.pw[p] = w;
  if (a >= 0) s.active[a] = e, s.tile_e[a] = e, s.tile_m0[a] = 0;
}

// A warp's shared scratch for routing one token: scores and choice values [kMaxE], group scores [kMaxG].
struct RouteScratch {
  float *sc, *ch, *gs;
};

// Warp `lane`s route token i (gate.cc's choices) and write its K experts, by expert index, as
// ids into pair_of[i, :K] with their weights in pw (the grouping turns ids into pair rows).
__device__ void route_token_warp(const RouteArgs& ra, const float* __restrict__ logits, const float* __restrict__ bias,
                                 const MoeSched& s, int64_t i, RouteScratch scratch, int32_t* topk_idx, float* topk_w) {
  float *sc = scratch.sc, *ch = scratch.ch, *gs = scratch.gs;
  const int E = s.E, K = s.K, Kt = s.K + s.S, G = ra.G, per = E / G, lane = threadIdx.x & 31;
  constexpr int kPer = kMaxE / 32;  // experts per lane at most
  const int nj = (E + 31) / 32;     // ... and for this E (the loops below skip the rest)
  const float* lg = logits + i * E;  // read from L2: written by other blocks (fused gate)
  // Scores in double, rounded once, as model/gate.cc (float32 versions differ by a few ulps,
  // which can flip a near-tie).
  float v[kPer];
  double mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = lane + 32 * j;
    v[j] = j < nj && e < E ? __ldcg(lg + e) : -INFINITY;
    mx = fmax(mx, double(v[j]));
  }
  if (!ra.sigmoid) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    double ex[kPer], sum = 0.0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      ex[j] = 0.0;
      if (j < nj && lane + 32 * j < E) ex[j] = exp(double(v[j]) - mx);  // a branch: no exp for absent experts
      sum += ex[j];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      if (j < nj) v[j] = float(ex[j] / sum);
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      if (j < nj && lane + 32 * j < E) v[j] = float(1.0 / (1.0 + exp(-double(v[j]))));
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = lane + 32 * j;
    if (j < nj && e < E) sc[e] = v[j], ch[e] = bias ? v[j] + bias[e] : v[j];
  }
  __syncwarp();
  if (G > 1) {
    for (int g = lane; g < G; g += 32) gs[g] = group_score(ch + g * per, per, bias != nullptr);
    __syncwarp();
    uint64_t keep = 0;
    for (int r = 0; r < ra.topk_groups; ++r) {
      float bv = -INFINITY;
      int bi = -1;
      for (int g = lane; g < G; g += 32)
        if (!((keep >> g) & 1)) better_of(bv, bi, gs[g], g);
      warp_best(bv, bi);
      keep |= uint64_t(1) << bi;
    }
    for (int e = lane; e < E; e += 32)
      if (!((keep >> (e / per)) & 1)) ch[e] = -INFINITY;
    __syncwarp();
  }
  // Top-K by K rounds of a warp-wide best over the experts not yet taken.
  uint32_t taken = 0;  // bit j: expert lane + 32 j
  float sum = 0.f;
  for (int k = 0; k < K; ++k) {
    float bv = -INFINITY;
    int bi = -1;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int e = lane + 32 * j;
      if (j < nj && e < E && !((taken >> j) & 1)) better_of(bv, bi, ch[e], e);
    }
    warp_best(bv, bi);
    if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
    const float wk = sc[bi];
    sum += wk;  // in choice order, as gate.cc
    if (topk_idx && lane == 0) topk_idx[i * K + k] = bi;  // tests: the choices in choice order
  }
  auto weight_of = [&](float sc_e) {
    float wv = sc_e;
    if (ra.norm) wv /= sum;
    return wv * ra.route_scale;
  };
  if (topk_idx && lane == 0)
    for (int k = 0; k < K; ++k) topk_w[i * K + k] = weight_of(sc[topk_idx[i * K + k]]);
  // Routed choices by expert index (the order the reference adds them in): each chosen expert's
  // rank is the number of chosen experts below it (ballots over the lanes' taken bits).
  int base = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (j >= nj) break;
    const bool mine = (taken >> j) & 1;
    const unsigned msk = __ballot_sync(0xffffffffu, mine);
    if (mine) {
      const int rank = base + __popc(msk & ((1u << lane) - 1u)), e = lane + 32 * j;
      s.pair_of[i * Kt + rank] = e, s.pw[i * Kt + rank] = weight_of(sc[e]);
    }
    base += __popc(msk);
  }
  __syncwarp();
}

// One token (a step of one) by the whole block, one expert per thread (blockDim >= E): the same
// choices as route_token_warp (gate.cc's order, higher value then lower index) found as each
// expert's rank among all of them rather than by K serial warp-wide rounds, and the schedule
// written directly (what group_pairs would make of it: pair row = rank by expert index, the
// shared slices after the routed experts). topk_idx / topk_w: the choices in choice order
// (tests). Every thread of the block must call it. Four barriers without groups: each
// reduction's partials have their own buffer, and after the ranks every thread that writes a
// pair reads the choices itself (the weight sum in choice order, its row by expert index).
// write = false: nothing is written (an expert block that needs only its own expert); want >= 0:
// returns, in every thread, the chosen expert of that rank by expert index (a fifth barrier).
__device__ int route_one_block(const RouteArgs& ra, const float* __restrict__ logits, const float* __restrict__ bias,
                               const MoeSched& s, int32_t* topk_idx, float* topk_w, bool write = true, int want = -1) {
  __shared__ float sc[kMaxE], ch[kMaxE], gs[kMaxG];
  __shared__ double red[2][kMaxE / 32];
  __shared__ int order[kMaxK], by_index[kMaxK];
  const int E = s.E, K = s.K, G = ra.G, per = E / G, e = threadIdx.x, lane = e & 31, warp = e >> 5;
  const int nw = (E + 31) >> 5;  // warps holding experts
  const bool live = e < E;
  // Max or sum in double over the live warps, the same value in every thread; buffer b.
  auto reduce = [&](double x, bool mx, int b) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const double y = __shfl_xor_sync(0xffffffffu, x, o);
      x = mx ? fmax(x, y) : x + y;
    }
    if (lane == 0 && warp < nw) red[b][warp] = x;
    __syncthreads();
    double r = red[b][0];
    for (int w = 1; w < nw; ++w) r = mx ? fmax(r, red[b][w]) : r + red[b][w];
    return r;
  };
  const float v = live ? __ldcg(logits + e) : -INFINITY;  // written by other blocks (fused gate)
  float p = 0.f;
  if (!ra.sigmoid) {  // scores in double, rounded once, as model/gate.cc
    const double mx = reduce(double(v), true, 0);
    const double ex = live ? exp(double(v) - mx) : 0.0;
    const double sum = reduce(ex, false, 1);
    p = float(ex / sum);
  } else if (live) {
    p = float(1.0 / (1.0 + exp(-double(v))));
  }
  if (live) sc[e] = p, ch[e] = bias ? p + bias[e] : p;
  __syncthreads();
  if (G > 1) {  // group scores as gate.cc (max, or the top-2 sum with a bias), then keep the best groups
    if (e < G) gs[e] = group_score(ch + e * per, per, bias != nullptr);
    __syncthreads();
    bool keep = false;
    if (live) {
      const int g = e / per;
      const float mine = gs[g];
      int rank = 0;
      for (int h = 0; h < G; ++h) rank += gs[h] > mine || (gs[h] == mine && h < g);
      keep = rank < ra.topk_groups;
    }
    __syncthreads();
    if (live && !keep) ch[e] = -INFINITY;
    __syncthreads();
  }
  // Top-K: an expert is chosen when fewer than K others come before it.
  bool chosen = false;
  if (live) {
    const float mine = ch[e];
    int rank = 0;
#pragma unroll 8
    for (int f = 0; f < E; ++f) {
      const float c = ch[f];
      rank += c > mine || (c == mine && f < e);
    }
    chosen = rank < K;
    if (chosen) order[rank] = e;
  }
  __syncthreads();
  if (chosen || (topk_idx && e < K)) {
    float sum = 0.f;
    int pos = 0, slot = 0;  // chosen experts below e: its pair row; ... run here: its active slot
    for (int k = 0; k < K; ++k) {
      const int o = order[k];
      sum += sc[o];  // in choice order, as gate.cc
      pos += o < e;
      slot += o < e && runs_here(s, o);
    }
    auto weight_of = [&](float sc_e) {
      float wv = sc_e;
      if (ra.norm) wv /= sum;
      return wv * ra.route_scale;
    };
    if (write && topk_idx && e < K) topk_idx[e] = order[e], topk_w[e] = weight_of(sc[order[e]]);
    if (chosen) {
      if (write) one_token_slot(s, pos, runs_here(s, e) ? slot : -1, e, weight_of(sc[e]));
      by_index[pos] = e;
    }
  }
  if (write) {
    int L = K;  // chosen experts run here (all unless another rank holds some)
    if (s.local0 > 0 || s.local1 < s.E) {
      L = 0;
      for (int k = 0; k < K; ++k) L += runs_here(s, order[k]);
    }
    if (e < s.S) one_token_slot(s, s.K + e, L + e, s.E + e, 1.f);  // shared slice e: pair row K + e
    if (e == 0) {
      *s.n_active = L + s.S, *s.n_tiles = L + s.S;
      if (s.experts_run) atomicAdd(s.experts_run, (unsigned long long)L);
    }
  }
  if (want < 0) return -1;
  __syncthreads();
  return by_index[want];
}

// One token's MoE output at columns c .. c + 3 (moe_combine's sum): pair rows po[k] (offsets into
// o) for k < Kt, the first K routed, weighted by pw[k] in expert-index order, then the shared
// slices added; load(p) reads four values at p, all Kt rows of a batch of 8 before the sums.
template <class Load>
__device__ __forceinline__ float4 combine4(const float* o, const int64_t* po, const float* pw, int K, int Kt,
                                           int64_t c, Load load) {
  float4 r = make_float4(0.f, 0.f, 0.f, 0.f), sh = r;
  for (int k0 = 0; k0 < Kt; k0 += 8) {
    float4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u)
      if (k0 + u < Kt) v[u] = load(o + po[k0 + u] + c);
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int k = k0 + u;
      if (k < K) {
        r.x += v[u].x * pw[k], r.y += v[u].y * pw[k], r.z += v[u].z * pw[k], r.w += v[u].w * pw[k];
      } else if (k < Kt) {
        sh.x += v[u].x, sh.y += v[u].y, sh.z += v[u].z, sh.w += v[u].w;
      }
    }
  }
  return make_float4(r.x + sh.x, r.y + sh.y, r.z + sh.z, r.w + sh.w);
}

// A one-token MoE output made into the next layer's input by every block of a 256-thread kernel
// for its own use (CombineNorm: combine4, h += it, x = rmsnorm(h) * w into xs in shared memory;
// block 0 also writes y, h and x): load() before the kernel's wait (every kernel triggers after
// its own wait, so the residual, last written before the expert stages, and the pair rows and
// weights that stage 0's first routed block or the router wrote are complete), run() after it
// (every thread; it syncs the block).
constexpr int kCombThreads = 256, kCombMaxD = 2048;
struct CombineStage {
  static constexpr int P = kCombMaxD / (kCombThreads * 4);  // float4 column groups per thread
  const CombineNorm& cn;
  float* xs;  // [kCombMaxD] shared
  int64_t* po;
  float* pw;
  float4 hv[P], wv[P];
  __device__ explicit CombineStage(const CombineNorm& c, float* x_shared) : cn(c), xs(x_shared) {
    __shared__ int64_t po_s[kMaxK + 16];
    __shared__ float pw_s[kMaxK + 16];
    po = po_s, pw = pw_s;
  }
  __device__ int64_t col(int p) const { return (int64_t(threadIdx.x) + int64_t(p) * kCombThreads) * 4; }
  __device__ void load() {
#pragma unroll
    for (int p = 0; p < P; ++p) {
      hv[p] = wv[p] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (col(p) < cn.d) {
        wv[p] = *reinterpret_cast<const float4*>(cn.w + col(p));
        hv[p] = __ldcg(reinterpret_cast<const float4*>(cn.h + col(p)));
      }
    }
    if (threadIdx.x < cn.s.K + cn.s.S) {
      po[threadIdx.x] = int64_t(__ldcg(cn.s.pair_of + threadIdx.x)) * cn.d;
      pw[threadIdx.x] = __ldcg(cn.s.pw + threadIdx.x);
    }
  }
  __device__ void run() {
    __shared__ float red[33];
    const bool writer = blockIdx.x == 0 && blockIdx.y == 0;
    __syncthreads();
    float ss = 0.f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t c = col(p);
      if (c >= cn.d) break;
      const float4 m = combine4(cn.o, po, pw, cn.s.K, cn.s.K + cn.s.S, c,
                                [](const float* q) { return __ldcg(reinterpret_cast<const float4*>(q)); });
      hv[p].x += m.x, hv[p].y += m.y, hv[p].z += m.z, hv[p].w += m.w;
      ss += hv[p].x * hv[p].x + hv[p].y * hv[p].y + hv[p].z * hv[p].z + hv[p].w * hv[p].w;
      if (writer) {
        *reinterpret_cast<float4*>(cn.y + c) = m;
        *reinterpret_cast<float4*>(cn.h + c) = hv[p];
      }
    }
    ss = block_sum(ss, red);
    const float rr = 1.f / sqrtf(ss / float(cn.d) + cn.eps);
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t c = col(p);
      if (c >= cn.d) break;
      const float4 xv = make_float4(hv[p].x * rr * wv[p].x, hv[p].y * rr * wv[p].y, hv[p].z * rr * wv[p].z,
                                    hv[p].w * rr * wv[p].w);
      *reinterpret_cast<float4*>(xs + c) = xv;
      if (writer) *reinterpret_cast<float4*>(cn.x + c) = xv;
    }
    __syncthreads();
  }
};

// Counts pairs per expert, lays the experts out (offsets, active list, 64-row GEMM tiles; one
// warp scans) and turns pair_of's expert ids into pair rows. One block; after route_token_warp.
__device__ void group_pairs(const MoeSched& s, bool tiles) {
  __shared__ int cnt[kMaxNE], off[kMaxNE], fill[kMaxNE];
  const int E = s.E, K = s.K, S = s.S, NE = E + S, Kt = K + S;
  const int64_t n = s.n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int e = threadIdx.x; e < NE; e += blockDim.x) cnt[e] = e < E ? 0 : int(n), fill[e] = 0;
  __syncthreads();
  // A thread per token, its K expert ids loaded before any atomic (all loads in flight at once).
  auto ids_of = [&](int64_t i, int (&id)[kMaxK]) {
#pragma unroll
    for (int k = 0; k < kMaxK; ++k)
      if (k < K) id[k] = __ldcg(s.pair_of + i * Kt + k);
  };
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    int id[kMaxK];
    ids_of(i, id);
#pragma unroll
    for (int k = 0; k < kMaxK; ++k)
      if (k < K) atomicAdd(&cnt[id[k]], 1);
  }
  __syncthreads();
  if (warp == 0) {
    int base = 0, na = 0, nt = 0;
    for (int e0 = 0; e0 < NE; e0 += 32) {
      // (another rank's expert keeps its pair rows but is neither active nor tiled)
      const int e = e0 + lane, c = e < NE ? cnt[e] : 0;
      const bool run = c > 0 && runs_here(s, e);
      const int tc = tiles && run ? (c + s.tile_rows - 1) / s.tile_rows : 0;
      int x = c, y = tc;  // inclusive scans over the lanes
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int xu = __shfl_up_sync(0xffffffffu, x, o), yu = __shfl_up_sync(0xffffffffu, y, o);
        if (lane >= o) x += xu, y += yu;
      }
      const unsigned act = __ballot_sync(0xffffffffu, run);
      if (e < NE) off[e] = base + x - c, s.off[e] = base + x - c, s.cnt[e] = c;
      if (run) s.active[na + __popc(act & ((1u << lane) - 1))] = e;
      for (int j = 0; j < tc; ++j) s.tile_e[nt + y - tc + j] = e, s.tile_m0[nt + y - tc + j] = s.tile_rows * j;
      base += __shfl_sync(0xffffffffu, x, 31);
      nt += __shfl_sync(0xffffffffu, y, 31);
      na += __popc(act);
    }
    if (lane == 0) {
      *s.n_active = na, *s.n_tiles = nt;
      if (s.experts_run) atomicAdd(s.experts_run, (unsigned long long)(na - (n > 0 ? S : 0)));
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    int id[kMaxK];
    ids_of(i, id);
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
      if (k >= K) break;
      const int p = off[id[k]] + atomicAdd(&fill[id[k]], 1);
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

// The expert of slot y (blockIdx.y) of an expert launch: the shared slices first (known before
// routing: their weights load while the router runs), then the routed experts of the active
// list. Stage 1 runs after stage 0 has passed its wait, so the router's schedule is complete
// then: it is read (from L2) and the weights started on before waiting for stage 0's output.
// false: no expert in this slot (the block has waited and triggered; it leaves). ONE: kernels of
// one-token launches, where the block may route the token itself (MoeSched::route_logits); only
// they carry the router's shared memory.
template <bool ONE>
__device__ __forceinline__ bool expert_slot(const MoeSched& s, int stage, int y, int& e, int64_t& off, int64_t& cnt) {
  if constexpr (ONE) {
    if (s.route_logits && y >= s.S) {  // one token, routed here from the gate's logits
      // Stage 0 waits for them; stage 1 comes two kernels after the gate and routes before its wait.
      if (stage == 0) pdl_wait();
      const bool write = stage == 0 && y == s.S && blockIdx.x == 0;  // the schedule, for the combine
      e = route_one_block(s.route, s.route_logits, s.route_bias, s, nullptr, nullptr, write, y - s.S);
      off = y - s.S, cnt = 1;
      return true;
    }
  }
  const bool early = y < s.S || stage == 1;
  if (!early) pdl_wait();
  if (y < s.S) {  // shared slice y: every token, after all routed pairs (no schedule read needed)
    e = s.E + y, off = s.n * s.K + y * s.n, cnt = s.n;
    return true;
  }
  const int na = __ldcg(s.n_active) - s.S;
  if (y - s.S >= na) {
    pdl_wait();
    pdl_trigger();
    return false;
  }
  e = __ldcg(s.active + (y - s.S));
  off = __ldcg(s.off + e), cnt = __ldcg(s.cnt + e);
  return true;
}

// Tile y (blockIdx.y) of an expert launch over the router's tile table (MoeSched::tile_rows
// pairs each, shared slices included): its expert e and pair rows [off, off + cnt). Stage 0 waits
// for the router first; stage 1 comes after stage 0 has passed that wait (as expert_slot).
__device__ __forceinline__ bool expert_tile(const MoeSched& s, int stage, int y, int& e, int64_t& off, int64_t& cnt) {
  if (stage == 0) pdl_wait();
  if (y >= __ldcg(s.n_tiles)) {
    pdl_wait();
    pdl_trigger();
    return false;
  }
  e = __ldcg(s.tile_e + y);
  const int64_t m0 = __ldcg(s.tile_m0 + y), c = __ldcg(s.cnt + e) - m0;
  off = __ldcg(s.off + e) + m0, cnt = c < s.tile_rows ? c : s.tile_rows;
  return true;
}

// DSV3_MOE_S1_ROUTED_FIRST=1: see launch_slot.
#ifndef DSV3_MOE_S1_ROUTED_FIRST
#define DSV3_MOE_S1_ROUTED_FIRST 1
#endif
// The expert slot of this block of an expert GEMV launch (blockIdx.y in order: shared slices
// first). One routed token's stage 1 puts the routed slots' blocks first: they route before
// their wait, so they are the ones to start while stage 0 still holds the SMs; the shared
// slices' blocks, which start later, need no routing.
template <bool ONE>
__device__ __forceinline__ int launch_slot(const MoeSched& s, int stage) {
  const int y = int(blockIdx.y);
  if (!DSV3_MOE_S1_ROUTED_FIRST || !ONE || stage != 1 || !s.route_logits) return y;
  const int nr = int(gridDim.y) - s.S;
  return y < nr ? y + s.S : y - nr;
}

// The token rows of slot y's pairs from pair row off, for stage 0 (null: tokens 0, 1, ... in
// order): a shared slice takes every token in order, and one token routed in the block is token 0,
// so neither reads the permutation rows (the first routed block may still be writing them).
__device__ __forceinline__ const int32_t* slot_tokens(const MoeSched& s, int y, int64_t off) {
  return y < s.S || s.route_logits ? nullptr : s.perm + off;
}

}  // namespace
}  // namespace dsv3::cuda
