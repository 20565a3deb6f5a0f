// The constants of the vector exp of the SIMD kernels (simd_avx512.h's exp_ps, kernels_avx2.cc's
// exp256): exp(x) = 2^n * p(r), n = round(x log2 e), r = x - n ln 2 (ln 2 split in a high part
// exact in few bits and a low part), p(r) = 1 + r + r^2 (c0 + c1 r + ... + c4 r^4) (relative
// error ~2e-7).
#pragma once

namespace dsv3::cpu {

inline constexpr float kExpLog2e = 1.44269504088896341f;
inline constexpr float kExpLn2Hi = 0.693359375f, kExpLn2Lo = -2.12194440e-4f;
// c4, c3, c2, c1, c0: Horner order.
inline constexpr float kExpPoly[5] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                                      5.0000001201e-1f};

}  // namespace dsv3::cpu
