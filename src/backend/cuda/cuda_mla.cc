// The CUDA backend's multi-head latent attention over the paged cache: RoPE, kv_norm and the
// cache write, then for few tokens (decode) the absorbed form in one launch (q absorption, the
// split attention over the latent cache, the value absorption), for many tokens of different
// sequences (serving batches) the same form with the cache rows staged for all heads, and for long runs of one
// sequence (prefill) the latent rows gathered and decompressed through wkv_b, then one flash-style
// kernel (or cuBLAS scores, softmax and values where its head dims do not fit).
#include <algorithm>

#include "backend/cuda/backend_impl.h"
#include "core/error.h"

namespace dsv3::cuda_impl {

namespace {

using Runs = std::vector<std::pair<int64_t, int64_t>>;

// Runs of tokens of one sequence at consecutive positions, [first, end) each.
Runs all_runs(const TokenPos* tp, int64_t n) {
  Runs runs;
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0 && tp[i].slot == tp[i - 1].slot && tp[i].pos == tp[i - 1].pos + 1) runs.back().second = i + 1;
    else runs.push_back({i, i + 1});
  }
  return runs;
}

// Whether runs [k, end) of n tokens suit the long-run form: at least 32 tokens per run (it pays per run).
bool long_enough(const Runs& runs, size_t k, int64_t n) {
  return k < runs.size() && int64_t(runs.size() - k) * 32 <= n;
}

// A step's tokens for the long-run form: empty where they all take the absorbed form. A serving
// step has single tokens first (the scheduler's decodes), then runs of prompt chunks: the singles
// [0, *nd) take the absorbed form and the runs after them the long-run form, where those runs are
// long enough on their own; else one form for the whole step.
Runs split_runs(const TokenPos* tp, int64_t n, int64_t* nd) {
  Runs runs = all_runs(tp, n);
  size_t k = 0;
  while (k < runs.size() && runs[k].second - runs[k].first == 1) ++k;  // the leading singles: tokens [0, k)
  if (k > 0 && long_enough(runs, k, n - int64_t(k))) {
    *nd = int64_t(k);
    return Runs(runs.begin() + int64_t(k), runs.end());
  }
  if (!long_enough(runs, 0, n)) runs.clear();
  *nd = runs.empty() ? n : 0;
  return runs;
}

int log2_exact(int b) {
  int s = 0;
  while ((1 << s) < b) ++s;
  DSV3_CHECK((1 << s) == b, "KV cache block of ", b, " positions (a power of two)");
  return s;
}

}  // namespace

// Whether every token of the step takes the absorbed form: no run of one sequence long enough for
// the long-run form, whose launches carry host positions (such steps are never recorded).
bool CudaBackend::absorbed_step(const Step& s) const {
  int64_t nd = s.n;
  return s.n < 32 || !use_tc(s.n) || split_runs(s.pos, s.n, &nd).empty();
}

cuda::MlaDims CudaBackend::mla_dims(const MlaCall& c, const DevPos** pos) {
  const ModelArgs& a = *c.a;
  const KvView& kv = c.step->kv;
  cuda::MlaDims d;
  d.H = a.n_heads, d.nope = a.qk_nope_head_dim, d.R = a.qk_rope_head_dim, d.C = a.kv_lora_rank;
  d.V = a.v_head_dim, d.max_len = kv.max_len(), d.scale = a.softmax_scale(), d.eps = a.rms_norm_eps;
  d.table = step_table(*c.step), d.table_w = kv.width, d.block_shift = log2_exact(kv.block);
  d.kv16 = c.cache->bf16;
  DSV3_CHECK(kv.max_len() <= int64_t(c.rope->n_positions) + kv.block, "rope table shorter than the cache");
  *pos = step_pos(*c.step);
  return d;
}

