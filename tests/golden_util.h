// Helpers for comparing against ../shared/golden copies in tests/data/golden.
#pragma once
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include <unistd.h>

#include "core/tensor.h"

namespace dsv3::testing_util {

// A scratch path unique to this process (ctest runs tests in parallel processes).
inline std::string tmp_path(const std::string& name) {
  return ::testing::TempDir() + "/dsv3_" + std::to_string(::getpid()) + "_" + name;
}

inline std::string golden_dir() { return std::string(DSV3_TEST_DATA) + "/golden"; }
inline std::string case_dir(const std::string& c) { return golden_dir() + "/models/" + c; }
inline const std::vector<std::string>& golden_cases() {
  static const std::vector<std::string> k = {"v2lite_bf16", "v2_groups_bf16", "v3_fp8", "v31_fp8_ue8m0", "v3_fp8_long"};
  return k;
}

// Relative L2 error ||got - want|| / ||want|| over n values.
inline double rel_l2(const float* got, const float* want, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    double d = double(got[i]) - double(want[i]);
    num += d * d;
    den += double(want[i]) * double(want[i]);
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

// The largest and the median of errors (not empty), as golden/README.md's table gives them.
inline std::pair<double, double> max_median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.back(), v[v.size() / 2]};
}

inline int argmax(const float* v, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

inline std::vector<float> to_floats(const TensorView& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) out[static_cast<size_t>(i)] = load_f32(t, i);
  return out;
}

}  // namespace dsv3::testing_util
