// Batch generation on one Model: each request gets a sequence of the paged KV cache, its prompt
// is prefilled (in chunks), then all unfinished requests decode together, one token per step,
// until EOS or their token budget. Equivalent to the reference's generate() (same logits per token) but without
// its padding: prompts of different lengths prefill fully at once.
#pragma once
#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "runtime/model.h"
#include "runtime/sampler.h"

namespace dsv3 {

struct GenerateRequest {
  std::vector<int32_t> prompt;  // non-empty
  SamplingParams sampling;
  int max_new_tokens = 128;
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids, EOS excluded
  std::string finish_reason;    // "stop" (EOS), "length" (budget or context), "cancelled"
  int prompt_tokens = 0;
  int reused_prompt_tokens = 0;  // prefix already in the cache (see Generator::cached)
};

struct GenerateStats {
  int64_t prompt_tokens = 0, generated_tokens = 0;
  double prefill_s = 0, decode_s = 0;
};

class Generator {
 public:
  explicit Generator(Model& model, int eos_id, int prefill_chunk = 256)
      : model_(model), eos_(eos_id), chunk_(prefill_chunk) {}
  ~Generator();

  // Runs the requests together (request i in the generator's sequence i). Each generated token
  // is passed to on_token(i, id) as soon as it is sampled (EOS too, last); `cancel` (if given)
  // stops every request at the next step. Throws Error for an empty prompt, a prompt that does
  // not fit the context, ids outside the vocabulary, a KV cache too small for the requests.
  std::vector<GenerateResult> run(const std::vector<GenerateRequest>& reqs,
                                  const std::function<void(size_t, int32_t)>& on_token = {},
                                  const std::atomic<bool>* cancel = nullptr);

  const GenerateStats& stats() const { return stats_; }
  // Whether a sequence's cache is kept across run() calls: a new prompt sharing a prefix with
  // what sequence i holds prefills only the rest (multi-turn chat). Off by default: every
  // sequence's blocks go back to the cache when run() returns.
  void set_reuse_prefix(bool on) { reuse_ = on; }
  // Samples only ids < n: checkpoints pad the vocabulary past the tokenizer's last id (DeepSeek-V3:
  // 129280 rows, 128815 tokens); ids that no tokenizer can decode are never drawn.
  void set_vocab_limit(int n) { vocab_limit_ = n; }
  // Whether decode steps draw on the backend where it offers that (Backend::argmax_rows when all
  // requests are greedy, sample_rows for draws without penalties) instead of downloading the
  // logits. On by default; off gives the host sampler's path (tests compare the two: the same
  // tokens for the same seeds).
  void set_device_sampling(bool on) { device_sampling_ = on; }

 private:
  Model& model_;
  int eos_;
  int chunk_;
  bool reuse_ = false;
  int vocab_limit_ = 0;  // 0 = the model's vocabulary
  bool device_sampling_ = true;
  std::vector<BlockTable> seqs_;              // per request index: its cache blocks
  std::vector<std::vector<int32_t>> cached_;  // ... and the tokens whose K/V they hold
  GenerateStats stats_;
};

}  // namespace dsv3
