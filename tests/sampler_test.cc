// Sampler: the distribution it draws from is checked against the formulas (penalties,
// temperature, top-k, top-p, min-p) written out here independently, and the draws are checked
// against that distribution statistically, with bounds whose false-failure probability is below
// 1e-6 per test (seeds are fixed, so the tests are also deterministic).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "core/error.h"
#include "runtime/sampler.h"

using namespace dsv3;

namespace {

constexpr float kNegInf = -INFINITY;
constexpr int kDraws = 50000;
// Per-check false-failure probability; a test makes at most ~60 checks (tokens + chi-square).
constexpr double kDelta = 1e-8;

// Regularised upper incomplete gamma Q(a, x) = Gamma(a, x) / Gamma(a): the chi-square survival
// function at 2x with 2a degrees of freedom. Series for x < a + 1, continued fraction otherwise.
double gamma_q(double a, double x) {
  if (x <= 0) return 1.0;
  const double log_front = -x + a * std::log(x) - std::lgamma(a);
  if (x < a + 1) {
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 1000 && term > sum * 1e-16; ++n) sum += term *= x / (a + n);
    return 1.0 - sum * std::exp(log_front);
  }
  // Lentz's method for the continued fraction of Gamma(a, x).
  const double tiny = 1e-300;
  double b = x + 1 - a, c = 1 / tiny, d = 1 / b, h = d;
  for (int n = 1; n < 1000; ++n) {
    double an = -n * (n - a);
    b += 2;
    d = an * d + b;
    if (std::fabs(d) < tiny) d = tiny;
    c = b + an / c;
    if (std::fabs(c) < tiny) c = tiny;
    d = 1 / d;
    double delta = d * c;
    h *= delta;
    if (std::fabs(delta - 1) < 1e-16) break;
  }
  return std::exp(log_front) * h;
}

// Bernstein: P(|X - Np| >= t) <= 2 exp(-t^2 / (2 (Np(1-p) + t/3))) for X ~ Binomial(N, p);
// the t at which that bound equals delta.
double binomial_bound(int n, double p, double delta) {
  const double l = std::log(2 / delta), var = n * p * (1 - p);
  return l / 3 + std::sqrt(l * l / 9 + 2 * var * l);
}

// Draws n tokens and checks them against `expected` (a probability per token): tokens with
// probability 0 are never drawn; every other count lies within its Bernstein bound; and the
// chi-square statistic over those tokens has a p-value above kDelta.
void expect_draws_follow(Sampler& s, const std::vector<float>& logits, const std::vector<int32_t>& context,
                         const std::vector<double>& expected, int n = kDraws) {
  ASSERT_EQ(expected.size(), logits.size());
  std::vector<int> count(logits.size(), 0);
  for (int i = 0; i < n; ++i) {
    int32_t t = s.sample(logits.data(), int(logits.size()), context);
    ASSERT_GE(t, 0);
    ASSERT_LT(size_t(t), logits.size());
    ++count[size_t(t)];
  }
  double chi2 = 0;
  int cells = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double p = expected[i];
    if (p == 0) {
      EXPECT_EQ(count[i], 0) << "token " << i << " was filtered out but drawn";
      continue;
    }
    const double mean = n * p;
    EXPECT_LE(std::fabs(count[i] - mean), binomial_bound(n, p, kDelta))
        << "token " << i << ": " << count[i] << " draws, expected " << mean;
    chi2 += (count[i] - mean) * (count[i] - mean) / mean;
    ++cells;
  }
  if (cells > 1) {
    EXPECT_GT(gamma_q((cells - 1) / 2.0, chi2 / 2), kDelta) << "chi-square " << chi2;
  }
}

std::vector<double> softmax(const std::vector<float>& l, double temperature = 1.0) {
  double mx = -INFINITY;
  for (float x : l) mx = std::max(mx, double(x));
  std::vector<double> p(l.size());
  double sum = 0;
  for (size_t i = 0; i < l.size(); ++i) sum += p[i] = std::exp((double(l[i]) - mx) / temperature);
  for (double& x : p) x /= sum;
  return p;
}

