#include "runtime/scheduler.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"

namespace dsv3 {

struct Scheduler::Seq {
  uint64_t id = 0, order = 0;
  EngineRequest req;
  StreamFn fn;
  Sampler sampler;
  std::vector<int32_t> tokens;  // the prompt, then the generated ids
  int prompt = 0, generated = 0, cached_prompt = 0;
  int64_t computed = 0;         // positions whose K/V the cache holds
  BlockTable table;
  std::vector<uint64_t> keys;   // prefix-cache keys of its first full blocks (found or published)
  bool looked_up = false;       // the prefix cache was asked since its blocks were last freed
  Seq(EngineRequest r, StreamFn f) : req(std::move(r)), fn(std::move(f)), sampler(req.sampling), tokens(req.prompt) {
    prompt = int(tokens.size());
  }
  int64_t len() const { return int64_t(tokens.size()); }
};

Scheduler::Scheduler(Model& model, const SchedulerOptions& opt) : model_(model), kv_(model.kv_cache()), opt_(opt) {
  if (opt_.max_seqs < 1) fail("max_seqs must be at least 1, got ", opt_.max_seqs);
  if (opt_.max_step_tokens < 1) fail("the step's token budget must be at least 1, got ", opt_.max_step_tokens);
  if (opt_.max_waiting < 0) fail("max_waiting must be >= 0, got ", opt_.max_waiting);
  stats_.kv_blocks_total = kv_.n_blocks();
}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true, accepting_ = false;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (auto& [id, s] : seqs_) kv_.free(s->table);
}

int Scheduler::max_context() const { return model_.max_len(); }
int Scheduler::vocab_size() const {
  const int V = model_.args().vocab_size;
  return opt_.vocab_limit > 0 ? std::min(opt_.vocab_limit, V) : V;
}

uint64_t Scheduler::submit(EngineRequest req, StreamFn on_event) {
  const int V = vocab_size();  // (ids past the tokenizer's are the checkpoint's padding rows)
  if (req.prompt.empty()) fail("empty prompt");
  for (int32_t t : req.prompt)
    if (t < 0 || t >= V) fail("token id ", t, " is outside the vocabulary [0, ", V, ")");
  if (req.max_tokens < 0) fail("max_tokens must be >= 0, got ", req.max_tokens);
  const int64_t need = int64_t(req.prompt.size()) + req.max_tokens;
  if (need > max_context())
    fail("the prompt's ", req.prompt.size(), " tokens + max_tokens ", req.max_tokens, " = ", need,
         " tokens are past the context of ", max_context(), " tokens");
  const int64_t room = kv_.n_blocks() * kv_.block();
  if (need > room)
    fail("the prompt's ", req.prompt.size(), " tokens + max_tokens ", req.max_tokens, " = ", need,
         " positions; the KV cache holds ", room, " (raise --kv-cache-gb)");
  auto s = std::make_unique<Seq>(std::move(req), std::move(on_event));  // (validates the sampling)
  std::lock_guard<std::mutex> lk(mu_);
  if (!accepting_) fail("the engine is shutting down");
  if (opt_.max_waiting > 0 && queued_ >= opt_.max_waiting)
    throw QueueFull(str("queue full: ", queued_, " requests are waiting (at most ", opt_.max_waiting, ")"));
  s->id = s->order = next_id_++;
  ++queued_;
  const uint64_t id = s->id;
  incoming_.push_back(std::move(s));
  cv_.notify_all();
  return id;
}

void Scheduler::cancel(uint64_t request) {
  std::lock_guard<std::mutex> lk(mu_);
  cancels_.insert(request);
  cv_.notify_all();
}

EngineStats Scheduler::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  EngineStats s = stats_;
  s.waiting = queued_;  // submitted or preempted, not yet running
  return s;
}

// New requests into the waiting queue; cancelled ones ended.
void Scheduler::take_incoming() {
  std::deque<std::unique_ptr<Seq>> in;
  std::set<uint64_t> cancels;
  {
    std::lock_guard<std::mutex> lk(mu_);
    in.swap(incoming_);
    cancels.swap(cancels_);
  }
  for (auto& s : in) {
    Seq* p = s.get();
    seqs_[p->id] = std::move(s);
    waiting_.push_back(p);
  }
  for (uint64_t id : cancels) {
    auto it = seqs_.find(id);
    if (it != seqs_.end()) finish(*it->second, Finish::kCancelled);
  }
}

