#include "model/rope.h"

#include <algorithm>
#include <cmath>

namespace dsv3 {

std::vector<float> rope_freqs(const ModelArgs& a) {
  const int dim = a.qk_rope_head_dim, half = dim / 2;
  std::vector<float> f(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i)
    f[size_t(i)] = float(1.0 / std::pow(double(a.rope_theta), double(2 * i) / double(dim)));
  if (!a.yarn) return f;
  const double log_base = 2 * std::log(double(a.rope_theta));
  auto correction_dim = [&](double rotations) {
    return dim * std::log(double(a.original_seq_len) / (rotations * 2 * M_PI)) / log_base;
  };
  double low = std::max(std::floor(correction_dim(a.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(a.beta_slow)), double(dim - 1));
  if (low == high) high += 0.001;
  for (int i = 0; i < half; ++i) {
    float ramp = std::clamp(float((i - low) / (high - low)), 0.f, 1.f);
    float smooth = 1.f - ramp;
    f[size_t(i)] = f[size_t(i)] / a.rope_factor * (1.f - smooth) + f[size_t(i)] * smooth;
  }
  return f;
}

static float yarn_mscale(float factor, float m) { return factor <= 1 ? 1.f : 0.1f * m * std::log(factor) + 1.f; }

RopeTable::RopeTable(const ModelArgs& a, int n_positions) : n_pos_(n_positions), half_(a.qk_rope_head_dim / 2) {
  std::vector<float> f = rope_freqs(a);
  float m = a.yarn ? yarn_mscale(a.rope_factor, a.mscale) / yarn_mscale(a.rope_factor, a.mscale_all_dim) : 1.f;
  cos_sin_.resize(size_t(n_positions) * size_t(2 * half_));
  for (int t = 0; t < n_positions; ++t)
    for (int i = 0; i < half_; ++i) {
      float ang = float(t) * f[size_t(i)];
      cos_sin_[size_t(t) * size_t(2 * half_) + size_t(2 * i)] = float(std::cos(double(ang))) * m;
      cos_sin_[size_t(t) * size_t(2 * half_) + size_t(2 * i + 1)] = float(std::sin(double(ang))) * m;
    }
}

}  // namespace dsv3
