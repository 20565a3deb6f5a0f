// The op interface every backend implements (ref/: scalar float32, the oracle; cpu/: SIMD;
// cuda/: GPU). Activation buffers are float32, row-major, in the backend's memory (host for
// CPU backends, device for CUDA); weights are the views of ModelWeights after prepare_weights.
// The forward loop (model/model.cc) calls only these.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace dsv3 {

class RopeTable;
class ThreadPool;

// Where each token of a batch sits: its cache slot and position. Host memory.
struct TokenPos {
  int32_t slot;  // KV cache row
  int32_t pos;   // position in that row; attends to [0, pos] of the slot
};

// One layer's latent cache (absorbed MLA) or full K/V cache (naive MLA), float32.
struct LayerCache {
  float* kv = nullptr;  // absorbed: [slots, max_len, kv_lora_rank] (kv_norm(latent))
  float* pe = nullptr;  // absorbed: [slots, max_len, qk_rope_head_dim] (roped key)
  float* k = nullptr;   // naive: [slots, max_len, n_heads, qk_head_dim]
  float* v = nullptr;   // naive: [slots, max_len, n_heads, v_head_dim]
};

enum class AttnImpl { kAbsorb, kNaive };

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // Memory in the backend's space (zeroed).
  virtual float* alloc(size_t n_floats) = 0;
  virtual void release(float* p) = 0;
  virtual void upload(float* dst, const float* host, size_t n) = 0;
  virtual void download(float* host, const float* src, size_t n) = 0;
  // Called once after loading; a device backend copies the weights and rewrites the views.
  virtual void prepare_weights(const ModelArgs& args, ModelWeights& w) {}

  // Optional hooks around one step of Model::forward, for device backends that record a step's
  // launches (CUDA graphs) and replay them. begin_step gets the step's host metadata, valid until
  // end_step; when it returns true, the backend replays a recorded step of the same shape at
  // end_step and the caller skips every op in between. Defaults: nothing is recorded.
  virtual bool begin_step(const int32_t* tokens, const TokenPos* pos, int64_t n, const int64_t* logit_rows,
                          int64_t m) {
    return false;
  }
  virtual void end_step() {}
  // y[r, :d] = x[rows[r], :d] for r < m, rows in host memory. Default: through the host.
  virtual void gather_rows(const float* x, int64_t d, const int64_t* rows, int64_t m, float* y) {
    std::vector<float> row(static_cast<size_t>(d));
    for (int64_t r = 0; r < m; ++r) {
      download(row.data(), x + rows[r] * d, size_t(d));
      upload(y + r * d, row.data(), size_t(d));
    }
  }

  // y[n, dim] = table[tokens[i]] (tokens in host memory, already range-checked).
  virtual void embed(const int32_t* tokens, int64_t n, const TensorView& table, float* y) = 0;
  // y[n, d] = x / rms(x) * w; rows are `stride` floats apart in x and y (y may alias x).
  virtual void rmsnorm(const float* x, int64_t n, int64_t d, int64_t stride, const TensorView& w, float eps,
                       float* y) = 0;
  // y[n, out] = x[n, in] · Wᵀ (FP8 weights dequantised with their block scales).
  virtual void linear(const float* x, int64_t n, const Linear& w, float* y) = 0;
  // y[n, d] += x[n, d]
  virtual void add(float* y, const float* x, int64_t n) = 0;

  // Multi-head latent attention for n tokens after the projections:
  //   q: [n, n_heads, qk_head_dim] (nope | rope parts, rope NOT yet applied),
  //   kv: [n, kv_lora_rank + qk_rope_head_dim] = wkv_a(x) (rope NOT yet applied).
  // Applies RoPE at each token's position, writes the cache at (slot, pos), attends causally
  // (token at pos sees [0, pos] of its slot) with float32 softmax, and writes
  // out: [n, n_heads * v_head_dim] (before wo). All tokens of one call must be distinct
  // (slot, pos) and a slot's earlier positions must already be cached.
  virtual void mla(const ModelArgs& a, AttnImpl impl, const AttnWeights& w, const RopeTable& rope,
                   const TokenPos* pos, int64_t n, float* q, float* kv, const LayerCache& cache,
                   int64_t max_len, float* out) = 0;

  // DeepSeekMoE: y[n, dim] = sum_k weight_k * expert_k(x) + shared_experts(x).
  virtual void moe(const ModelArgs& a, const MoEWeights& w, const float* x, int64_t n, float* y) = 0;
  // Dense MLP: y[n, dim] = w2(silu(w1 x) * w3 x).
  virtual void mlp(const MLPWeights& w, const float* x, int64_t n, float* y) = 0;

  // Greedy sampling where the logits live: for each of `rows` rows of x [rows, cols] (backend
  // memory), ids[r] (host) = the lowest index of the largest value among columns [0, limit),
  // with the host sampler's checks (a NaN or +inf logit, or a row with none above -inf: Error
  // naming it). false: not offered here, nothing done (the caller downloads the logits).
  virtual bool argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t limit, int32_t* ids) { return false; }

  // Sampling where the logits live, one SampleSpec per row (a draw of runtime/sampler.h without
  // penalties: temperature 0 is the argmax; else temperature, top-k, top-p, min-p and the draw at
  // the uniform u the row's Sampler drew). ids[r] = the token, or -1 where the backend leaves the
  // row to the host (`host` set; a backend may also leave rows it cannot draw): that row's
  // logits [0, cols) are then copied to host_logits + r * cols. Errors as argmax_rows. false:
  // not offered, nothing done.
  struct SampleSpec {
    float temperature = 0.f, top_p = 1.f, min_p = 0.f;
    int32_t top_k = 0;
    double u = 0.0;
    bool host = false;
  };
  virtual bool sample_rows(const float* x, int64_t rows, int64_t cols, int64_t limit, const SampleSpec* spec,
                           int32_t* ids, float* host_logits) {
    return false;
  }

  // Optional instrumentation for benchmarks: how many (layer, routed expert) pairs moe() has run
  // since the last reset_counters() (an expert used by several tokens of one call counts once);
  // -1 when the backend does not count.
  virtual int64_t routed_experts_run() const { return -1; }
  virtual void reset_counters() {}
};

// The scalar float32 backend: the oracle (multi-threaded over the global ThreadPool).
std::unique_ptr<Backend> make_ref_backend();
// The SIMD CPU backend (backend/cpu/): the best instruction set this CPU has (capped by the
// environment variable DSV3_CPU_ISA=scalar|avx2|avx512), or the named one ("" = best).
// `pool`: the threads to use (default: ThreadPool::global()); must outlive the backend.
std::unique_ptr<Backend> make_cpu_backend(const std::string& isa = "", ThreadPool* pool = nullptr);
#ifdef DSV3_HAVE_CUDA
std::unique_ptr<Backend> make_cuda_backend();  // backend/cuda/; throws Error without a usable GPU
#endif
// By name: "ref", and whichever of "cpu" / "cuda" this build has (registry.cc).
std::unique_ptr<Backend> make_backend(const std::string& name);
std::vector<std::string> backend_names();

}  // namespace dsv3
