// Kernel microbenchmark for the cpu backend: FP8 / bf16 GEMV and GEMM at the 16B shape's sizes,
// on random weights in memory (no checkpoint needed), each beside the floor it should meet:
// weight bytes per second against the measured read bandwidth (decode), FLOP/s against the
// measured FMA peak (prefill). Wall clock and per-thread CPU time are both shown: the machine is
// shared, and CPU time tells compute-bound from waiting.
//   dsv3_kernel_bench [--threads N] [--gb G] [--isa avx512|avx2|scalar]
//   dsv3_kernel_bench --file CHECKPOINT.safetensors [--window-gb 2.8] [--threads N]
// --file: where the weights' memory costs speed. Decode streams a window of a checkpoint (2.8 GB:
// one batch-1 step of the 16B shape) as 4 MB matrices ([2048 x 2048] FP8, as wo); the same bytes
// are read from the file's own pages (MAP_SHARED, as the engine maps checkpoints), from anonymous
// 4 KB pages and from anonymous pages advised MADV_HUGEPAGE, in turn, five rounds, and each
// memory's median GB/s is printed.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <time.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/floors.h"
#include "backend/cpu/kernels.h"
#include "core/dtype.h"
#include "core/thread_pool.h"

using namespace dsv3;
using namespace dsv3::cpu;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
double cpu_now() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

struct Mat {
  std::vector<uint8_t> w;
  std::vector<float> s;
  Linear lin;
  Mat(DType dt, int64_t out, int64_t in) {
    const size_t es = dtype_size(dt);
    w.resize(size_t(out * in) * es);
    std::mt19937 rng(1);
    for (size_t i = 0; i < w.size(); i += 4) {
      uint32_t r = rng();
      std::memcpy(&w[i], &r, std::min<size_t>(4, w.size() - i));
    }
    if (dt == DType::F8_E4M3) {
      // As synth and real checkpoints quantise: uniform values, block amax -> 448. (Uniformly
      // random bytes would make 6% of codes subnormal, which real weights almost never are.)
      std::uniform_real_distribution<float> ud(-448.f, 448.f);
      for (auto& b : w) b = f32_to_e4m3(ud(rng));
      s.assign(size_t(((out + 127) / 128) * ((in + 127) / 128)), 1e-3f);
      lin.scale = {DType::F32, {(out + 127) / 128, (in + 127) / 128}, s.data()};
    } else {  // bf16: keep exponents sane
      for (size_t i = 1; i < w.size(); i += 2) w[i] = uint8_t(0x3c + (w[i] & 3));
    }
    lin.weight = {dt, {out, in}, w.data()};
  }
};

// y = x W^T over the pool (row tiles of 128, as the backend does); returns seconds per call.
double run(ThreadPool& pool, const Kernels& k, const Linear& w, const float* x, int64_t M, float* y,
           std::vector<std::unique_ptr<Scratch>>& scr, int reps, double* cpu_s) {
  const int64_t out = w.out(), tile = 128, items = (out + tile - 1) / tile;
  double best = 1e30, cbest = 0;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now(), c0 = cpu_now();
    pool.parallel_for(items, [&](int64_t b, int64_t e, int t) {
      const int64_t r0 = b * tile, r1 = std::min(out, e * tile);
      k.matmul({x, M, w.in()}, w, {r0, r1 - r0}, {y + r0, out}, *scr[size_t(t)]);
    });
    const double dt = now() - t0;
    if (dt < best) best = dt, cbest = cpu_now() - c0;
  }
  *cpu_s = cbest;
  return best;
}

