#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace dsv3 {

void SamplingParams::validate() const {
  // Written as !(ok) so that NaN fails every check.
  if (!(temperature >= 0.f && std::isfinite(temperature)))
    fail("sampling: temperature must be a finite number >= 0 (0 = greedy), got ", temperature);
  if (top_k < 0) fail("sampling: top_k must be >= 0 (0 = off), got ", top_k);
  if (!(top_p > 0.f && top_p <= 1.f)) fail("sampling: top_p must be in (0, 1], got ", top_p);
  if (!(min_p >= 0.f && min_p <= 1.f)) fail("sampling: min_p must be in [0, 1], got ", min_p);
  if (!(repetition_penalty > 0.f && std::isfinite(repetition_penalty)))
    fail("sampling: repetition_penalty must be a finite number > 0 (1 = off), got ", repetition_penalty);
  if (!std::isfinite(presence_penalty)) fail("sampling: presence_penalty must be finite, got ", presence_penalty);
  if (!std::isfinite(frequency_penalty))
    fail("sampling: frequency_penalty must be finite, got ", frequency_penalty);
}

namespace {
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

// Refuses logits the distribution cannot be built from; returns the largest.
float check_logits(const float* logits, int vocab) {
  if (vocab <= 0) fail("sampling: vocab size must be positive, got ", vocab);
  if (!logits) fail("sampling: no logits given");
  float mx = -INFINITY;
  for (int i = 0; i < vocab; ++i) {
    float l = logits[i];
    if (std::isnan(l) || l == INFINITY) fail("sampling: logit of token ", i, " is ", l, " (must be finite or -inf)");
    mx = std::max(mx, l);
  }
  if (mx == -INFINITY) fail("sampling: every one of the ", vocab, " logits is -inf");
  return mx;
}

// Lowest id among the largest values.
int32_t argmax(const std::vector<float>& v) {
  int32_t best = 0;
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] > v[size_t(best)]) best = int32_t(i);
  return best;
}
}  // namespace

void Rng::reseed(uint64_t seed) {
  for (auto& s : s_) s = splitmix64(seed);  // never all zero: splitmix64 is a bijection of a counter
}

uint64_t Rng::next() {  // xoshiro256**
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) { params_.validate(); }

std::vector<float> Sampler::penalized_logits(const SamplingParams& p, const float* logits, int vocab,
                                             const std::vector<int32_t>& context) {
  check_logits(logits, vocab);
  std::vector<float> out(logits, logits + vocab);
  if (!p.penalized()) return out;
  const bool rep = p.repetition_penalty != 1.f;
  // Occurrences of each token in the context, kept sparse: the context is short next to the vocab.
  std::vector<int32_t> ids(context);
  for (int32_t id : ids)
    if (id < 0 || id >= vocab) fail("sampling: context token id ", id, " is outside the vocab [0, ", vocab, ")");
  std::sort(ids.begin(), ids.end());
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j < ids.size() && ids[j] == ids[i]) ++j;
    float& l = out[size_t(ids[i])];
    const float count = float(j - i);
    if (l != -INFINITY) {  // a masked token stays masked
      if (rep) l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;  // once per distinct token
      l -= p.presence_penalty + p.frequency_penalty * count;
      if (std::isnan(l) || l == INFINITY)
        fail("sampling: the penalties overflow the logit of token ", ids[i], " (", count, " occurrences)");
    }
    i = j;
  }
  if (*std::max_element(out.begin(), out.end()) == -INFINITY)
    fail("sampling: every logit is -inf after the penalties");
  return out;
}