void CudaBackend::mla(const MlaCall& c) {
  const DevPos* pos = nullptr;
  const cuda::MlaDims d = mla_dims(c, &pos);
  const TokenPos* tp = c.step->pos;
  const int64_t n = c.step->n;
  const LayerCache& cache = *c.cache;
  const AttnWeights& w = *c.w;
  float *q = c.q, *kv = c.kv, *out = c.out;
  const float* cs = c.rope->data;
  DSV3_CHECK(w.kv_norm.dtype == DType::F32, "kv_norm not on the device");
  const DevLinear wkv_b = dev_linear(w.wkv_b);
  const int64_t H = d.H, C = d.C, V = d.V, nope = d.nope;
  cuda::MlaPrep prep{pos, n, q, kv, w.kv_norm.as<float>(), cs};
  // (fast mode over a bf16 cache: the attention rounds the absorbed query to bf16 as well, and
  // mla_absorbed rounds the attention's output for the value absorption)
  prep.qabs_bf16 = fast_at(n) && cache.bf16;
  mark("mla.prep");
  if (c.impl == AttnImpl::kNaive) {
    float* lat = f32(kLat, size_t(n * C));
    prep.latent = lat, prep.cache_k = cache.k;
    cuda::mla_prep(L_, d, true, prep);
    float* kvb = f32(kKvb, size_t(n * H * (nope + V)));
    run_linear(wkv_b, lat, n, kvb, H * (nope + V), /*fp8=*/false);
    cuda::mla_naive_store(L_, d, pos, n, kvb, cache.k, cache.v);
    float* S = f32(kS, size_t(n * H * d.max_len));
    cuda::mla_naive_scores(L_, d, pos, n, q, cache.k, S);
    cuda::mla_naive_values(L_, d, pos, n, S, cache.v, out);
    return;
  }
  // (Steps that may be recorded as graphs have fewer tokens than a split needs: 32 per run.)
  int64_t nd = n;  // tokens [0, nd) on the absorbed form, the runs after them on the long-run form
  Runs runs;
  if (use_tc(n)) runs = split_runs(tp, n, &nd);
  prep.cache_kv = cache.kv, prep.cache_pe = cache.pe;
  if (nd < n) {
    cuda::MlaPrep tail = prep;
    tail.pos = pos + nd, tail.n = n - nd, tail.q = q + nd * H * (nope + d.R), tail.kv = kv + nd * (C + d.R);
    cuda::mla_prep(L_, d, false, tail);
    mla_runs(d, runs, c, wkv_b);
  }
  if (nd == 0) return;
  prep.n = nd;
  mla_absorbed(c, d, prep, wkv_b);
}