// Zeroes the tokens not in `keep` and renormalises.
std::vector<double> restrict_to(std::vector<double> p, const std::set<int>& keep) {
  double sum = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (!keep.count(int(i))) p[i] = 0;
    sum += p[i];
  }
  for (double& x : p) x /= sum;
  return p;
}

void expect_probs_near(const std::vector<double>& got, const std::vector<double>& want, double tol = 1e-9) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "token " << i;
}

// An oracle written from the definitions (quadratic, no sorting): token j beats i if its logit
// is larger, or equal with a lower id. top-k keeps i if fewer than k tokens beat it; top-p keeps
// i if the tokens beating it hold less than top_p of the mass; min-p keeps i if p_i >= min_p *
// max p. Each step renormalises over what the earlier ones kept.
std::vector<double> oracle(const SamplingParams& sp, const std::vector<float>& logits) {
  const size_t v = logits.size();
  auto beats = [&](size_t j, size_t i) { return logits[j] > logits[i] || (logits[j] == logits[i] && j < i); };
  std::vector<double> p = softmax(logits, sp.temperature);
  std::set<int> keep;
  for (size_t i = 0; i < v; ++i) {
    if (logits[i] == kNegInf) continue;
    size_t better = 0;
    for (size_t j = 0; j < v; ++j) better += logits[j] != kNegInf && beats(j, i);
    if (sp.top_k == 0 || better < size_t(sp.top_k)) keep.insert(int(i));
  }
  p = restrict_to(p, keep);
  std::set<int> keep_p;
  for (int i : keep) {
    double mass = 0;
    for (int j : keep) mass += beats(size_t(j), size_t(i)) ? p[size_t(j)] : 0;
    if (sp.top_p >= 1 || mass < sp.top_p) keep_p.insert(i);
  }
  p = restrict_to(p, keep_p);
  const double mx = *std::max_element(p.begin(), p.end());
  std::set<int> keep_min;
  for (int i : keep_p)
    if (p[size_t(i)] >= sp.min_p * mx) keep_min.insert(i);
  return restrict_to(p, keep_min);
}

SamplingParams params(float temperature, uint64_t seed = 1) {
  SamplingParams p;
  p.temperature = temperature;
  p.seed = seed;
  return p;
}

// Logits whose softmax is exactly q (up to rounding): log q.
std::vector<float> logits_of(const std::vector<double>& q) {
  std::vector<float> l;
  for (double x : q) l.push_back(x > 0 ? float(std::log(x)) : kNegInf);
  return l;
}

// A distribution with distinct, well separated probabilities, most likely id 1:
// sorted: 1 (0.4), 3 (0.3), 4 (0.15), 2 (0.1), 0 (0.05).
const std::vector<double> kQ = {0.05, 0.4, 0.1, 0.3, 0.15};

}  // namespace

TEST(Sampler, ChiSquareSurvivalIsRight) {
  // The statistical helpers themselves, at known values.
  EXPECT_NEAR(gamma_q(0.5, 3.841458820694124 / 2), 0.05, 1e-9);  // chi2(1) 95% point
  EXPECT_NEAR(gamma_q(2.0, 9.487729036781154 / 2), 0.05, 1e-9);  // chi2(4)
  EXPECT_NEAR(gamma_q(5.0, 23.209251158954356 / 2), 0.01, 1e-9); // chi2(10) 99% point
  EXPECT_NEAR(gamma_q(1.0, 2.0), std::exp(-2.0), 1e-12);
  EXPECT_NEAR(gamma_q(3.0, 0.5), 0.9856123220330293, 1e-12);
}

