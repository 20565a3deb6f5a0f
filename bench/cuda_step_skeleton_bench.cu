// A skeleton of one-token decode at the 16B shape, to measure what the step's shape costs
// before anyone builds it for real: the same phases, bytes and dependencies as dsv3's decode step
// (per MoE layer: wq + wkv_a with the previous layer's MoE combine and the norm, the q absorption
// with the cache write, split attention over the latent cache, the value absorption with the
// splits' combine, wo, the gate with the residual add and the norm, expert stage 0 (w1 | w3 of 2
// shared + 6 routed slots, routed by every block itself) and stage 1 (w2); then the head),
// computed by one simple FMA GEMV (a warp per row, 16-byte chunks; e4m3 widened exactly), in two
// ways that differ only in how a phase waits for the one before:
//   chain   - a kernel per phase, programmatic dependent launch, one CUDA graph: each kernel
//             copies its block's slice of the weights (up to --preload-kb) into shared memory
//             before its griddepcontrol.wait (as dsv3's kernels load weights before theirs);
//   persist - one cooperative kernel for the whole step, the phases separated by a grid barrier
//             (one atomic per block on a counter, then polling it); each phase's slice is copied
//             into the other of two shared buffers while the phase before computes;
//   flow    - the same kernel, but after the pair, the q absorption, the attention and stage 0 a
//             block waits only for the blocks whose rows it reads (per head or slot counters).
// --sync-only drops the GEMVs' rows (every phase still stages its activations and waits): what
// the dependencies alone cost. Prints the step time, each phase's median cost inside the step
// (block 0's global timer at each wait end) and the fraction of the HBM floor (copy bandwidth).
// The two ways compute the same thing in the same order; the program checks that their outputs
// agree (to rounding: the compiler may contract differently inside the two kernels). Not dsv3's
// arithmetic (float32-grade there, plain FMA here) nor its kernels: a measurement of the step's
// shape (docs/cuda.md, "What is left"). The first (dense) layer is left out.
//
//   dsv3_cuda_step_skeleton_bench [--dtype fp8|bf16] [--layers 26] [--ctx 64] [--reps 20]
//                                 [--preload-kb 64] [--bps 1] [--rows 2|4] [--modes chain,persist,flow]
//                                 [--sync-only]
// --rows: rows of weights each lane group streams at once (four 16-byte chunks of each in flight).
// --preload-kb up to 88: two chain kernels' blocks then still fit one SM (the next one's copy
// overlaps the one before). --bps 2 runs only the chain (the persistent kernel's registers allow
// one block per SM). The chain's kernel is held to 128 registers (two blocks per SM), the
// persistent one is not.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_bench_util.cuh"

