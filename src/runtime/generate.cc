#include "runtime/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"

namespace dsv3 {

using Clock = std::chrono::steady_clock;
static double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

Generator::~Generator() {
  for (BlockTable& t : seqs_) model_.kv_cache().free(t);
}

std::vector<GenerateResult> Generator::run(const std::vector<GenerateRequest>& reqs,
                                           const std::function<void(size_t, int32_t)>& on_token,
                                           const std::atomic<bool>* cancel) {
  const ModelArgs& a = model_.args();
  const int V = a.vocab_size, max_len = model_.max_len();
  if (reqs.empty()) return {};
  KvCache& kvc = model_.kv_cache();
  // Without prefix reuse, every sequence's blocks go back when run() ends (an error included).
  struct Release {
    Generator& g;
    ~Release() {
      if (g.reuse_) return;
      for (BlockTable& t : g.seqs_) g.model_.kv_cache().free(t);
      g.cached_.clear();
    }
  } release{*this};
  if (seqs_.size() < reqs.size()) seqs_.resize(reqs.size()), cached_.resize(reqs.size());
  std::vector<GenerateResult> out(reqs.size());
  std::vector<Sampler> samplers;
  samplers.reserve(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto& p = reqs[i].prompt;
    if (p.empty()) fail("request ", i, ": empty prompt");
    if (int(p.size()) >= max_len)
      fail("request ", i, ": prompt of ", p.size(), " tokens does not fit the context of ", max_len,
           " tokens (leave room for at least one new token)");
    for (int32_t t : p)
      if (t < 0 || t >= V) fail("request ", i, ": token id ", t, " is outside the vocabulary [0, ", V, ")");
    if (reqs[i].max_new_tokens < 0) fail("request ", i, ": max_new_tokens must be >= 0");
    samplers.emplace_back(reqs[i].sampling);
    out[i].prompt_tokens = int(p.size());
  }

  // Prefill: each prompt in chunks (the part not already cached), logits of its last token.
  auto t0 = Clock::now();
  std::vector<float> logits(reqs.size() * size_t(V));
  std::vector<std::vector<int32_t>> ctx(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto& p = reqs[i].prompt;
    size_t start = 0;
    if (reuse_) {
      const auto& c = cached_[i];
      while (start < c.size() && start + 1 < p.size() && c[start] == p[start]) ++start;
    }
    out[i].reused_prompt_tokens = int(start);
    cached_[i].assign(p.begin(), p.begin() + long(start));
    kvc.truncate(seqs_[i], int64_t(start));
    kvc.reserve(seqs_[i], int64_t(p.size()));
    for (size_t b = start; b < p.size(); b += size_t(chunk_)) {
      size_t e = std::min(p.size(), b + size_t(chunk_));
      Model::Batch batch;
      std::vector<TokenPos> pos;
      for (size_t t = b; t < e; ++t) pos.push_back({0, int32_t(t)});
      batch.tokens = p.data() + b, batch.pos = pos.data(), batch.n = int64_t(pos.size());
      batch.seqs = {&seqs_[i]};
      if (e == p.size()) batch.logit_rows.push_back(int64_t(e - b - 1));
      model_.forward(batch, logits.data() + i * size_t(V));
      cached_[i].insert(cached_[i].end(), p.begin() + long(b), p.begin() + long(e));
    }
    ctx[i] = p;
    stats_.prompt_tokens += int64_t(p.size() - start);
  }
  stats_.prefill_s += seconds_since(t0);

  // Decode: sample for every live request, then one batched step for those still going.
  auto t1 = Clock::now();
  std::vector<size_t> live;
  for (size_t i = 0; i < reqs.size(); ++i) {
    if (reqs[i].max_new_tokens == 0) out[i].finish_reason = "length";
    else live.push_back(i);
  }
  bool first = true;
  // A decode step's draws without penalties can happen where the logits are: a backend that
  // offers it takes each row's argmax (argmax_rows: every request greedy) or draws it
  // (sample_rows, with the u each row's sampler drew for it), and only the ids come back; a row
  // it leaves to the host (ids[r] < 0), and every row otherwise, is sampled here from its logits
  // (with that same u where one was drawn: each sampler's stream stays that of the host path).
  std::vector<int32_t> ids;
  std::vector<double> pre_u;  // by position in `live`: the u drawn for this step's row (< 0: none)
  bool have_ids = false;
  while (!live.empty()) {
    std::vector<size_t> next;
    std::vector<int32_t> toks;
    std::vector<TokenPos> pos;
    for (size_t r = 0; r < live.size(); ++r) {
      size_t i = live[r];
      // The first step's logits are laid out by request, later steps' by position in `live`.
      float* row = logits.data() + (first ? i : r) * size_t(V);
      const bool dev = have_ids && ids[r] >= 0;
      if (!dev && vocab_limit_ > 0 && vocab_limit_ < V) std::fill(row + vocab_limit_, row + V, -INFINITY);
      const double u = !first && r < pre_u.size() ? pre_u[r] : -1.0;
      int32_t tok = dev ? ids[r] : (u >= 0 ? samplers[i].sample_at(row, V, ctx[i], u) : samplers[i].sample(row, V, ctx[i]));
      if (on_token) on_token(i, tok);
      if (tok == eos_) {
        out[i].finish_reason = "stop";
        continue;
      }
      out[i].tokens.push_back(tok);
      ctx[i].push_back(tok);
      stats_.generated_tokens++;
      int p = int(ctx[i].size()) - 1;  // position of the new token
      if (int(out[i].tokens.size()) >= reqs[i].max_new_tokens || p >= max_len) {
        out[i].finish_reason = "length";
        continue;
      }
      if (cancel && cancel->load()) {
        out[i].finish_reason = "cancelled";
        continue;
      }
      next.push_back(i);
      toks.push_back(tok);
      pos.push_back({int32_t(next.size() - 1), int32_t(p)});
    }
    live = next;
    first = false;
    if (live.empty()) break;
    Model::Batch batch;
    batch.tokens = toks.data(), batch.pos = pos.data(), batch.n = int64_t(toks.size());
    for (size_t r = 0; r < live.size(); ++r) {
      kvc.reserve(seqs_[live[r]], int64_t(pos[r].pos) + 1);
      batch.seqs.push_back(&seqs_[live[r]]);
      batch.logit_rows.push_back(int64_t(r));
    }
    bool greedy = device_sampling_, drawn = false;
    for (size_t i : live) {
      const SamplingParams& p = samplers[i].params();
      greedy = greedy && p.greedy() && !p.penalized();
      drawn = drawn || (!p.greedy() && !p.penalized());
    }
    ids.resize(live.size());
    pre_u.assign(live.size(), -1.0);
    if (greedy) {
      have_ids = model_.forward_greedy(batch, vocab_limit_, ids.data(), logits.data());
    } else if (device_sampling_ && drawn) {
      std::vector<Backend::SampleSpec> spec(live.size());
      for (size_t r = 0; r < live.size(); ++r) {
        Sampler& s = samplers[live[r]];
        const SamplingParams& p = s.params();
        spec[r].temperature = p.temperature, spec[r].top_k = p.top_k, spec[r].top_p = p.top_p;
        spec[r].min_p = p.min_p, spec[r].host = p.penalized();
        if (!p.penalized()) spec[r].u = pre_u[r] = s.draw_uniform();
      }
      have_ids = model_.forward_sample(batch, vocab_limit_, spec.data(), ids.data(), logits.data());
    } else {
      model_.forward(batch, logits.data());
      have_ids = false;
    }
    for (size_t r = 0; r < live.size(); ++r) cached_[live[r]].push_back(toks[r]);
  }
  stats_.decode_s += seconds_since(t1);
  return out;
}

}  // namespace dsv3
