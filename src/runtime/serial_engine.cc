#include "runtime/serial_engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "core/error.h"

namespace dsv3 {

namespace {

// Log-probabilities from the raw logits [0, L): the log-softmax at `t.id`, and with k > 0 the k
// most likely ids (ties: the lower id first).
void add_logprobs(const float* logits, int L, int k, SampledToken& t) {
  const float mx = *std::max_element(logits, logits + L);
  double sum = 0;
  for (int i = 0; i < L; ++i) sum += std::exp(double(logits[i]) - double(mx));
  const double lse = double(mx) + std::log(sum);
  t.logprob = float(double(logits[t.id]) - lse);
  if (k <= 0) return;
  k = std::min(k, L);
  std::vector<int32_t> ids(static_cast<size_t>(L));
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  t.top.clear();
  for (int i = 0; i < k; ++i) t.top.push_back({ids[size_t(i)], float(double(logits[ids[size_t(i)]]) - lse)});
}

int64_t blocks_for(int64_t positions) {
  return (positions + SerialEngine::kBlockTokens - 1) / SerialEngine::kBlockTokens;
}

}  // namespace

SerialEngine::SerialEngine(Model& model, const Options& opt) : model_(model), opt_(opt) {
  const int V = model.args().vocab_size;
  vocab_ = opt.vocab_limit > 0 ? std::min(opt.vocab_limit, V) : V;
  if (opt_.prefill_chunk < 1) fail("SerialEngine: prefill_chunk must be >= 1, got ", opt_.prefill_chunk);
  stats_.kv_blocks_total = blocks_for(model.max_len());
  worker_ = std::thread([this] { loop(); });
}

SerialEngine::~SerialEngine() { shutdown(0); }

uint64_t SerialEngine::submit(EngineRequest req, StreamFn on_event) {
  const size_t P = req.prompt.size();
  if (P == 0) fail("the prompt is empty");
  for (size_t i = 0; i < P; ++i)
    if (req.prompt[i] < 0 || req.prompt[i] >= vocab_)
      fail("prompt token ", i, " is id ", req.prompt[i], ", outside the vocabulary [0, ", vocab_, ")");
  req.sampling.validate();
  if (req.max_tokens < 0) fail("max_tokens must be >= 0, got ", req.max_tokens);
  if (req.top_logprobs < -1) fail("top_logprobs must be >= -1, got ", req.top_logprobs);
  if (int64_t(P) + req.max_tokens > max_context())
    fail("the prompt's ", P, " tokens + max_tokens ", req.max_tokens, " = ", int64_t(P) + req.max_tokens,
         " exceed the context of ", max_context(), " tokens");
  if (!on_event) fail("submit needs an event callback");
  std::lock_guard<std::mutex> lk(mu_);
  if (!accepting_) fail("the engine is shutting down");
  const uint64_t id = next_id_++;
  queue_.push_back({id, std::move(req), std::move(on_event)});
  stats_.waiting = int(queue_.size());
  cv_.notify_all();
  return id;
}

void SerialEngine::cancel(uint64_t request) {
  std::lock_guard<std::mutex> lk(mu_);
  bool known = request == running_;
  for (const Job& j : queue_) known = known || j.id == request;
  if (known) cancelled_.insert(request);  // unknown and finished ids are not remembered
}

EngineStats SerialEngine::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

void SerialEngine::shutdown(double grace_s) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    accepting_ = false;
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(std::max(0.0, grace_s)));
    if (!draining_ || deadline < deadline_) deadline_ = deadline;  // a later call may only shorten it
    draining_ = true;
    cv_.notify_all();
  }
  std::lock_guard<std::mutex> jl(join_mu_);  // a second caller waits for the first one's join
  if (worker_.joinable()) worker_.join();
}

bool SerialEngine::should_stop(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  return cancelled_.count(id) || (draining_ && std::chrono::steady_clock::now() >= deadline_);
}

