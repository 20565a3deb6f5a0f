// dsv3 bench: prefill and decode speed of a model on this machine, each beside the floor it
// measures itself: read bandwidth (a STREAM-style multi-threaded sum) against the bytes a decode
// step reads (weights at stored width, the routed experts actually hit, the KV cache), and the
// peak of the matrix arithmetic the backend uses against prefill's useful FLOPs. With
// --device cuda (the CUDA backend): the GPU's measured copy bandwidth (HBM floor) and, for the
// DeepSeek-V2-Lite ("16B") shape, the ratios to the reference's and transformers' H200 speeds.
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "backend/cpu/floors.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "dist/comm.h"
#include "io/checkpoint.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "tools/bench_model.h"
#include "model/weights.h"
#include "tools/anchors_h200.h"
#include "tools/command.h"
#include "tools/model_options.h"
#ifdef DSV3_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace dsv3 {
namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// CPU seconds this process has used (all threads): against wall time x threads, the share of the
// cores the run actually got on a shared machine.
double process_cpu_seconds() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

std::vector<int> parse_list(const std::string& s, const char* what) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    long x = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end || x < 1 || x > 4096) fail("--", what, " must be a comma-separated list of integers in [1, 4096], got '", s, "'");
    v.push_back(int(x));
  }
  if (v.empty()) fail("--", what, " is empty");
  return v;
}

std::string cpu_model_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      auto c = line.find(':');
      return c == std::string::npos ? line : line.substr(c + 2);
    }
  return "unknown";
}

int64_t proc_status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::atoll(line.c_str() + std::strlen(key));
  return -1;
}

// Useful FLOPs of a causal prefill of P tokens from position 0 (2 per multiply-add): the
// projections, the absorbed attention's latent products, the experts each token is routed to,
// and the head for the last token only.
double prefill_flops(const ModelArgs& a, int64_t P) {
  const double H = a.n_heads, C = a.kv_lora_rank, R = a.qk_rope_head_dim, nope = a.qk_nope_head_dim,
               V = a.v_head_dim, D = a.dim;
  double per_tok = 0;
  for (int l = 0; l < a.n_layers; ++l) {
    double attn = a.q_lora_rank == 0 ? D * H * (nope + R)
                                     : D * a.q_lora_rank + double(a.q_lora_rank) * H * (nope + R);
    attn += D * (C + R) + H * V * D + H * C * (nope + V);  // wkv_a, wo, absorbed wkv_b (q side and out side)
    double ffn = a.is_moe_layer(l) ? (double(a.n_activated_experts) + a.n_shared_experts) * 3 * D * a.moe_inter_dim +
                                         D * a.n_routed_experts
                                   : 3 * D * double(a.inter_dim);
    per_tok += attn + ffn;
  }
  // Scores (latent + rope) and the weighted latent sum over positions 0..p for each token.
  const double core = double(P) * double(P + 1) / 2 * H * (2 * C + R) * a.n_layers;
  return 2 * (per_tok * double(P) + core + double(a.vocab_size) * D);
}


// The shape of the reference's configs/config_16B.json (the anchors' model).
bool is_16b_shape(const ModelArgs& a) {
  return a.dim == 2048 && a.n_layers == 27 && a.n_heads == 16 && a.n_routed_experts == 64 &&
         a.n_activated_experts == 6 && a.n_shared_experts == 2 && a.moe_inter_dim == 1408 && a.kv_lora_rank == 512 &&
         a.q_lora_rank == 0 && a.vocab_size == 102400;
}

// "  x12.3 reference  x4.5 transformers" for the 16B shape on the GPU (an anchor <= 0: none).
std::string anchor_ratios(double tok_s, double ref, double hf) {
  char b[96] = "";
  int n = 0;
  if (ref > 0) n += std::snprintf(b + n, sizeof b - size_t(n), "; x%.1f the reference", tok_s / ref);
  if (hf > 0) std::snprintf(b + n, sizeof b - size_t(n), ", x%.1f transformers", tok_s / hf);
  return b;
}

