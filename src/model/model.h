// The DeepSeek-V3 transformer: the reference's Transformer.forward as one explicit loop over
// layers, calling Backend ops. Owns the KV cache (slots x max_len) and the activations.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "io/checkpoint.h"
#include "model/rope.h"
#include "model/weights.h"

namespace dsv3 {

struct ModelOptions {
  AttnImpl attn = AttnImpl::kAbsorb;
  int max_slots = 8;    // KV cache rows (concurrent sequences)
  int max_len = 0;      // positions per row; 0 = the config's max_position_embeddings
  // KV cache budget in GB (1e9 bytes); 0 = no budget (slots x max_len). With a budget, max_len
  // is cut to what max_slots rows fit in it, and a request past that is an Error that names
  // the budget (--kv-cache-gb).
  double kv_cache_gb = 0;
};

// Bytes of KV cache one position of one sequence takes (all layers; float32 latent + rope key
// for absorbed MLA, full K and V for naive).
int64_t kv_cache_bytes_per_position(const ModelArgs& a, AttnImpl attn);

class Model {
 public:
  Model(std::unique_ptr<Checkpoint> ck, std::unique_ptr<Backend> backend, const ModelOptions& opt);
  // A model over weights already in the backend's memory (prepare_weights is not called), e.g.
  // random device weights for a benchmark. It has no checkpoint: checkpoint() is an error.
  Model(const ModelArgs& args, ModelWeights w, std::unique_ptr<Backend> backend, const ModelOptions& opt);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelArgs& args() const { return args_; }
  const ModelWeights& weights() const { return w_; }
  Backend& backend() { return *be_; }  // e.g. for its benchmark counters
  const Checkpoint& checkpoint() const {
    DSV3_CHECK(ck_, "this model was built from weights, not a checkpoint");
    return *ck_;
  }
  int max_slots() const { return opt_.max_slots; }
  int max_len() const { return opt_.max_len; }
  // Bytes the KV cache was sized for (slots x max_len x bytes per position).
  int64_t kv_cache_bytes() const;

  // The reference's forward(tokens [B, T], start_pos): rows 0..B-1 write cache slots 0..B-1 at
  // positions [start_pos, start_pos + T), attend causally, and give the logits of each row's last
  // new token: logits [B, vocab_size] (host). Errors (not crashes) for ids outside the vocabulary,
  // positions past max_len, B > max_slots.
  void forward(const int32_t* tokens, int B, int T, int start_pos, float* logits);

  // Debug taps: when set, called with named intermediates of every forward (host copies):
  // "attn_norm.L", "attn_out.L", "ffn_norm.L", "ffn_out.L", "h.L" (the residual after layer L),
  // each [n_tokens, dim]. Slow (a download per tap); for tracing a wrong logit to a layer.
  using Tap = std::function<void(const std::string& name, const float* data, int64_t rows, int64_t cols)>;
  void set_tap(Tap tap) { tap_ = std::move(tap); }

  // General form for continuous batching: n tokens, each with its own (slot, pos); logits of the
  // tokens listed in `logit_rows` (indices into the n tokens) go to logits [rows, vocab_size].
  void forward(const int32_t* tokens, const TokenPos* pos, int64_t n, const std::vector<int64_t>& logit_rows,
               float* logits);
  // The same step for greedy decoding: where the backend offers argmax_rows, ids [rows] get each
  // logit row's argmax over [0, limit) (ties: the lowest id) and true is returned, the logits
  // never leaving the backend; else the logits go to `logits` as above and false is returned.
  bool forward_greedy(const int32_t* tokens, const TokenPos* pos, int64_t n, const std::vector<int64_t>& logit_rows,
                      int64_t limit, int32_t* ids, float* logits);
  // The same step sampled where the logits are (Backend::sample_rows), spec [rows]: true with
  // ids [rows] the draws, -1 for a row left to the host, whose logits are then in `logits` (its
  // row); false: the backend does not sample, every row's logits are in `logits`.
  bool forward_sample(const int32_t* tokens, const TokenPos* pos, int64_t n, const std::vector<int64_t>& logit_rows,
                      int64_t limit, const Backend::SampleSpec* spec, int32_t* ids, float* logits);

 private:
  void init();
  void run_ops(const int32_t* tokens, const TokenPos* pos, int64_t n, const std::vector<int64_t>& logit_rows);
  void ensure_workspace(int64_t n);
  void tap(const char* what, int layer, const float* buf, int64_t n, int64_t cols);
  Tap tap_;
  void ensure_logit_rows(int64_t m);
  std::unique_ptr<Checkpoint> ck_;
  std::unique_ptr<Backend> be_;
  ModelOptions opt_;
  ModelArgs args_;
  ModelWeights w_;
  RopeTable rope_;
  std::vector<LayerCache> cache_;
  // Workspace (backend memory), sized for ws_tokens_ tokens and logit_rows_ rows of logits.
  int64_t ws_tokens_ = 0, logit_rows_ = 0;
  bool budget_limited_ = false;  // max_len was cut to fit opt_.kv_cache_gb
  float *h_ = nullptr, *x_ = nullptr, *q_ = nullptr, *qa_ = nullptr, *kv_ = nullptr, *attn_ = nullptr,
        *y_ = nullptr, *last_ = nullptr, *logits_ = nullptr;
};

}  // namespace dsv3
