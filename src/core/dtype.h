// Element types of checkpoints and activations, and exact scalar conversions between them
// (bf16 and e4m3 round-to-nearest-even, as torch does).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace dsv3 {

enum class DType : uint8_t { F32, BF16, F16, F8_E4M3, I32, I64, U8 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // safetensors spelling: "F32", "BF16", "F8_E4M3", ...
bool parse_dtype(std::string_view s, DType* out);

inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t bits_from_f32(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }
// Round-to-nearest-even; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_from_f32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; no infinities; 0x7f/0xff are NaN; max 448.
float e4m3_to_f32(uint8_t b);
// Round-to-nearest-even, saturating to +-448 (torch's float->float8_e4m3fn conversion after clamp).
uint8_t f32_to_e4m3(float f);

}  // namespace dsv3
