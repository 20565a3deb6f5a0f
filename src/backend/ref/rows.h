// Plain float32 building blocks shared by the ref backend and the CPU backend's scalar kernels
// (its oracle twins): one dot product with a fixed summation order, one weight row as float.
#pragma once
#include <cstdint>

#include "model/weights.h"

namespace dsv3 {

// sum_i a[i] * b[i] over 8 running partial sums, combined pairwise, then the tail.
float dot_f32(const float* a, const float* b, int64_t n);

// Row `row` of a linear weight as float32: FP8 rows times their 128-column block scales, bf16
// widened, other dtypes through load_f32.
void weight_row_f32(const Linear& w, int64_t row, float* out);

}  // namespace dsv3
