// The fast CPU kernels behind the "cpu" backend, one table per instruction set, chosen at run
// time (cpu_features.h). Each kernel has a slow twin in ref/ or in tests/cpu_backend_test.cc.
// Kernels are single-threaded; the backend splits work over the global ThreadPool and gives each
// thread its own Scratch.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cpu/cpu_features.h"
#include "model/weights.h"

namespace dsv3::cpu {

// Per-thread scratch buffers (grow-only, 64-byte aligned).
class Scratch {
 public:
  Scratch() = default;
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  // Buffer `i` (0..kSlots-1) with room for at least `bytes` bytes.
  void* get(int i, size_t bytes);
  template <class T>
  T* get(int i, size_t n) { return static_cast<T*>(get(i, n * sizeof(T))); }
  static constexpr int kSlots = 12;  // kernels use 0-7, the backend 8-11

  // What slot 4 holds packed (kernels_amx.cc), so that a product over the same activations can
  // skip packing them again. invalidate() whenever activation buffers may have changed.
  struct PackKey {
    const float* x = nullptr;
    int64_t m = 0, ld = 0, k = 0;
    int order = 0;
    bool operator==(const PackKey&) const = default;
  };
  bool packed_is(const PackKey& k) const { return packed_valid_ && packed_ == k; }
  void set_packed(const PackKey& k) { packed_ = k, packed_valid_ = true; }
  void invalidate() { packed_valid_ = false; }

 private:
  PackKey packed_;
  bool packed_valid_ = false;
  void* p_[kSlots] = {};
  size_t n_[kSlots] = {};
};

// The operands the kernels pass around. Small and trivially copyable: passed by value, unpacked
// into locals before any loop.
//
// Float32 rows a kernel reads: row i (i < n) at p + i * ld. A product's tokens (one row per token),
// one side of an attention product.
struct Rows {
  const float* p;
  int64_t n;   // rows
  int64_t ld;  // row stride, floats
};
// Float32 rows a kernel writes: row i at p + i * ld (as many rows as the product has).
struct OutRows {
  float* p;
  int64_t ld;  // row stride, floats
};
// Rows [r0, r0 + n) of a Linear's weight ([out, in]).
struct RowRange {
  int64_t r0, n;
};

struct Kernels {
  Isa isa;
  // y[m][j] = sum_k x[m][k] * W[r0 + j, k]   (m < x.n, j < rows.n, k < W.in())
  // FP8 weights with their 128x128 block scales. Arithmetic: AVX-512: x (times the block scale)
  // rounded to bf16, exact bf16 weights, float32 accumulation; AVX2/scalar: float32.
  void (*matmul)(Rows x, const Linear& w, RowRange rows, OutRows y, Scratch& s);
  // The transposed product over a row range: y[m][c] = sum_{d < rows.n} x[m][d] * W[rows.r0 + d, c]
  // (c < W.in()). Same arithmetic as matmul.
  void (*matmul_t)(Rows x, const Linear& w, RowRange rows, OutRows y, Scratch& s);
  // Float32 products for attention: c[m][n] = alpha * sum_{k < K} a[m][k] * b[n][k]   (m < a.n, n < b.n).
  void (*gemm_nt_f32)(Rows a, Rows b, int64_t K, float alpha, OutRows c);
  // o[m][j] += sum_n p[m][n] * v[n][j]   (m < p.n, n < v.n, j < J).
  void (*gemm_nn_acc_f32)(Rows p, Rows v, int64_t J, OutRows o);
  // y[i][k] = x[i][k] * r_i * w[k]   (i < x.n, k < d), r_i = 1/sqrt(mean(x_i^2) + eps); w float32.
  void (*rmsnorm)(Rows x, int64_t d, const float* w, float eps, OutRows y);
  // h[i] = silu(a[i]) * b[i]
  void (*silu_mul)(const float* a, const float* b, int64_t n, float* h);
  // y[i] += alpha * x[i]
  void (*axpy)(float alpha, const float* x, int64_t n, float* y);
  // x[0..n) = softmax(x) in place (float32).
  void (*softmax)(float* x, int64_t n);
};

// The kernels for `isa` (which must be supported: isa_supported).
const Kernels& kernels(Isa isa);

// Per-ISA tables (defined only where the build has them).
extern const Kernels kScalarKernels;
extern const Kernels kAvx2Kernels;
extern const Kernels kAvx512Kernels;
extern const Kernels kAmxKernels;

// The AVX2 table's e4m3 -> float32 conversion (kernels_avx2.cc; both are exact and give identical
// results): 0 picks per CPU (the integer route on AMD), 1 forces the fp16 route, 2 the integer
// route. For tests.
void set_avx2_fp8_route(int route);

// Microbenchmarks for `dsv3 bench`: peaks of the arithmetic the cpu backend uses for large matrix
// products (float32 FMA; AMX bf16 tiles), one thread, FLOP/s, from register-blocked loops of
// `iters` iterations; and a STREAM-style read of n floats.
double fma_f32_peak_flops_1thread(Isa isa, long iters);
double amx_peak_1thread(long iters);  // AMX bf16 tile products (Isa::kAmx only)
float read_sum(Isa isa, const float* p, int64_t n);

}  // namespace dsv3::cpu