// Publishes the sequence's blocks whose every position is computed (prefix cache).
void Scheduler::publish_full_blocks(Seq& s) {
  if (!opt_.prefix_cache) return;
  const int B = kv_.block();
  for (size_t k = s.keys.size(); int64_t(k + 1) * B <= s.computed; ++k) {
    const uint64_t parent = k ? s.keys[k - 1] : 0;
    const int32_t* toks = s.tokens.data() + k * size_t(B);
    kv_.publish(s.table.blocks[k], parent, toks);
    s.keys.push_back(KvCache::block_hash(parent, toks, B));
  }
}

void Scheduler::release(Seq& s) {
  publish_full_blocks(s);
  kv_.free(s.table);
  s.keys.clear();
  s.computed = 0;
  s.looked_up = false;
}

void Scheduler::finish(Seq& s, Finish f, const std::string& error, std::vector<SampledToken> tokens) {
  StreamEvent ev;
  ev.request = s.id, ev.finish = f, ev.error = error, ev.tokens = std::move(tokens);
  ev.prompt_tokens = s.prompt, ev.cached_prompt_tokens = s.cached_prompt, ev.completion_tokens = s.generated;
  release(s);
  const bool was_waiting = std::find(waiting_.begin(), waiting_.end(), &s) != waiting_.end();
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), &s), waiting_.end());
  running_.erase(std::remove(running_.begin(), running_.end(), &s), running_.end());
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (was_waiting) --queued_;
    stats_.running = int(running_.size());
    stats_.kv_blocks_used = kv_.used_blocks();
  }
  const StreamFn fn = std::move(s.fn);
  seqs_.erase(s.id);
  if (fn) fn(ev);
}

// The newest running sequence goes back to the front of the queue, its blocks freed.
void Scheduler::preempt(Seq& s) {
  release(s);
  running_.erase(std::remove(running_.begin(), running_.end(), &s), running_.end());
  waiting_.push_front(&s);
  std::lock_guard<std::mutex> lk(mu_);
  ++queued_;
  ++stats_.preemptions;
  stats_.running = int(running_.size());
}

// Before a waiting sequence first runs (again): the longest prefix of its tokens the cache holds,
// whole blocks, leaving at least one token to compute (its logits come from it).
void Scheduler::admit(Seq& s) {
  if (s.looked_up || !opt_.prefix_cache) {
    s.looked_up = true;
    return;
  }
  s.looked_up = true;
  const int B = kv_.block();
  const int64_t blocks = (s.len() - 1) / B;
  for (int64_t k = 0; k < blocks; ++k) {
    const uint64_t parent = k ? s.keys[size_t(k - 1)] : 0;
    const int32_t* toks = s.tokens.data() + k * B;
    const int32_t b = kv_.lookup(parent, toks);
    if (b < 0) break;
    s.table.blocks.push_back(b);
    s.keys.push_back(KvCache::block_hash(parent, toks, B));
    s.computed += B;
  }
  if (s.generated == 0) {  // a first run: its prompt counts for the hit rate
    s.cached_prompt = int(s.computed);
    std::lock_guard<std::mutex> lk(mu_);
    stats_.prefix_query_tokens += s.prompt;
    stats_.prefix_hit_tokens += s.computed;
  }
}

