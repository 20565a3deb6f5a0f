#include "backend/cpu/cpu_features.h"

#include <cpuid.h>

#include <cstdint>
#include <cstdlib>

#include "core/error.h"

namespace dsv3::cpu {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAmx: return "amx";
  }
  return "?";
}

bool parse_isa(const std::string& s, Isa* out) {
  for (Isa i : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAmx})
    if (s == isa_name(i)) {
      *out = i;
      return true;
    }
  return false;
}

bool amx_request_permission();  // kernels_amx.cc

namespace {

// CPUID and XGETBV directly (the compilers' __builtin_cpu_supports do not all know BF16/GFNI):
// a feature counts only when the OS also saves its registers (XCR0).
struct Features {
  bool avx2 = false, avx512 = false, amx = false;
  Features() {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
    if (!osxsave || !avx) return;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    const uint64_t xcr0 = (uint64_t(hi) << 32) | lo;
    if ((xcr0 & 0x6) != 0x6) return;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    const bool avx2_ = b & (1u << 5), bmi1 = b & (1u << 3), bmi2 = b & (1u << 8);
    const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
    const bool vbmi = c & (1u << 1), gfni = c & (1u << 8);
    unsigned a1 = 0, b1, c1, d1;
    __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
    const bool bf16 = a1 & (1u << 5);
    avx2 = avx2_ && fma && f16c && bmi1 && bmi2;
    avx512 = avx2 && (xcr0 & 0xE6) == 0xE6 && f && dq && bw && vl && vbmi && gfni && bf16;
    const bool amx_tile = d & (1u << 24), amx_bf16 = d & (1u << 22);
    amx = avx512 && amx_tile && amx_bf16 && (xcr0 & (3ull << 17)) == (3ull << 17) && amx_request_permission();
  }
};

const Features& features() {
  static const Features f;
  return f;
}

}  // namespace

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2: return features().avx2;
    case Isa::kAvx512: return features().avx512;
    case Isa::kAmx: return features().amx;
  }
  return false;
}

Isa best_isa() {
  Isa best = Isa::kScalar;
  for (Isa i : {Isa::kAvx2, Isa::kAvx512, Isa::kAmx})
    if (isa_supported(i)) best = i;
  if (const char* env = std::getenv("DSV3_CPU_ISA"); env && *env) {
    Isa cap;
    if (!parse_isa(env, &cap)) fail("DSV3_CPU_ISA must be scalar, avx2, avx512 or amx, got '", env, "'");
    if (int(cap) < int(best)) best = cap;
  }
  return best;
}

std::string supported_isas() {
  std::string s;
  for (Isa i : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAmx})
    if (isa_supported(i)) s += (s.empty() ? "" : " ") + std::string(isa_name(i));
  return s;
}

}  // namespace dsv3::cpu
