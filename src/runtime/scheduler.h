// Continuous batching on one Model: the Engine that generate, chat, bench and the HTTP server run.
// Requests join between steps; every step runs the running sequences' next tokens — one token for
// a sequence that decodes, a chunk of its prompt for one that prefills — together, within a token
// budget; a finished or cancelled sequence leaves at once and its KV blocks go back. When blocks
// run out, the newest running sequence is preempted (its blocks freed; it is recomputed from its
// tokens when it runs again, with the same sampler state, so it continues as if never stopped).
// Full blocks are published in the prefix cache (runtime/kv_cache.h): a request whose prompt
// starts with cached blocks computes only the rest.
//
// Threads: submit / cancel / stats / shutdown may be called from any thread. The steps run either
// on a thread of the scheduler's own (start(); serving) or on the caller's (step(),
// run_until_idle(); batch generation and tests). Events come from the thread that steps.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/sampler.h"

namespace dsv3 {

struct SchedulerOptions {
  int eos = -1;              // the end-of-sequence id (-1: none)
  int max_seqs = 64;         // sequences in a step at most
  int max_step_tokens = 2048;  // tokens in a step at most (decodes count one each); the prefill chunk size
  int max_waiting = 0;       // requests queued beyond the running ones before submit refuses (QueueFull); 0: no bound
  bool prefix_cache = true;  // publish full blocks and reuse them
  int vocab_limit = 0;       // sample only ids below it (the tokenizer's size); 0: the model's vocabulary
  bool device_sampling = true;  // draw where the logits are when the backend offers it (only ids come back)
};

// submit() when max_waiting requests already wait: the caller may retry later (HTTP 429).
struct QueueFull : Error {
  using Error::Error;
};

class Scheduler final : public Engine {
 public:
  Scheduler(Model& model, const SchedulerOptions& opt);
  ~Scheduler() override;  // stops the thread (start()) and cancels what is left

  uint64_t submit(EngineRequest req, StreamFn on_event) override;
  void cancel(uint64_t request) override;
  EngineStats stats() const override;
  int max_context() const override;
  int vocab_size() const override;
  void shutdown(double grace_s) override;

  // Runs the steps on a thread of the scheduler's own until shutdown.
  void start();
  // One step on the caller's thread: admits, schedules, runs the model, samples, streams.
  // false when nothing is queued or running. Not with start().
  bool step();
  void run_until_idle();

 private:
  struct Seq;
  void take_incoming();
  // Ends s: its last event (with `tokens`, the last sampled, if any), its blocks back; s is destroyed.
  void finish(Seq& s, Finish f, const std::string& error = "", std::vector<SampledToken> tokens = {});
  void release(Seq& s);
  void publish_full_blocks(Seq& s);
  void preempt(Seq& s);
  void admit(Seq& s);
  void sample_rows(const std::vector<Seq*>& rows, const Model::Batch& batch);
  void emit_token(Seq& s, int32_t id, const float* logits);
  void loop();

  Model& model_;
  KvCache& kv_;
  SchedulerOptions opt_;
  // Shared with the submitting threads.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Seq>> incoming_;
  std::set<uint64_t> cancels_;
  uint64_t next_id_ = 1;
  bool accepting_ = true, stop_ = false;
  EngineStats stats_;
  int queued_ = 0;  // incoming + waiting, for max_waiting
  // The stepping thread's own.
  std::map<uint64_t, std::unique_ptr<Seq>> seqs_;  // every live sequence by id
  std::deque<Seq*> waiting_;                      // admitted in this order (preempted ones first)
  std::vector<Seq*> running_;                     // in arrival order
  std::vector<float> logits_;              // [logit rows, vocab] of the last step (host rows)
  std::vector<int32_t> row_ids_;           // the last step's draws by logit row
  std::vector<const float*> row_logits_;   // ... and the host logits they came from (null: drawn on the backend)
  std::thread thread_;
};

}  // namespace dsv3
