// Next-token sampling from one row of logits: penalties (repetition, presence, frequency), then
// temperature, top-k, top-p, min-p, then a draw from the renormalised distribution with the
// sampler's own seeded RNG (deterministic given the seed); temperature 0 is greedy argmax.
#pragma once
#include <cstdint>
#include <vector>

namespace dsv3 {

struct SamplingParams {
  float temperature = 0.f;         // 0 = greedy argmax (after penalties); else logits / temperature
  int top_k = 0;                   // keep the k most likely tokens; 0 = off
  float top_p = 1.f;               // keep the smallest most-likely set with mass >= top_p; 1 = off
  float min_p = 0.f;               // keep tokens with p >= min_p * p_max; 0 = off
  float repetition_penalty = 1.f;  // HF: a logit l of a token seen in the context -> l > 0 ? l / r : l * r
  float presence_penalty = 0.f;    // OpenAI: l -= presence * [count > 0] ...
  float frequency_penalty = 0.f;   // ... + frequency * count (count = occurrences in the context)
  uint64_t seed = 0;

  // Throws Error naming the parameter when it is out of range (temperature < 0, top_k < 0,
  // top_p outside (0, 1], min_p outside [0, 1], repetition_penalty <= 0, anything not finite).
  void validate() const;
  bool greedy() const { return temperature == 0.f; }
  bool penalized() const { return repetition_penalty != 1.f || presence_penalty != 0.f || frequency_penalty != 0.f; }
};

// xoshiro256** (Blackman and Vigna), seeded through splitmix64 so that nearby seeds give
// unrelated streams. Small, fast, and the same on every platform (unlike std:: distributions).
class Rng {
 public:
  explicit Rng(uint64_t seed) { reseed(seed); }
  void reseed(uint64_t seed);
  uint64_t next();
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }  // [0, 1), 53 random bits

 private:
  uint64_t s_[4];
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);  // validates params
  const SamplingParams& params() const { return params_; }
  void reseed(uint64_t seed) { rng_.reseed(seed); }

  // Draws the next token id from logits[0, vocab). `context` is the prompt and the generated ids
  // so far, used only by the penalties (every id must lie in [0, vocab)). Logits may be -inf
  // (never drawn); NaN or +inf is an error, as is a row with no finite logit.
  int32_t sample(const float* logits, int vocab, const std::vector<int32_t>& context);
  // sample() in two halves, for a draw made elsewhere (a backend sampling where the logits are):
  // draw_uniform() advances the RNG as sample() would (no draw for greedy sampling: returns -1),
  // sample_at(..., u) draws with that u. sample() == sample_at(..., draw_uniform()).
  double draw_uniform() { return params_.greedy() ? -1.0 : rng_.uniform(); }
  int32_t sample_at(const float* logits, int vocab, const std::vector<int32_t>& context, double u) const;

  // The exact distribution sample() draws from, as vocab probabilities summing to 1 (zero for
  // filtered-out tokens); for greedy sampling, one-hot at the argmax.
  std::vector<double> probabilities(const float* logits, int vocab, const std::vector<int32_t>& context) const;

  // The logits after the repetition, presence and frequency penalties (the first step).
  static std::vector<float> penalized_logits(const SamplingParams& p, const float* logits, int vocab,
                                             const std::vector<int32_t>& context);

 private:
  struct Candidates {
    std::vector<int32_t> ids;    // kept tokens; the most likely first (all sorted if a filter ran)
    std::vector<double> probs;   // their renormalised probabilities, same order, sum 1
  };
  Candidates filter(const float* logits, int vocab, const std::vector<int32_t>& context) const;

  SamplingParams params_;
  Rng rng_;
};

}  // namespace dsv3
