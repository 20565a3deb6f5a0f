// The reference's FP8 kernels (inference/kernel.py) as plain functions: the oracle the fast
// CPU and CUDA versions are checked against. Block size 128 throughout.
#pragma once
#include <cstdint>
#include <string>

namespace dsv3 {

// act_quant(x, 128, scale_fmt): per 128 consecutive values of each row, s = max(amax, 1e-4)·(1/448)
// (ue8m0: s = 2^ceil(log2 s)), y = e4m3(x / s) round-to-nearest-even, saturating.
// x: [rows, cols] float (cols % 128 == 0); y: [rows, cols] e4m3 bits; s: [rows, cols/128].
void act_quant(const float* x, int64_t rows, int64_t cols, bool ue8m0, uint8_t* y, float* s);

// weight_dequant: y[i, j] = e4m3(q[i, j]) * s[i/128, j/128]; q: [m, n]; s: [ceil(m/128), ceil(n/128)].
void weight_dequant(const uint8_t* q, const float* s, int64_t m, int64_t n, float* y);

// fp8_gemm: c[m, n] = sum_k a[m,k] a_s[m,k/128] b[n,k] b_s[n/128,k/128], float32 accumulation
// per 128-wide K block (as the Triton kernel does). a: [M, K], a_s: [M, K/128], b: [N, K],
// b_s: [ceil(N/128), K/128]. K % 128 == 0. Result in float (the kernel rounds to bf16 after).
void fp8_gemm(const uint8_t* a, const float* a_s, const uint8_t* b, const float* b_s, int64_t M,
              int64_t N, int64_t K, float* c);

// e4m3 decoding table: kE4m3[b] == e4m3_to_f32(b).
extern const float* const kE4m3;

}  // namespace dsv3