namespace {

// The 16B shape (DeepSeek-V2-Lite): dim 2048, 16 heads of 128 + 64 (q), latent 512 + 64, values
// 128, experts of 1408, 2 shared + 6 of 64 routed (the skeleton routes among NE candidates per
// layer: the bytes read per step are the same), vocabulary 102400.
constexpr int kDim = 2048, kHeads = 16, kQHead = 192, kNope = 128, kLat = 512, kKvA = 576, kV = 128;
constexpr int kInter = 1408, kSlots = 8, kShared = 2, kTopK = 6, kNE = 16, kGateRows = 64, kVocab = 102400;
constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kXCap = 6144;  // floats of staged activations per block
constexpr int kGroups = 17;  // flow: groups per phase (heads or slots, and one more: kv rows / cache row / routing)

enum Kind { kPair, kPrep, kAttn, kVabs, kWo, kGate, kS0, kS1, kHead, kKinds };
const char* const kKindName[kKinds] = {"wq+wkv_a (+combine, norm)", "q absorption (+cache row)", "attention (splits)",
                                       "value absorption (+split combine)", "wo", "gate (+add, norm)",
                                       "expert stage 0 (w1|w3, routing)", "expert stage 1 (w2)", "head"};

struct Params {
  int eb;       // weight bytes per element: 1 (e4m3) or 2 (bf16)
  int layers, ctx, splits, nb, preload, sync_only;
  int rows;     // rows per lane group in flight in the GEMV: 2 or 4
  int nphase;   // layers * 8 + 1 (the head)
  // weights: per layer [pair 3648 x 2048][prep 16 x 512 x 128][vabs 2048 x 512][wo 2048 x 2048][gate 64 x 2048 bf16]
  const uint8_t* wl;
  int64_t layer_bytes;
  const uint8_t* w13;  // [layer][2 + NE][2 * 1408][2048]
  const uint8_t* w2;   // [layer][2 + NE][2048][1408]
  const uint8_t* head; // [102400][2048] bf16
  float* cache;        // [layer][ctx][576]
  float* h_attn;       // [layer + 1][2048]: the residual before each layer's attention (after the combine)
  float* h_moe;        // [layer][2048]: before the MoE
  float* xm;           // [2048]: norm(h_moe), the experts' input
  float* y_pair;       // [3648]
  float* y_prep;       // [16 x 512]
  float* part;         // [16][splits][2 + 512]: attention partials (max, sum, sum of weighted rows)
  float* y_vabs;       // [2048]
  float* y_wo;         // [2048]
  float* y_gate;       // [64]
  float* y_s0;         // [8][2816]
  float* y_s1;         // [8][2048]
  int* route;          // [layer][6] routed candidates
  float* route_w;      // [layer][8] slot weights
  float* logits;       // [102400]
  unsigned* counter;   // the persistent kernel's grid barrier
  unsigned* flags;     // flow: [phase][kGroups] blocks done per group of a phase's rows
  int flow;            // the persistent kernel with local waits after the pair, prep, attention, stage 0
  int* err;
  unsigned long long* rec;  // [nphase + 1]: block 0's global timer at each phase's start
};

// Phase i of the step: layer i / 8's phase i % 8, the last one the head.
__host__ __device__ __forceinline__ int phase_kind(int i, int nphase) { return i == nphase - 1 ? int(kHead) : i % 8; }

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void cp_async16(void* smem, const void* g) {
  const unsigned s = unsigned(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float block_sum(float v, float* red) {  // red: kWarps floats; every thread gets the sum
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += red[w];
  return s;
}

// A GEMV phase's geometry: R rows of K weights (eb bytes each), rows grouped (rows per group
// share activations: a head, an expert slot), and where a block's rows come from.
struct Gemv {
  int R, K, eb, rows_per_group;
  int x_group;  // rows per group of staged activations (stage 0: every slot takes the same x)
  __device__ int64_t rb() const { return int64_t(K) * eb; }
};
__device__ Gemv gemv_of(const Params& P, int kind) {
  switch (kind) {
    case kPair: return {kHeads * kQHead + kKvA, kDim, P.eb, 1 << 30, 1 << 30};
    case kPrep: return {kHeads * kLat, kNope, P.eb, kLat, kLat};
    case kVabs: return {kHeads * kV, kLat, P.eb, kV, kV};
    case kWo: return {kDim, kHeads * kV, P.eb, 1 << 30, 1 << 30};
    case kGate: return {kGateRows, kDim, 2, 1 << 30, 1 << 30};
    case kS0: return {kSlots * 2 * kInter, kDim, P.eb, 2 * kInter, 1 << 30};
    case kS1: return {kSlots * kDim, kInter, P.eb, kDim, kDim};
    case kHead: return {kVocab, kDim, 2, 1 << 30, 1 << 30};
    default: return {0, 1, 1, 1, 1};
  }
}
// The pool index of a slot's expert: the shared ones first; a routed one from sel (the block's
// own routing, stage 0) or from what block 0 published (stage 1, a phase later).
__device__ __forceinline__ int slot_expert(const Params& P, int layer, int slot, const int* sel) {
  if (slot < kShared) return slot;
  return kShared + (sel ? sel[slot - kShared] : __ldcg(P.route + layer * kTopK + slot - kShared));
}
// Row r's weights.
__device__ const uint8_t* row_ptr(const Params& P, int kind, int layer, int r, const int* sel = nullptr) {
  const Gemv g = gemv_of(P, kind);
  const uint8_t* base = P.wl + int64_t(layer) * P.layer_bytes;
  const int64_t pair = int64_t(kHeads * kQHead + kKvA) * kDim * P.eb, prep = int64_t(kHeads) * kLat * kNope * P.eb,
                vabs = int64_t(kHeads) * kV * kLat * P.eb, wo = int64_t(kDim) * kHeads * kV * P.eb;
  switch (kind) {
    case kPair: return base + int64_t(r) * g.rb();
    case kPrep: return base + pair + int64_t(r) * g.rb();
    case kVabs: return base + pair + prep + int64_t(r) * g.rb();
    case kWo: return base + pair + prep + vabs + int64_t(r) * g.rb();
    case kGate: return base + pair + prep + vabs + wo + int64_t(r) * g.rb();
    case kS0: {
      const int s = r / g.rows_per_group, j = r % g.rows_per_group;
      return P.w13 + ((int64_t(layer) * (kShared + kNE) + slot_expert(P, layer, s, sel)) * g.rows_per_group + j) * g.rb();
    }
    case kS1: {
      const int s = r / g.rows_per_group, j = r % g.rows_per_group;
      return P.w2 + ((int64_t(layer) * (kShared + kNE) + slot_expert(P, layer, s, sel)) * g.rows_per_group + j) * g.rb();
    }
    case kHead: return P.head + int64_t(r) * g.rb();
    default: return nullptr;
  }
}
__device__ __forceinline__ void block_rows(int R, int nb, int b, int& r0, int& r1) {
  r0 = int(int64_t(R) * b / nb), r1 = int(int64_t(R) * (b + 1) / nb);
}
// The rows of a block whose weights are known before the phase's inputs are (all but the routed
// slots'): they can be copied ahead. Contiguous in memory (the shared experts are stored first).
__device__ void preload_rows(const Params& P, int kind, int b, int& p0, int& p1) {
  p0 = p1 = 0;
  if (kind == kAttn || P.sync_only) return;
  const Gemv g = gemv_of(P, kind);
  int r0, r1;
  block_rows(g.R, P.nb, b, r0, r1);
  if (kind == kS0 || kind == kS1) r1 = min(r1, kShared * g.rows_per_group);
  p0 = r0, p1 = max(r0, r1);
}

// Copies the block's preloadable slice (at most P.preload bytes) into buf (cp.async, one group).
__device__ void preload(const Params& P, int kind, int layer, int b, uint8_t* buf) {
  int p0, p1;
  preload_rows(P, kind, b, p0, p1);
  if (p1 > p0) {
    const Gemv g = gemv_of(P, kind);
    const uint8_t* src = row_ptr(P, kind, layer, p0);
    const int64_t n = min(int64_t(P.preload), (p1 - p0) * g.rb());
    for (int64_t o = 16 * threadIdx.x; o < n; o += 16 * kThreads) cp_async16(buf + o, src + o);
  }
  cp_commit();
}

__device__ __forceinline__ void dot_chunk(const uint4& v, const float* x, int eb, float& acc) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  const float4* x4 = reinterpret_cast<const float4*>(x);  // (16-byte aligned: K % 4 == 0)
  if (eb == 1) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 xv = x4[i];
      const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[i] & 0xffffu), __NV_E4M3);
      const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[i] >> 16), __NV_E4M3);
      const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
      const float2 c = __half22float2(*reinterpret_cast<const __half2*>(&hi));
      acc = fmaf(a.x, xv.x, acc);
      acc = fmaf(a.y, xv.y, acc);
      acc = fmaf(c.x, xv.z, acc);
      acc = fmaf(c.y, xv.w, acc);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float4 xv = x4[i];
      acc = fmaf(__uint_as_float(w[2 * i] << 16), xv.x, acc);
      acc = fmaf(__uint_as_float(w[2 * i] & 0xffff0000u), xv.y, acc);
      acc = fmaf(__uint_as_float(w[2 * i + 1] << 16), xv.z, acc);
      acc = fmaf(__uint_as_float(w[2 * i + 1] & 0xffff0000u), xv.w, acc);
    }
  }
}