Sampler::Candidates Sampler::filter(const float* logits, int vocab, const std::vector<int32_t>& context) const {
  const SamplingParams& p = params_;
  std::vector<float> z = penalized_logits(p, logits, vocab, context);
  // Every token with a finite logit is a candidate, most likely first (ties: lower id first).
  Candidates c;
  c.ids.reserve(size_t(vocab));
  for (int32_t i = 0; i < vocab; ++i)
    if (z[size_t(i)] != -INFINITY) c.ids.push_back(i);
  auto before = [&](int32_t a, int32_t b) {
    return z[size_t(a)] > z[size_t(b)] || (z[size_t(a)] == z[size_t(b)] && a < b);
  };
  const double inv_t = 1.0 / double(p.temperature);
  auto weight = [&](int32_t id, double top) { return std::exp((double(z[size_t(id)]) - top) * inv_t); };
  // top-k: exactly the k first in that order (a tie at the boundary goes to the lower ids).
  const bool top_k = p.top_k > 0 && size_t(p.top_k) < c.ids.size();
  if (top_k) {
    std::partial_sort(c.ids.begin(), c.ids.begin() + p.top_k, c.ids.end(), before);
    c.ids.resize(size_t(p.top_k));
  }
  if (p.top_p < 1.f || p.min_p > 0.f) {
    // top-p and min-p keep a prefix of that order. The softmax needs every survivor's weight, but
    // only the prefix needs sorting: the most likely m in order (nth_element, then a sort of m),
    // m growing fourfold until the filters stop inside it; the kept tokens, their order and so
    // their probabilities are those of a full sort.
    if (!top_k) std::iter_swap(c.ids.begin(), std::min_element(c.ids.begin(), c.ids.end(), before));
    const double top = double(z[size_t(c.ids[0])]);
    double all = 0;
    for (int32_t id : c.ids) all += weight(id, top);
    const size_t n = c.ids.size();
    size_t m = std::min<size_t>(n, 256), keep = 0;
    for (;;) {
      if (m < n) std::nth_element(c.ids.begin(), c.ids.begin() + std::ptrdiff_t(m), c.ids.end(), before);
      std::sort(c.ids.begin(), c.ids.begin() + std::ptrdiff_t(m), before);
      // top-p: the shortest prefix whose mass reaches top_p (a token is kept if the mass before
      // it is below top_p, so the most likely token always stays); then min-p within it: tokens
      // at least min_p times as likely as the most likely one.
      double mass = 0;
      keep = 0;
      const double floor = double(p.min_p) * weight(c.ids[0], top) / all;
      while (keep < m && (p.top_p >= 1.f || mass < double(p.top_p))) {
        const double q = weight(c.ids[keep], top) / all;
        if (keep > 0 && p.min_p > 0.f && q < floor) break;
        mass += q, ++keep;
      }
      const bool open = keep == m && (p.top_p >= 1.f || mass < double(p.top_p));  // may go on past m
      if (!open || m == n) break;
      m = std::min(n, 4 * m);
    }
    c.ids.resize(keep);
  } else if (!top_k) {  // no filter needs the order: just bring the most likely token to the front
    std::iter_swap(c.ids.begin(), std::min_element(c.ids.begin(), c.ids.end(), before));
  }
  // Softmax of logit / temperature over the survivors, in double; the first is the largest.
  const double top = double(z[size_t(c.ids[0])]);
  c.probs.resize(c.ids.size());
  for (size_t i = 0; i < c.ids.size(); ++i) c.probs[i] = weight(c.ids[i], top);
  const double sum = std::accumulate(c.probs.begin(), c.probs.end(), 0.0);
  for (double& q : c.probs) q /= sum;
  return c;
}

std::vector<double> Sampler::probabilities(const float* logits, int vocab,
                                           const std::vector<int32_t>& context) const {
  std::vector<double> out(size_t(std::max(vocab, 0)), 0.0);
  if (params_.greedy()) {
    out.at(size_t(argmax(penalized_logits(params_, logits, vocab, context)))) = 1.0;
    return out;
  }
  Candidates c = filter(logits, vocab, context);
  for (size_t i = 0; i < c.ids.size(); ++i) out[size_t(c.ids[i])] = c.probs[i];
  return out;
}

int32_t Sampler::sample(const float* logits, int vocab, const std::vector<int32_t>& context) {
  return sample_at(logits, vocab, context, draw_uniform());
}

int32_t Sampler::sample_at(const float* logits, int vocab, const std::vector<int32_t>& context, double u) const {
  if (params_.greedy()) {
    if (params_.penalized()) return argmax(penalized_logits(params_, logits, vocab, context));
    // No penalties: the checks and the argmax on the row itself (no copy of it).
    check_logits(logits, vocab);
    return int32_t(std::max_element(logits, logits + vocab) - logits);  // the first of the largest
  }
  Candidates c = filter(logits, vocab, context);
  // Inverse CDF; the last kept token absorbs any rounding left over at the top.
  double cum = 0;
  for (size_t i = 0; i + 1 < c.ids.size(); ++i) {
    cum += c.probs[i];
    if (u < cum) return c.ids[i];
  }
  return c.ids.back();
}

}  // namespace dsv3
