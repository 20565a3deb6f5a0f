#include "backend/ref/rows.h"

#include <cstring>

#include "backend/ref/fp8.h"
#include "core/dtype.h"

namespace dsv3 {

float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void weight_row_f32(const Linear& w, int64_t row, float* out) {
  const int64_t in = w.in();
  if (w.fp8()) {
    const uint8_t* q = w.weight.as<uint8_t>() + row * in;
    const float* s = w.scale.as<float>() + (row / 128) * ((in + 127) / 128);
    for (int64_t k = 0; k < in; ++k) out[k] = kE4m3[q[k]] * s[k / 128];
  } else if (w.weight.dtype == DType::BF16) {
    const uint16_t* q = w.weight.as<uint16_t>() + row * in;
    for (int64_t k = 0; k < in; ++k) out[k] = bf16_to_f32(q[k]);
  } else if (w.weight.dtype == DType::F32) {
    std::memcpy(out, w.weight.as<float>() + row * in, size_t(in) * 4);
  } else {
    for (int64_t k = 0; k < in; ++k) out[k] = load_f32(w.weight, row * in + k);
  }
}

}  // namespace dsv3
