// The kernel trace of a DSV3_TRACE=1 build (a measurement aid; common.cuh records): one buffer
// bound into every translation unit, dumped as text in launch order.
#include <cstdio>
#include <vector>

#include "backend/cuda/common.cuh"

namespace dsv3::cuda {

#if DSV3_TRACE
namespace {
struct Unit {
  void (*bind)(TraceBuf*, unsigned);
  const char* name;
};
std::vector<Unit>& units() {
  static std::vector<Unit> u;
  return u;
}
TraceBuf* g_buf = nullptr;
}  // namespace

void trace_register(void (*bind)(TraceBuf*, unsigned), const char* unit) { units().push_back({bind, unit}); }

void trace_begin() {
  if (g_buf) return;
  DSV3_CUDA_CHECK(cudaMalloc(&g_buf, sizeof(TraceBuf)));
  DSV3_CUDA_CHECK(cudaMemset(g_buf, 0, sizeof(TraceBuf)));
  for (size_t i = 0; i < units().size(); ++i) units()[i].bind(g_buf, unsigned(i));
}

void trace_dump(const char* path, const char* label) {
  if (!g_buf) return;
  DSV3_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<TraceBuf> h(1);
  DSV3_CUDA_CHECK(cudaMemcpy(h.data(), g_buf, sizeof(TraceBuf), cudaMemcpyDeviceToHost));
  DSV3_CUDA_CHECK(cudaMemset(g_buf, 0, sizeof(TraceBuf)));  // the next dump starts afresh
  FILE* f = std::fopen(path, "a");
  if (!f) {
    std::fprintf(stderr, "dsv3: cannot append the kernel trace to %s\n", path);
    return;
  }
  std::fprintf(f, "# %s\n# units:", label);
  for (size_t i = 0; i < units().size(); ++i) std::fprintf(f, " %zu=%s", i, units()[i].name);
  std::fprintf(f, "\n# ticket t_enter_ns t_waited_ns unit line grid_x grid_y grid_z\n");
  const unsigned long long n = h[0].ticket, first = n > kTraceRecs ? n - kTraceRecs : 0;
  for (unsigned long long t = first; t < n; ++t) {
    const unsigned long long* r = h[0].rec[t % kTraceRecs];
    std::fprintf(f, "%llu %llu %llu %llu %llu %llu %llu %llu\n", t, r[0], r[1], r[2] >> 16, r[2] & 0xffff,
                 r[3] & 0xffffff, (r[3] >> 24) & 0xffffff, r[3] >> 48);
  }
  std::fclose(f);
}
#else
void trace_begin() {}
void trace_dump(const char*, const char*) {}
#endif

}  // namespace dsv3::cuda
