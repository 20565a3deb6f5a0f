#include "runtime/generate.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "runtime/scheduler.h"

namespace dsv3 {

using Clock = std::chrono::steady_clock;

std::vector<GenerateResult> Generator::run(const std::vector<GenerateRequest>& reqs,
                                           const std::function<void(size_t, int32_t)>& on_token,
                                           const std::atomic<bool>* cancel) {
  if (reqs.empty()) return {};
  const int max_len = model_.max_len();
  SchedulerOptions o;
  o.eos = eos_, o.max_seqs = max_seqs_ > 0 ? max_seqs_ : int(reqs.size()), o.max_step_tokens = std::max(chunk_, 1);
  o.prefix_cache = reuse_, o.vocab_limit = vocab_limit_, o.device_sampling = device_sampling_;
  Scheduler sched(model_, o);
  std::vector<GenerateResult> out(reqs.size());
  std::vector<uint64_t> ids(reqs.size());
  size_t first_tokens = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const GenerateRequest& r = reqs[i];
    if (r.prompt.empty()) fail("request ", i, ": empty prompt");
    if (int64_t(r.prompt.size()) >= max_len)
      fail("request ", i, ": prompt of ", r.prompt.size(), " tokens does not fit the context of ", max_len,
           " tokens (leave room for at least one new token)");
    if (r.max_new_tokens < 0) fail("request ", i, ": max_new_tokens must be >= 0");
    EngineRequest e;
    e.prompt = r.prompt, e.sampling = r.sampling;
    e.max_tokens = std::min<int>(r.max_new_tokens, max_len - int(r.prompt.size()));
    out[i].prompt_tokens = int(r.prompt.size());
    bool first = true;
    try {
      ids[i] = sched.submit(std::move(e), [&, i, first](const StreamEvent& ev) mutable {
        for (const SampledToken& t : ev.tokens) {
          if (first) first = false, ++first_tokens;
          if (on_token) on_token(i, t.id);
          if (ev.finish != Finish::kStop || &t != &ev.tokens.back()) out[i].tokens.push_back(t.id);
        }
        if (ev.finish == Finish::kNone) return;
        out[i].finish_reason = ev.finish == Finish::kError ? "error: " + ev.error : finish_name(ev.finish);
        out[i].reused_prompt_tokens = ev.cached_prompt_tokens;
      });
    } catch (const Error& e) {
      fail("request ", i, ": ", e.what());
    }
  }
  const auto t0 = Clock::now();
  auto t1 = t0;
  bool prefilled = false;
  const EngineStats before = sched.stats();
  while (sched.step()) {
    if (!prefilled && first_tokens == reqs.size()) prefilled = true, t1 = Clock::now();
    if (cancel && cancel->load())
      for (uint64_t id : ids) sched.cancel(id);
  }
  const auto t2 = Clock::now();
  if (!prefilled) t1 = t2;
  for (size_t i = 0; i < reqs.size(); ++i)
    if (out[i].finish_reason.rfind("error: ", 0) == 0) fail("request ", i, ": ", out[i].finish_reason.substr(7));
  const EngineStats after = sched.stats();
  stats_.prompt_tokens += after.prompt_tokens - before.prompt_tokens;
  stats_.generated_tokens += after.generation_tokens - before.generation_tokens;
  stats_.prefill_s += std::chrono::duration<double>(t1 - t0).count();
  stats_.decode_s += std::chrono::duration<double>(t2 - t1).count();
  return out;
}

}  // namespace dsv3
