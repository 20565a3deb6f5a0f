#include "core/tensor.h"

namespace dsv3 {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

float load_f32(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::F32: return t.as<float>()[i];
    case DType::BF16: return bf16_to_f32(t.as<uint16_t>()[i]);
    case DType::F16: return f16_to_f32(t.as<uint16_t>()[i]);
    case DType::F8_E4M3: return e4m3_to_f32(t.as<uint8_t>()[i]);
    default: fail("load_f32: dtype ", dtype_name(t.dtype), " is not a float type");
  }
}

}  // namespace dsv3