void SerialEngine::cancel_queued() {
  std::vector<Job> ended;
  {
    std::lock_guard<std::mutex> lk(mu_);
    const bool past = draining_ && std::chrono::steady_clock::now() >= deadline_;
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (past || cancelled_.count(it->id)) {
        cancelled_.erase(it->id);
        ended.push_back(std::move(*it));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    stats_.waiting = int(queue_.size());
  }
  for (Job& j : ended) {
    StreamEvent ev;
    ev.request = j.id;
    ev.finish = Finish::kCancelled;
    ev.prompt_tokens = int(j.req.prompt.size());
    emit(j, ev);
  }
}

void SerialEngine::emit(Job& job, StreamEvent& ev) {
  try {
    job.fn(ev);
  } catch (const std::exception& e) {  // a frontend's bug must not end the engine's thread
    std::fprintf(stderr, "SerialEngine: the event callback of request %llu threw: %s\n",
                 (unsigned long long)job.id, e.what());
  } catch (...) {
    std::fprintf(stderr, "SerialEngine: the event callback of request %llu threw\n", (unsigned long long)job.id);
  }
}

void SerialEngine::loop() {
  for (;;) {
    cancel_queued();
    Job job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return !queue_.empty() || !accepting_; });
      if (queue_.empty()) return;  // shut down and nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
      running_ = job.id;
      stats_.running = 1;
      stats_.waiting = int(queue_.size());
    }
    run(job);
  }
}

void SerialEngine::run(Job& job) {
  const EngineRequest& r = job.req;
  const int P = int(r.prompt.size());
  StreamEvent ev;
  ev.request = job.id;
  ev.prompt_tokens = P;
  int generated = 0;
  // Positions row 0 holds for this request, for stats(): blocks in use while it runs.
  auto set_positions = [&](int64_t n) {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.kv_blocks_used = blocks_for(n);
  };
  // The last event: the request's blocks are freed and it no longer counts as running.
  auto finish = [&](Finish f, std::string error = {}) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stats_.kv_blocks_used = 0;
      stats_.running = 0;
      running_ = 0;
      cancelled_.erase(job.id);
    }
    ev.finish = f;
    ev.error = std::move(error);
    ev.completion_tokens = generated;
    emit(job, ev);
  };
  try {
    if (should_stop(job.id)) return finish(Finish::kCancelled);
    {
      std::lock_guard<std::mutex> lk(mu_);
      stats_.prompt_tokens += P;
      stats_.prefix_query_tokens += P;  // looked up, never found: this engine keeps no prefix cache
    }
    if (r.max_tokens == 0) return finish(Finish::kLength);
    const int V = model_.args().vocab_size;
    std::vector<float> logits(static_cast<size_t>(V));  // [vocab_size]: the last position's
    for (int b = 0; b < P; b += opt_.prefill_chunk) {
      if (b > 0 && should_stop(job.id)) return finish(Finish::kCancelled);
      const int e = std::min(P, b + opt_.prefill_chunk);
      set_positions(e);
      model_.forward(r.prompt.data() + b, 1, e - b, b, logits.data());
    }
    Sampler sampler(r.sampling);
    std::vector<int32_t> context = r.prompt;
    for (;;) {
      SampledToken t;
      t.id = sampler.sample(logits.data(), vocab_, context);
      if (r.top_logprobs >= 0) add_logprobs(logits.data(), vocab_, r.top_logprobs, t);
      ev.tokens.assign(1, t);
      const bool eos = t.id == opt_.eos_id && !r.ignore_eos;
      if (eos || std::find(r.stop_ids.begin(), r.stop_ids.end(), t.id) != r.stop_ids.end())
        return finish(Finish::kStop);
      ++generated;
      context.push_back(t.id);
      {
        std::lock_guard<std::mutex> lk(mu_);
        stats_.generation_tokens++;
      }
      if (generated >= r.max_tokens || int(context.size()) >= max_context()) return finish(Finish::kLength);
      if (should_stop(job.id)) return finish(Finish::kCancelled);
      emit(job, ev);
      cancel_queued();
      set_positions(int64_t(context.size()));
      model_.forward(&t.id, 1, 1, int(context.size()) - 1, logits.data());
    }
  } catch (const std::exception& e) {
    ev.tokens.clear();
    finish(Finish::kError, e.what());
  }
}

}  // namespace dsv3
