// The machine's own ceilings, measured (not quoted) for `dsv3 bench` and the kernel benchmark:
// read bandwidth (a STREAM-style multi-threaded sum over a buffer much larger than the caches)
// and the peak of the matrix arithmetic the cpu backend uses (a register-blocked loop of
// independent FMAs with no memory traffic).
#pragma once
#include <cstddef>
#include <string>

#include "backend/cpu/cpu_features.h"

namespace dsv3 {
class ThreadPool;
}

namespace dsv3::cpu {

// Best of `reps` sums over `bytes` bytes split across the pool's threads, in GB/s (1e9 bytes).
double read_bandwidth_gbps(ThreadPool& pool, size_t bytes, int reps = 3);

// Peak float32 FMA rate of all the pool's threads, FLOP/s (2 per FMA lane), timed in each thread's
// CPU time: the hardware's rate even when other processes share the cores.
double fma_peak_flops(ThreadPool& pool, Isa isa);
// Peak of the arithmetic `isa`'s large products use: AMX bf16 tile rate for kAmx, else FMA.
double matrix_peak_flops(ThreadPool& pool, Isa isa);

// What the cpu backend's large products compute with, for reports ("fp32 FMA (AVX-512)").
std::string matrix_arith_name(Isa isa);

}  // namespace dsv3::cpu
