// Batch generation with the scheduler (runtime/scheduler.h) on the caller's thread: all the
// requests submitted at once, stepped until each ends (EOS, its token budget, the context, or a
// cancel). Equivalent to the reference's generate() (the same logits per token) without its
// padding: prompts of different lengths prefill together, in chunks beside the decodes.
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
  int reused_prompt_tokens = 0;  // prefix found in the prefix cache
};

struct GenerateStats {
  int64_t prompt_tokens = 0, generated_tokens = 0;
  // prefill_s: until every request has its first token; decode_s: the rest.
  double prefill_s = 0, decode_s = 0;
};

class Generator {
 public:
  // prefill_chunk: the most tokens one step computes (decodes and prompt chunks together).
  explicit Generator(Model& model, int eos_id, int prefill_chunk = 256)
      : model_(model), eos_(eos_id), chunk_(prefill_chunk) {}

  // Runs the requests, at most max_seqs at once (the rest queue). Each generated token is passed
  // to on_token(i, id) as soon as it is sampled (EOS too, last); `cancel` (if given) stops every
  // request at the next step. Throws Error for an empty prompt, a prompt that does not fit the
  // context, ids outside the vocabulary, a request larger than the KV cache. max_new_tokens is cut
  // to what the context leaves.
  std::vector<GenerateResult> run(const std::vector<GenerateRequest>& reqs,
                                  const std::function<void(size_t, int32_t)>& on_token = {},
                                  const std::atomic<bool>* cancel = nullptr);

  const GenerateStats& stats() const { return stats_; }
  // Whether full cache blocks are published and reused (runtime/kv_cache.h's prefix cache): a
  // prompt sharing a prefix with an earlier one computes only the rest (multi-turn chat). Off by
  // default.
  void set_reuse_prefix(bool on) { reuse_ = on; }
  // Samples only ids < n: checkpoints pad the vocabulary past the tokenizer's last id (DeepSeek-V3:
  // 129280 rows, 128815 tokens); ids that no tokenizer can decode are never drawn.
  void set_vocab_limit(int n) { vocab_limit_ = n; }
  // Whether steps draw on the backend where it offers that (Backend::argmax_rows /
  // sample_rows) instead of downloading the logits. On by default; off gives the host sampler's
  // path (tests compare the two: the same tokens for the same seeds).
  void set_device_sampling(bool on) { device_sampling_ = on; }
  // Sequences in flight at most (default: all the requests).
  void set_max_seqs(int n) { max_seqs_ = n; }

 private:
  Model& model_;
  int eos_;
  int chunk_;
  bool reuse_ = false;
  int vocab_limit_ = 0;  // 0 = the model's vocabulary
  bool device_sampling_ = true;
  int max_seqs_ = 0;
  GenerateStats stats_;
};

}  // namespace dsv3