// The --file mode (see the top of the file): median GB/s of each memory over `rounds` rounds.
int file_mode(ThreadPool& pool, const Kernels& k, std::vector<std::unique_ptr<Scratch>>& scr, const std::string& path,
              double window_gb) {
  constexpr int64_t R = 2048, K = 2048, kMat = R * K;
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return std::fprintf(stderr, "cannot open %s\n", path.c_str()), 1;
  const off_t size = ::lseek(fd, 0, SEEK_END);
  const size_t skip = size_t(1) << 21;  // past the header, 2 MB-aligned in the file
  const int64_t n = std::min<int64_t>(int64_t(window_gb * 1e9) / kMat, (int64_t(size) - int64_t(skip)) / kMat);
  if (n < 1) return std::fprintf(stderr, "%s is too small\n", path.c_str()), 1;
  const size_t bytes = size_t(n * kMat);
  auto* file = static_cast<uint8_t*>(::mmap(nullptr, skip + bytes, PROT_READ, MAP_SHARED, fd, 0));
  ::close(fd);
  if (file == MAP_FAILED) return std::perror("mmap"), 1;
  const uint8_t* src = file + skip;
  auto anon = [&](bool huge) {
    const size_t a = size_t(2) << 20;
    auto* p = static_cast<uint8_t*>(::mmap(nullptr, bytes + a, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (p == MAP_FAILED) std::perror("mmap"), std::exit(1);
    p = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + a - 1) & ~uintptr_t(a - 1));
    if (huge) ::madvise(p, bytes, MADV_HUGEPAGE);
    std::memcpy(p, src, bytes);
    return p;
  };
  const std::array<const uint8_t*, 3> mem = {src, anon(false), anon(true)};
  const char* name[3] = {"file pages (MAP_SHARED)", "anonymous 4 KB pages", "anonymous MADV_HUGEPAGE"};
  std::vector<float> sc(16 * 16, 1e-3f), x(K, 0.5f), y(R);
  std::printf("--file %s: %lld matrices [%lld x %lld] FP8 (%.2f GB) per pass, M=1\n", path.c_str(), (long long)n,
              (long long)R, (long long)K, double(bytes) / 1e9);
  std::vector<double> gbs[3];
  for (int round = 0; round < 5; ++round)
    for (int v = 0; v < 3; ++v) {
      const double t0 = now();
      for (int64_t i = 0; i < n; ++i) {
        Linear w;
        w.weight = {DType::F8_E4M3, {R, K}, mem[size_t(v)] + i * kMat};
        w.scale = {DType::F32, {16, 16}, sc.data()};
        double cs;
        run(pool, k, w, x.data(), 1, y.data(), scr, 1, &cs);
      }
      gbs[v].push_back(double(bytes) / (now() - t0) / 1e9);
    }
  for (int v = 0; v < 3; ++v) {
    std::sort(gbs[v].begin(), gbs[v].end());
    std::printf("%-26s median %.1f GB/s (min %.1f, max %.1f over 5 rounds)\n", name[v], gbs[v][2], gbs[v][0], gbs[v][4]);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2;
  double gb = 1.0;
  Isa isa = best_isa();
  std::string file;
  double window_gb = 2.8;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--threads") threads = std::atoi(argv[i + 1]);
    else if (a == "--file") file = argv[i + 1];
    else if (a == "--window-gb") window_gb = std::atof(argv[i + 1]);
    else if (a == "--gb") gb = std::atof(argv[i + 1]);
    else if (a == "--isa") parse_isa(argv[i + 1], &isa);
  }
  ThreadPool pool(threads);
  const Kernels& k = kernels(isa);
  std::vector<std::unique_ptr<Scratch>> scr;
  for (int t = 0; t < threads; ++t) scr.push_back(std::make_unique<Scratch>());
  if (!file.empty()) return file_mode(pool, k, scr, file, window_gb);
  const double bw = read_bandwidth_gbps(pool, size_t(2e9));
  const double peak = fma_peak_flops(pool, isa);
  std::printf("isa %s, %d threads: read bandwidth %.1f GB/s, fp32 FMA peak %.1f GFLOP/s\n", isa_name(isa), threads, bw,
              peak / 1e9);

  const int64_t K = 2048;
  std::vector<float> x(size_t(512 * 10944));
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  // Decode: a matrix much larger than the caches, streamed once per call.
  for (DType dt : {DType::F8_E4M3, DType::BF16}) {
    const int64_t rows = int64_t(gb * 1e9 / double(K * int64_t(dtype_size(dt)))) / 128 * 128;
    Mat m(dt, rows, K);
    std::vector<float> y(size_t(rows * 8));
    for (int64_t M : {1, 2, 4, 8}) {
      double cs;
      const double t = run(pool, k, m.lin, x.data(), M, y.data(), scr, 3, &cs);
      const double bytes = double(m.w.size());
      std::printf("%-8s GEMV [%lld x %lld] M=%lld: %.2f ms  %.1f GB/s = %.0f%% of read bandwidth  (cpu %.1f GB/s per core)\n",
                  dtype_name(dt), (long long)rows, (long long)K, (long long)M, t * 1e3, bytes / t / 1e9,
                  100 * bytes / t / 1e9 / bw, bytes / cs / 1e9);
    }
  }
  // The same kernels on an L2-resident matrix, one thread, CPU time: the compute cost per weight
  // byte without the memory system (what the decode kernels could stream at, per core).
  for (DType dt : {DType::F8_E4M3, DType::BF16}) {
    const int64_t rows = int64_t(1 << 19) / (K * int64_t(dtype_size(dt))) * 4;
    Mat m(dt, rows, K);
    std::vector<float> y(size_t(rows * 8));
    for (int64_t M : {1, 2, 4, 8}) {
      const int reps = 200;
      k.matmul({x.data(), M, K}, m.lin, {0, rows}, {y.data(), rows}, *scr[0]);
      const double c0 = cpu_now();
      for (int r = 0; r < reps; ++r) k.matmul({x.data(), M, K}, m.lin, {0, rows}, {y.data(), rows}, *scr[0]);
      const double cs = cpu_now() - c0;
      std::printf("%-8s in-cache GEMV [%lld x %lld] M=%lld, 1 thread: %.1f GB/s of weights per core-second\n",
                  dtype_name(dt), (long long)rows, (long long)K, (long long)M, double(m.w.size()) * reps / cs / 1e9);
    }
  }
  // Prefill: 512 tokens through FP8 [2048 x 2048] and [1408 x 2048] (an expert's w1 at 48 tokens).
  for (auto [out, in, M] : std::vector<std::array<int64_t, 3>>{{2048, 2048, 512}, {1408, 2048, 48}, {2048, 1408, 48}}) {
    Mat m(DType::F8_E4M3, out, in);
    std::vector<float> y(size_t(out * M));
    double cs;
    const double t = run(pool, k, m.lin, x.data(), M, y.data(), scr, 3, &cs);
    const double flops = 2.0 * double(out * in * M);
    std::printf("FP8 GEMM [%lld x %lld] M=%lld: %.2f ms  %.1f GFLOP/s = %.0f%% of FMA peak\n", (long long)out,
                (long long)in, (long long)M, t * 1e3, flops / t / 1e9, 100 * flops / t / peak);
  }
  return 0;
}