// The absorbed form for the step's first p.n tokens: q absorbed into the latent space, the
// attention over the latent cache (one launch for few tokens, mla_decode_many for many, score
// and value kernels otherwise), then the value absorption through wkv_b's value rows.
void CudaBackend::mla_absorbed(const MlaCall& c, const cuda::MlaDims& d, const cuda::MlaPrep& prep,
                               const DevLinear& wkv_b) {
  const TokenPos* tp = c.step->pos;
  const DevPos* pos = prep.pos;
  const int64_t n = prep.n, H = d.H, C = d.C, V = d.V, nope = d.nope;
  float *q = c.q, *out = c.out;
  const LayerCache& cache = *c.cache;
  float* ol = f32(kKvb, size_t(n * H * C));
  const DevLinear wv = slice(wkv_b, nope, V, 0, C);
  cuda::GemvShift sh;
  sh.xs = C, sh.ys = V, sh.wrows = nope + V;
  cuda::DecodeAttn da;
  da.hb = cuda::mla_decode_heads(n);
  const bool one = n <= 16 && n < opt_.tune.attn_many_min && cuda::mla_decode_ok(d, n, kAttnCounters, da.hb);
  const bool many = !one && n >= opt_.tune.attn_many_min && cuda::mla_many_ok(d);
  // (A step that may be recorded has no host lengths: each token's own length splits it.)
  if (many && !(opt_.graphs && n <= opt_.tune.graph_max))
    for (int64_t i = 0; i < n; ++i) da.len_max = std::max<int64_t>(da.len_max, tp[i].pos + 1);
  const int ns = one    ? cuda::mla_decode_splits(d, n, 0, da.hb)
                 : many ? cuda::mla_many_splits(d, n, da.len_max)
                        : cuda::mla_splits(d, n);
  float* part = ns > 1 ? f32(kPart, size_t(ns * n * H * C)) : nullptr;
  float* ml = ns > 1 ? f32(kMl, size_t(ns * n * H * 2)) : nullptr;
  // One token: the value absorption combines the attention's splits.
  const bool splits_to_vabs = one && n == 1 && ns > 1 && !(use_tc(n) && tc_takes(wv)) && cuda::gemv_splits_ok(L_, wv);
  float* qa = f32(kLat, size_t(n * H * C));
  if (nope <= 128) {
    cuda::mla_prep_qabs(L_, d, prep, wkv_b, qa);
  } else {
    cuda::mla_prep(L_, d, false, prep);
    mark("mla.qabs");
    cuda::mla_qabs(L_, d, wkv_b, q, n, qa);
  }
  da.qa = qa, da.q = q, da.cache_kv = cache.kv, da.cache_pe = cache.pe, da.nsplit = ns, da.part = part, da.ml = ml;
  da.ol = ol;
  if (one) {
    mark("mla.attn1");
    da.counters = attn_counters_, da.combine = !splits_to_vabs;
    cuda::mla_decode_attn(L_, d, pos, n, da);
  } else if (many) {
    mark("mla.attn");
    cuda::mla_decode_many(L_, d, pos, n, da);
  } else {
    float* S = f32(kS, size_t(n * H * d.max_len));
    mark("mla.scores");
    cuda::mla_scores(L_, d, pos, n, da, S);
    mark("mla.values");
    cuda::mla_values(L_, d, pos, n, S, da);
  }
  // out[i, h*V + v] = ol[i, h, :] · wkv_b[h*(nope+V) + nope + v, :], a GEMV per head.
  mark("mla.out");
  if (splits_to_vabs) {
    cuda::gemv_splits(L_, wv, int(H), sh, pos, da, out);
    return;
  }
  if (use_tc(n) && tc_takes(wv)) {
    // (fast mode over a bf16 cache: ol rounded to bf16, one pass, as the reference's bf16 model
    // holds the attention's output; else hi + lo, float32-grade)
    cuda::TcJob j;
    j.a_hi = scratch(kHi2, size_t(n * H * C) * 2);
    j.a_lo = prep.qabs_bf16 ? nullptr : scratch(kLo2, size_t(n * H * C) * 2);
    cuda::split_rows(L_, ol, n * H, C, C, const_cast<void*>(j.a_hi), const_cast<void*>(j.a_lo));
    j.lda = H * C, j.w = wv, j.M = n, j.c = out, j.ldc = H * V, j.shift = sh;
    set_form(j, C % 64 == 0, wv.t);
    cuda::tc_gemm(L_, j, cuda::tc_tiles(n, j.tm), V, int(H));
    return;
  }
  const bool tc = n > opt_.tune.gemv_max && wv.t != cuda::kF32 && cuda::gemm_ok(wv) &&
                  (wv.t != cuda::kFP8 || (nope + V) % 128 == 0);
  const cuda::ProductRows io{.x = ol, .ldx = H * C, .m = n, .y = out, .ldy = H * V, .batch = int(H), .shift = sh};
  if (tc) cuda::gemm(L_, wv, nullptr, io);
  else cuda::gemv(L_, wv, nullptr, io);
}

