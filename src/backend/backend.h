// The interface every backend implements (ref/: scalar float32, the oracle; cpu/: SIMD; cuda/:
// GPU): run a step graph (backend/graph.h), node by node. The ops below are the vocabulary a node
// of one op is made of; a backend that accepts a fusion (fuses()) runs that node its own way.
// Activation buffers are float32, row-major, in the backend's memory (host for CPU backends,
// device for CUDA); weights are the views of ModelWeights after prepare_weights.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/graph.h"
#include "model/config.h"
#include "model/weights.h"

namespace dsv3 {

class ThreadPool;

// Everything one attention op reads: the layer's weights and cache, the step's positions and
// block tables, q [n, n_heads, qk_head_dim] (nope | rope parts, rope NOT yet applied) and
// kv [n, kv_lora_rank + qk_rope_head_dim] = wkv_a(x) (rope NOT yet applied).
struct MlaCall {
  const ModelArgs* a = nullptr;
  AttnImpl impl = AttnImpl::kAbsorb;
  const AttnWeights* w = nullptr;
  const RopeView* rope = nullptr;
  const Step* step = nullptr;       // pos, n and the block tables (KvView)
  const LayerCache* cache = nullptr;
  float* q = nullptr;
  float* kv = nullptr;
  float* out = nullptr;             // [n, n_heads * v_head_dim] (before wo)
};

// Where host weights live (--weight-memory): kMap reads them in place from the checkpoint's
// mapping (file pages, shared and evictable, nothing copied); kCopy copies them into anonymous
// memory with transparent huge pages, which streams faster; kAuto copies when they fit in the
// memory available beside `keep_free` bytes. `lock` pins them (mlock) wherever they are.
struct WeightMemory {
  enum Mode { kAuto, kMap, kCopy } mode = kAuto;
  bool lock = false;
  int64_t keep_free = 0;  // bytes to leave available after a kAuto copy (the KV cache, the rest)
};

// Where prepare_weights put the weights: a line for the user ("mapped from the checkpoint",
// "copied into ...", with any warning), and whether no view points into the checkpoint any more
// (its file pages may then be dropped from the process).
struct WeightPlacement {
  std::string note;
  bool off_checkpoint = false;
  bool copied = false;  // into host memory of the process's own (WeightMemory::kCopy's copy)
  bool locked = false;  // pinned as WeightMemory::lock asked
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // Memory in the backend's space (zeroed).
  virtual float* alloc(size_t n_floats) = 0;
  virtual void release(float* p) = 0;
  virtual void upload(float* dst, const float* host, size_t n) = 0;
  virtual void download(float* host, const float* src, size_t n) = 0;
  // Called once after loading; a device backend copies the weights and rewrites the views, the
  // cpu backend may copy them into anonymous huge pages (WeightMemory). Default: they stay in
  // place (locked if asked).
  virtual WeightPlacement prepare_weights(const ModelArgs& args, ModelWeights& w, const WeightMemory& m = {});
  // Bytes a device backend has free for more buffers (the KV cache's default capacity); -1 for
  // host memory (allocations there cost nothing until touched).
  virtual int64_t device_free_bytes() const { return -1; }
  // Whether the absorbed attention's cache rows (latent and rope key) are kept in bf16, as the
  // reference's kv_cache / pe_cache are (LayerCache::bf16); default float32.
  virtual bool bf16_latent_cache() const { return false; }

  // Runs one step: the graph's nodes in order over `step`. `after` (optional) is called after
  // every node with the index of its last op (debug taps; a backend does not record such a run).
  using AfterNode = std::function<void(int last_op)>;
  virtual void run(const StepGraph& g, const Step& step, const AfterNode& after = {});
  // Whether this backend runs fusion `f` over ops [first, first + count) of g as one node (asked
  // by runtime/rewrites.cc). Default: no fusion.
  virtual bool fuses(const StepGraph& g, Fusion f, int first, int count) const { return false; }

  // ---- the ops
  // y[n, dim] = table[tokens[i] - row0], zeros for a token outside the table's rows [row0,
  // row0 + rows) (a rank's slice of the vocabulary). Tokens in host memory, already range-checked.
  virtual void embed(const Step& s, const TensorView& table, int64_t row0, float* y) = 0;
  // y[n, d] = x / rms(x) * w; rows are `stride` floats apart in x and y (y may alias x).
  virtual void rmsnorm(const float* x, int64_t n, int64_t d, int64_t stride, const TensorView& w, float eps,
                       float* y) = 0;
  // y[n, out] = x[n, in] · Wᵀ (FP8 weights dequantised with their block scales).
  virtual void linear(const float* x, int64_t n, const Linear& w, float* y) = 0;
  // y[n] += x[n]
  virtual void add(float* y, const float* x, int64_t n) = 0;
  // Multi-head latent attention for the step's tokens after the projections: applies RoPE at each
  // token's position, writes the cache rows of (slot, pos), attends causally (a token at pos sees
  // [0, pos] of its sequence) with float32 softmax. All tokens of one call must be distinct
  // (slot, pos) and a sequence's earlier positions must already be cached.
  virtual void mla(const MlaCall& c) = 0;
  // DeepSeekMoE: y[n, dim] = sum_k weight_k * expert_k(x) + shared_experts(x).
  virtual void moe(const ModelArgs& a, const MoEWeights& w, const float* x, int64_t n, float* y) = 0;
  // Dense MLP: y[n, dim] = w2(silu(w1 x) * w3 x).
  virtual void mlp(const MLPWeights& w, const float* x, int64_t n, float* y) = 0;
  // y[r, :d] = x[rows[r], :d] for r < m, rows in host memory. Default: through the host.
  virtual void gather_rows(const float* x, int64_t d, const int64_t* rows, int64_t m, float* y);
  // Collectives (kAllReduce / kAllGather): x [n] summed over the ranks in place; every rank's
  // x [rows, d] into y [rows, parts * d]. Default: through Comm on host memory.
  virtual void all_reduce(Comm& comm, float* x, int64_t n);
  virtual void all_gather(Comm& comm, const float* x, int64_t rows, int64_t d, float* y);

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

 protected:
  // One op of g (a node without fusion), through the op methods above.
  void run_op(const StepGraph& g, const Step& s, const Op& op);
  // A node with a fusion this backend accepted (fuses()). Default: an internal error.
  virtual void run_fused(const StepGraph& g, const Step& s, const Node& nd);
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
