// SerialEngine: the Engine interface over one Model, running ONE request at a time. A worker
// thread takes requests first in, first out; each prefills its prompt from position 0 in cache
// row 0 (no prefix reuse: every request computes the same logits it would alone), then decodes
// token by token until EOS, a stop id, max_tokens or the context ends it, checking for
// cancellation at every step. A stand-in until the continuous-batching scheduler over the paged
// KV cache implements Engine; it deliberately has no features of its own.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "model/model.h"
#include "runtime/engine.h"

namespace dsv3 {

class SerialEngine : public Engine {
 public:
  struct Options {
    int eos_id = -1;          // ends a request (unless ignore_eos); -1: none
    int vocab_limit = 0;      // ids that may be sampled or appear in prompts: [0, vocab_limit); 0 = the model's
    int prefill_chunk = 256;  // prompt tokens per forward call (cancellation is checked between chunks)
  };
  // Positions per KV "block" in stats(): this engine has no paged cache, so it reports the
  // positions row 0 holds for the running request in blocks of this size (0 when idle).
  static constexpr int kBlockTokens = 16;

  SerialEngine(Model& model, const Options& opt);
  ~SerialEngine() override;  // shutdown(0) if not yet shut down
  SerialEngine(const SerialEngine&) = delete;
  SerialEngine& operator=(const SerialEngine&) = delete;

  uint64_t submit(EngineRequest req, StreamFn on_event) override;
  void cancel(uint64_t request) override;
  EngineStats stats() const override;
  int max_context() const override { return model_.max_len(); }
  int vocab_size() const override { return vocab_; }
  void shutdown(double grace_s) override;

 private:
  struct Job {
    uint64_t id = 0;
    EngineRequest req;
    StreamFn fn;
  };
  void loop();
  void run(Job& job);
  bool should_stop(uint64_t id);     // cancelled, or the shutdown deadline passed
  void cancel_queued();              // ends cancelled jobs still in the queue (engine thread)
  void emit(Job& job, StreamEvent& ev);

  Model& model_;
  Options opt_;
  int vocab_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  std::unordered_set<uint64_t> cancelled_;  // ids asked to stop (queued or running)
  uint64_t next_id_ = 1;
  uint64_t running_ = 0;  // id of the running request, 0 when idle
  bool accepting_ = true, stop_now_ = false, draining_ = false;
  std::chrono::steady_clock::time_point deadline_;
  EngineStats stats_;
  std::mutex join_mu_;
  std::thread worker_;
};

}  // namespace dsv3
