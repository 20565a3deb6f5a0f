#include "model/gate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace dsv3 {

void route_token(const ModelArgs& a, const float* logits, const float* bias, int32_t* indices, float* weights,
                 float* scratch) {
  const int E = a.n_routed_experts, G = a.n_expert_groups, per = E / G, K = a.n_activated_experts;
  float* scores = scratch;      // [E] unbiased
  float* choice = scratch + E;  // [E] biased, masked
  float* gscore = scratch + 2 * E;  // [G]
  // Scores in double, rounded once: float32 implementations differ from each other by a few ulps
  // here (and route_scale multiplies that); the correctly rounded value sits among them.
  if (a.score_func == "softmax") {
    float mx = -std::numeric_limits<float>::infinity();
    for (int e = 0; e < E; ++e) mx = std::max(mx, logits[e]);
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += std::exp(double(logits[e]) - mx);
    for (int e = 0; e < E; ++e) scores[e] = float(std::exp(double(logits[e]) - mx) / sum);
  } else {
    for (int e = 0; e < E; ++e) scores[e] = float(1.0 / (1.0 + std::exp(-double(logits[e]))));
  }
  for (int e = 0; e < E; ++e) choice[e] = bias ? scores[e] + bias[e] : scores[e];
  // Higher score first; equal scores: lower index first.
  auto better = [](const float* v) { return [v](int i, int j) { return v[i] > v[j] || (v[i] == v[j] && i < j); }; };
  if (G > 1) {
    for (int g = 0; g < G; ++g) {
      const float* s = choice + g * per;
      if (!bias) {
        gscore[g] = *std::max_element(s, s + per);
      } else {
        float m1 = -std::numeric_limits<float>::infinity(), m2 = m1;
        for (int i = 0; i < per; ++i) {
          if (s[i] > m1) { m2 = m1; m1 = s[i]; }
          else if (s[i] > m2) m2 = s[i];
        }
        gscore[g] = m1 + m2;
      }
    }
    std::vector<int> gi(static_cast<size_t>(G));
    std::iota(gi.begin(), gi.end(), 0);
    std::partial_sort(gi.begin(), gi.begin() + a.n_limited_groups, gi.end(), better(gscore));
    for (int r = a.n_limited_groups; r < G; ++r)
      for (int i = 0; i < per; ++i) choice[gi[size_t(r)] * per + i] = -std::numeric_limits<float>::infinity();
  }
  // Top-K of the choice scores by a partial selection over indices.
  std::vector<int> ei(static_cast<size_t>(E));
  std::iota(ei.begin(), ei.end(), 0);
  std::partial_sort(ei.begin(), ei.begin() + K, ei.end(), better(choice));
  double sum = 0;
  for (int k = 0; k < K; ++k) {
    indices[k] = ei[k];
    sum += scores[ei[k]];
  }
  for (int k = 0; k < K; ++k) {
    double wk = scores[ei[k]];
    if (a.norm_topk_prob) wk /= sum;
    weights[k] = float(wk * a.route_scale);
  }
}

}  // namespace dsv3