TEST(Sampler, ValidatesParams) {
  auto refused = [](auto edit, const char* what) {
    SamplingParams p = params(1.f);
    edit(p);
    try {
      Sampler s(p);
      ADD_FAILURE() << what << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused([](SamplingParams& p) { p.temperature = -0.1f; }, "temperature");
  refused([](SamplingParams& p) { p.temperature = NAN; }, "temperature");
  refused([](SamplingParams& p) { p.temperature = INFINITY; }, "temperature");
  refused([](SamplingParams& p) { p.top_k = -1; }, "top_k");
  refused([](SamplingParams& p) { p.top_p = 0.f; }, "top_p");
  refused([](SamplingParams& p) { p.top_p = 1.01f; }, "top_p");
  refused([](SamplingParams& p) { p.top_p = NAN; }, "top_p");
  refused([](SamplingParams& p) { p.min_p = -0.01f; }, "min_p");
  refused([](SamplingParams& p) { p.min_p = 1.5f; }, "min_p");
  refused([](SamplingParams& p) { p.repetition_penalty = 0.f; }, "repetition_penalty");
  refused([](SamplingParams& p) { p.repetition_penalty = -1.f; }, "repetition_penalty");
  refused([](SamplingParams& p) { p.presence_penalty = INFINITY; }, "presence_penalty");
  refused([](SamplingParams& p) { p.frequency_penalty = NAN; }, "frequency_penalty");
  SamplingParams edge = params(0.f);
  edge.top_p = 1.f;
  edge.min_p = 1.f;
  edge.top_k = 1 << 30;
  EXPECT_NO_THROW(Sampler{edge});
}

TEST(Sampler, RefusesBadLogitsAndContext) {
  Sampler s(params(1.f));
  std::vector<float> l = {0.f, 1.f, 2.f};
  EXPECT_THROW(s.sample(l.data(), 0, {}), Error);
  EXPECT_THROW(s.sample(nullptr, 3, {}), Error);
  for (float bad : {NAN, INFINITY}) {
    std::vector<float> b = {0.f, bad, 1.f};
    EXPECT_THROW(s.sample(b.data(), 3, {}), Error);
  }
  std::vector<float> masked(3, kNegInf);
  EXPECT_THROW(s.sample(masked.data(), 3, {}), Error);
  SamplingParams rp = params(1.f);
  rp.repetition_penalty = 1.2f;
  Sampler r(rp);
  EXPECT_THROW(r.sample(l.data(), 3, {0, 3}), Error);
  EXPECT_THROW(r.sample(l.data(), 3, {-1}), Error);
  // A penalty that overflows a logit to +inf is refused, not turned into NaN probabilities.
  SamplingParams fp = params(1.f);
  fp.frequency_penalty = -3e38f;
  Sampler f(fp);
  EXPECT_THROW(f.sample(l.data(), 3, {1, 1, 1}), Error);
  // Without penalties the context is not looked at.
  EXPECT_NO_THROW(s.sample(l.data(), 3, {7, -2}));
}

TEST(Sampler, GreedyIsArgmaxWithTiesToTheLowestId) {
  std::vector<float> l = {1.f, 3.f, -2.f, 3.f, 2.5f};
  for (uint64_t seed : {0ull, 1ull, 99ull}) {
    Sampler s(params(0.f, seed));
    for (int i = 0; i < 5; ++i) EXPECT_EQ(s.sample(l.data(), 5, {}), 1);
    expect_probs_near(s.probabilities(l.data(), 5, {}), {0, 1, 0, 0, 0});
  }
  // The filters never remove the argmax, so they do not change greedy.
  SamplingParams f = params(0.f);
  f.top_k = 1;
  f.top_p = 0.1f;
  f.min_p = 0.9f;
  EXPECT_EQ(Sampler(f).sample(l.data(), 5, {}), 1);
  std::vector<float> masked = {kNegInf, kNegInf, -5.f};
  EXPECT_EQ(Sampler(params(0.f)).sample(masked.data(), 3, {}), 2);
}

TEST(Sampler, GreedyAppliesPenaltiesFirst) {
  std::vector<float> l = {1.f, 3.f, -2.f, 3.f, 2.5f};
  SamplingParams p = params(0.f);
  p.repetition_penalty = 2.f;  // 1 and 3 seen: 3 / 2 = 1.5 < 2.5
  EXPECT_EQ(Sampler(p).sample(l.data(), 5, {1, 3}), 4);
  p = params(0.f);
  p.presence_penalty = 0.25f;  // 3 -> 2.75: the argmax moves to the other 3.0
  EXPECT_EQ(Sampler(p).sample(l.data(), 5, {1}), 3);
  p.frequency_penalty = 0.5f;  // token 3 twice: 3 - 0.25 - 1 = 1.75; token 1: 2.25
  EXPECT_EQ(Sampler(p).sample(l.data(), 5, {1, 3, 3}), 4);
}

TEST(Sampler, PenaltiesFollowTheFormulas) {
  std::vector<float> l = {2.0f, -1.0f, 0.5f, 3.0f, -0.5f, 1.0f, kNegInf};
  std::vector<int32_t> ctx = {0, 1, 1, 3, 3, 3, 6};
  SamplingParams p = params(0.8f, 7);
  p.repetition_penalty = 1.5f;
  p.presence_penalty = 0.4f;
  p.frequency_penalty = 0.3f;
  // HF repetition (once per distinct token: l > 0 ? l / r : l * r), then OpenAI presence and
  // frequency (l -= presence + frequency * count); -inf stays -inf.
  std::vector<float> want = {2.0f / 1.5f - 0.4f - 0.3f * 1,
                             -1.0f * 1.5f - 0.4f - 0.3f * 2,
                             0.5f,
                             3.0f / 1.5f - 0.4f - 0.3f * 3,
                             -0.5f,
                             1.0f,
                             kNegInf};
  std::vector<float> got = Sampler::penalized_logits(p, l.data(), int(l.size()), ctx);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_FLOAT_EQ(got[i], want[i]) << "token " << i;
  // Order of the context does not matter, nor the repeats for the repetition penalty.
  std::vector<int32_t> shuffled = {3, 6, 1, 3, 0, 3, 1};
  EXPECT_EQ(Sampler::penalized_logits(p, l.data(), int(l.size()), shuffled), got);

  Sampler s(p);
  // (want differs from got by float rounding in the order of operations: a few ulps.)
  std::vector<double> expected = softmax(want, 0.8f);
  expect_probs_near(s.probabilities(l.data(), int(l.size()), ctx), expected, 1e-6);
  expect_draws_follow(s, l, ctx, expected);

  // Each penalty alone.
  SamplingParams r = params(1.f);
  r.repetition_penalty = 0.5f;  // < 1 encourages repeats
  got = Sampler::penalized_logits(r, l.data(), int(l.size()), {0, 1});
  EXPECT_FLOAT_EQ(got[0], 4.0f);
  EXPECT_FLOAT_EQ(got[1], -0.5f);
  EXPECT_FLOAT_EQ(got[2], 0.5f);
  SamplingParams pr = params(1.f);
  pr.presence_penalty = -1.f;
  got = Sampler::penalized_logits(pr, l.data(), int(l.size()), {2, 2, 2});
  EXPECT_FLOAT_EQ(got[2], 1.5f);
  EXPECT_FLOAT_EQ(got[0], 2.0f);
  SamplingParams fr = params(1.f);
  fr.frequency_penalty = 0.5f;
  got = Sampler::penalized_logits(fr, l.data(), int(l.size()), {2, 2, 2});
  EXPECT_FLOAT_EQ(got[2], -1.0f);
}

TEST(Sampler, TemperatureScalesTheLogits) {
  std::vector<float> l = {0.5f, 1.5f, -0.3f, 1.0f, 0.0f, 2.0f};
  uint64_t seed = 11;
  for (float t : {1.f, 0.5f, 2.f, 0.25f}) {
    SCOPED_TRACE(t);
    Sampler s(params(t, seed++));
    std::vector<double> expected = softmax(l, t);
    expect_probs_near(s.probabilities(l.data(), int(l.size()), {}), expected);
    expect_draws_follow(s, l, {}, expected);
  }
}

TEST(Sampler, MaskedTokensAreNeverDrawn) {
  std::vector<float> l = {kNegInf, 0.f, kNegInf, 1.f, kNegInf};
  Sampler s(params(1.f, 5));
  expect_draws_follow(s, l, {}, softmax(l));
}

TEST(Sampler, TopKKeepsTheKMostLikely) {
  std::vector<float> l = {0.1f, 2.0f, 1.0f, 3.0f, -1.0f, 1.5f};
  SamplingParams p = params(0.7f, 21);
  p.top_k = 3;
  Sampler s(p);
  std::vector<double> expected = restrict_to(softmax(l, 0.7f), {1, 3, 5});
  expect_probs_near(s.probabilities(l.data(), 6, {}), expected);
  expect_draws_follow(s, l, {}, expected);
  // A tie at the boundary goes to the lower id; k past the vocab keeps everything.
  std::vector<float> tie = {1.f, 2.f, 1.f, 1.f};
  p.top_k = 2;
  expect_probs_near(Sampler(p).probabilities(tie.data(), 4, {}), restrict_to(softmax(tie, 0.7f), {0, 1}));
  p.top_k = 100;
  expect_probs_near(Sampler(p).probabilities(tie.data(), 4, {}), softmax(tie, 0.7f));
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  std::vector<float> l = logits_of(kQ);
  struct Case {
    float top_p;
    std::set<int> keep;
  };
  // Mass before each token in order 1, 3, 4, 2, 0: 0, 0.4, 0.7, 0.85, 0.95.
  uint64_t seed = 31;
  for (const Case& c : {Case{0.01f, {1}}, Case{0.35f, {1}}, Case{0.65f, {1, 3}}, Case{0.8f, {1, 3, 4}},
                        Case{0.9f, {1, 3, 4, 2}}, Case{0.99f, {1, 3, 4, 2, 0}}, Case{1.f, {0, 1, 2, 3, 4}}}) {
    SCOPED_TRACE(c.top_p);
    SamplingParams p = params(1.f, seed++);
    p.top_p = c.top_p;
    Sampler s(p);
    std::vector<double> expected = restrict_to(kQ, c.keep);
    expect_probs_near(s.probabilities(l.data(), 5, {}), expected, 1e-6);
    expect_draws_follow(s, l, {}, expected);
  }
}

TEST(Sampler, MinPKeepsTokensNearTheTop) {
  std::vector<float> l = logits_of(kQ);
  struct Case {
    float min_p;
    std::set<int> keep;
  };
  uint64_t seed = 41;
  // p / p_max: 1 -> 1, 3 -> 0.75, 4 -> 0.375, 2 -> 0.25, 0 -> 0.125.
  for (const Case& c : {Case{0.1f, {0, 1, 2, 3, 4}}, Case{0.2f, {1, 2, 3, 4}}, Case{0.3f, {1, 3, 4}},
                        Case{0.5f, {1, 3}}, Case{0.8f, {1}}, Case{1.f, {1}}}) {
    SCOPED_TRACE(c.min_p);
    SamplingParams p = params(1.f, seed++);
    p.min_p = c.min_p;
    Sampler s(p);
    std::vector<double> expected = restrict_to(kQ, c.keep);
    expect_probs_near(s.probabilities(l.data(), 5, {}), expected, 1e-6);
    expect_draws_follow(s, l, {}, expected);
  }
}

TEST(Sampler, FiltersRunInOrderAfterTemperature) {
  std::vector<float> l = logits_of(kQ);
  // top-k before top-p: with k = 4 the mass before token 4 is 0.7 / 0.95 = 0.737 >= 0.72, so it
  // goes; without top-k it is 0.7 < 0.72 and stays.
  SamplingParams p = params(1.f, 51);
  p.top_p = 0.72f;
  expect_probs_near(Sampler(p).probabilities(l.data(), 5, {}), restrict_to(kQ, {1, 3, 4}), 1e-6);
  p.top_k = 4;
  Sampler s(p);
  expect_probs_near(s.probabilities(l.data(), 5, {}), restrict_to(kQ, {1, 3}), 1e-6);
  expect_draws_follow(s, l, {}, restrict_to(kQ, {1, 3}));
  // Temperature before top-p and min-p: T = 2 flattens q to sqrt(q) / sum, in order
  // 1 (.300), 3 (.260), 4 (.184), 2 (.150), 0 (.106); top_p 0.5 keeps 1 and 3, as does min_p 0.8
  // (.260 / .300 = .866); at T = 1 min_p 0.8 keeps token 1 only (.75 < .8).
  SamplingParams t = params(2.f, 52);
  t.top_p = 0.5f;
  expect_probs_near(Sampler(t).probabilities(l.data(), 5, {}), restrict_to(softmax(l, 2.0), {1, 3}), 1e-6);
  t.top_p = 1.f;
  t.min_p = 0.8f;
  Sampler m(t);
  expect_probs_near(m.probabilities(l.data(), 5, {}), restrict_to(softmax(l, 2.0), {1, 3}), 1e-6);
  expect_draws_follow(m, l, {}, restrict_to(softmax(l, 2.0), {1, 3}));
  // Penalties before everything: a penalised favourite drops out of a top-1.
  SamplingParams pen = params(1.f, 53);
  pen.top_k = 1;
  pen.presence_penalty = 10.f;
  expect_probs_near(Sampler(pen).probabilities(l.data(), 5, {1}), {0, 0, 0, 1, 0});
}

TEST(Sampler, MatchesTheDefinitionsOnRandomInputs) {
  // probabilities() against the quadratic oracle on random logits and random filter settings;
  // draws checked on a few of them.
  std::mt19937_64 gen(2024);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  int checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int v = 2 + int(gen() % 9);
    std::vector<float> l(static_cast<size_t>(v));
    for (float& x : l) x = gen() % 8 == 0 ? kNegInf : normal(gen);
    if (*std::max_element(l.begin(), l.end()) == kNegInf) l[0] = 0.f;
    if (trial % 5 == 0) l[1] = l[0];  // exact ties
    SamplingParams p = params(0.3f + 2 * unit(gen), uint64_t(trial));
    p.top_k = int(gen() % 5);
    p.top_p = gen() % 2 ? 1.f : 0.05f + 0.95f * unit(gen);
    p.min_p = gen() % 2 ? 0.f : 0.5f * unit(gen);
    std::vector<double> want = oracle(p, l);
    // Skip draws that sit within rounding of a top-p or min-p boundary.
    std::vector<double> sm = softmax(l, p.temperature);
    bool borderline = false;
    for (size_t i = 0; i < sm.size() && p.min_p > 0; ++i)
      for (size_t j = 0; j < sm.size(); ++j) borderline |= i != j && sm[i] > 0 && std::fabs(sm[j] / sm[i] - p.min_p) < 1e-5;
    if (borderline) continue;
    SCOPED_TRACE(trial);
    Sampler s(p);
    std::vector<double> got = s.probabilities(l.data(), v, {});
    bool same_support = true;
    for (size_t i = 0; i < want.size(); ++i) same_support &= (want[i] > 0) == (got[i] > 0);
    if (!same_support && p.top_p < 1.f) {
      // Tolerate only a top-p boundary within rounding: recompute with a nudged top_p.
      SamplingParams lo = p, hi = p;
      lo.top_p = std::nextafter(p.top_p, 0.f);
      hi.top_p = std::min(1.f, std::nextafter(p.top_p, 2.f));
      if (oracle(lo, l) != want || oracle(hi, l) != want) continue;
    }
    expect_probs_near(got, want, 1e-7);
    if (trial % 30 == 0) expect_draws_follow(s, l, {}, want, 20000);
    ++checked;
  }
  EXPECT_GT(checked, 250);
}

TEST(Sampler, SameSeedSameDrawsDifferentSeedDifferentDraws) {
  std::vector<float> l = {0.f, 0.1f, -0.2f, 0.3f, 0.05f, -0.1f, 0.2f, 0.f};
  auto draws = [&](uint64_t seed) {
    Sampler s(params(1.f, seed));
    std::vector<int32_t> out;
    for (int i = 0; i < 1000; ++i) out.push_back(s.sample(l.data(), 8, {}));
    return out;
  };
  EXPECT_EQ(draws(42), draws(42));
  EXPECT_NE(draws(42), draws(43));
  EXPECT_NE(draws(0), draws(1));
  Sampler s(params(1.f, 42));
  std::vector<int32_t> first;
  for (int i = 0; i < 1000; ++i) first.push_back(s.sample(l.data(), 8, {}));
  s.reseed(42);
  std::vector<int32_t> again;
  for (int i = 0; i < 1000; ++i) again.push_back(s.sample(l.data(), 8, {}));
  EXPECT_EQ(first, again);
  EXPECT_EQ(first, draws(42));
}

// sample() in halves (what a backend sampling where the logits live uses): draw_uniform() then
// sample_at() with that u gives sample()'s draws and leaves the RNG where sample() does; greedy
// sampling draws nothing.
TEST(Sampler, DrawUniformThenSampleAtIsSample) {
  std::vector<float> l = {0.f, 0.1f, -0.2f, 0.3f, 0.05f, -0.1f, 0.2f, 0.f};
  SamplingParams p = params(0.7f, 9);
  p.top_k = 5, p.top_p = 0.9f;
  Sampler whole(p), halves(p);
  for (int i = 0; i < 500; ++i) {
    const double u = halves.draw_uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    EXPECT_EQ(halves.sample_at(l.data(), 8, {}, u), whole.sample(l.data(), 8, {})) << "draw " << i;
  }
  Sampler g(params(0.f, 9));
  EXPECT_LT(g.draw_uniform(), 0.0);
  EXPECT_EQ(g.sample_at(l.data(), 8, {}, -1.0), 3);
}

TEST(Sampler, RngIsUniform) {
  // 64 equal bins of uniform(): chi-square with 63 degrees of freedom; plus range and the mean.
  Rng r(12345);
  const int n = 640000;
  std::vector<int> bins(64, 0);
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    double u = r.uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    ++bins[size_t(u * 64)];
  }
  double chi2 = 0, mean = n / 64.0;
  for (int b : bins) chi2 += (b - mean) * (b - mean) / mean;
  EXPECT_GT(gamma_q(63 / 2.0, chi2 / 2), kDelta) << chi2;
  // Mean of n uniforms: sd sqrt(1/12/n); 6 sd is far beyond 1e-6 false failure.
  EXPECT_NEAR(sum / n, 0.5, 6 * std::sqrt(1.0 / 12 / n));
  // Nearby seeds give unrelated streams; seed 0 is fine.
  Rng a(0), b(1);
  int equal_bits = 0;
  for (int i = 0; i < 100; ++i) equal_bits += 64 - __builtin_popcountll(a.next() ^ b.next());
  EXPECT_NEAR(equal_bits, 3200, 6 * 40);  // Binomial(6400, 1/2): sd 40
}