// y[r] = w_r . x for the block's rows; x: the staged activations of groups g0.. (row r's at
// (r / x_group - g0) * K); sel: stage 0's routing. Rows [p0, p0 + pre / rb) come from buf
// (copied ahead), the rest from global memory. Lanes per row: up to 32 (16-byte chunks each);
// NR rows per lane group at once, four chunks of each in flight.
template <int NR>
__device__ void gemv_rows(const Params& P, int kind, int layer, int b, const uint8_t* buf, const float* x, int g0,
                          float* y, const int* sel) {
  const Gemv g = gemv_of(P, kind);
  int r0, r1, p0, p1;
  block_rows(g.R, P.nb, b, r0, r1);
  preload_rows(P, kind, b, p0, p1);
  const int64_t rb = g.rb(), pre = min(int64_t(P.preload), (p1 - p0) * rb);
  const int nc = int(rb / 16), lpr = nc >= 32 ? 32 : nc, rpw = 32 / lpr, epc = 16 / g.eb;
  const int lane = threadIdx.x & 31, gi = lane / lpr, gl = lane % lpr, warp = threadIdx.x >> 5;
  for (int base = r0 + warp * NR * rpw; base < r1; base += kWarps * NR * rpw) {
    int r[NR];
    const uint8_t* w[NR];
    const float* xr[NR];
    float acc[NR];
#pragma unroll
    for (int j = 0; j < NR; ++j) {
      r[j] = base + j * rpw + gi;
      w[j] = r[j] < r1 ? row_ptr(P, kind, layer, r[j], sel) : nullptr;
      xr[j] = x + (r[j] / g.x_group - g0) * int64_t(g.K);
      acc[j] = 0;
    }
    for (int c0 = gl; c0 < nc; c0 += 4 * lpr) {
      uint4 l[NR][4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int c = c0 + u * lpr;
#pragma unroll
        for (int j = 0; j < NR; ++j) {
          const int64_t o = int64_t(r[j] - p0) * rb + 16 * c;
          l[j][u] = make_uint4(0, 0, 0, 0);
          if (r[j] < r1 && c < nc) l[j][u] = o < pre ? *reinterpret_cast<const uint4*>(buf + o) : ld_nc(w[j] + 16 * c);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int c = c0 + u * lpr;
#pragma unroll
        for (int j = 0; j < NR; ++j)
          if (r[j] < r1 && c < nc) dot_chunk(l[j][u], xr[j] + c * epc, g.eb, acc[j]);
      }
    }
    const float s = rsqrtf(float(g.K));
#pragma unroll
    for (int j = 0; j < NR; ++j) {
      for (int o = lpr / 2; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
      if (gl == 0 && r[j] < r1) y[r[j]] = acc[j] * s;
    }
  }
}
__device__ void gemv(const Params& P, int kind, int layer, int b, const uint8_t* buf, const float* x, int g0, float* y,
                     const int* sel = nullptr) {
  if (P.sync_only) return;
  if (P.rows == 4) gemv_rows<4>(P, kind, layer, b, buf, x, g0, y, sel);
  else gemv_rows<2>(P, kind, layer, b, buf, x, g0, y, sel);
}

// Routing among the layer's NE candidates: the top 6 gate outputs (lowest index on ties),
// weights sigmoid / their sum; every routed block computes it itself (warp 0, a candidate per
// lane), block 0 also publishes it.
__device__ void route(const Params& P, int layer, int b, int* sel, float* w) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float v = lane < kNE ? __ldcg(P.y_gate + lane) : -INFINITY, tot = 0;
    for (int k = 0; k < kTopK; ++k) {
      float bv = v;
      int bi = lane;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
      }
      const float wk = 1.f / (1.f + expf(-bv));
      tot += wk;
      if (lane == 0) sel[k] = bi, w[kShared + k] = wk;
      if (lane == bi) v = -INFINITY;
    }
    __syncwarp();
    if (lane < kTopK) w[kShared + lane] /= tot;
    if (lane < kShared) w[lane] = 1.f;
    __syncwarp();
    if (b == 0 && lane < kTopK) P.route[layer * kTopK + lane] = sel[lane];
    if (b == 0 && lane < kSlots) P.route_w[layer * kSlots + lane] = w[lane];
  }
  __syncthreads();
}

// x = rmsnorm(a + sum_s c_s y_s) over kDim, into smem x; block 0 writes the sum (pre-norm) to out.
__device__ void stage_add_norm(const float* a, const float* ys, const float* c, int nslots, float* out, int b, float* x,
                               float* red) {
  float ss = 0;
  for (int i = threadIdx.x; i < kDim; i += kThreads) {
    float v = __ldcg(a + i);
    for (int s = 0; s < nslots; ++s) v += c[s] * __ldcg(ys + int64_t(s) * kDim + i);
    x[i] = v;
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, red) / kDim + 1e-6f);
  for (int i = threadIdx.x; i < kDim; i += kThreads) {
    if (b == 0) out[i] = x[i];
    x[i] *= inv;
  }
  __syncthreads();
}