bool Scheduler::step() {
  take_incoming();
  if (running_.empty() && waiting_.empty()) return false;
  int64_t budget = opt_.max_step_tokens;
  struct Work {
    Seq* s;
    int64_t n;  // tokens computed this step, from s->computed
  };
  std::vector<Work> plan;
  bool tight = false;  // a running sequence had to be preempted: admit nobody this step
  // Running sequences, oldest first: their next token, or their prompt's next chunk.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Seq* s = running_[i];
    const int64_t n = std::min(s->len() - s->computed, budget);
    bool self = false;
    while (!kv_.grow(s->table, s->computed + n)) {
      tight = true;
      Seq* victim = running_.back();
      self = victim == s;
      preempt(*victim);
      if (self) break;
    }
    if (self) break;
    plan.push_back({s, n});
    budget -= n;
  }
  // Then waiting ones (preempted first, then by arrival) while there is room.
  while (!tight && !waiting_.empty() && int(running_.size()) < opt_.max_seqs && budget > 0) {
    Seq* s = waiting_.front();
    if (s->req.max_tokens == 0) {
      finish(*s, Finish::kLength);
      continue;
    }
    admit(*s);
    const int64_t n = std::min(s->len() - s->computed, budget);
    if (!kv_.grow(s->table, s->computed + n)) break;
    waiting_.pop_front();
    running_.insert(std::upper_bound(running_.begin(), running_.end(), s,
                                     [](const Seq* a, const Seq* b) { return a->order < b->order; }),
                    s);
    {
      std::lock_guard<std::mutex> lk(mu_);
      --queued_;
      stats_.running = int(running_.size());
    }
    plan.push_back({s, n});
    budget -= n;
  }
  if (!plan.empty()) {
    // Single tokens (the decodes) first, then the prompt chunks: a backend may take the two kinds
    // in different forms (the CUDA backend's attention does: absorbed, and over decompressed K/V).
    std::stable_partition(plan.begin(), plan.end(), [](const Work& w) { return w.n == 1; });
    // The batch: each sequence's tokens [computed, computed + n); a logit row where that reaches
    // its last token (it samples the next one).
    Model::Batch batch;
    std::vector<int32_t> ids;
    std::vector<TokenPos> pos;
    std::vector<Seq*> rows;
    for (size_t k = 0; k < plan.size(); ++k) {
      Seq* s = plan[k].s;
      batch.seqs.push_back(&s->table);
      for (int64_t t = s->computed; t < s->computed + plan[k].n; ++t) {
        ids.push_back(s->tokens[size_t(t)]);
        pos.push_back({int32_t(k), int32_t(t)});
      }
      if (s->computed + plan[k].n == s->len()) batch.logit_rows.push_back(int64_t(ids.size()) - 1), rows.push_back(s);
    }
    batch.tokens = ids.data(), batch.pos = pos.data(), batch.n = int64_t(ids.size());
    const bool decode = std::all_of(plan.begin(), plan.end(), [](const Work& w) { return w.s->len() - w.s->computed == 1; });
    const auto t0 = std::chrono::steady_clock::now();
    try {
      sample_rows(rows, batch);
      for (const Work& w : plan) w.s->computed += w.n;
    } catch (const Error& e) {
      for (const Work& w : plan) finish(*w.s, Finish::kError, e.what());  // (frees every w.s)
      plan.clear(), rows.clear();
    }
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lk(mu_);
      ++stats_.steps, stats_.step_tokens += batch.n, stats_.step_s += took;
      if (decode) ++stats_.decode_steps, stats_.decode_step_s += took;
      for (const Work& w : plan)
        if (w.s->generated == 0 && w.s->computed <= w.s->prompt) stats_.prompt_tokens += w.n;
    }
    for (const Work& w : plan) publish_full_blocks(*w.s);
    for (size_t r = 0; r < rows.size(); ++r) emit_token(*rows[r], row_ids_[r], row_logits_[r]);
  }
  std::lock_guard<std::mutex> lk(mu_);
  stats_.running = int(running_.size());
  stats_.kv_blocks_used = kv_.used_blocks();
  return true;
}

// Runs the batch and draws each logit row's token: on the backend where it offers that (only ids
// come back), else on the host from the logits. A row with penalties or log-probabilities asked
// is drawn on the host. Each row's Sampler draws as it would on the host: the same tokens for
// the same seed on every path.
void Scheduler::sample_rows(const std::vector<Seq*>& rows, const Model::Batch& batch) {
  const int V = model_.args().vocab_size;
  const int64_t m = int64_t(rows.size());
  logits_.resize(size_t(std::max<int64_t>(m, 1)) * size_t(V));
  row_ids_.assign(size_t(m), -1);
  row_logits_.assign(size_t(m), nullptr);
  bool greedy = opt_.device_sampling, drawn = false;
  for (Seq* s : rows) {
    const SamplingParams& p = s->sampler.params();
    const bool host = p.penalized() || s->req.top_logprobs >= 0;
    greedy = greedy && p.greedy() && !host;
    drawn = drawn || (!p.greedy() && !host);
  }
  std::vector<int32_t> ids(rows.size(), -1);
  std::vector<double> pre_u(rows.size(), -1.0);
  bool have_ids = false;
  if (m > 0 && greedy) {
    have_ids = model_.forward_greedy(batch, opt_.vocab_limit, ids.data(), logits_.data());
  } else if (m > 0 && opt_.device_sampling && drawn) {
    std::vector<Backend::SampleSpec> spec(rows.size());
    for (int64_t r = 0; r < m; ++r) {
      Seq& s = *rows[size_t(r)];
      const SamplingParams& p = s.sampler.params();
      Backend::SampleSpec& sp = spec[size_t(r)];
      sp.temperature = p.temperature, sp.top_k = p.top_k, sp.top_p = p.top_p, sp.min_p = p.min_p;
      sp.host = p.penalized() || s.req.top_logprobs >= 0;
      if (!sp.host) sp.u = pre_u[size_t(r)] = s.sampler.draw_uniform();
    }
    have_ids = model_.forward_sample(batch, opt_.vocab_limit, spec.data(), ids.data(), logits_.data());
  } else {
    model_.forward(batch, logits_.data());
  }
  for (int64_t r = 0; r < m; ++r) {
    Seq& s = *rows[size_t(r)];
    if (have_ids && ids[size_t(r)] >= 0) {
      row_ids_[size_t(r)] = ids[size_t(r)];
      continue;
    }
    float* row = logits_.data() + r * V;
    if (opt_.vocab_limit > 0 && opt_.vocab_limit < V) std::fill(row + opt_.vocab_limit, row + V, -INFINITY);
    const double u = pre_u[size_t(r)];
    row_ids_[size_t(r)] = u >= 0 ? s.sampler.sample_at(row, V, s.tokens, u) : s.sampler.sample(row, V, s.tokens);
    row_logits_[size_t(r)] = row;
  }
}