TEST(Sampler, LargeVocabKeepsOnlyTheTopK) {
  const int v = 129280;
  std::mt19937_64 gen(7);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::vector<float> l(static_cast<size_t>(v));
  for (float& x : l) x = normal(gen);
  std::vector<int32_t> order(static_cast<size_t>(v));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[size_t(a)] > l[size_t(b)]; });
  std::set<int32_t> top40(order.begin(), order.begin() + 40);
  SamplingParams p = params(0.8f, 3);
  p.top_k = 40;
  Sampler s(p);
  for (int i = 0; i < 200; ++i) EXPECT_TRUE(top40.count(s.sample(l.data(), v, {})));
  std::vector<double> probs = s.probabilities(l.data(), v, {});
  EXPECT_NEAR(std::accumulate(probs.begin(), probs.end(), 0.0), 1.0, 1e-12);
  EXPECT_EQ(std::count_if(probs.begin(), probs.end(), [](double x) { return x > 0; }), 40);
  // top-p alone keeps a prefix of the sorted order.
  SamplingParams tp = params(1.f, 4);
  tp.top_p = 0.9f;
  probs = Sampler(tp).probabilities(l.data(), v, {});
  size_t kept = size_t(std::count_if(probs.begin(), probs.end(), [](double x) { return x > 0; }));
  ASSERT_GT(kept, 0u);
  for (size_t i = 0; i < kept; ++i) EXPECT_GT(probs[size_t(order[i])], 0.0);
  std::vector<double> full = softmax(l);
  double mass_before_last = 0;
  for (size_t i = 0; i + 1 < kept; ++i) mass_before_last += full[size_t(order[i])];
  EXPECT_LT(mass_before_last, 0.9);
  EXPECT_GE(mass_before_last + full[size_t(order[kept - 1])], 0.9 - 1e-6);
}