// One phase of the step for block b (every block calls it; blocks without rows only stage).
// buf: this phase's weights copied ahead (and the attention's scratch).
__device__ void run_phase(const Params& P, int i, int b, uint8_t* buf, float* x, float* red, int* sel, float* sw) {
  if (i == P.nphase - 1) {  // the head: the last layer's MoE combined, added, normalised
    const int L = P.layers - 1;
    for (int s = threadIdx.x; s < kSlots; s += kThreads) sw[s] = __ldcg(P.route_w + L * kSlots + s);
    __syncthreads();
    stage_add_norm(P.h_moe + int64_t(L) * kDim, P.y_s1, sw, kSlots, P.h_attn + int64_t(P.layers) * kDim, b, x, red);
    gemv(P, kHead, 0, b, buf, x, 0, P.logits);
    return;
  }
  const int layer = i / 8, kind = i % 8;
  const Gemv g = gemv_of(P, kind);
  int r0 = 0, r1 = 0;
  if (kind != kAttn) block_rows(g.R, P.nb, b, r0, r1);
  const int g0 = r0 / g.x_group, g1 = r1 > r0 ? (r1 - 1) / g.x_group : g0;
  switch (kind) {
    case kPair: {  // the previous layer's experts combined into the residual, normalised
      if (layer == 0) {
        stage_add_norm(P.h_attn, nullptr, nullptr, 0, P.h_attn, 1, x, red);  // (layer 0's input as is)
      } else {
        for (int s = threadIdx.x; s < kSlots; s += kThreads) sw[s] = __ldcg(P.route_w + (layer - 1) * kSlots + s);
        __syncthreads();
        stage_add_norm(P.h_moe + int64_t(layer - 1) * kDim, P.y_s1, sw, kSlots, P.h_attn + int64_t(layer) * kDim, b, x, red);
      }
      gemv(P, kPair, layer, b, buf, x, 0, P.y_pair);
      return;
    }
    case kPrep: {  // q_nope of the block's heads; block 0 writes the cache row of the new position
      for (int hh = g0; hh <= g1; ++hh)
        for (int d = threadIdx.x; d < kNope; d += kThreads) x[(hh - g0) * kNope + d] = __ldcg(P.y_pair + hh * kQHead + d);
      if (b == 0)
        for (int d = threadIdx.x; d < kKvA; d += kThreads)
          P.cache[(int64_t(layer) * P.ctx + P.ctx - 1) * kKvA + d] = __ldcg(P.y_pair + kHeads * kQHead + d);
      __syncthreads();
      gemv(P, kPrep, layer, b, buf, x, g0, P.y_prep);
      return;
    }
    case kAttn: {  // block (head, split): its positions' partial softmax and latent-weighted sum
      if (b >= kHeads * P.splits) return;
      const int h = b / P.splits, sp = b % P.splits, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
      const int q0 = int(int64_t(P.ctx) * sp / P.splits), q1 = int(int64_t(P.ctx) * (sp + 1) / P.splits);
      for (int d = threadIdx.x; d < kLat; d += kThreads) x[d] = __ldcg(P.y_prep + h * kLat + d);
      __syncthreads();
      float m = -INFINITY, s = 0, acc[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) acc[j] = 0;
      const float scale = rsqrtf(float(kQHead));
      for (int q = q0 + warp; q < q1; q += kWarps) {
        const float* row = P.cache + (int64_t(layer) * P.ctx + q) * kKvA;
        float v[16], dot = 0;
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = __ldcg(row + lane * 16 + j), dot = fmaf(v[j], x[lane * 16 + j], dot);
        const float sc = warp_sum(dot) * scale, nm = fmaxf(m, sc), f = expf(m - nm), e = expf(sc - nm);
        s = s * f + e;
#pragma unroll
        for (int j = 0; j < 16; ++j) acc[j] = acc[j] * f + e * v[j];
        m = nm;
      }
      float* ws = reinterpret_cast<float*>(buf);  // [warp][2 + 512]
      if (lane == 0) ws[warp * (kLat + 2)] = m, ws[warp * (kLat + 2) + 1] = s;
#pragma unroll
      for (int j = 0; j < 16; ++j) ws[warp * (kLat + 2) + 2 + lane * 16 + j] = acc[j];
      __syncthreads();
      float M = -INFINITY;
      for (int w = 0; w < kWarps; ++w) M = fmaxf(M, ws[w * (kLat + 2)]);
      float* out = P.part + (int64_t(h) * P.splits + sp) * (kLat + 2);
      for (int d = threadIdx.x; d < kLat + 2; d += kThreads) {
        float v = d == 0 ? M : 0;
        if (d > 0)
          for (int w = 0; w < kWarps; ++w) {
            const float mw = ws[w * (kLat + 2)];
            if (mw > -INFINITY) v += ws[w * (kLat + 2) + d] * expf(mw - M);
          }
        out[d] = v;
      }
      return;
    }
    case kVabs: {  // the block's heads: the splits combined
      for (int hh = g0; hh <= g1; ++hh) {
        const float* pp = P.part + int64_t(hh) * P.splits * (kLat + 2);
        float M = -INFINITY;
        for (int sp = 0; sp < P.splits; ++sp) M = fmaxf(M, __ldcg(pp + sp * (kLat + 2)));
        float tot = 0;
        for (int sp = 0; sp < P.splits; ++sp) {
          const float ms = __ldcg(pp + sp * (kLat + 2));
          if (ms > -INFINITY) tot += __ldcg(pp + sp * (kLat + 2) + 1) * expf(ms - M);
        }
        for (int d = threadIdx.x; d < kLat; d += kThreads) {
          float v = 0;
          for (int sp = 0; sp < P.splits; ++sp) {
            const float ms = __ldcg(pp + sp * (kLat + 2));
            if (ms > -INFINITY) v += __ldcg(pp + sp * (kLat + 2) + 2 + d) * expf(ms - M);
          }
          x[(hh - g0) * kLat + d] = v / tot;
        }
      }
      __syncthreads();
      gemv(P, kVabs, layer, b, buf, x, g0, P.y_vabs);
      return;
    }
    case kWo:
      for (int d = threadIdx.x; d < kDim; d += kThreads) x[d] = __ldcg(P.y_vabs + d);
      __syncthreads();
      gemv(P, kWo, layer, b, buf, x, 0, P.y_wo);
      return;
    case kGate: {  // h + attention output, normalised; block 0 writes h and the experts' input
      const float one = 1.f;
      stage_add_norm(P.h_attn + int64_t(layer) * kDim, P.y_wo, &one, 1, P.h_moe + int64_t(layer) * kDim, b, x, red);
      if (b == 0)
        for (int d = threadIdx.x; d < kDim; d += kThreads) P.xm[d] = x[d];
      gemv(P, kGate, layer, b, buf, x, 0, P.y_gate);
      return;
    }
    case kS0:
      route(P, layer, b, sel, sw);
      for (int d = threadIdx.x; d < kDim; d += kThreads) x[d] = __ldcg(P.xm + d);
      __syncthreads();
      gemv(P, kS0, layer, b, buf, x, 0, P.y_s0, sel);
      return;
    case kS1:  // silu(w1 x) * w3 x of the block's slots
      for (int s = g0; s <= g1; ++s)
        for (int d = threadIdx.x; d < kInter; d += kThreads) {
          const float a = __ldcg(P.y_s0 + s * 2 * kInter + d), c = __ldcg(P.y_s0 + s * 2 * kInter + kInter + d);
          x[(s - g0) * kInter + d] = a / (1.f + expf(-a)) * c;
        }
      __syncthreads();
      gemv(P, kS1, layer, b, buf, x, g0, P.y_s1);
      return;
  }
}

