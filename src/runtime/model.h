// The DeepSeek-V3 transformer: the reference's Transformer.forward as one explicit loop over
// layers that records a step as a graph of ops (backend/graph.h), rewritten once per shape into
// the fusions the backend runs (runtime/rewrites.h), then run by the backend over the paged KV
// cache (runtime/kv_cache.h). Owns the weights' views, the cache, the activations and the graphs.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "io/checkpoint.h"
#include "model/rope.h"
#include "model/weights.h"
#include "runtime/kv_cache.h"

namespace dsv3 {

class Comm;

struct ModelOptions {
  AttnImpl attn = AttnImpl::kAbsorb;
  int max_seqs = 8;   // sequences the cache is sized for without a budget
  int max_len = 0;    // positions one sequence may reach; 0 = the config's max_position_embeddings
  // KV cache budget in GB (1e9 bytes); 0 = max_seqs x max_len positions, capped by what a device
  // backend has free. Running past it is an Error naming the positions asked and free.
  double kv_cache_gb = 0;
  int kv_block = 64;        // positions per cache block
  Comm* comm = nullptr;     // the ranks the weights are split over (rank 0 leads); null: one process
  WeightMemory weights;     // where host weights live (--weight-memory, --mlock)
  uint32_t rewrites = ~0u;  // the fusions (runtime/rewrites.h Rewrite bits) to run where the backend accepts
                            // them; 0: the recorded ops one by one
};

class Model {
 public:
  // With several ranks (opt.comm), every rank constructs its Model together: they check that they
  // run the same config, each loads its shard of the weights, and they agree on the KV cache's
  // geometry; a rank that fails makes every rank fail, with that rank's message on its stderr.
  Model(std::unique_ptr<Checkpoint> ck, std::unique_ptr<Backend> backend, const ModelOptions& opt);
  // A model over weights already in the backend's memory (prepare_weights is not called), e.g.
  // random device weights for a benchmark. It has no checkpoint: checkpoint() is an error.
  Model(const ModelArgs& args, ModelWeights w, std::unique_ptr<Backend> backend, const ModelOptions& opt);
  ~Model();  // the leader tells the followers to stop
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // Several ranks: rank 0 (the leader) runs the commands, schedules and samples; every step it
  // runs, it first sends to the others, which run it too (their shard of every op, the
  // collectives between) inside follow() until the leader's Model is destroyed.
  bool leader() const { return rank() == 0; }
  int rank() const;
  int ranks() const;
  void follow();

  const ModelArgs& args() const { return args_; }
  const ModelWeights& weights() const { return w_; }
  Backend& backend() { return *be_; }  // e.g. for its benchmark counters
  const Checkpoint& checkpoint() const {
    DSV3_CHECK(ck_, "this model was built from weights, not a checkpoint");
    return *ck_;
  }
  KvCache& kv_cache() { return *cache_; }
  int max_len() const { return opt_.max_len; }  // positions one sequence may reach
  const ModelOptions& options() const { return opt_; }
  // Where the backend put the weights (prepare_weights; empty for a model built from weights).
  const WeightPlacement& weights_placement() const { return placed_; }

  // One step of n tokens: token i of sequence seqs[pos[i].slot] at position pos[i].pos. Each
  // sequence's blocks must already cover its positions (KvCache::reserve); its earlier positions
  // must be cached. Logits of the tokens listed in logit_rows come out.
  struct Batch {
    const int32_t* tokens = nullptr;  // [n] host
    const TokenPos* pos = nullptr;    // [n] host
    int64_t n = 0;
    std::vector<const BlockTable*> seqs;
    std::vector<int64_t> logit_rows;  // indices into the n tokens
  };
  // logits [logit_rows, vocab_size] (host). Errors (not crashes) for ids outside the vocabulary,
  // positions past max_len or outside their sequence's blocks.
  void forward(const Batch& b, float* logits);
  // The same step for greedy decoding: where the backend offers argmax_rows, ids [rows] get each
  // logit row's argmax over [0, limit) (ties: the lowest id) and true is returned, the logits
  // never leaving the backend; else the logits go to `logits` and false is returned.
  bool forward_greedy(const Batch& b, int64_t limit, int32_t* ids, float* logits);
  // The same step sampled where the logits are (Backend::sample_rows), spec [rows]: true with
  // ids [rows] the draws, -1 for a row left to the host, whose logits are then in `logits` (its
  // row); false: the backend does not sample, every row's logits are in `logits`.
  bool forward_sample(const Batch& b, int64_t limit, const Backend::SampleSpec* spec, int32_t* ids, float* logits);

  // The reference's forward(tokens [B, T], start_pos) on the model's own sequences 0..B-1 (taking
  // cache blocks as they grow): row b writes positions [start_pos, start_pos + T) of sequence b,
  // attends causally, and gives the logits of its last new token: logits [B, vocab_size] (host).
  void forward(const int32_t* tokens, int B, int T, int start_pos, float* logits);
  // Frees the blocks of those sequences.
  void reset_rows();

  // Debug taps: when set, called with named intermediates of every forward (host copies):
  // "attn_norm.L", "attn_out.L", "ffn_norm.L", "ffn_out.L", "h.L" (the residual after layer L),
  // each [n_tokens, dim]. Slow (a download per tap, no fusion); for tracing a wrong logit to a layer.
  using Tap = std::function<void(const std::string& name, const float* data, int64_t rows, int64_t cols)>;
  void set_tap(Tap tap) { tap_ = std::move(tap); }

  // The graph a step of n tokens and m logit rows runs, recorded on first use and planned for
  // the backend (with options().rewrites; `fused` false: one node per op).
  const StepGraph& graph(int64_t n, int64_t m, bool fused = true);

 private:
  void init();
  // With several ranks: whether every rank got here with `err` empty; else an Error (this rank's
  // message, or that another rank failed at `what`).
  void agree(const std::string& err, const char* what);
  void send_step(const Step& s, bool fused);
  std::unique_ptr<StepGraph> record(int64_t n, int64_t m);
  void ensure_workspace(int64_t n, int64_t m);
  void check(const Batch& b) const;
  bool run(const Batch& b, int64_t limit, const Backend::SampleSpec* spec, int32_t* ids, float* logits);
  Tap tap_;
  std::unique_ptr<Checkpoint> ck_;
  std::unique_ptr<Backend> be_;
  ModelOptions opt_;
  WeightPlacement placed_;
  ModelArgs args_;
  ModelArgs local_;  // args_ as one rank's ops see them: its n_heads / ranks heads
  ModelWeights w_;
  RopeTable rope_;
  float* rope_dev_ = nullptr;  // rope_ in the backend's memory
  std::unique_ptr<KvCache> cache_;
  std::vector<BlockTable> rows_;  // the sequences of forward(tokens, B, T, start_pos, ...)
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<StepGraph>> graphs_[2];  // [fused]
  std::vector<int32_t> table_;  // the step's block tables [seqs, width] (host)
  // Workspace (backend memory), sized for ws_tokens_ tokens and ws_rows_ rows of logits.
  int64_t ws_tokens_ = 0, ws_rows_ = 0;
  float *h_ = nullptr, *x_ = nullptr, *q_ = nullptr, *qa_ = nullptr, *kv_ = nullptr, *attn_ = nullptr,
        *y_ = nullptr, *last_ = nullptr, *logits_ = nullptr;
  float* part_logits_ = nullptr;  // [rows, vocab / ranks]: this rank's head slice (several ranks)
};

}  // namespace dsv3