// The filters on a large vocabulary (where only a growing prefix of the order is sorted) against
// the definitions with one full sort: survivors, their probabilities and the draws' support, for
// flat and peaked logits and filters that keep from one token to most of the vocabulary.
TEST(Sampler, LargeVocabFiltersMatchAFullSort) {
  const int v = 20000;
  std::mt19937_64 gen(11);
  for (float spread : {0.05f, 1.f, 4.f}) {
    std::normal_distribution<float> normal(0.f, spread);
    std::vector<float> l(static_cast<size_t>(v));
    for (float& x : l) x = gen() % 50 == 0 ? kNegInf : normal(gen);
    for (int i = 0; i < 100; ++i) l[size_t(gen() % v)] = l[size_t(gen() % v)];  // ties
    struct F {
      float temperature, top_p, min_p;
      int top_k;
    };
    for (const F& f : {F{1.f, 0.9f, 0.f, 0}, F{0.7f, 0.5f, 0.f, 0}, F{1.3f, 0.999f, 0.f, 0}, F{1.f, 1.f, 0.3f, 0},
                       F{1.f, 1.f, 0.001f, 0}, F{0.8f, 0.95f, 0.02f, 0}, F{1.f, 0.9f, 0.f, 3000}, F{1.f, 1e-6f, 0.f, 0}}) {
      SamplingParams p = params(f.temperature, 5);
      p.top_p = f.top_p, p.min_p = f.min_p, p.top_k = f.top_k;
      const std::string what = "spread " + std::to_string(spread) + " t " + std::to_string(f.temperature) + " top_p " +
                               std::to_string(f.top_p) + " min_p " + std::to_string(f.min_p) + " top_k " +
                               std::to_string(f.top_k);
      // The definitions, with one full sort (most likely first, ties to the lower id).
      std::vector<int32_t> order;
      for (int32_t i = 0; i < v; ++i)
        if (l[size_t(i)] != kNegInf) order.push_back(i);
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return l[size_t(a)] > l[size_t(b)] || (l[size_t(a)] == l[size_t(b)] && a < b);
      });
      if (f.top_k > 0) order.resize(size_t(f.top_k));
      std::vector<double> q(order.size());
      double all = 0;
      for (size_t i = 0; i < order.size(); ++i)
        all += q[i] = std::exp((double(l[size_t(order[i])]) - l[size_t(order[0])]) / f.temperature);
      size_t keep = 0;
      double mass = 0;
      while (keep < q.size() && mass < double(f.top_p)) mass += q[keep++] / all;
      size_t keep2 = 1;
      while (keep2 < keep && q[keep2] >= double(f.min_p) * q[0]) ++keep2;
      std::vector<double> want(static_cast<size_t>(v), 0.0);
      double kept = 0;
      for (size_t i = 0; i < keep2; ++i) kept += q[i];
      for (size_t i = 0; i < keep2; ++i) want[size_t(order[i])] = q[i] / kept;
      Sampler s(p);
      const std::vector<double> got = s.probabilities(l.data(), v, {});
      size_t n_got = 0;
      for (size_t i = 0; i < got.size(); ++i) n_got += got[i] > 0;
      EXPECT_EQ(n_got, keep2) << what;
      expect_probs_near(got, want, 1e-9);
      for (int d = 0; d < 20; ++d) EXPECT_GT(want[size_t(s.sample(l.data(), v, {}))], 0.0) << what;
    }
  }
}