struct alignas(16) Smem {
  float x[kXCap];
  float red[kWarps];
  int sel[kTopK];
  float sw[kSlots];
};
__host__ __device__ constexpr size_t smem_bytes(int preload, int bufs) {
  return sizeof(Smem) + size_t(bufs) * size_t(preload);
}

// The chain: one kernel per phase, its slice copied ahead of the wait.
__global__ void __launch_bounds__(kThreads, 2) phase_kernel(Params P, int i) {
  extern __shared__ __align__(16) uint8_t smem[];
  Smem& S = *reinterpret_cast<Smem*>(smem);
  uint8_t* buf = smem + sizeof(Smem);
  const int kind = phase_kind(i, P.nphase);
  // Stage 0's routed rows depend on the routing, so only the shared slots' rows come ahead; the
  // rows' pointers for shared slots do not read the routing.
  preload(P, kind, i / 8, blockIdx.x, buf);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
  if (blockIdx.x == 0 && threadIdx.x == 0) P.rec[i] = global_ns();
  cp_wait<0>();
  __syncthreads();
  run_phase(P, i, blockIdx.x, buf, S.x, S.red, S.sel, S.sw);
}
__global__ void end_kernel(Params P) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0) P.rec[P.nphase] = global_ns();
}

// Flow: after the pair, the q absorption, the attention and stage 0, a block does not wait for
// the whole grid but only for the blocks that wrote the rows it reads: per head (the pair's
// q rows of it, the absorption's latent rows, the attention's splits) or per slot (stage 0's
// rows), plus the pair's kv rows (absorption block 0 writes the cache row from them), that
// cache row (every attention block reads it) and stage 0's routing (published by its block 0).
// A producer block adds one to each group its rows touch; a consumer waits for the number of
// blocks whose rows meet the group (every block has rows in these phases: R >= blocks).
__device__ __forceinline__ bool flow_local(int kind) { return kind == kPair || kind == kPrep || kind == kAttn || kind == kS0; }
__device__ __forceinline__ int pair_group(int r) { return r < kHeads * kQHead ? r / kQHead : kHeads; }
__device__ __forceinline__ int block_of(int r, int R, int nb) { return int((int64_t(r + 1) * nb + R - 1) / R) - 1; }
__device__ int blocks_meeting(int a, int c, int R, int nb) { return block_of(c - 1, R, nb) - block_of(a, R, nb) + 1; }
// One more at *f (releasing this block's writes); waiting until *f reaches n (acquiring theirs).
// 0.2 s without progress sets the error flag and lets every block go.
__device__ void count_add(unsigned* f) { asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(f) : "memory"); }
__device__ void wait_count(const Params& P, const unsigned* f, unsigned n) {
  unsigned now;
  const unsigned long long t0 = global_ns();
  for (;;) {
    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(f) : "memory");
    if (now >= n) return;
    if (*reinterpret_cast<volatile int*>(P.err) || global_ns() - t0 > 200000000ull) {
      atomicExch(P.err, 1);
      return;
    }
  }
}
// The grid barrier: each block adds one to the counter and waits until it reaches nb * n for
// its n-th barrier.
__device__ void grid_barrier(const Params& P, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    count_add(P.counter);
    wait_count(P, P.counter, target);
  }
  __syncthreads();
}

