// dsv3_cuda_bench: the CUDA backend on one GPU with the DeepSeek-V2-Lite ("16B") shape and random
// weights made directly in device memory (no checkpoint). Measures the card's copy bandwidth,
// then for bf16 and FP8 weights: decode at batch 1 and 8, and a 1024-token prefill, each beside
// its floor (decode: weight bytes a step reads / copy bandwidth; prefill: matmul FLOPs / the
// bf16 matrix rate, or all weight bytes / bandwidth, whichever is larger) and beside the
// reference's and transformers' speeds on an H200 (bench/anchors_h200.h).
//
//   dsv3_cuda_bench [--dtypes bf16,fp8] [--steps 64] [--json FILE] [--quick] [--profile] [--prefill-only]
//                   [--ctx N]   (decode after N prefilled positions per row; default 16)
//                   [--prefill BxT] (the prefill as B sequences of T tokens in one step, e.g. 16x512 for a
//                   serving prompt step; default 1x1024, the only shape with the reference's anchors)
//                   [--generate] (also Generator::run, greedy, argmax on the device vs the host sampler)
//                   [--decode-only] [--variants default,unfused,...]   (only the named runs; unfused and
//                   no-<fusion>: the step graph without its fusions or without one)
//                   [--shape 671B [--layers N]]   (another model's shape, model/shapes.h, cut to N layers;
//                   the reference's anchors go with the default shape only)
// --profile adds a run that times every op and kernel group with events (no graphs). The last timed
// decode step of each batch and the last prefill run lie in a profiler range (cudaProfilerStart /
// Stop), so `ncu --profile-from-start off` sees only their kernels.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tools/anchors_h200.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/kernels.h"
#include "runtime/model.h"
#include "model/shapes.h"
#include "runtime/generate.h"
#include "runtime/rewrites.h"

using namespace dsv3;

