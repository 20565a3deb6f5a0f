// Which instruction sets this CPU offers the "cpu" backend, detected at run time
// (CPUID/XGETBV, and for AMX the OS's permission), so that one generic build runs everywhere and
// uses AVX-512 / AMX where present. DSV3_CPU_ISA=scalar|avx2|avx512|amx caps the choice.
#pragma once
#include <string>

namespace dsv3::cpu {

enum class Isa {
  kScalar = 0,  // plain C++ (the compiler's baseline vectorisation)
  kAvx2 = 1,    // AVX2 + FMA + F16C: float32 arithmetic
  kAvx512 = 2,  // AVX-512 F/BW/VL/DQ + BF16 + VBMI + GFNI: weights widened in registers, float32 FMA
  kAmx = 3,     // kAvx512 + AMX-BF16 tiles for FP8/bf16 products (activations as bf16 hi + lo)
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