// Block b has finished phase i (of a kind with local consumers): count it in its groups.
__device__ void flow_signal(const Params& P, int i, int kind, int b) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  unsigned* f = P.flags + int64_t(i) * kGroups;
  const Gemv g = gemv_of(P, kind);
  int r0, r1;
  block_rows(g.R, P.nb, b, r0, r1);
  if (kind == kAttn) {
    if (b < kHeads * P.splits) count_add(f + b / P.splits);
    return;
  }
  if (r1 > r0) {
    const int g0 = kind == kPair ? pair_group(r0) : r0 / g.rows_per_group;
    const int g1 = kind == kPair ? pair_group(r1 - 1) : (r1 - 1) / g.rows_per_group;
    for (int k = g0; k <= g1; ++k) count_add(f + k);
  }
  if (b == 0 && kind == kPrep) count_add(f + kHeads);  // the cache row
  if (b == 0 && kind == kS0) count_add(f + kSlots);     // the routing
}
// Before phase i (whose predecessor, phase i - 1 of kind pk, had local consumers): wait for
// the rows block b reads.
__device__ void flow_wait_for(const Params& P, int i, int pk, int b) {
  if (threadIdx.x == 0) {
    const unsigned* f = P.flags + int64_t(i - 1) * kGroups;
    const int kind = phase_kind(i, P.nphase);
    const Gemv pg = gemv_of(P, pk), g = gemv_of(P, kind);
    int r0 = 0, r1 = 0;
    if (kind != kAttn) block_rows(g.R, P.nb, b, r0, r1);
    if (pk == kPair) {  // the q absorption: the q rows of its heads; block 0 the kv rows
      for (int h = r0 / g.rows_per_group; r1 > r0 && h <= (r1 - 1) / g.rows_per_group; ++h)
        wait_count(P, f + h, blocks_meeting(h * kQHead, (h + 1) * kQHead, pg.R, P.nb));  // (whole group: all count)
      if (b == 0) wait_count(P, f + kHeads, blocks_meeting(kHeads * kQHead, pg.R, pg.R, P.nb));
    } else if (pk == kPrep) {  // the attention: its head's latent rows and the cache row
      if (b < kHeads * P.splits) {
        const int h = b / P.splits;
        wait_count(P, f + h, blocks_meeting(h * kLat, (h + 1) * kLat, pg.R, P.nb));
        wait_count(P, f + kHeads, 1);
      }
    } else if (pk == kAttn) {  // the value absorption: its heads' splits
      for (int h = r0 / g.rows_per_group; r1 > r0 && h <= (r1 - 1) / g.rows_per_group; ++h)
        wait_count(P, f + h, unsigned(P.splits));
    } else if (pk == kS0) {  // stage 1: its slots' rows of stage 0 and the routing
      for (int s = r0 / g.rows_per_group; r1 > r0 && s <= (r1 - 1) / g.rows_per_group; ++s)
        wait_count(P, f + s, blocks_meeting(s * 2 * kInter, (s + 1) * 2 * kInter, pg.R, P.nb));
      wait_count(P, f + kSlots, 1);
    }
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 1) persist_kernel(Params P) {
  extern __shared__ __align__(16) uint8_t smem[];
  Smem& S = *reinterpret_cast<Smem*>(smem);
  uint8_t* bufs[2] = {smem + sizeof(Smem), smem + sizeof(Smem) + P.preload};
  const int b = blockIdx.x;
  preload(P, phase_kind(0, P.nphase), 0, b, bufs[0]);
  unsigned barriers = 0;
  for (int i = 0; i < P.nphase; ++i) {
    if (P.flow && i > 0 && flow_local(phase_kind(i - 1, P.nphase))) flow_wait_for(P, i, phase_kind(i - 1, P.nphase), b);
    // The next phase's slice, while this one runs (its rows' pointers for shared slots and the
    // dense weights do not depend on this phase).
    if (b == 0 && threadIdx.x == 0) P.rec[i] = global_ns();
    if (i + 1 < P.nphase) preload(P, phase_kind(i + 1, P.nphase), (i + 1) / 8, b, bufs[(i + 1) & 1]);
    else cp_commit();
    cp_wait<1>();
    __syncthreads();
    run_phase(P, i, b, bufs[i & 1], S.x, S.red, S.sel, S.sw);
    if (P.flow && flow_local(phase_kind(i, P.nphase))) flow_signal(P, i, phase_kind(i, P.nphase), b);
    else grid_barrier(P, unsigned(P.nb) * ++barriers);
  }
  if (b == 0 && threadIdx.x == 0) P.rec[P.nphase] = global_ns();
}

__global__ void fill_kernel(uint8_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed ^ uint32_t(i >> 32) * 40503u;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    // bit 6 clear: e4m3 with its exponent field below 8 (|v| < 2, never NaN); in a bf16's high
    // byte the exponent's top bit (|v| < 2)
    p[i] = uint8_t(h & 0xbf);
  }
}
__global__ void fill_float(float* p, int64_t n, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    p[i] = float(h & 0xffff) / 32768.f - 1.f;
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string dtype = "fp8", modes = "chain,persist,flow";
  int layers = 26, ctx = 64, reps = 20, preload_kb = 64, bps = 1, sync_only = 0, rows = 2;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--dtype") dtype = next();
    else if (a == "--layers") layers = std::atoi(next());
    else if (a == "--ctx") ctx = std::atoi(next());
    else if (a == "--reps") reps = std::atoi(next());
    else if (a == "--preload-kb") preload_kb = std::atoi(next());
    else if (a == "--bps") bps = std::atoi(next());
    else if (a == "--modes") modes = next();
    else if (a == "--rows") rows = std::atoi(next());
    else if (a == "--sync-only") sync_only = 1;
    else {
      std::fprintf(stderr,
                   "usage: dsv3_cuda_step_skeleton_bench [--dtype fp8|bf16] [--layers N] [--ctx N] [--reps N] "
                   "[--preload-kb N] [--bps N] [--rows 2|4] [--modes chain,persist,flow] [--sync-only]\n");
      return 2;
    }
  }
  if ((dtype != "fp8" && dtype != "bf16") || layers < 1 || layers > 64 || ctx < 2 || reps < 1 || preload_kb < 17 ||
      preload_kb > 88 || bps < 1 || bps > 2 || (rows != 2 && rows != 4)) {
    std::fprintf(stderr, "--dtype fp8|bf16, --layers 1-64, --ctx >= 2, --reps >= 1, --preload-kb 17-88, --bps 1-2, --rows 2|4\n");
    return 2;
  }
  int dev = 0, sms = 0, coop = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));

  Params P{};
  P.eb = dtype == "fp8" ? 1 : 2;
  P.layers = layers, P.ctx = ctx, P.nb = sms * bps, P.preload = preload_kb * 1024, P.sync_only = sync_only, P.rows = rows;
  P.splits = std::max(1, std::min(16, P.nb / kHeads));
  P.nphase = layers * 8 + 1;
  // From 16 blocks on, a block's rows span at most two heads or slots, so its staged activations fit
  // kXCap (the widest: two slots of stage 1, 2816 floats), and every head has an attention split.
  if (P.nb < 16) {
    std::fprintf(stderr, "needs at least 16 blocks (%d SMs x %d)\n", sms, bps);
    return 2;
  }
  const int64_t pair = int64_t(kHeads * kQHead + kKvA) * kDim * P.eb, prep = int64_t(kHeads) * kLat * kNope * P.eb,
                vabs = int64_t(kHeads) * kV * kLat * P.eb, wo = int64_t(kDim) * kHeads * kV * P.eb,
                gate = int64_t(kGateRows) * kDim * 2;
  P.layer_bytes = (pair + prep + vabs + wo + gate + 255) / 256 * 256;
  const int64_t w13_bytes = int64_t(layers) * (kShared + kNE) * 2 * kInter * kDim * P.eb;
  const int64_t w2_bytes = int64_t(layers) * (kShared + kNE) * kDim * kInter * P.eb;
  const int64_t head_bytes = int64_t(kVocab) * kDim * 2;
  const int64_t expert_bytes = int64_t(kSlots) * (2 * int64_t(kInter) * kDim + int64_t(kDim) * kInter) * P.eb;
  const int64_t read_bytes = int64_t(layers) * (pair + prep + vabs + wo + gate + expert_bytes) + head_bytes +
                             int64_t(layers) * ctx * kKvA * 4;

  uint8_t *wl, *w13, *w2, *head;
  CK(cudaMalloc(&wl, size_t(P.layer_bytes * layers)));
  CK(cudaMalloc(&w13, size_t(w13_bytes)));
  CK(cudaMalloc(&w2, size_t(w2_bytes)));
  CK(cudaMalloc(&head, size_t(head_bytes)));
  fill_kernel<<<1024, 256>>>(wl, P.layer_bytes * layers, 1);
  fill_kernel<<<1024, 256>>>(w13, w13_bytes, 2);
  fill_kernel<<<1024, 256>>>(w2, w2_bytes, 3);
  fill_kernel<<<1024, 256>>>(head, head_bytes, 4);
  P.wl = wl, P.w13 = w13, P.w2 = w2, P.head = head;
  auto fa = [](int64_t n) {
    float* p;
    CK(cudaMalloc(&p, size_t(n) * 4));
    CK(cudaMemset(p, 0, size_t(n) * 4));
    return p;
  };
  P.cache = fa(int64_t(layers) * ctx * kKvA);
  fill_float<<<256, 256>>>(P.cache, int64_t(layers) * ctx * kKvA, 5);
  P.h_attn = fa(int64_t(layers + 1) * kDim);
  fill_float<<<8, 256>>>(P.h_attn, kDim, 6);
  P.h_moe = fa(int64_t(layers) * kDim);
  P.xm = fa(kDim), P.y_pair = fa(kHeads * kQHead + kKvA), P.y_prep = fa(kHeads * kLat);
  P.part = fa(int64_t(kHeads) * P.splits * (kLat + 2));
  P.y_vabs = fa(kDim), P.y_wo = fa(kDim), P.y_gate = fa(kGateRows), P.y_s0 = fa(kSlots * 2 * kInter);
  P.y_s1 = fa(kSlots * kDim), P.logits = fa(kVocab), P.route_w = fa(int64_t(layers) * kSlots);
  CK(cudaMalloc(&P.route, sizeof(int) * layers * kTopK));
  CK(cudaMemset(P.route, 0, sizeof(int) * layers * kTopK));
  CK(cudaMalloc(&P.counter, sizeof(unsigned)));
  CK(cudaMalloc(&P.flags, sizeof(unsigned) * P.nphase * kGroups));
  CK(cudaMalloc(&P.err, sizeof(int)));
  CK(cudaMemset(P.err, 0, sizeof(int)));
  CK(cudaMalloc(&P.rec, sizeof(unsigned long long) * (P.nphase + 1)));
  float* h0;  // the input residual, restored before every step (the cache row is rewritten the same way)
  CK(cudaMalloc(&h0, kDim * 4));
  CK(cudaMemcpy(h0, P.h_attn, kDim * 4, cudaMemcpyDeviceToDevice));
  CK(cudaDeviceSynchronize());

  // copy bandwidth: the floor
  void *c0, *c1;
  const size_t cb = size_t(1) << 30;
  CK(cudaMalloc(&c0, cb));
  CK(cudaMalloc(&c1, cb));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const double copy_us =
      1e3 * median(time_samples_ms([&] { CK(cudaMemcpyAsync(c1, c0, cb, cudaMemcpyDeviceToDevice, st)); }, 10, st));
  const double bw = 2.0 * double(cb) / (copy_us * 1e-6);  // bytes/s, read + write
  CK(cudaFree(c0));
  CK(cudaFree(c1));
  const double floor_us = double(read_bytes) / bw * 1e6;
  std::printf("%s, %d SMs; %s weights, %d MoE layers + head, ctx %d, %d blocks (%d per SM), %d attention splits, "
              "preload %d KB, %d rows in flight%s\n",
              prop.name, sms, dtype.c_str(), layers, ctx, P.nb, bps, P.splits, preload_kb, rows,
              sync_only ? ", SYNC ONLY (no GEMV rows)" : "");
  std::printf("bytes read per step %.3f GB; copy bandwidth %.0f GB/s; floor %.1f us (%.0f tok/s)\n", read_bytes / 1e9,
              bw / 1e9, floor_us, 1e6 / floor_us);

  const size_t sm_chain = smem_bytes(P.preload, 1), sm_persist = smem_bytes(P.preload, 2);
  CK(cudaFuncSetAttribute(phase_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sm_chain)));
  CK(cudaFuncSetAttribute(persist_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sm_persist)));
  auto reset = [&] {  // the step's input residual and the barrier's counters (outside the timed region)
    CK(cudaMemcpyAsync(P.h_attn, h0, kDim * 4, cudaMemcpyDeviceToDevice, st));
    CK(cudaMemsetAsync(P.counter, 0, sizeof(unsigned), st));
    CK(cudaMemsetAsync(P.flags, 0, sizeof(unsigned) * P.nphase * kGroups, st));
  };
  // Everything a step writes, made NaN (the routing: each pick moved to another candidate), so
  // that the check step after the timed ones sees any read of a value before it was written.
  auto poison = [&] {
    auto nan = [&](float* p, int64_t n) { CK(cudaMemsetAsync(p, 0xff, size_t(n) * 4, st)); };
    nan(P.h_attn + kDim, int64_t(layers) * kDim), nan(P.h_moe, int64_t(layers) * kDim), nan(P.xm, kDim);
    nan(P.y_pair, kHeads * kQHead + kKvA), nan(P.y_prep, kHeads * kLat), nan(P.part, int64_t(kHeads) * P.splits * (kLat + 2));
    nan(P.y_vabs, kDim), nan(P.y_wo, kDim), nan(P.y_gate, kGateRows), nan(P.y_s0, kSlots * 2 * kInter);
    nan(P.y_s1, kSlots * kDim), nan(P.route_w, int64_t(layers) * kSlots), nan(P.logits, kVocab);
    for (int l = 0; l < layers; ++l) nan(P.cache + (int64_t(l) * ctx + ctx - 1) * kKvA, kKvA);
    std::vector<int> wrong(size_t(layers) * kTopK);  // the last step's picks, each moved to another candidate
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(wrong.data(), P.route, wrong.size() * sizeof(int), cudaMemcpyDeviceToHost));
    for (int& v : wrong) v = (v + 1) % kNE;
    CK(cudaMemcpy(P.route, wrong.data(), wrong.size() * sizeof(int), cudaMemcpyHostToDevice));
  };
  std::vector<float> out_first;
  std::vector<float> h_first;
  double worst = 0;  // the largest difference from the first mode's outputs, relative to their largest magnitude
  std::string failed;  // modes whose outputs are not finite or differ
  for (size_t pos = 0; pos <= modes.size();) {
    size_t e = modes.find(',', pos);
    if (e == std::string::npos) e = modes.size();
    const std::string mode = modes.substr(pos, e - pos);
    pos = e + 1;
    cudaGraphExec_t ge = nullptr;
    void* args[] = {&P};
    if (mode == "chain") {
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      cudaLaunchAttribute at[1] = {};
      at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      at[0].val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t cfg{};
      cfg.blockDim = dim3(kThreads), cfg.stream = st, cfg.attrs = at;
      for (int i = 0; i < P.nphase; ++i) {
        cfg.gridDim = dim3(unsigned(P.nb)), cfg.dynamicSmemBytes = sm_chain, cfg.numAttrs = i > 0;
        CK(cudaLaunchKernelEx(&cfg, phase_kernel, P, i));
      }
      cfg.gridDim = dim3(1), cfg.dynamicSmemBytes = 0, cfg.numAttrs = 1;
      CK(cudaLaunchKernelEx(&cfg, end_kernel, P));
      CK(cudaStreamEndCapture(st, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      CK(cudaGraphDestroy(g));
    } else if (mode == "persist" || mode == "flow") {
      P.flow = mode == "flow";
      int per_sm = 0;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persist_kernel, kThreads, sm_persist));
      if (!coop || per_sm * sms < P.nb) {
        std::printf("\n%s: cannot run %d co-resident blocks (cooperative launch %d, %d per SM fit): skipped\n",
                    mode.c_str(), P.nb, coop, per_sm);
        continue;
      }
    } else {
      std::fprintf(stderr, "unknown mode %s (chain, persist, flow)\n", mode.c_str());
      return 2;
    }
    auto launch = [&] {
      if (ge) CK(cudaGraphLaunch(ge, st));
      else
        CK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(persist_kernel), dim3(unsigned(P.nb)), dim3(kThreads),
                                       args, sm_persist, st));
    };
    // Each step: reset, then the launch between two events; also the step inside the kernels
    // (block 0's timer from the first phase's wait end to the end), free of the launch's cost.
    std::vector<double> tk;
    std::vector<unsigned long long> rec(size_t(P.nphase + 1));
    std::vector<double> t = time_samples_ms(launch, reps, st, 3, reset, [&] {
      CK(cudaMemcpy(rec.data(), P.rec, rec.size() * 8, cudaMemcpyDeviceToHost));
      tk.push_back(double(rec.back() - rec.front()) / 1e3);
    });
    for (double& v : t) v *= 1e3;
    // The last timed step's outputs (an early read there still saw the step before's equal values),
    // then a step after poisoning whatever a step writes: its outputs must be the same.
    auto outputs = [&](std::vector<float>& lg, std::vector<float>& hh) {
      lg.resize(kVocab), hh.resize(size_t(kDim) * (layers + 1));
      CK(cudaMemcpy(lg.data(), P.logits, kVocab * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hh.data(), P.h_attn, hh.size() * 4, cudaMemcpyDeviceToHost));
    };
    std::vector<float> timed_logits, timed_h;
    outputs(timed_logits, timed_h);
    if (!sync_only) poison();  // (without the GEMVs the outputs mean nothing: not compared)
    reset();
    launch();
    if (ge) CK(cudaGraphExecDestroy(ge));
    CK(cudaStreamSynchronize(st));
    int err = 0;
    CK(cudaMemcpy(&err, P.err, sizeof err, cudaMemcpyDeviceToHost));
    if (err) {
      std::printf("%s: the grid barrier timed out; its numbers are meaningless\n", mode.c_str());
      return 1;
    }
    std::vector<float> logits, h;
    outputs(logits, h);
    bool finite = true;
    for (float v : logits) finite = finite && std::isfinite(v);
    for (float v : h) finite = finite && std::isfinite(v);
    auto rel = [](const std::vector<float>& a, const std::vector<float>& b) {  // NaN anywhere: 1
      double d = 0, m = 0;
      for (size_t k = 0; k < a.size(); ++k) {
        const double e = std::fabs(double(a[k]) - double(b[k]));
        if (!std::isfinite(e)) return 1.0;
        d = std::max(d, e), m = std::max(m, std::fabs(double(a[k])));
      }
      return d / std::max(m, 1e-30);
    };
    double self = 0, cross = 0;  // against this mode's timed step, against the first mode's
    if (!sync_only) {
      self = std::max(rel(timed_logits, logits), rel(timed_h, h));
      if (out_first.empty()) out_first = logits, h_first = h;
      else cross = std::max(rel(out_first, logits), rel(h_first, h));
      if (!finite || self > 1e-6 || cross > 1e-4) failed += (failed.empty() ? "" : ", ") + mode;
      worst = std::max(worst, cross);
    }
    const double step = t[t.size() / 2], kstep = median(tk);
    std::printf("\n%-8s step %8.1f us (min %.1f, max %.1f over %d), %6.1f tok/s", mode.c_str(), step, t.front(),
                t.back(), reps, 1e6 / step);
    if (!sync_only) std::printf(", %5.1f%% of the floor", 100.0 * floor_us / step);
    std::printf("; inside the kernels %.1f us (%.1f tok/s)\n", kstep, 1e6 / kstep);
    if (!sync_only)
      std::printf("  outputs %s; after poisoning, %.2e from the timed step's (relative), %.2e from the first mode's\n",
                  finite ? "finite" : "NOT FINITE", self, cross);
    std::printf("  %-36s %9s %9s\n", "phase (median over layers)", "us", "us/step");
    double total = 0;
    for (int k = 0; k < kKinds; ++k) {
      std::vector<double> d;
      for (int i = 0; i < P.nphase; ++i) {
        const int kind = phase_kind(i, P.nphase);
        if (kind == k) d.push_back(double(rec[size_t(i) + 1] - rec[size_t(i)]) / 1e3);
      }
      double sum = 0;
      for (double v : d) sum += v;
      total += sum;
      std::printf("  %-36s %9.2f %9.1f\n", kKindName[k], median(d), sum);
    }
    std::printf("  %-36s %9s %9.1f (first wait to the end, last recorded step)\n", "sum", "", total);
  }
  if (sync_only) return 0;
  // A mode's step after the poisoning must give its timed step's outputs (the same kernels, the
  // same order: equal bits; an early read shows as NaN or another routing), and the modes agree
  // to rounding (the compiler may contract differently inside the two kernels).
  std::printf("\nmodes' outputs (logits, residuals) differ by at most %.2e relative; %s\n", worst,
              failed.empty() ? "every check passed" : ("CHECK FAILED (a race or a bug): " + failed).c_str());
  return failed.empty() ? 0 : 1;
}
