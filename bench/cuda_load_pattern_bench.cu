// How fast the H200 streams a weight matrix under the two load patterns of dsv3's decode GEMVs,
// with no arithmetic in the way (each lane XORs what it loads): "rows" = the FMA GEMV's (a warp
// reads 512 contiguous bytes of one row per load instruction, two rows, four loads per row in
// flight), "tiles" = the tensor-core GEMV's (a warp reads 16 rows; per load instruction 8 rows x
// 64 bytes, four lanes per row; a 3-deep register ring of 128-byte-per-row iterations), and
// "tiles256" = the same with 256 bytes per row per iteration (two deep); "tiles" also with a ring of
// 2 and 1 iterations (the bytes in flight per warp that kernels_tcgemv.cu keeps since run33). Prints GB/s and the
// fraction of the copy bandwidth. Not a test: a measurement for kernels_tcgemv.cu's design.
// --burst-mb M: instead, N = --bursts kernels one after another, each over its own M MB (as a
// decode step's expert stages: one layer's weights per kernel, none of it in L2), recorded as one
// CUDA graph; prints the time per kernel and its bandwidth for each pattern.
// --bps B: blocks of 8 warps per SM (default 2, as the GEMVs), so that the bytes in flight vary
// with the ring depth and the warp count.
//
//   dsv3_cuda_load_pattern_bench [--mb 1024] [--row-bytes 4096] [--reps 20] [--bps 2] [--burst-mb M --bursts 26]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_bench_util.cuh"

namespace {

__device__ __forceinline__ unsigned fold(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

// Row pairs: warp takes rows 2g, 2g + 1; per row 4 loads of 16 bytes per lane in flight.
__global__ void __launch_bounds__(256, 2) rows_kernel(const char* w, int64_t rows, int64_t rb, unsigned* out) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * 8, first = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5);
  unsigned acc = 0;
  for (int64_t g = first; 2 * g < rows; g += warps) {
    const char* a = w + 2 * g * rb;
    const char* b = a + rb;
    for (int64_t o = 16 * lane; o < rb; o += 512 * 4) {
      uint4 va[4], vb[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t off = o + 512 * u;
        if (off < rb) va[u] = ld_nc(a + off), vb[u] = ld_nc(b + off);
        else va[u] = vb[u] = make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) acc ^= fold(va[u]) ^ fold(vb[u]);
    }
  }
  if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads
}

// 16-row tiles: lane (g, c) loads 16 bytes at 16c and 64 + 16c (and, with PER = 256, at 128 + 16c
// and 192 + 16c) of rows g and g + 8 per iteration; NB iterations in a register ring.
template <int PER, int NB>
__global__ void __launch_bounds__(256, 2) tiles_kernel(const char* w, int64_t rows, int64_t rb, unsigned* out) {
  constexpr int NL = PER / 64 * 2;  // loads per lane per iteration
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int64_t warps = int64_t(gridDim.x) * 8, first = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int nit = int(rb / PER);
  unsigned acc = 0;
  for (int64_t t = first; 16 * t < rows; t += warps) {
    const char* a = w + (16 * t + g) * rb + 16 * c;
    const char* b = a + 8 * rb;
    auto load = [&](int i, uint4* r) {
#pragma unroll
      for (int q = 0; q < NL / 2; ++q) {
        r[2 * q] = ld_nc(a + int64_t(i) * PER + 64 * q);
        r[2 * q + 1] = ld_nc(b + int64_t(i) * PER + 64 * q);
      }
    };
    uint4 buf[NB][NL];
#pragma unroll
    for (int s = 0; s < NB; ++s)
      if (s < nit) load(s, buf[s]);
    for (int i = 0; i < nit; i += NB) {
#pragma unroll
      for (int s = 0; s < NB; ++s) {
        if (i + s < nit) {
#pragma unroll
          for (int q = 0; q < NL; ++q) acc ^= fold(buf[s][q]);
          if (i + s + NB < nit) load(i + s + NB, buf[s]);
        }
      }
    }
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

template <typename F>
double time_ms(F f, int reps, cudaStream_t st = nullptr) {
  const std::vector<double> t = time_samples_ms(f, reps, st);
  return t[t.size() / 2];
}
// The load patterns, by name; launched on --bps blocks of 8 warps per SM.
using PatternLaunch = void (*)(dim3, const char*, int64_t, int64_t, unsigned*, cudaStream_t);
struct Pattern {
  const char* name;
  PatternLaunch launch;
};
void launch_rows(dim3 g, const char* w, int64_t rows, int64_t rb, unsigned* out, cudaStream_t st) {
  rows_kernel<<<g, 256, 0, st>>>(w, rows, rb, out);
}
template <int PER, int NB>
void launch_tiles(dim3 g, const char* w, int64_t rows, int64_t rb, unsigned* out, cudaStream_t st) {
  tiles_kernel<PER, NB><<<g, 256, 0, st>>>(w, rows, rb, out);
}
const Pattern kPatterns[] = {
    {"rows (FMA GEMV pattern)", launch_rows},
    {"tiles (tensor-core GEMV, 128 B/row/iter, ring 3)", launch_tiles<128, 3>},
    {"tiles, ring 2 (one weight's ring)", launch_tiles<128, 2>},
    {"tiles, ring 1", launch_tiles<128, 1>},
    {"tiles256 (256 B/row/iter, ring 2)", launch_tiles<256, 2>},
};

}  // namespace

// N kernels of each pattern over N regions of M MB each, as one graph: microseconds per kernel.
int bursts(int64_t burst_mb, int n, int64_t rb, int reps, int sms, int bps) {
  const int64_t rows = (burst_mb << 20) / rb / 16 * 16, bytes = rows * rb;
  char* w = nullptr;
  unsigned* out = nullptr;
  CK(cudaMalloc(&w, size_t(bytes * n)));
  CK(cudaMalloc(&out, sizeof(unsigned)));
  CK(cudaMemset(w, 0x5a, size_t(bytes * n)));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const dim3 grid(unsigned(bps * sms));
  std::printf("%d kernels of %lld rows x %lld bytes (%.1f MB each), one graph, %d blocks per SM\n", n, (long long)rows,
              (long long)rb, double(bytes) / 1e6, bps);
  for (const Pattern& p : kPatterns) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < n; ++i) p.launch(grid, w + int64_t(i) * bytes, rows, rb, out, st);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    const double us = 1e3 * time_ms([&] { CK(cudaGraphLaunch(ge, st)); }, reps, st) / n;
    std::printf("%-52s %8.2f us per kernel  %6.0f GB/s\n", p.name, us, double(bytes) / (us * 1e3));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
  }
  CK(cudaStreamDestroy(st));
  CK(cudaFree(w));
  CK(cudaFree(out));
  return 0;
}