int run_bench(int argc, char** argv) {
  Args args(argc, argv,
            {"model", "config", "backend", "device", "batch", "prompt", "gen", "threads", "decode-ctx", "kv-cache-gb", "bw-gb",
             "seed", "attn", "synthetic", "dtype", "layers", "vocab", "concurrency", "input-len", "output-len", "requests",
             "request-rate", "max-step-tokens", "shared-prefix", "prefix-cache", "weight-memory", "tp-shard"},
            {"json", "mlock"});
  if (launched_by_mpi()) fail("dsv3 bench measures one process; run it without mpirun");
  if (args.has("concurrency")) return run_serving_bench(args);
  const bool json = args.has("json");
  FILE* out = json ? stderr : stdout;
  if (args.has("threads")) {
    long t = args.get_int("threads", 0);
    if (t < 1 || t > 1024) fail("--threads must be in [1, 1024], got ", t);
    ThreadPool::set_global_threads(int(t));
  }
  ThreadPool& pool = ThreadPool::global();
  const std::string device = args.get("device", "cpu");
  if (device != "cpu" && device != "cuda") fail("--device must be cpu or cuda, got '", device, "'");
  const std::string backend = device == "cuda" ? "cuda" : args.get("backend", "cpu");
  const bool gpu = backend == "cuda";
  const std::vector<int> batches = parse_list(args.get("batch", "1,8"), "batch");
  const long prompt = args.get_int("prompt", 512), gen = args.get_int("gen", 32);
  const long ctx = args.get_int("decode-ctx", 64);
  if (prompt < 1 || gen < 1 || ctx < 1) fail("--prompt, --gen and --decode-ctx must be positive");
  const double bw_gb = args.get_float("bw-gb", 2.0);
  double load0[3] = {0, 0, 0};
  getloadavg(load0, 3);

  // 1. The floors, before the model's pages compete for the caches.
  const cpu::Isa isa = cpu::best_isa();
  std::fprintf(out, "machine: %s, %d threads, load average %.2f\n", cpu_model_name().c_str(), pool.size(), load0[0]);
  double bw = 0, fma_peak = 0, peak = 0, split = 1;
  std::string arith;
  if (gpu) {
#ifdef DSV3_HAVE_CUDA
    std::string why;
    if (!cuda::device_available(&why)) fail("--device cuda: ", why);
    bw = cuda::copy_bandwidth_gbps(size_t(bw_gb * 1e9 / 2), 20);
    // The matrix rate is not measured here: the anchors' bf16 matmul rate on the H200.
    peak = anchors::kBf16MatmulTFlops * 1e12;
    arith = "bf16 tensor cores (the H200 anchors' measured matmul rate)";
    std::fprintf(out, "GPU copy bandwidth: %.0f GB/s (device to device, read + write; the HBM floor); matrix peak: %.1f "
                      "TFLOP/s of %s\n", bw, peak / 1e12, arith.c_str());
#else
    fail("--device cuda: this build has no CUDA backend (built without nvcc or with -DDSV3_CUDA=OFF)");
#endif
  } else {
    bw = cpu::read_bandwidth_gbps(pool, size_t(bw_gb * 1e9));
    const cpu::Isa arith_isa = backend == "cpu" ? isa : cpu::Isa::kScalar;
    fma_peak = cpu::fma_peak_flops(pool, arith_isa);
    peak = arith_isa == cpu::Isa::kAmx ? cpu::matrix_peak_flops(pool, arith_isa) : fma_peak;
    // AMX carries each activation as two bf16 columns (hi + lo): a useful multiply-add costs two.
    split = arith_isa == cpu::Isa::kAmx ? 2.0 : 1.0;
    arith = backend == "cpu" ? cpu::matrix_arith_name(isa) : "fp32 (ref: scalar loops)";
    std::fprintf(out,
                 "read bandwidth: %.1f GB/s (sum over %.1f GB); float32 FMA peak %.1f GFLOP/s; matrix peak: %.1f GFLOP/s of %s\n",
                 bw, bw_gb, fma_peak / 1e9, peak / 1e9, arith.c_str());
  }

  // 2. The model: a checkpoint, or random weights of a named shape made in the GPU's memory.
  BenchSource src = bench_source(args, gpu);
  std::unique_ptr<Checkpoint>& ck = src.ck;
  const ModelArgs a = src.args;
  const std::string& what = src.what;
  const int max_b = *std::max_element(batches.begin(), batches.end());
  ModelOptions opt;
  opt.attn = args.get("attn", "absorb") == "naive" ? AttnImpl::kNaive : AttnImpl::kAbsorb;
  opt.max_seqs = max_b;
  opt.max_len = int(std::min<long>(a.max_seq_len, std::max(prompt, ctx + gen + 1)));
  opt.kv_cache_gb = args.get_float("kv-cache-gb", 0);
  opt.weights = parse_weight_memory(args);
  opt.weights.lock = args.has("mlock");
  const double t_load = now();
  std::unique_ptr<Model> mp = bench_model(src, backend, opt, uint64_t(args.get_int("seed", 1)));
  Model& model = *mp;
  const WeightPlacement& placed = model.weights_placement();
  const bool locked = placed.locked;
  const ModelWeights& w = model.weights();
  const WeightStats st = weight_stats(a, w);
  // Bytes of one routed expert (all MoE layers' experts have the same shapes).
  int64_t expert_bytes = 0, n_moe = 0;
  for (const LayerWeights& L : w.layers)
    if (L.moe) {
      ++n_moe;
      if (!expert_bytes)
        for (const Linear* l : {&L.moe_w.experts[0].w1, &L.moe_w.experts[0].w2, &L.moe_w.experts[0].w3})
          expert_bytes += int64_t(l->weight.nbytes() + (l->scale.empty() ? 0 : l->scale.nbytes()));
    }
  const int64_t fixed_bytes = st.decode_bytes_per_token - n_moe * a.n_activated_experts * expert_bytes;
  // Batch 1 reads the activated experts; a rank of --tp-shard N holds 1 / N of them on average.
  const int64_t batch1_bytes = fixed_bytes + n_moe * a.n_activated_experts * expert_bytes / src.tp_shard;
  // Page every weight in once (from the page cache or disk), so timings see resident weights.
  // (On the GPU the weights were copied to device memory when the model was made.)
  int64_t total_bytes = 0;
  if (gpu) {
    for (auto& [k, b] : st.bytes_by_dtype) total_bytes += b;
  } else {
    volatile uint8_t sink = 0;
    auto touch = [&](const TensorView& t) {
      if (t.empty()) return;
      const uint8_t* p = static_cast<const uint8_t*>(t.data);
      for (size_t i = 0; i < t.nbytes(); i += 4096) sink = sink + p[i];
      total_bytes += int64_t(t.nbytes());
    };
    auto touch_lin = [&](const Linear& l) { touch(l.weight), touch(l.scale); };
    auto touch_mlp = [&](const MLPWeights& m) { touch_lin(m.w1), touch_lin(m.w2), touch_lin(m.w3); };
    touch(w.embed), touch(w.norm), touch_lin(w.head);
    for (const LayerWeights& L : w.layers) {
      touch(L.attn_norm), touch(L.ffn_norm), touch(L.attn.q_norm), touch(L.attn.kv_norm);
      for (const Linear* l : {&L.attn.wq, &L.attn.wq_a, &L.attn.wq_b, &L.attn.wkv_a, &L.attn.wkv_b, &L.attn.wo}) touch_lin(*l);
      if (!L.moe) {
        touch_mlp(L.ffn);
        continue;
      }
      touch(L.moe_w.gate), touch(L.moe_w.bias);
      for (const MLPWeights& e : L.moe_w.experts) touch_mlp(e);
      if (L.moe_w.has_shared) touch_mlp(L.moe_w.shared_experts);
    }
  }
  std::fprintf(out, "model: %s, %d layers, %.2f GB of weights (%s in %.1f s)%s; decode reads %.3f GB/token at batch 1\n",
               what.c_str(), a.n_layers, double(total_bytes) / 1e9, ck || !gpu ? "paged in" : "made", now() - t_load,
               locked ? ", mlocked" : "", double(batch1_bytes) / 1e9);
  if (!placed.note.empty()) std::fprintf(out, "%s\n", placed.note.c_str());

  std::mt19937 rng(uint32_t(args.get_int("seed", 1)));
  std::uniform_int_distribution<int> tok(0, a.vocab_size - 1);
  const int V = a.vocab_size;

  // 3. Prefill: one sequence of `prompt` tokens from position 0; time to first token.
  if (prompt > model.max_len()) fail("--prompt ", prompt, " exceeds the cache's ", model.max_len(), " positions");
  std::vector<int32_t> ptoks(static_cast<size_t>(prompt));
  for (auto& t : ptoks) t = tok(rng);
  std::vector<float> logits(static_cast<size_t>(max_b) * V);
  if (gpu) {  // one untimed prefill of the same length: the GPU's scratch buffers and libraries set up
    model.forward(ptoks.data(), 1, int(prompt), 0, logits.data());
    model.reset_rows();
  }
  const double t0 = now(), c0 = process_cpu_seconds();
  model.forward(ptoks.data(), 1, int(prompt), 0, logits.data());
  model.reset_rows();
  const double ttft = now() - t0, prefill_share = (process_cpu_seconds() - c0) / (ttft * pool.size());
  // (one rank of N: the whole model's FLOPs / N, as every linear but the gate and the low-rank
  // projections is split)
  const double pflops = prefill_flops(a, prompt) / src.tp_shard;
  std::fprintf(out, "prefill: %ld tokens in %.2f s = %.1f tok/s (time to first token %.2f s); %.1f GFLOP/s = %.0f%% of the matrix peak",
               prompt, ttft, double(prompt) / ttft, ttft, pflops / ttft / 1e9, 100 * pflops / ttft / peak);
  if (split > 1) std::fprintf(out, " (%.0f%% of the hi+lo useful peak %.1f GFLOP/s)", 100 * pflops / ttft / (peak / split), peak / split / 1e9);
  if (gpu) {
    const bool fp8 = st.bytes_by_dtype.count("F8_E4M3") > 0;
    const bool anchored = is_16b_shape(a) && prompt == 1024;
    std::fprintf(out, "%s\n", anchored ? anchor_ratios(double(prompt) / ttft, fp8 ? anchors::kRefFp8Bf16GemmPrefill1024
                                                                                  : anchors::kRefBf16Prefill1024,
                                                       anchors::kHfBf16Prefill1024).c_str()
                                       : "");
  } else {
    std::fprintf(out, "; got %.0f%% of the cores\n", 100 * prefill_share);
  }

  // 4. Decode at each batch size, as `dsv3 generate` does it (Generator: greedy, drawn where the
  // logits are, only ids back): B prompts of `ctx` tokens, then `gen` tokens each (EOS ignored);
  // the speed is the Generator's own decode time. Then a few more steps on the same shape count
  // the distinct routed experts a step reads (the backend's router counter).
  nlohmann::json dec = nlohmann::json::array();
  for (int B : batches) {
    if (ctx + gen + 1 > model.max_len())
      fail("--decode-ctx + --gen = ", ctx + gen, " exceeds the cache's ", model.max_len(), " positions");
    std::vector<GenerateRequest> reqs(static_cast<size_t>(B));
    for (GenerateRequest& r : reqs) {
      r.prompt.resize(size_t(ctx));
      for (auto& t : r.prompt) t = tok(rng);
      r.max_new_tokens = int(gen);
    }
    Generator warm(model, -1);
    for (GenerateRequest& r : reqs) r.max_new_tokens = 2;
    warm.run(reqs);  // (recorded steps and scratch for this shape)
    for (GenerateRequest& r : reqs) r.max_new_tokens = int(gen);
    const double dc0 = process_cpu_seconds();
    Generator g(model, -1);
    g.run(reqs);
    const GenerateStats& gs = g.stats();
    const double secs = gs.decode_s, share = (process_cpu_seconds() - dc0) / ((gs.decode_s + gs.prefill_s) * pool.size());
    const double tok_s = double(gs.generated_tokens) / secs;
    // Distinct routed experts per MoE layer and step, over up to 8 more steps of B tokens.
    const int probe = int(std::min<long>(gen, 8));
    std::vector<int32_t> ptok(static_cast<size_t>(B) * size_t(ctx));
    for (auto& t : ptok) t = tok(rng);
    std::vector<float> lg(static_cast<size_t>(B) * V);
    model.forward(ptok.data(), B, int(ctx), 0, lg.data());
    model.backend().reset_counters();
    for (int s2 = 0; s2 < probe; ++s2) {
      std::vector<int32_t> next(static_cast<size_t>(B));
      for (auto& t : next) t = tok(rng);
      model.forward(next.data(), B, 1, int(ctx) + s2, lg.data());
    }
    model.reset_rows();
    const int64_t run = model.backend().routed_experts_run();
    const bool measured = run >= 0;
    const double E = a.n_routed_experts, K = a.n_activated_experts;
    const double experts_per_layer =
        measured ? double(run) / double(probe) / double(std::max<int64_t>(1, n_moe)) : E * (1 - std::pow(1 - K / E, B));
    const double kv_bytes = double(B) * (double(ctx) + double(gen) / 2) * double(model.kv_cache().position_bytes());
    const double bytes = double(fixed_bytes) + experts_per_layer * double(n_moe) * double(expert_bytes) + kv_bytes;
    const double floor_tok_s = double(B) / (bytes / (bw * 1e9));
    const double step_ms = 1e3 * secs / (double(gs.generated_tokens) / B);
    std::string tail = str("; got ", int(100 * share + 0.5), "% of the cores");
    if (gpu) {
      const bool fp8 = st.bytes_by_dtype.count("F8_E4M3") > 0;
      double ref = 0, hf = 0;
      if (is_16b_shape(a) && (B == 1 || B == 8)) {
        ref = fp8 ? (B == 1 ? anchors::kRefFp8Bf16GemmDecodeB1 : anchors::kRefFp8DecodeB8)
                  : (B == 1 ? anchors::kRefBf16DecodeB1 : anchors::kRefBf16DecodeB8);
        hf = fp8 ? 0 : (B == 1 ? anchors::kHfBf16DecodeB1 : anchors::kHfBf16DecodeB8);
      }
      tail = anchor_ratios(tok_s, ref, hf);
    }
    std::fprintf(out,
                 "decode batch %d: %.2f tok/s (%.2f ms/step, as generate runs it, after %ld positions (--decode-ctx)); "
                 "reads %.3f GB/step (%.1f experts/layer %s) -> floor %.2f tok/s; %.0f%% of the %s floor%s\n",
                 B, tok_s, step_ms, ctx, bytes / 1e9, experts_per_layer, measured ? "measured" : "estimated", floor_tok_s,
                 100 * tok_s / floor_tok_s, gpu ? "HBM" : "bandwidth", tail.c_str());
    dec.push_back({{"batch", B},
                   {"tokens", gs.generated_tokens},
                   {"context", ctx},
                   {"tok_s", tok_s},
                   {"step_ms", step_ms},
                   {"bytes_per_step", bytes},
                   {"routed_experts_per_layer", experts_per_layer},
                   {"experts", measured ? "measured from routing" : "estimated (uniform routing)"},
                   {"floor_tok_s", floor_tok_s},
                   {"fraction_of_floor", tok_s / floor_tok_s},
                   {"cpu_share", share}});
  }
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  const int64_t peak_rss = int64_t(ru.ru_maxrss) * 1024, anon = proc_status_kb("RssAnon:") * 1024,
                file = proc_status_kb("RssFile:") * 1024;
  double load1[3] = {0, 0, 0};
  getloadavg(load1, 3);
  std::fprintf(out, "memory: peak RSS %.2f GB (now: %.2f GB file-backed weights, %.2f GB anonymous); KV cache sized %.3f GB\n",
               double(peak_rss) / 1e9, double(file) / 1e9, double(anon) / 1e9, double(model.kv_cache().bytes()) / 1e9);
  if (!gpu)
    std::fprintf(out, "load average: %.2f at start, %.2f at end (shared cores: numbers are noisy when it is high)\n",
                 load0[0], load1[0]);
  if (json) {
    nlohmann::json j = {{"model", what},
                        {"backend", backend},
                        {"device", gpu ? "cuda" : "cpu"},
                        {"tp_shard", src.tp_shard},
                        {"isa", backend == "cpu" ? cpu::isa_name(isa) : "n/a"},
                        {"machine", cpu_model_name()},
                        {"threads", pool.size()},
                        {"load_average", {load0[0], load1[0]}},
                        {"read_bandwidth_GBps", bw},
                        {"matrix_peak_GFLOPs", peak / 1e9},
                        {"fma_peak_GFLOPs", fma_peak / 1e9},
                        {"matrix_arithmetic", arith},
                        {"weights_bytes", total_bytes},
                        {"decode_bytes_per_token_batch1", batch1_bytes},
                        {"prefill",
                         {{"tokens", prompt},
                          {"seconds", ttft},
                          {"tok_s", double(prompt) / ttft},
                          {"ttft_s", ttft},
                          {"gflop", pflops / 1e9},
                          {"gflops", pflops / ttft / 1e9},
                          {"fraction_of_peak", pflops / ttft / peak},
                          {"fraction_of_useful_peak", pflops / ttft / (peak / split)},
                          {"cpu_share", prefill_share}}},
                        {"decode", dec},
                        {"peak_rss_bytes", peak_rss},
                        {"rss_file_bytes", file},
                        {"rss_anon_bytes", anon},
                        {"kv_cache_bytes", model.kv_cache().bytes()},
                        {"weight_memory", placed.copied ? "copy" : gpu ? "device" : "map"},
                        {"mlocked", locked}};
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

}  // namespace

DSV3_COMMAND(bench,
             "(--model DIR | --synthetic SHAPE [--dtype bf16|fp8] [--layers N] [--vocab V]) [--backend cpu|ref] [--device cpu|cuda] "
             "[--batch 1,8,32] [--prompt 512] [--gen 32] [--decode-ctx 64] [--threads N] [--kv-cache-gb G] [--weight-memory auto|map|copy] [--mlock] "
             "[--tp-shard N] [--json]: "
             "prefill and decode speed (decode as generate runs it) beside the measured bandwidth and matrix floors; "
             "--synthetic: random weights of that shape made on the GPU (--device cuda); --tp-shard N: rank 0's share of "
             "the model spread over N ranks, measured alone (collectives move nothing: the interconnect's time is left out)",
             run_bench);

}  // namespace dsv3
