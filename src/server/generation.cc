#include "server/generation.h"

#include "core/error.h"

namespace dsv3::server {

bool ServerShared::reserve(int n) {
  std::lock_guard<std::mutex> lk(mu_);
  if (in_flight_ + n > capacity_) return false;
  in_flight_ += n;
  return true;
}

void ServerShared::release(int n) {
  std::lock_guard<std::mutex> lk(mu_);
  in_flight_ -= n;
  DSV3_CHECK(in_flight_ >= 0, "more engine requests released than reserved");
}

int ServerShared::in_flight() const {
  std::lock_guard<std::mutex> lk(mu_);
  return in_flight_;
}

namespace {
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

Generation::Generation(Engine& engine, std::shared_ptr<ServerShared> shared, const Tokenizer& tok,
                       std::vector<ChoiceSpec> specs, Clock::time_point arrival)
    : engine_(engine), shared_(std::move(shared)), inbox_(std::make_shared<Inbox>()) {
  choices_.reserve(specs.size());
  for (const ChoiceSpec& s : specs) {
    choices_.push_back(Choice{0, false, false, s.prompt, int(s.request.prompt.size()), 0, 0,
                              s.request.top_logprobs >= 0, ChoiceText(tok, s.text)});
  }
  open_ = int(choices_.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    try {
      choices_[i].engine_id = engine_.submit(std::move(specs[i].request), callback(int(i), arrival));
      choices_[i].submitted = true;
    } catch (...) {
      shared_->release(int(specs.size() - i));  // those never submitted; the others end by cancel()
      cancel();
      throw;
    }
  }
}

Generation::~Generation() { cancel(); }

StreamFn Generation::callback(int choice, Clock::time_point arrival) {
  // Runs on the engine's thread: takes the latency metrics, hands the event over, and frees the
  // request's place in the queue at its end (even when nobody polls any more).
  return [inbox = inbox_, shared = shared_, choice, arrival, first = true,
          last = arrival](const StreamEvent& ev) mutable {
    const Clock::time_point now = Clock::now();
    if (!ev.tokens.empty()) {
      if (first) {
        shared->metrics.ttft.observe(seconds(now - arrival));
        first = false;
      } else {  // k tokens in one event: k gaps of a k-th of the time since the last event
        const double gap = seconds(now - last) / double(ev.tokens.size());
        for (size_t i = 0; i < ev.tokens.size(); ++i) shared->metrics.itl.observe(gap);
      }
      last = now;
    }
    if (ev.finish != Finish::kNone) {
      shared->metrics.e2e.observe(seconds(now - arrival));
      if (ev.finish == Finish::kError) shared->metrics.count_error(ErrorKind::kEngine);
      shared->release(1);
    }
    {
      std::lock_guard<std::mutex> lk(inbox->mu);
      inbox->events.emplace_back(choice, ev);
    }
    inbox->cv.notify_all();
  };
}

std::vector<ChoiceUpdate> Generation::poll(double secs) {
  std::deque<std::pair<int, StreamEvent>> events;
  {
    std::unique_lock<std::mutex> lk(inbox_->mu);
    if (inbox_->events.empty() && open_ > 0)
      inbox_->cv.wait_for(lk, std::chrono::duration<double>(secs), [&] { return !inbox_->events.empty(); });
    events.swap(inbox_->events);
  }
  std::vector<ChoiceUpdate> out;
  std::vector<int> slot(choices_.size(), -1);  // choice -> its update in `out`
  for (auto& [c, ev] : events) {
    if (choices_[size_t(c)].done) continue;  // e.g. the engine's end of a choice a stop string ended
    if (slot[size_t(c)] < 0) {
      slot[size_t(c)] = int(out.size());
      out.emplace_back();
      out.back().choice = c;
    }
    apply(c, ev, out[size_t(slot[size_t(c)])]);
  }
  return out;
}

void Generation::apply(int c, const StreamEvent& ev, ChoiceUpdate& u) {
  Choice& ch = choices_[size_t(c)];
  auto end = [&](const char* reason) {
    u.delta.append(ch.text.finish());
    u.finish_reason = reason;
    ch.done = true;
    --open_;
    shared_->metrics.count_finish(reason[0] == 's' ? Finish::kStop : Finish::kLength);
  };
  size_t n = ev.tokens.size();
  if (ev.finish == Finish::kStop && n > 0) --n;  // the stop id or EOS that ended it: no text
  for (size_t i = 0; i < n; ++i) {
    u.delta.append(ch.text.push(ev.tokens[i].id));
    ch.completion_tokens++;
    if (ch.want_logprobs) u.tokens.push_back(ev.tokens[i]);
    if (ch.text.stopped()) {
      engine_.cancel(ch.engine_id);
      return end("stop");
    }
  }
  if (ev.finish == Finish::kNone) return;
  ch.cached_tokens = ev.cached_prompt_tokens;
  u.engine_finish = ev.finish;
  if (ev.finish == Finish::kStop) return end("stop");
  if (ev.finish == Finish::kLength) return end("length");
  u.error = ev.finish == Finish::kCancelled ? "the server is shutting down: the request was cancelled"
                                            : "the engine failed the request: " + ev.error;
  ch.done = true;
  --open_;
}

void Generation::cancel() {
  for (Choice& ch : choices_) {
    if (ch.done) continue;
    if (ch.submitted) engine_.cancel(ch.engine_id);
    ch.done = true;
    --open_;
  }
}

Usage Generation::usage() const {
  Usage u;
  int last_prompt = -1;
  for (const Choice& ch : choices_) {
    if (ch.prompt != last_prompt) {  // choices of one prompt are adjacent; count the prompt once
      u.prompt_tokens += ch.prompt_tokens;
      u.cached_tokens += ch.cached_tokens;
      last_prompt = ch.prompt;
    }
    u.completion_tokens += ch.completion_tokens;
  }
  return u;
}

}  // namespace dsv3::server
