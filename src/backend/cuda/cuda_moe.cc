// The CUDA backend's DeepSeekMoE: the gate's logits in float32, the router on the device
// (moe_route.cuh), the routed experts and the shared-expert slices grouped by expert (GEMVs of
// few tokens, the grouped tensor-core GEMM of many), and the weighted combine — at the end of
// the op, or in the next node (a deferred combine: kCombineAddRmsNorm and its pair form).
#include <algorithm>
#include <cstdio>
#include <string>

#include "backend/cuda/backend_impl.h"
#include "core/error.h"

namespace dsv3::cuda_impl {

namespace {

cuda::RouteArgs route_args(const ModelArgs& a) {
  cuda::RouteArgs r;
  r.E = a.n_routed_experts, r.K = a.n_activated_experts, r.G = a.n_expert_groups, r.topk_groups = a.n_limited_groups;
  r.sigmoid = a.score_func != "softmax", r.norm = a.norm_topk_prob, r.route_scale = a.route_scale;
  return r;
}

}  // namespace

// Slices of moe_inter_dim rows balance the work with the routed experts; FP8 slices must start on
// a 128-row scale block for the tensor-core kernel, else one slice.
int shared_slices(const ModelArgs& a, const MoEWeights& w) {
  if (!w.has_shared) return 0;
  const int64_t rows = w.shared_experts.w1.out(), mi = a.moe_inter_dim, ns = rows / std::max<int64_t>(mi, 1);
  const bool fp8 = w.shared_experts.w1.weight.dtype == DType::F8_E4M3;
  const bool split = ns > 1 && ns * mi == rows && (!fp8 || mi % 128 == 0);
  return split ? int(ns) : 1;
}

bool CudaBackend::fused_gate(const DevLinear& gate, int64_t n) const {
  return n <= std::min(opt_.tune.gemv_max, 8) && gate.t != cuda::kFP8 && !(use_tc(n) && tc_takes(gate));
}

void CudaBackend::moe_op(const ModelArgs& a, const MoEWeights& w, const float* x, int64_t n, float* y,
                         const cuda::GateNorm* norm, bool defer) {
  const DevLinear gate = dev_linear(Linear{w.gate, {}});
  const bool gate_kernel = fused_gate(gate, n);
  DSV3_CHECK(!norm || (gate_kernel && n == 1), "the add + norm of a MoE's input in a gate that cannot take it");
  mark("moe.gate");
  const MoeTable& T = moe_table(a, w);
  const int E = a.n_routed_experts, K = a.n_activated_experts;
  // Gate logits [n, E] in float32, then the device router.
  float* logits = f32(kLogits, size_t(n * E));
  cuda::MoeSched s = sched(n, E, K, T.S);
  if (T.partial) s.local0 = T.local0, s.local1 = T.local1;
  // Rows too long for the tensor-core GEMV (tune.long_k): stage 0 (K = dim) in chunks (path 2) or
  // both stages on the pipelined GEMM (path 1, and path 2 where stage 1's K, the inter dim, is long).
  const int long_d = long_k(n, T.wtype, a.dim), long_i = long_k(n, T.wtype, T.rows13);
  // More tokens of e4m3 experts whose routed pairs average at most tune.moe_tiles per expert: the
  // tensor-core GEMV over the router's tiles of 8 pairs (an expert's weights streamed once per
  // tile) instead of the grouped GEMM, which widens e4m3 tiles in shared memory and is bound by
  // that pipeline at so few rows per expert. (bf16 experts: the grouped GEMM is the faster one.) In
  // FP8 GEMM mode the grouped stages (the persistent kernel) read the e4m3 tiles as they are and
  // overtake the tiles by 6 pairs per expert (16B shape, H100: 11.0 against 12.0 ms a step at 64 tokens).
  const int tiles_max = fp8_moe(T, n, a.dim) ? std::min(opt_.tune.moe_tiles, opt_.tune.moe_tiles_fp8gemm)
                                             : opt_.tune.moe_tiles;
  const bool tiles = n > 8 && use_tc(n) && T.tcv && T.wtype == cuda::kFP8 && n * K <= int64_t(tiles_max) * E &&
                     cuda::tcv_moe_tiles(L_, T.wtype, a.dim, T.rows13);
  const bool tc = !tiles && T.tc && (use_tc(n) || long_d == 1 || long_i != 0);
  const bool swap = tc && moe_swap(T, n);
  // FP8 GEMM mode: x quantised for stage 0, whose SwiGLU output (float32) is quantised for stage 1.
  const bool f8 = tc && fp8_moe(T, n, a.dim);
  // (Swapped operands in FP8 GEMM mode, or over bf16 experts in fast mode: the persistent kernel,
  // tc_gemm's form its twin; its tokens quantised or split in pair order, so that TMA loads them)
  const bool bf_fast = T.wtype == cuda::kBF16 && fast_at(n) && n * K >= int64_t(opt_.tune.moe_persist_bf16_min) * E;
  const bool persist = tc && (f8 || bf_fast) && swap && opt_.tune.moe_persist && T.tmaps;
  if (tc) s.tile_rows = swap ? 128 : tile_m(T.wtype);
  if (tiles) s.tile_rows = 8;
  const cuda::RouteArgs r = route_args(a);
  const float* bias = w.bias.empty() ? nullptr : w.bias.as<float>();
  const int64_t P = s.P(), D = a.dim;
  const bool gemvs = tiles || (!tc && (n <= opt_.tune.gemv_max || !T.gemm));
  // Another rank's experts keep their pair rows, which no kernel writes: zero, they add nothing to
  // the combine (as the CPU backend skips them; the all-reduce after the MoE sums the ranks).
  if (T.partial) CK(cudaMemsetAsync(f32(kMoeO, size_t(P * D)), 0, size_t(P * D) * 4, stream_));
  cuda::TcJob xs;  // x's split when the gate made it
  if (gate_kernel) {
    // One token on the expert GEMVs: their blocks route it from the logits (no last-block router).
    // (Not with another rank's experts: the router's schedule leaves those out of the active list.)
    const bool rie = opt_.tune.route_in_experts && gemvs && n == 1 && E <= 256 && !T.partial;
    cuda::gate_route(L_, gate, r, s, {x, n, logits, bias, counter_, !rie, norm});
    if (rie) s.route_logits = logits, s.route_bias = bias, s.route = r;
  } else if (persist && opt_.tune.gate_fma && cuda::gate_logits_ok(gate) && gate.cols == D) {
    // The experts take x in pair order (quantised or split there): the gate's own float32 FMAs,
    // not a split of x for it alone and a split-K product.
    cuda::gate_logits(L_, gate, x, n, logits);
    mark("moe.route");
    cuda::moe_route(L_, r, logits, bias, s, nullptr, nullptr);
  } else if (tc && tc_takes(gate) && gate.cols == D) {
    // x split once (hi + lo) for the gate (exact) and the experts' first stage (hi only when fast).
    xs = split_input(x, n, D, /*fast=*/false);
    tc_linear(xs, gate, n, logits, E);
    mark("moe.route");
    cuda::moe_route(L_, r, logits, bias, s, nullptr, nullptr);
  } else {
    run_linear(gate, x, n, logits, E, /*fp8=*/false);  // routing: float32-grade
    mark("moe.route");
    cuda::moe_route(L_, r, logits, bias, s, nullptr, nullptr);
  }
  mark("moe.experts");
  float* o = f32(kMoeO, size_t(P * D));
  if (tc) {
    cuda::TcJob j0 = persist && f8 ? quant_input(x, P, D, false, s.perm)
                     : persist     ? split_input(x, P, D, /*fast=*/true, s.perm)
                     : f8          ? quant_input(x, n, D)
                     : xs.a_hi     ? xs
                                   : split_input(x, n, D, fast_at(n));
    if (persist) j0.M = P;
    if (fast_at(n)) j0.a_lo = nullptr;
    set_form(j0, T.k64, T.wtype);  // tile rows as the schedule's (by the weight type)
    if (swap) j0.tm = 128, j0.swap = true;  // (moe_swap: the wgmma form)
    j0.grouped = true, j0.experts = T.dev, j0.a_idx = persist ? nullptr : s.perm, j0.tmaps = T.tmaps;
    j0.cnt = s.cnt, j0.off = s.off, j0.tile_e = s.tile_e, j0.tile_m0 = s.tile_m0, j0.n_tiles = s.n_tiles;
    cuda::TcJob j1 = j0;
    // (FP8 GEMM mode on the persistent kernel: stage 0 quantises its output for stage 1 itself)
    const bool fused_q = f8 && persist && opt_.tune.moe_quant_fused;
    j0.stage = 0, j0.swiglu = true, j0.o_f32 = f8 && !fused_q;
    j0.o_hi = fused_q ? nullptr : scratch(kHi2, size_t(P * T.rows13) * (f8 ? 4 : 2));
    j0.o_lo = fast_at(n) || f8 ? nullptr : scratch(kLo2, size_t(P * T.rows13) * 2);
    j0.ldo = T.rows13;
    if (fused_q) {
      j0.o_q = static_cast<uint8_t*>(scratch(kQ2, size_t(P * T.rows13)));
      j0.o_qs = f32(kQs2, size_t(P * T.rows13 / 128));
      j0.ue8m0 = ue8m0_;
    }
    auto gemm = [&](const cuda::TcJob& j, int64_t rows) {
      if (persist) cuda::moe_persist_gemm(L_, j, s.max_tiles(), rows), ++persist_stages_;
      else cuda::tc_gemm(L_, j, s.max_tiles(), rows);
    };
    gemm(j0, T.rows13);
    if (fused_q) {
      j1.a_hi = j0.o_q, j1.a_s = j0.o_qs, j1.ldas = T.rows13 / 128;
    } else if (f8) {
      const cuda::TcJob q = quant_input(static_cast<const float*>(j0.o_hi), P, T.rows13, /*second=*/true);
      j1.a_hi = q.a_hi, j1.a_s = q.a_s, j1.ldas = q.ldas;
    } else {
      j1.a_hi = j0.o_hi, j1.a_lo = j0.o_lo;
    }
    j1.stage = 1, j1.a_idx = nullptr, j1.lda = T.rows13;
    j1.c = o, j1.ldc = D;
    gemm(j1, T.rows2);
  } else if (gemvs) {
    // GEMVs: on tensor cores where they take the experts (tcv_moe), else the FMA kernels.
    float* h = f32(kMoeH, size_t(P * T.rows13));
    cuda::MoeStage s0{0, T.dev, T.rows13, T.wtype, x, D, h, T.rows13};
    if (long_d == 2 || tiles)
      s0.parts = f32(kChunks, size_t(cuda::moe_chunk_floats(T.wtype, D, tiles ? 8 : n, P, T.rows13)));
    const cuda::MoeStage s1{1, T.dev, T.rows2, T.wtype, h, T.rows13, o, D};
    if (tiles) {
      const bool ran = cuda::tcv_moe(L_, s0, s) && cuda::tcv_moe(L_, s1, s);
      DSV3_CHECK(ran, "the tensor-core GEMV refused the MoE tiles tcv_moe_tiles admitted");
    } else {
      if (!(T.tcv && cuda::tcv_moe(L_, s0, s))) cuda::moe_gemv(L_, s0, s);
      if (!(T.tcv && cuda::tcv_moe(L_, s1, s))) cuda::moe_gemv(L_, s1, s);
    }
  } else {
    float* h = f32(kMoeH, size_t(P * 2 * T.rows13));
    cuda::moe_gemm(L_, {0, T.dev, T.rows13, T.wtype, x, D, h, 2 * T.rows13}, s, T.rows13, fast_at(n));
    cuda::moe_gemm(L_, {1, T.dev, T.rows2, T.wtype, h, 2 * T.rows13, o, D}, s, T.rows13, fast_at(n));
  }
  if (defer) return;  // the next node combines (combine_view)
  mark("moe.combine");
  cuda::moe_combine(L_, s, o, D, y);
}

// The deferred combine of `moe` (the op before `add`): the same schedule and expert outputs
// the MoE node left in scratch, y its output, then add's h += y and norm's x = rmsnorm(h).
cuda::CombineNorm CudaBackend::combine_view(const StepGraph& g, const Op& moe, const Op& add, const Op& norm) {
  DSV3_CHECK(moe.kind == OpKind::kMoe && add.kind == OpKind::kAdd && add.in == moe.out && norm.in == add.out,
             "a deferred MoE combine outside moe; add; rmsnorm");
  const ModelArgs& a = *g.args;
  const Value &y = g.val(moe.out), &h = g.val(add.out), &x = g.val(norm.out);
  const MoeTable& T = moe_table(a, *moe.moe);
  cuda::CombineNorm cn;
  cn.s = sched(y.rows, a.n_routed_experts, a.n_activated_experts, T.S);
  cn.o = f32(kMoeO, size_t(cn.s.P() * a.dim));
  cn.d = a.dim, cn.y = y.data, cn.h = h.data, cn.w = norm.weight->as<float>(), cn.eps = norm.eps, cn.x = x.data;
  return cn;
}

// A MoE layer's grouped stages of n tokens with the weights as the MMA's A and each tile's
// tokens as its N (Tuning::tc_swap), where the wgmma form takes them.
bool CudaBackend::moe_swap(const MoeTable& T, int64_t n) const {
  const int sw = opt_.tune.tc_swap;
  const bool want = sw == 2 || (sw == 1 && (T.wtype == cuda::kFP8 || fast_at(n)));
  return want && wgmma_ && T.k64;
}

// FP8 GEMM mode for a MoE layer's grouped stages of n tokens: e4m3 experts whose K (dim and the
// inter dim) are multiples of 128, on the wgmma form's 128-row tiles.
bool CudaBackend::fp8_moe(const MoeTable& T, int64_t n, int64_t dim) const {
  return fp8_at(n) && T.wtype == cuda::kFP8 && dim % 128 == 0 && T.rows13 % 128 == 0 &&
         (moe_swap(T, n) || tile_m(T.wtype) == 128);
}

cuda::MoeSched CudaBackend::sched(int64_t n, int E, int K, int S) {
  cuda::MoeSched s;
  s.n = n, s.E = E, s.K = K, s.S = S;
  s.experts_run = experts_run_;
  const int64_t NE = s.NE(), P = s.P(), T = (P + 7) / 8 + NE, Kt = K + S;  // (room for tiles of 8 rows)
  const size_t words = size_t(3 * NE + 2 + P + 2 * n * Kt + 2 * T);
  int32_t* b = static_cast<int32_t*>(scratch(kSched, words * 4));
  s.cnt = b, b += NE;
  s.off = b, b += NE;
  s.active = b, b += NE;
  s.n_active = b++;
  s.n_tiles = b++;
  s.perm = b, b += P;
  s.pair_of = b, b += n * Kt;
  s.pw = reinterpret_cast<float*>(b), b += n * Kt;
  s.tile_e = b, b += T;
  s.tile_m0 = b;
  return s;
}

const MoeTable& CudaBackend::moe_table(const ModelArgs& a, const MoEWeights& w) {
  const void* key = w.gate.data;  // (every rank holds the whole gate; expert 0 may be another rank's)
  auto it = moe_.find(key);
  if (it != moe_.end()) return it->second;
  no_capture("MoE table build");
  MoeTable T;
  // The routed experts this rank holds: a contiguous range (model/weights.h's partition); the
  // others' entries keep the shapes of a held one with no weights (no kernel runs them).
  const int E = int(w.experts.size());
  T.local0 = E, T.local1 = 0;
  for (int e = 0; e < E; ++e)
    if (!w.experts[size_t(e)].w1.weight.empty()) T.local0 = std::min(T.local0, e), T.local1 = e + 1;
  if (T.local0 >= T.local1) fail("CUDA backend: a MoE layer without any of its routed experts on this rank");
  for (int e = T.local0; e < T.local1; ++e)
    DSV3_CHECK(!w.experts[size_t(e)].w1.weight.empty(), "this rank's routed experts are not a contiguous range");
  T.partial = T.local0 > 0 || T.local1 < E;
  const MLPWeights& held = w.experts[size_t(T.local0)];
  const cuda::DevExpert absent{dev_linear(held.w1), dev_linear(held.w3), dev_linear(held.w2)};
  std::vector<cuda::DevExpert> v;
  for (int e = 0; e < E; ++e) {
    const MLPWeights& x = w.experts[size_t(e)];
    if (e >= T.local0 && e < T.local1) {
      v.push_back({dev_linear(x.w1), dev_linear(x.w3), dev_linear(x.w2)});
    } else {
      v.push_back(absent);
      for (DevLinear* l : {&v.back().w1, &v.back().w3, &v.back().w2}) l->w = nullptr, l->s = nullptr;
    }
  }
  if (w.has_shared) {
    const DevLinear s1 = dev_linear(w.shared_experts.w1), s3 = dev_linear(w.shared_experts.w3),
                    s2 = dev_linear(w.shared_experts.w2);
    const int S = shared_slices(a, w);
    const int64_t rows = s1.rows / S;
    for (int64_t j = 0; j < S; ++j)
      v.push_back({slice(s1, j * rows, rows, 0, s1.cols), slice(s3, j * rows, rows, 0, s3.cols),
                   slice(s2, 0, s2.rows, j * rows, rows)});
    T.S = S;
  }
  T.wtype = v[size_t(T.local0)].w1.t;
  T.gemm = true;
  T.tc = true;
  T.k64 = true;
  T.tcv = true;
  for (cuda::DevExpert& e : v) {
    if (!e.w1.w) continue;  // another rank's
    for (const DevLinear* l : {&e.w1, &e.w3, &e.w2}) {
      if (l->t != T.wtype) fail("CUDA backend: MoE layer mixes weight dtypes");
      T.tcv = T.tcv && cuda::tcv_ok(*l);
      T.gemm = T.gemm && cuda::gemm_ok(*l) && l->t != cuda::kF32;
      T.tc = T.tc && tc_takes(*l);
      T.k64 = T.k64 && l->cols % 64 == 0;
    }
    e.vec13 = cuda::vec_ok(e.w1) && cuda::vec_ok(e.w3);
    e.vec2 = cuda::vec_ok(e.w2);
    T.rows13 = std::max(T.rows13, e.w1.rows);
    T.rows2 = std::max(T.rows2, e.w2.rows);
  }
  const bool f8 = T.wtype == cuda::kFP8;
  if ((f8 || T.wtype == cuda::kBF16) && wgmma_) {
    std::string why;
    T.tmaps = cuda::moe_persist_tmaps(v.data(), int(v.size()), &why);
    if (!T.tmaps && (f8 ? opt_.fp8_gemm : opt_.fast) && !tmaps_warned_) {
      std::fprintf(stderr, "dsv3: warning: the %s experts run on the slower GEMM form: %s\n", f8 ? "FP8" : "bf16",
                   why.c_str());
      tmaps_warned_ = true;
    }
  }
  CK(cudaMalloc(&T.dev, v.size() * sizeof(cuda::DevExpert)));
  CK(cudaMemcpy(T.dev, v.data(), v.size() * sizeof(cuda::DevExpert), cudaMemcpyHostToDevice));
  return moe_.emplace(key, T).first->second;
}

// Test hook: the router alone.
void CudaBackend::route(const ModelArgs& a, const float* logits, const float* bias, int64_t n, int32_t* idx,
                        float* wts) {
  const int K = a.n_activated_experts;
  cuda::MoeSched s = sched(n, a.n_routed_experts, K, 0);
  int32_t* di = static_cast<int32_t*>(scratch(kTopk, size_t(n * K) * 8));
  float* dw = reinterpret_cast<float*>(di + n * K);
  cuda::moe_route(L_, route_args(a), logits, bias, s, di, dw);
  CK(cudaMemcpyAsync(idx, di, size_t(n * K) * 4, cudaMemcpyDeviceToHost, stream_));
  CK(cudaMemcpyAsync(wts, dw, size_t(n * K) * 4, cudaMemcpyDeviceToHost, stream_));
  sync();
}

}  // namespace dsv3::cuda_impl
