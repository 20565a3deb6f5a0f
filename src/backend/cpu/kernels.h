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

// Row range of a Linear: rows [r0, r0 + nr) of w.weight ([out, in]).
struct Kernels {
  Isa isa;
  // y[m*ldy + j] = sum_k x[m*ldx + k] * W[r0 + j, k]   (m < M, j < nr, k < W.in())
  // FP8 weights with their 128x128 block scales. Arithmetic: AVX-512: x (times the block scale)
  // rounded to bf16, exact bf16 weights, float32 accumulation; AVX2/scalar: float32.
  void (*matmul)(const float* x, int64_t M, int64_t ldx, const Linear& w, int64_t r0, int64_t nr, float* y,
                 int64_t ldy, Scratch& s);
  // The transposed product over a row range: y[m*ldy + c] = sum_{d < nd} x[m*ldx + d] * W[d0 + d, c]
  // (c < W.in()). Same arithmetic as matmul.
  void (*matmul_t)(const float* x, int64_t M, int64_t ldx, const Linear& w, int64_t d0, int64_t nd, float* y,
                   int64_t ldy, Scratch& s);
  // Float32 products for attention: c[m*ldc + n] = alpha * sum_k a[m*lda + k] * b[n*ldb + k].
  void (*gemm_nt_f32)(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t M, int64_t N, int64_t K,
                      float alpha, float* c, int64_t ldc);
  // o[m*ldo + j] += sum_n p[m*ldp + n] * v[n*ldv + j]   (j < J).
  void (*gemm_nn_acc_f32)(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t M, int64_t N,
                          int64_t J, float* o, int64_t ldo);
  // y[i*d + k] = x[i*stride_x + k] * r_i * w[k], r_i = 1/sqrt(mean(x_i^2) + eps); w float32.
  void (*rmsnorm)(const float* x, int64_t stride_x, int64_t n, int64_t d, const float* w, float eps, float* y,
                  int64_t stride_y);
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
