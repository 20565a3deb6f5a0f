// What a frontend (generate, chat, the HTTP server) talks to: requests go in with their own
// sampling parameters, tokens stream out through a callback as they are sampled, a request can
// be cancelled at any time. Implementations run their own step loop on one thread; every public
// function here is thread-safe, and callbacks come from the engine's thread (they must not block
// for long: hand the event to your own queue).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/sampler.h"

namespace dsv3 {

struct EngineRequest {
  std::vector<int32_t> prompt;     // token ids, non-empty, each in the vocabulary
  SamplingParams sampling;         // validated by submit()
  int max_tokens = 128;            // generated tokens at most (>= 0); the context also bounds them
  std::vector<int32_t> stop_ids;   // sampling one of these ends the request ("stop"); EOS always does
  int top_logprobs = -1;           // -1: no log-probabilities; 0: the sampled token's; k > 0: also the k most
                                   // likely tokens' (of the distribution before temperature and filters)
  // EOS does not end the request (it is sampled and reported like any other token); stop_ids still
  // do. The HTTP server's `ignore_eos` extension: benchmarks need outputs of an exact length.
  bool ignore_eos = false;
};

enum class Finish { kNone, kStop, kLength, kCancelled, kError };
const char* finish_name(Finish f);  // "", "stop", "length", "cancelled", "error"

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0.f;
};

struct SampledToken {
  int32_t id = 0;                   // a stop id or EOS is reported too (last, with finish kStop)
  float logprob = 0.f;              // when asked (top_logprobs >= 0)
  std::vector<TokenLogprob> top;    // when top_logprobs > 0, most likely first
};

// One callback: new tokens (possibly none), and when finish != kNone, the request is over (the
// last event of this request; its KV blocks are already freed).
struct StreamEvent {
  uint64_t request = 0;
  std::vector<SampledToken> tokens;
  Finish finish = Finish::kNone;
  std::string error;                // with kError: what went wrong, in the caller's terms
  int prompt_tokens = 0;            // on the last event: the prompt's length ...
  int cached_prompt_tokens = 0;     // ... and how much of it came from the prefix cache
  int completion_tokens = 0;        // ... and tokens generated (stop id / EOS excluded)
};
using StreamFn = std::function<void(const StreamEvent&)>;

struct EngineStats {
  int running = 0, waiting = 0;             // requests in a step / queued or preempted
  int64_t kv_blocks_used = 0, kv_blocks_total = 0;
  int64_t prefix_hit_tokens = 0, prefix_query_tokens = 0;  // prompt tokens found cached / looked up
  int64_t prompt_tokens = 0, generation_tokens = 0;         // totals since start
  int64_t preemptions = 0;
  // The model steps since start: how many, the tokens they computed, and the seconds they took
  // (forward and draw); "decode" ones are those where every sequence computed its one next token.
  int64_t steps = 0, step_tokens = 0, decode_steps = 0;
  double step_s = 0, decode_step_s = 0;
};

class Engine {
 public:
  virtual ~Engine() = default;
  // Queues a request; returns its id. Throws Error, naming the number, when it can never run: an
  // empty prompt, an id outside the vocabulary, bad sampling parameters, prompt + max_tokens past
  // the context (max_context()). `on_event` is called for every step that samples for it.
  virtual uint64_t submit(EngineRequest req, StreamFn on_event) = 0;
  // Ends a request at the next step boundary (its last event says kCancelled) and frees its KV
  // blocks; unknown or finished ids are ignored.
  virtual void cancel(uint64_t request) = 0;
  virtual EngineStats stats() const = 0;
  virtual int max_context() const = 0;  // positions one sequence may use (prompt + generated)
  virtual int vocab_size() const = 0;
  // Stops taking requests (submit throws), lets running ones finish for up to `grace_s` seconds,
  // cancels the rest, and returns when the step loop has ended.
  virtual void shutdown(double grace_s) = 0;
};

}  // namespace dsv3
