// What the standalone CUDA benchmarks share: a checked call, event timing, a streaming load.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

// f() timed with events on stream st, reps times after `warm` unrecorded runs: milliseconds, sorted.
// before() runs ahead of each start event (untimed); after() once each recorded run has finished.
template <typename F>
std::vector<double> time_samples_ms(F f, int reps, cudaStream_t st = nullptr, int warm = 2,
                                    const std::function<void()>& before = {}, const std::function<void()>& after = {}) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int r = 0; r < reps + warm; ++r) {
    if (before) before();
    CK(cudaEventRecord(e0, st));
    f();
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= warm) {
      t.push_back(ms);
      if (after) after();
    }
  }
  std::sort(t.begin(), t.end());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return t;
}

// 16 bytes read once: not kept in L1.
__device__ __forceinline__ uint4 ld_nc(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