// MLA for long runs of a sequence (prefill) over the latent cache: each run's rows [0, end)
// gathered from their blocks, K/V decompressed through wkv_b (as the naive form; 192 + 128
// multiply-adds per (query, key, head) instead of the absorbed form's 1088), then the flash
// kernel, or per head cuBLAS GEMMs for the scores (nope part batched over heads, rope part
// shared), a causal softmax and the values in chunks of 512 queries. Consecutive runs whose rows
// add up to at most tune.mla_group_rows share one gather buffer and one wkv_b product (a serving step's
// sixteen 512-token prompt chunks: one GEMM of 8192 rows, not sixteen of 512). Float32 GEMMs
// (bf16 tensor cores in fast mode). out [n, H * V].
void CudaBackend::mla_runs(const cuda::MlaDims& d, const std::vector<std::pair<int64_t, int64_t>>& runs,
                           const MlaCall& c, const DevLinear& wkv_b) {
  constexpr int64_t kChunk = 512;
  const int64_t group_rows = opt_.tune.mla_group_rows;
  const TokenPos* tp = c.step->pos;
  const int64_t tp_n = c.step->n;
  const DevPos* pos = step_pos(*c.step);
  const int64_t H = d.H, C = d.C, R = d.R, nope = d.nope, V = d.V, qk = nope + R, ML = d.max_len, KV = nope + V;
  const bool flash = cuda::flash_prefill_ok(d);
  float* S = flash ? nullptr : f32(kS, size_t(tp_n * H * ML));  // score rows of the cuBLAS form
  // Fast mode: bf16 tensor cores with float32 accumulation (the reference's attention arithmetic).
  const cublasComputeType_t ct = fast_at(tp_n) ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F;
  const float one = 1.f, zero = 0.f, scale = d.scale;
  auto end_of = [&](size_t r) { return tp[runs[r].second - 1].pos + 1; };  // a run's keys: rows [0, end)
  for (size_t g0 = 0, g1 = 0; g0 < runs.size(); g0 = g1) {
    int64_t rows = 0;  // runs [g0, g1): rows of their prefixes one after another
    for (g1 = g0; g1 < runs.size() && (g1 == g0 || rows + end_of(g1) <= group_rows); ++g1) rows += end_of(g1);
    mark("mla.gather");
    float* kvs = f32(kGather, size_t(rows * (C + R)));  // [rows, C] latent, then [rows, R] rope keys
    float* pes_all = kvs + rows * C;
    int64_t off = 0;
    for (size_t r = g0; r < g1; off += end_of(r), ++r)
      cuda::gather_cache_rows(L_, d, tp[runs[r].first].slot, end_of(r), c.cache->kv, c.cache->pe, kvs + off * C,
                              pes_all + off * R);
    mark("mla.expand");
    float* kvb_all = f32(kKvb, size_t(rows * H * KV));  // [rows, H, nope + V]
    run_linear(wkv_b, kvs, rows, kvb_all, H * KV, /*fp8=*/false);
    mark("mla.attn");
    off = 0;
    for (size_t r = g0; r < g1; off += end_of(r), ++r) {
      const auto [r0, r1] = runs[r];
      const float *kvb = kvb_all + off * H * KV, *pes = pes_all + off * R;
      if (flash) {
        const int64_t m = r1 - r0, pos0 = tp[r0].pos;
        void* ws = scratch(kS, cuda::flash_prefill_ws(d, m, pos0));
        cuda::flash_prefill(L_, d, {c.q + r0 * H * qk, m, pos0, kvb, pes, c.out + r0 * H * V, !fast_at(tp_n), ws});
        continue;
      }
      for (int64_t c0 = r0; c0 < r1; c0 += kChunk) {
        const int64_t c1 = std::min(r1, c0 + kChunk), Lk = tp[c1 - 1].pos + 1, m = c1 - c0;
        float* Sc = S + c0 * H * ML;
        const float* qc = c.q + c0 * H * qk;
        // S[i, h, t] = scale * (q_nope[i, h] · k_nope[t, h] + q_pe[i, h] · pe[t])
        CB(cublasGemmStridedBatchedEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(Lk), int(m), int(nope), &scale, kvb,
                                      CUDA_R_32F, int(H * KV), KV, qc, CUDA_R_32F, int(H * qk), qk, &zero, Sc,
                                      CUDA_R_32F, int(H * ML), ML, int(H), ct, CUBLAS_GEMM_DEFAULT));
        CB(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(Lk), int(m * H), int(R), &scale, pes, CUDA_R_32F,
                        int(R), qc + nope, CUDA_R_32F, int(qk), &one, Sc, CUDA_R_32F, int(ML), ct,
                        CUBLAS_GEMM_DEFAULT));
        cuda::causal_softmax_rows(L_, Sc, m * H, ML, Lk, pos, c0, int(H));
        // out[i, h*V + v] = sum_t P[i, h, t] * v[t, h, v]
        CB(cublasGemmStridedBatchedEx(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, int(V), int(m), int(Lk), &one, kvb + nope,
                                      CUDA_R_32F, int(H * KV), KV, Sc, CUDA_R_32F, int(H * ML), ML, &zero,
                                      c.out + c0 * H * V, CUDA_R_32F, int(H * V), V, int(H), ct,
                                      CUBLAS_GEMM_DEFAULT));
      }
    }
  }
}

}  // namespace dsv3::cuda_impl