// One sampled token of s: streamed, then s ends if it was a stop id (or EOS), the last token
// allowed, or the context is full.
void Scheduler::emit_token(Seq& s, int32_t id, const float* logits) {
  const int lim = vocab_size();
  SampledToken t;
  t.id = id;
  if (s.req.top_logprobs >= 0 && logits) {  // log-softmax of the raw logits (before temperature and filters)
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < lim; ++i) mx = std::max(mx, double(logits[i]));
    for (int i = 0; i < lim; ++i) sum += std::exp(double(logits[i]) - mx);
    const double lse = mx + std::log(sum);
    t.logprob = float(double(logits[id]) - lse);
    if (s.req.top_logprobs > 0) {
      std::vector<int32_t> order(static_cast<size_t>(lim));
      for (int i = 0; i < lim; ++i) order[size_t(i)] = i;
      const size_t k = std::min<size_t>(size_t(s.req.top_logprobs), order.size());
      std::partial_sort(order.begin(), order.begin() + long(k), order.end(),
                        [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
      for (size_t j = 0; j < k; ++j) t.top.push_back({order[j], float(double(logits[order[j]]) - lse)});
    }
  }
  const bool stop = (id == opt_.eos && !s.req.ignore_eos) ||
                    std::find(s.req.stop_ids.begin(), s.req.stop_ids.end(), id) != s.req.stop_ids.end();
  if (!stop) {
    s.tokens.push_back(id);
    ++s.generated;
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.generation_tokens;
  }
  Finish f = Finish::kNone;
  if (stop) f = Finish::kStop;
  else if (s.generated >= s.req.max_tokens || s.len() >= max_context()) f = Finish::kLength;
  if (f != Finish::kNone) return finish(s, f, "", {std::move(t)});  // the token and the end in one event
  StreamEvent ev;
  ev.request = s.id;
  ev.tokens.push_back(std::move(t));
  if (s.fn) s.fn(ev);
}

void Scheduler::run_until_idle() {
  while (step()) {
  }
}

void Scheduler::start() {
  DSV3_CHECK(!thread_.joinable(), "the scheduler's thread started twice");
  thread_ = std::thread([this] { loop(); });
}

void Scheduler::loop() {
  for (;;) {
    bool cancel_all = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (running_.empty() && waiting_.empty())
        cv_.wait(lk, [&] { return stop_ || !incoming_.empty() || !cancels_.empty(); });
      cancel_all = stop_;
    }
    if (cancel_all) {  // shutdown: whatever is left is cancelled
      take_incoming();
      while (!seqs_.empty()) finish(*seqs_.begin()->second, Finish::kCancelled);
      return;
    }
    try {
      step();
    } catch (const std::exception& e) {  // not a request's error: end them all, keep serving
      while (!seqs_.empty()) finish(*seqs_.begin()->second, Finish::kError, e.what());
    }
  }
}

void Scheduler::shutdown(double grace_s) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    accepting_ = false;
  }
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(std::max(grace_s, 0.0));
  if (thread_.joinable()) {
    for (;;) {
      const EngineStats s = stats();
      if ((s.running == 0 && s.waiting == 0) || std::chrono::steady_clock::now() >= end) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    return;
  }
  while (std::chrono::steady_clock::now() < end && step()) {
  }
  take_incoming();
  while (!seqs_.empty()) finish(*seqs_.begin()->second, Finish::kCancelled);
}

}  // namespace dsv3
