#include "core/dtype.h"

namespace dsv3 {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::BF16: case DType::F16: return 2;
    case DType::F8_E4M3: case DType::U8: return 1;
    case DType::I64: return 8;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
  }
  return "?";
}

bool parse_dtype(std::string_view s, DType* out) {
  static const struct { const char* n; DType t; } kNames[] = {
      {"F32", DType::F32}, {"BF16", DType::BF16}, {"F16", DType::F16}, {"F8_E4M3", DType::F8_E4M3},
      {"I32", DType::I32}, {"I64", DType::I64},   {"U8", DType::U8}};
  for (auto& e : kNames)
    if (s == e.n) { *out = e.t; return true; }
  return false;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    float v = std::ldexp(float(man), -24);
    return (h & 0x8000) ? -v : v;
  }
  if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (man << 13));
  return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t f32_to_f16(float f) {
  uint32_t u = bits_from_f32(f), sign = (u >> 16) & 0x8000;
  float a = std::fabs(f);
  if (std::isnan(f)) return uint16_t(sign | 0x7e00);
  if (a >= 65520.f) return uint16_t(sign | 0x7c00);
  if (a < 6.103515625e-05f) {  // subnormal: quantum 2^-24, nearbyint is round-half-even
    return uint16_t(sign | uint32_t(std::nearbyint(a * 16777216.f)));
  }
  uint32_t v = bits_from_f32(a);
  v += 0xfffu + ((v >> 13) & 1u);
  return uint16_t(sign | (((v >> 23) - 112) << 10) | ((v >> 13) & 0x3ff));
}

float e4m3_to_f32(uint8_t b) {
  uint32_t exp = (b >> 3) & 0xf, man = b & 7;
  float v;
  if (exp == 0xf && man == 7) return std::nanf("");
  if (exp == 0) v = std::ldexp(float(man), -9);  // subnormal: man/8 * 2^-6
  else v = std::ldexp(1.f + float(man) / 8.f, int(exp) - 7);
  return (b & 0x80) ? -v : v;
}

uint8_t f32_to_e4m3(float f) {
  uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return uint8_t(sign | 0x7f);
  float a = std::fabs(f);
  if (a >= 448.f) return uint8_t(sign | 0x7e);
  if (a < 0.015625f) {  // below 2^-6: subnormal quantum 2^-9, half-even via nearbyint
    int m = int(std::nearbyint(a * 512.f));  // 0..8; 8 rounds up into the first normal
    return uint8_t(sign | m);
  }
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5,1): exponent of a is e-1
  int exp = e - 1;
  float q = std::ldexp(a, -exp) * 8.f;     // in [8,16): 1.mmm * 8
  int m = int(std::nearbyint(q)) - 8;      // round half even on the mantissa
  if (m == 8) { m = 0; ++exp; }
  int be = exp + 7;
  if (be > 15 || (be == 15 && m == 7)) return uint8_t(sign | 0x7e);
  return uint8_t(sign | (be << 3) | m);
}

}  // namespace dsv3
