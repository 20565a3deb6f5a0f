#include "backend/cpu/floors.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <vector>

#include "backend/cpu/kernels.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace dsv3::cpu {

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
}  // namespace

double read_bandwidth_gbps(ThreadPool& pool, size_t bytes, int reps) {
  const int64_t n = int64_t(bytes / sizeof(float)) / 64 * 64;
  void* p = ::mmap(nullptr, size_t(n) * 4, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) fail("cannot map ", bytes, " bytes for the bandwidth test");
  float* buf = static_cast<float*>(p);
  const Isa isa = best_isa();
  const int threads = pool.size();
  // Each thread touches (and later reads) its own part, so pages sit where that thread runs.
  pool.parallel_for(threads, [&](int64_t b, int64_t e, int) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t lo = n / threads * t, hi = t == threads - 1 ? n : n / threads * (t + 1);
      std::memset(buf + lo, 0, size_t(hi - lo) * 4);
    }
  });
  double best = 0;
  std::atomic<float> sink{0};
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    pool.parallel_for(threads, [&](int64_t b, int64_t e, int) {
      for (int64_t t = b; t < e; ++t) {
        const int64_t lo = n / threads * t, hi = t == threads - 1 ? n : n / threads * (t + 1);
        sink = sink + read_sum(isa, buf + lo, hi - lo);
      }
    });
    best = std::max(best, double(n) * 4 / (now() - t0) / 1e9);
  }
  ::munmap(p, size_t(n) * 4);
  return best;
}

double fma_peak_flops(ThreadPool& pool, Isa isa) {
  const int threads = pool.size();
  std::vector<double> rate(size_t(threads), 0);
  const long iters = isa == Isa::kScalar ? 20'000'000 : 10'000'000;
  for (int rep = 0; rep < 2; ++rep)  // the first round warms up clocks
    pool.parallel_for(threads, [&](int64_t b, int64_t e, int) {
      for (int64_t t = b; t < e; ++t) rate[size_t(t)] = fma_f32_peak_flops_1thread(isa, iters);
    });
  double total = 0;
  for (double r : rate) total += r;
  return total;
}

double matrix_peak_flops(ThreadPool& pool, Isa isa) {
  if (isa != Isa::kAmx) return fma_peak_flops(pool, isa);
  const int threads = pool.size();
  std::vector<double> rate(size_t(threads), 0);
  for (int rep = 0; rep < 2; ++rep)
    pool.parallel_for(threads, [&](int64_t b, int64_t e, int) {
      for (int64_t t = b; t < e; ++t) rate[size_t(t)] = amx_peak_1thread(2'000'000);
    });
  double total = 0;
  for (double r : rate) total += r;
  return total;
}

std::string matrix_arith_name(Isa isa) {
  switch (isa) {
    case Isa::kAmx: return "AMX bf16 tiles (activations as bf16 hi + lo, float32 accumulation)";
    case Isa::kAvx512: return "fp32 FMA (AVX-512, FP8/bf16 weights widened in registers)";
    case Isa::kAvx2: return "fp32 FMA (AVX2)";
    default: return "fp32 (scalar C++)";
  }
}

}  // namespace dsv3::cpu
