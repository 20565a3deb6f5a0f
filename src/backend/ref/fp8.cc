#include "backend/ref/fp8.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "core/dtype.h"
#include "core/error.h"

namespace dsv3 {

static const std::array<float, 256> kTable = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) t[size_t(b)] = e4m3_to_f32(uint8_t(b));
  return t;
}();
const float* const kE4m3 = kTable.data();

void act_quant(const float* x, int64_t rows, int64_t cols, bool ue8m0, uint8_t* y, float* s) {
  DSV3_CHECK(cols % 128 == 0, "act_quant needs cols % 128 == 0, got ", cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < cols / 128; ++b) {
      const float* xb = x + r * cols + b * 128;
      float amax = 0.f;
      for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(xb[i]));
      amax = std::max(amax, 1e-4f);
      // kernel.py writes amax / 448, which Triton evaluates as amax * float(1/448): the golden
      // scales agree with the product bit for bit and differ from the true quotient in the last bit.
      float sc = amax * (1.f / 448.f);
      if (ue8m0) sc = std::exp2(std::ceil(std::log2(sc)));
      s[r * (cols / 128) + b] = sc;
      for (int i = 0; i < 128; ++i) y[r * cols + b * 128 + i] = f32_to_e4m3(xb[i] / sc);
    }
  }
}

void weight_dequant(const uint8_t* q, const float* s, int64_t m, int64_t n, float* y) {
  const int64_t sn = (n + 127) / 128;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) y[i * n + j] = kE4m3[q[i * n + j]] * s[(i / 128) * sn + j / 128];
}

void fp8_gemm(const uint8_t* a, const float* a_s, const uint8_t* b, const float* b_s, int64_t M,
              int64_t N, int64_t K, float* c) {
  DSV3_CHECK(K % 128 == 0, "fp8_gemm needs K % 128 == 0, got ", K);
  const int64_t kb = K / 128;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.f;
      for (int64_t blk = 0; blk < kb; ++blk) {
        float part = 0.f;
        for (int64_t k = blk * 128; k < blk * 128 + 128; ++k) part += kE4m3[a[m * K + k]] * kE4m3[b[n * K + k]];
        acc += part * a_s[m * kb + blk] * b_s[(n / 128) * kb + blk];
      }
      c[m * N + n] = acc;
    }
}

}  // namespace dsv3
