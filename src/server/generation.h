// One API request in flight: an engine request per prompt and choice, the engine's events
// gathered from the engine's thread (where the latency metrics are taken), and each choice's
// text, built on the HTTP thread that polls it. Destroying a Generation cancels what still runs.
#pragma once
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "server/metrics.h"
#include "server/text_stream.h"

namespace dsv3::server {

using Clock = std::chrono::steady_clock;

// What the server shares with the engine's callbacks (which may outlive a request): the
// metrics and the count of engine requests not yet ended, which bounds the queue.
class ServerShared {
 public:
  explicit ServerShared(int capacity) : capacity_(capacity) {}
  ServerMetrics metrics;
  // Reserves room for n engine requests; false when the queue is full.
  bool reserve(int n);
  void release(int n);
  int in_flight() const;
  int capacity() const { return capacity_; }

 private:
  mutable std::mutex mu_;
  int capacity_;
  int in_flight_ = 0;
};

struct ChoiceSpec {
  EngineRequest request;
  ChoiceTextOptions text;
  int prompt = 0;  // which prompt of the API request it continues
};

// What one choice produced since the last poll.
struct ChoiceUpdate {
  int choice = 0;
  TextDelta delta;
  std::vector<SampledToken> tokens;  // the tokens behind the delta (stop id / EOS left out)
  std::string finish_reason;         // "" while it runs, else "stop" or "length"
  std::string error;                 // the engine failed it, or shutdown cancelled it
  Finish engine_finish = Finish::kNone;
};

struct Usage {
  int prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
};

class Generation {
 public:
  // Submits every choice (reserved in `shared` by the caller, released here as each ends).
  // Throws Error when the engine refuses one; those already submitted are cancelled.
  Generation(Engine& engine, std::shared_ptr<ServerShared> shared, const Tokenizer& tok,
             std::vector<ChoiceSpec> choices, Clock::time_point arrival);
  ~Generation();
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  // Waits up to `seconds` for events and returns the updates they make (none on a timeout).
  std::vector<ChoiceUpdate> poll(double seconds);
  bool done() const { return open_ == 0; }
  int choices() const { return int(choices_.size()); }
  // Ends every choice still running (the client left).
  void cancel();
  Usage usage() const;

 private:
  struct Inbox {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::pair<int, StreamEvent>> events;  // (choice, event)
  };
  struct Choice {
    uint64_t engine_id = 0;
    bool submitted = false, done = false;
    int prompt = 0, prompt_tokens = 0, cached_tokens = 0, completion_tokens = 0;
    bool want_logprobs = false;
    ChoiceText text;
  };
  StreamFn callback(int choice, Clock::time_point arrival);
  void apply(int choice, const StreamEvent& ev, ChoiceUpdate& u);

  Engine& engine_;
  std::shared_ptr<ServerShared> shared_;
  std::shared_ptr<Inbox> inbox_;
  std::vector<Choice> choices_;
  int open_ = 0;  // choices not yet done
};

}  // namespace dsv3::server
