// Which instruction sets this CPU offers the "cpu" backend, detected at run time
// (__builtin_cpu_supports), so that one generic build runs everywhere and uses AVX-512 where
// present. DSV3_CPU_ISA=scalar|avx2|avx512 caps the choice (tests and comparisons).
#pragma once
#include <string>

namespace dsv3::cpu {

enum class Isa {
  kScalar = 0,  // plain C++ (the compiler's baseline vectorisation)
  kAvx2 = 1,    // AVX2 + FMA + F16C: float32 arithmetic
  kAvx512 = 2,  // AVX-512 F/BW/VL/DQ + BF16 + VBMI + GFNI: bf16 dot products, float32 accumulation
};

const char* isa_name(Isa isa);
bool parse_isa(const std::string& s, Isa* out);
// What the hardware (and OS) support, ignoring DSV3_CPU_ISA.
bool isa_supported(Isa isa);
// The best supported ISA, capped by DSV3_CPU_ISA when set (an unknown value is an Error).
Isa best_isa();
// All supported ISAs, lowest first.
std::string supported_isas();

}  // namespace dsv3::cpu
