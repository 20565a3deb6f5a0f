// Batch generation on one Model: each request gets a KV cache slot, its prompt is prefilled (in
// chunks), then all unfinished requests decode together, one token per step, until EOS or their
// token budget. Equivalent to the reference's generate() (same logits per token) but without
// its padding: prompts of different lengths prefill fully at once.
#pragma once
#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "model/model.h"
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
      : model_(model), eos_(eos_id), chunk_(prefill_chunk), cached_(size_t(model.max_slots())) {}

  // Runs the requests together (request i in cache slot i; at most model.max_slots()). Each
  // generated token is passed to on_token(i, id) as soon as it is sampled (EOS too, last);
  // `cancel` (if given) stops every request at the next step. Throws Error for an empty prompt,
  // a prompt that does not fit the context, ids outside the vocabulary, too many requests.
  std::vector<GenerateResult> run(const std::vector<GenerateRequest>& reqs,
                                  const std::function<void(size_t, int32_t)>& on_token = {},
                                  const std::atomic<bool>* cancel = nullptr);

  const GenerateStats& stats() const { return stats_; }
  // Whether a slot's cache is reused across run() calls: a new prompt sharing a prefix with what
  // the slot holds prefills only the rest (multi-turn chat). Off by default.
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
  std::vector<std::vector<int32_t>> cached_;  // per slot: the tokens whose K/V the cache holds
  GenerateStats stats_;
};

}  // namespace dsv3