namespace {

// The reference's configs/config_16B.json (FP8: inter_dim 10880, a multiple of the 128 block).
ModelArgs shape_16b(bool fp8) {
  ModelArgs a;
  a.vocab_size = 102400, a.dim = 2048, a.inter_dim = fp8 ? 10880 : 10944, a.moe_inter_dim = 1408;
  a.n_layers = 27, a.n_dense_layers = 1, a.n_heads = 16;
  a.n_routed_experts = 64, a.n_shared_experts = 2, a.n_activated_experts = 6;
  a.n_expert_groups = 1, a.n_limited_groups = 1, a.score_func = "softmax", a.route_scale = 1.f;
  a.q_lora_rank = 0, a.kv_lora_rank = 512, a.qk_nope_head_dim = 128, a.qk_rope_head_dim = 64, a.v_head_dim = 128;
  a.max_seq_len = 16384, a.original_seq_len = 4096, a.yarn = true, a.rope_factor = 40.f;
  a.mscale = 0.707f, a.mscale_all_dim = 0.707f;
  a.dtype = fp8 ? "fp8" : "bf16";
  return a;
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Multiply-adds of the linears one token runs (attention, dense/shared/routed MLPs, gate).
double linear_macs_per_token(const ModelArgs& a) {
  const double H = a.n_heads, qk = a.qk_head_dim(), C = a.kv_lora_rank, R = a.qk_rope_head_dim, V = a.v_head_dim,
               D = a.dim;
  double attn = H * qk * D + (C + R) * D + H * (a.qk_nope_head_dim + V) * C + D * H * V;
  double total = 0;
  for (int l = 0; l < a.n_layers; ++l) {
    total += attn;
    if (a.is_moe_layer(l))
      total += (a.n_activated_experts + a.n_shared_experts) * 3.0 * D * a.moe_inter_dim + a.n_routed_experts * D;
    else
      total += 3.0 * D * a.inter_dim;
  }
  return total;
}

// Attention-core multiply-adds of a T-token prefill from position 0 (absorbed MLA).
double attention_macs(const ModelArgs& a, int64_t T) {
  const double H = a.n_heads, C = a.kv_lora_rank, R = a.qk_rope_head_dim, nope = a.qk_nope_head_dim, V = a.v_head_dim;
  const double pairs = double(T) * double(T + 1) / 2;  // (token, cached position) pairs
  return a.n_layers * H * (double(T) * (nope * C + C * V) + pairs * (C + R + C));
}

struct Line {
  std::string dtype, what, variant;
  double tok_s = 0, ms = 0, floor_ms = 0, ref = 0, hf = 0;
  double experts = 0;  // decode: routed experts per MoE layer and step (measured)
};
std::vector<Line> g_lines;

void report(const Line& l) {
  g_lines.push_back(l);
  std::printf("%-5s %-13s %-12s %10.1f tok/s %9.3f ms/step  floor %8.3f ms (%5.1f%%)", l.dtype.c_str(),
              l.what.c_str(), l.variant.c_str(), l.tok_s, l.ms, l.floor_ms, 100.0 * l.floor_ms / l.ms);
  if (l.ref > 0) std::printf("  x%.1f reference", l.tok_s / l.ref);
  if (l.hf > 0) std::printf("  x%.1f transformers", l.tok_s / l.hf);
  if (l.experts > 0) std::printf("  %.1f experts/layer", l.experts);
  std::printf("\n");
  std::fflush(stdout);
}

struct Variant {
  std::string name;
  CudaOptions opt;
  bool decode, prefill;
  bool profile = false;
  uint32_t rewrites = kRewritesAll;  // the step graph's fusions (ModelOptions::rewrites)
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> dtypes = {"bf16", "fp8"};
  int steps = 64;
  bool quick = false, profile = false, prefill_only = false, decode_only = false, generate = false;
  std::vector<std::string> only;
  std::vector<int> batches = {1, 8};
  int ctx = 16, layers = 0;
  int pre_b = 1, pre_t = 1024;  // --prefill BxT
  std::string json, shape;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", s.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    auto list = [&](std::vector<std::string>& out) {
      out.clear();
      std::string v = next();
      for (size_t p = 0; p <= v.size();) {
        size_t q = v.find(',', p);
        if (q == std::string::npos) q = v.size();
        out.push_back(v.substr(p, q - p));
        p = q + 1;
      }
    };
    if (s == "--dtypes") {
      list(dtypes);
    } else if (s == "--variants") {
      list(only);
    } else if (s == "--batches") {
      std::vector<std::string> bs;
      list(bs);
      batches.clear();
      for (const std::string& b : bs) batches.push_back(std::clamp(std::atoi(b.c_str()), 1, 512));
    } else if (s == "--generate") {
      generate = true;
    } else if (s == "--decode-only") {
      decode_only = true;
    } else if (s == "--steps") {
      steps = std::max(1, std::atoi(next().c_str()));
    } else if (s == "--json") {
      json = next();
    } else if (s == "--quick") {
      quick = true;
    } else if (s == "--prefill-only") {
      prefill_only = true;
    } else if (s == "--prefill") {
      const std::string v = next();
      if (std::sscanf(v.c_str(), "%dx%d", &pre_b, &pre_t) != 2 || pre_b < 1 || pre_t < 1 || pre_b > 512) {
        std::fprintf(stderr, "--prefill wants BxT (sequences x tokens, e.g. 16x512), not %s\n", v.c_str());
        return 2;
      }
    } else if (s == "--ctx") {
      ctx = std::max(1, std::atoi(next().c_str()));
    } else if (s == "--profile") {
      profile = true;
    } else if (s == "--shape") {
      shape = next();
    } else if (s == "--layers") {
      layers = std::max(1, std::atoi(next().c_str()));
    } else {
      std::fprintf(stderr, "usage: dsv3_cuda_bench [--dtypes bf16,fp8] [--steps N] [--json FILE] [--quick] [--profile] "
                           "[--prefill-only] [--prefill BxT] [--ctx N] [--decode-only] [--variants a,b] [--batches 1,8] [--generate] "
                           "[--shape NAME [--layers N]]\n");
      return 2;
    }
  }
  std::string why;
  if (!cuda::device_available(&why)) {
    std::fprintf(stderr, "dsv3_cuda_bench: %s\n", why.c_str());
    return 2;
  }
  try {
    if (std::getenv("DSV3_CUDA_TRACE")) cuda::trace_begin();  // (a DSV3_TRACE=1 build's kernel trace)
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    const double bw = cuda::copy_bandwidth_gbps(size_t(2) << 30, 20);
    std::printf("device: %s, %d SMs, %.1f GB, L2 %.0f MB; copy bandwidth %.0f GB/s (read + write; anchors: %.0f)\n",
                prop.name, prop.multiProcessorCount, double(prop.totalGlobalMem) / 1e9, double(prop.l2CacheSize) / 1e6,
                bw, anchors::kCopyGBps);
    const double peak = anchors::kBf16MatmulTFlops * 1e12;
    for (const std::string& dt : dtypes) {
      const bool fp8 = dt == "fp8";
      const ModelArgs a = shape.empty() ? shape_16b(fp8) : shape_args(shape, dt, layers);
      const bool anchored = shape.empty();  // (the reference was measured on its 16B config)
      std::vector<Variant> vars;
      CudaOptions base = CudaOptions::from_env();  // graphs + PDL, float32-grade GEMMs (DSV3_CUDA_* may change it)
      vars.push_back({"default", base, true, true});
      if (!quick) {
        CudaOptions o = base;
        o.fast = true;
        vars.push_back({"fast", o, false, true});
        o = base;
        o.fp8_gemm = true;  // e4m3 activations in FP8 weights' prefill products
        vars.push_back({"fp8gemm", o, false, true});
        o.fast = true;
        vars.push_back({"fast-fp8gemm", o, false, true});
        o = base;
        o.graphs = false;
        vars.push_back({"nograph", o, true, false});
        o = base;
        o.pdl = false;
        vars.push_back({"nopdl", o, true, false});
        o = base;
        o.tune.tcv_max = 0;  // decode GEMVs on the FMA kernels (kernels_gemv.cu) only
        vars.push_back({"fma-gemv", o, true, false});
        o = base;
        o.tune.tcv_bf16_min = 1;  // the tensor-core GEMV for bf16 weights at one token too
        vars.push_back({"tcv-bf16", o, true, false});
        o = base;
        o.tune.tc_min = 8;  // eight tokens on the pipelined GEMM instead of the GEMVs
        vars.push_back({"gemm-b8", o, true, false});
        o = base;
        o.tune.tc_min = 1 << 30;  // prefill on the first-generation WMMA kernel and CUDA-core attention
        vars.push_back({"wmma", o, false, true});
        o = base;
        o.tune.wgmma = false;  // the pipelined kernel's mma.sync form
        vars.push_back({"mma.sync", o, false, true});
        o.fast = true;
        vars.push_back({"mma.sync-fast", o, false, true});
      }
      if (profile) {
        CudaOptions o = base;
        o.profile = true;
        vars.push_back({"profile", o, true, true, true});
        o.fast = true;
        vars.push_back({"profile-fast", o, false, true, true});
        o.fast = false, o.fp8_gemm = true;
        vars.push_back({"profile-fp8gemm", o, false, true, true});
      }
      auto asked = [&](const std::string& name) { return std::find(only.begin(), only.end(), name) != only.end(); };
      // (asked for only) the step graph without some of its fusions (runtime/rewrites.h): none at
      // all, or all but one
      const std::pair<const char*, uint32_t> unfused[] = {
          {"unfused", 0u},
          {"no-add-norm-moe", kRewritesAll & ~kRewriteAddRmsNormMoe},
          {"no-combine-pair", kRewritesAll & ~kRewriteCombineIntoPair},
          {"no-combine-norm", kRewritesAll & ~(kRewriteMoeCombineIntoNorm | kRewriteCombineIntoPair)},
          {"no-linear-pair", kRewritesAll & ~(kRewriteLinearPair | kRewriteCombineIntoPair)}};
      for (auto [name, rw] : unfused)
        if (asked(name)) vars.push_back({name, base, true, true, false, rw});
      for (int p : {0, 1, 2}) {  // 2-8 tokens of rows too long for the tensor-core GEMV: FMA GEMV, pipelined GEMM, chunks
        const std::string name = "long-k-" + std::to_string(p);
        if (!asked(name)) continue;
        CudaOptions o = base;
        o.tune.long_k = p;
        vars.push_back({name, o, true, false});
      }
      for (int t : {0, 8, 16, 32}) {  // MoE steps on the tensor-core GEMV's 8-pair tiles up to t pairs per expert
        const std::string name = "moe-tiles-" + std::to_string(t);
        if (!asked(name)) continue;
        CudaOptions o = base;
        o.tune.moe_tiles = t;
        vars.push_back({name, o, true, false});
      }
      if (asked("graphs-16")) {  // only decode steps of up to 16 tokens recorded as graphs (default: 256)
        CudaOptions o = base;
        o.tune.graph_max = 16;
        vars.push_back({"graphs-16", o, true, false});
      }
      if (asked("moe-persist-0")) {  // swapped MoE stages (FP8 GEMM mode, fast bf16) on tc_gemm's forms, not the persistent kernel
        CudaOptions o = base;
        o.tune.moe_persist = false;
        vars.push_back({"moe-persist-0", o, true, true});
      }
      for (int t : {0, 64, 128, 512}) {  // bf16 experts on the persistent kernel from t routed pairs per expert on average
        const std::string name = "bf16-persist-" + std::to_string(t);
        if (!asked(name)) continue;
        CudaOptions o = base;
        o.tune.moe_persist_bf16_min = t;
        vars.push_back({name, o, true, true});
      }
      if (asked("mla-group-1")) {  // each prefill run's wkv_b product alone (default: runs of a step share one)
        CudaOptions o = base;
        o.tune.mla_group_rows = 1;
        vars.push_back({"mla-group-1", o, false, true});
      }
      if (asked("gate-tc")) {  // the gate of many tokens as a split-K tensor-core product, not gate_logits' FMAs
        CudaOptions o = base;
        o.tune.gate_fma = false;
        vars.push_back({"gate-tc", o, true, false});
      }
      if (asked("quant-sep")) {  // FP8 GEMM mode's stage 0 writing float32, act_quant after it (not quantising itself)
        CudaOptions o = base;
        o.tune.moe_quant_fused = false;
        vars.push_back({"quant-sep", o, true, true});
      }
      if (asked("gate-route")) {  // one token routed by the gate kernel's last block, not the experts'
        CudaOptions o = base;
        o.tune.route_in_experts = false;
        vars.push_back({"gate-route", o, true, false});
      }
      if (!only.empty())
        vars.erase(std::remove_if(vars.begin(), vars.end(),
                                  [&](const Variant& v) { return !asked(v.name); }),
                   vars.end());
      for (Variant& v : vars) {
        if (decode_only) v.prefill = false;
        auto be = make_cuda_backend(v.opt);
        Backend* bp = be.get();
        ModelWeights w = cuda::random_weights(*be, a, 1234);
        const WeightStats st = weight_stats(a, w);
        int64_t all_bytes = 0;
        for (auto& [k, b] : st.bytes_by_dtype) all_bytes += b;
        ModelOptions mo;
        mo.rewrites = v.rewrites;
        const int max_b = *std::max_element(batches.begin(), batches.end());
        mo.max_seqs = std::max({8, max_b, pre_b});
        mo.max_len = std::max(pre_t + 64, ctx + 8 + steps + 8);
        Model model(a, std::move(w), std::move(be), mo);
        const int V = a.vocab_size;
        float* logits = nullptr;
        cudaMallocHost(&logits, sizeof(float) * size_t(V) * size_t(std::max({8, max_b, pre_b})));
        std::mt19937 rng(7);
        std::uniform_int_distribution<int> tokd(0, V - 1);
        if (v.decode && !prefill_only) {
          for (int B : batches) {
            const int T0 = ctx;
            std::vector<int32_t> tok(size_t(B * T0));
            for (auto& t : tok) t = tokd(rng);
            // Prefill the rows, 64 positions of every row per step (a step of all B * T0
            // tokens at once would need workspace for all of them).
            for (int p0 = 0; p0 < T0; p0 += 64) {
              const int t = std::min(64, T0 - p0);
              std::vector<int32_t> chunk(size_t(B * t));
              for (int r = 0; r < B; ++r)
                std::copy_n(tok.begin() + ptrdiff_t(r * T0 + p0), t, chunk.begin() + ptrdiff_t(r * t));
              model.forward(chunk.data(), B, t, p0, logits);
            }
            const int warm = 8, n = B == 1 ? steps : std::max(8, steps / 2);
            double t0 = 0;
            for (int s = 0; s < warm + n; ++s) {
              if (s == warm) {
                if (v.profile) cuda::profile_report(*bp, true);
                bp->reset_counters();
                t0 = now();
              }
              std::vector<int32_t> step(static_cast<size_t>(B));
              for (auto& t : step) t = tokd(rng);
              const bool last = s == warm + n - 1;
              if (last) cudaProfilerStart();
              model.forward(step.data(), B, 1, T0 + s, logits);
              if (last) cudaProfilerStop();
            }
            const double ms = (now() - t0) * 1e3 / n;
            // Bytes a step reads: everything but the routed experts, plus the experts the B tokens
            // used (the router's device counter; batch 1: exactly n_activated).
            const double K = a.n_activated_experts;
            const double per_expert = double(3 * a.dim * a.moe_inter_dim) * (fp8 ? 1.0 : 2.0);
            const double moe_layers = a.n_layers - a.n_dense_layers;
            const double distinct = double(bp->routed_experts_run()) / double(n) / moe_layers;
            const double bytes = double(st.decode_bytes_per_token) + moe_layers * per_expert * (distinct - K);
            Line l;
            l.dtype = dt, l.what = "decode b" + std::to_string(B), l.variant = v.name;
            l.tok_s = B * 1e3 / ms, l.ms = ms, l.floor_ms = bytes / (bw * 1e9) * 1e3;
            l.experts = distinct;
            if (anchored && (B == 1 || B == 8)) {  // (the anchors' batches)
              l.ref = fp8 ? (B == 1 ? anchors::kRefFp8Bf16GemmDecodeB1 : anchors::kRefFp8DecodeB8)
                          : (B == 1 ? anchors::kRefBf16DecodeB1 : anchors::kRefBf16DecodeB8);
              l.hf = B == 1 ? anchors::kHfBf16DecodeB1 : anchors::kHfBf16DecodeB8;
            }
            report(l);
            if (v.profile) std::printf("%s", cuda::profile_report(*bp, true).c_str());
            // A DSV3_TRACE=1 build's kernel waits over the last steps (DSV3_CUDA_TRACE=file).
            if (const char* tp = std::getenv("DSV3_CUDA_TRACE"))
              cuda::trace_dump(tp, (dt + " " + l.what + " " + v.name).c_str());
          }
        }
        if (generate && v.decode && !prefill_only) {
          // Generator::run end to end: greedy, temperature 0.8 alone, with top-k 50, with top-p
          // 0.9; drawn on the device (only ids come back; a row it leaves to the host comes back
          // as logits) or the logits downloaded and sampled on the host. Decode tokens/s from
          // its own stats. (Random weights give flat distributions: top-p 0.9 keeps far more
          // than the 1024 tokens the device sorts, so those rows go to the host.)
          struct Mode {
            const char* name;
            float t, p;
            int k;
          };
          for (const Mode& md : {Mode{"greedy", 0.f, 1.f, 0}, Mode{"t0.8", 0.8f, 1.f, 0}, Mode{"t0.8-k50", 0.8f, 1.f, 50},
                                 Mode{"t0.8-p0.9", 0.8f, 0.9f, 0}})
          for (int B : batches) {
            std::vector<GenerateRequest> reqs(static_cast<size_t>(B));
            for (size_t q = 0; q < reqs.size(); ++q) {
              GenerateRequest& r = reqs[q];
              r.prompt.resize(size_t(ctx));
              for (auto& t : r.prompt) t = tokd(rng);
              r.max_new_tokens = steps;
              r.sampling.temperature = md.t, r.sampling.top_p = md.p, r.sampling.top_k = md.k;
              r.sampling.seed = 7 + q;
            }
            std::vector<std::vector<int32_t>> toks[2];
            for (int dev = 1; dev >= 0; --dev) {
              Generator gen(model, -1);
              gen.set_device_sampling(dev == 1);
              gen.run(reqs);  // warm (graphs recorded)
              Generator g2(model, -1);
              g2.set_device_sampling(dev == 1);
              for (auto& res : g2.run(reqs)) toks[dev].push_back(res.tokens);
              const GenerateStats& gs = g2.stats();
              std::printf("%-5s generate b%d  %-14s %9.1f tok/s decode (%lld tokens in %.3f s, %s)%s\n", dt.c_str(), B,
                          dev ? "device-sampler" : "host-sampler", double(gs.generated_tokens) / gs.decode_s,
                          (long long)gs.generated_tokens, gs.decode_s, md.name,
                          dev ? "" : (toks[0] == toks[1] ? ", the same tokens" : ", OTHER TOKENS than the device"));
            }
          }
        }
        if (v.prefill) {
          const int T = pre_t, PB = pre_b;  // PB sequences of T tokens, one step
          const bool standard = PB == 1 && T == 1024;  // the reference's anchored shape
          std::vector<int32_t> tok(static_cast<size_t>(PB) * T);
          for (auto& t : tok) t = tokd(rng);
          std::vector<double> ts;
          for (int r = 0; r < 4; ++r) {
            if (v.profile && r == 3) cuda::profile_report(*bp, true);
            const double t0 = now();
            if (r == 3) cudaProfilerStart();
            model.forward(tok.data(), PB, T, 0, logits);
            if (r == 3) cudaProfilerStop();
            if (r > 0) ts.push_back(now() - t0);
          }
          std::sort(ts.begin(), ts.end());
          const double ms = ts[ts.size() / 2] * 1e3;
          const double flops = 2.0 * PB * (linear_macs_per_token(a) * T + attention_macs(a, T));
          const double floor_ms = std::max(flops / peak, double(all_bytes) / (bw * 1e9)) * 1e3;
          Line l;
          l.dtype = dt, l.variant = v.name;
          l.what = standard ? "prefill 1024" : "prefill " + std::to_string(PB) + "x" + std::to_string(T);
          l.tok_s = double(PB) * T * 1e3 / ms, l.ms = ms, l.floor_ms = floor_ms;
          if (anchored && standard) {
            l.ref = fp8 ? anchors::kRefFp8Bf16GemmPrefill1024 : anchors::kRefBf16Prefill1024;
            l.hf = anchors::kHfBf16Prefill1024;
          }
          report(l);
          if (v.profile) std::printf("%s", cuda::profile_report(*bp, true).c_str());
        }
        cudaFreeHost(logits);
      }
    }
    if (!json.empty()) {
      FILE* f = std::fopen(json.c_str(), "w");
      if (!f) {
        std::fprintf(stderr, "cannot write %s\n", json.c_str());
        return 1;
      }
      std::fprintf(f, "{\"device\": \"%s\", \"copy_GBps\": %.1f, \"runs\": [\n", prop.name, bw);
      for (size_t i = 0; i < g_lines.size(); ++i) {
        const Line& l = g_lines[i];
        std::fprintf(f,
                     "  {\"dtype\": \"%s\", \"what\": \"%s\", \"variant\": \"%s\", \"tok_s\": %.2f, \"ms\": %.4f, "
                     "\"floor_ms\": %.4f, \"vs_reference\": %.2f, \"vs_transformers\": %.2f, "
                     "\"experts_per_layer\": %.2f}%s\n",
                     l.dtype.c_str(), l.what.c_str(), l.variant.c_str(), l.tok_s, l.ms, l.floor_ms,
                     l.ref > 0 ? l.tok_s / l.ref : 0.0, l.hf > 0 ? l.tok_s / l.hf : 0.0, l.experts,
                     i + 1 < g_lines.size() ? "," : "");
      }
      std::fprintf(f, "]}\n");
      std::fclose(f);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsv3_cuda_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