int main(int argc, char** argv) {
  int64_t mb = 1024, rb = 4096, burst_mb = 0;
  int reps = 20, nb = 26, bps = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--mb")) mb = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--row-bytes")) rb = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--burst-mb")) burst_mb = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--bursts")) nb = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--bps")) bps = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr,
                   "usage: dsv3_cuda_load_pattern_bench [--mb N] [--row-bytes B] [--reps N] [--bps B] [--burst-mb M --bursts N]\n");
      return 2;
    }
  }
  if (rb % 256 != 0 || mb <= 0 || burst_mb < 0 || nb < 1 || bps < 1 || bps > 8) {
    std::fprintf(stderr, "--row-bytes must be a multiple of 256, --mb positive, --bursts at least 1, --bps 1-8\n");
    return 2;
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (burst_mb > 0) return bursts(burst_mb, nb, rb, reps, sms, bps);
  const int64_t bytes = mb << 20, rows = bytes / rb / 16 * 16;
  char* w = nullptr;
  char* dst = nullptr;
  unsigned* out = nullptr;
  CK(cudaMalloc(&w, size_t(rows * rb)));
  CK(cudaMalloc(&dst, size_t(rows * rb)));
  CK(cudaMalloc(&out, sizeof(unsigned)));
  CK(cudaMemset(w, 0x5a, size_t(rows * rb)));
  const double gb = double(rows * rb) / 1e9;
  const double copy = time_ms([&] { CK(cudaMemcpyAsync(dst, w, size_t(rows * rb), cudaMemcpyDeviceToDevice)); }, reps);
  const double copy_gbs = 2 * gb / (copy * 1e-3);
  std::printf("%lld rows x %lld bytes (%.2f GB); copy bandwidth %.0f GB/s (read + write); %d blocks per SM\n",
              (long long)rows, (long long)rb, gb, copy_gbs, bps);
  const dim3 grid(unsigned(bps * sms));
  for (const Pattern& p : kPatterns) {
    const double ms = time_ms([&] { p.launch(grid, w, rows, rb, out, nullptr); }, reps);
    CK(cudaGetLastError());
    std::printf("%-52s %8.3f ms  %6.0f GB/s  %5.1f%% of copy\n", p.name, ms, gb / (ms * 1e-3),
                100.0 * gb / (ms * 1e-3) / copy_gbs);
  }
  CK(cudaFree(w));
  CK(cudaFree(dst));
  CK(cudaFree(out));
  return 0;
}
