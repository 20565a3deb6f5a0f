// Device helpers shared by the CUDA kernels: programmatic-dependent-launch waits, warp
// reductions, bf16/e4m3 decoding, element access to a DevLinear, and the launch wrapper.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <mutex>
#include <unordered_map>
#include <utility>

#include "backend/cuda/kernels.h"

namespace dsv3::cuda {

// Wait until the kernels this one depends on have finished and their writes are visible
// (a no-op without PDL). Every kernel calls it, in every block, before any early exit: that
// keeps completion transitive along the stream. Past the wait the block also lets the next
// kernel launch (DSV3_PDL_TRIGGER=1, the default): once every block of this grid is past its
// wait, the next grid's blocks take the free slots and issue their weight loads, which never
// depend on this kernel, before their own wait. (Without the trigger the next grid launches
// only as this one's blocks exit.)
#ifndef DSV3_PDL_TRIGGER
#define DSV3_PDL_TRIGGER 1
#endif
__device__ __forceinline__ void pdl_wait_raw() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#if DSV3_PDL_TRIGGER
  asm volatile("griddepcontrol.launch_dependents;");
#endif
#endif
}

// DSV3_TRACE=1 (a measurement build, never for results): block (0,0,0) of every kernel takes a
// ticket in launch order at its wait and records the global timer before and after it, with the
// call's source line and the grid (trace.cu). The next kernel's wait ends when this one has
// finished, so the differences of the wait ends are each kernel's cost inside the recorded chain.
#ifndef DSV3_TRACE
#define DSV3_TRACE 0
#endif
#if DSV3_TRACE
struct TraceBuf {
  unsigned long long ticket;
  unsigned long long rec[kTraceRecs][4];  // t before the wait, t after it, line | unit << 16, grid
};
static __device__ TraceBuf* g_trace = nullptr;
static __device__ unsigned g_trace_unit = 0;
void trace_register(void (*bind)(TraceBuf*, unsigned), const char* unit);
static void trace_bind_unit(TraceBuf* b, unsigned unit) {
  cudaMemcpyToSymbol(g_trace, &b, sizeof b);
  cudaMemcpyToSymbol(g_trace_unit, &unit, sizeof unit);
}
static const int g_trace_registered = (trace_register(trace_bind_unit, __BASE_FILE__), 0);
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void pdl_wait_traced(int line) {
  TraceBuf* b = g_trace;
  const bool rec = b && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
  unsigned long long t0 = 0, slot = 0;
  if (rec) t0 = global_ns(), slot = atomicAdd(&b->ticket, 1ull) % kTraceRecs;
  pdl_wait_raw();
  if (rec) {
    unsigned long long* r = b->rec[slot];
    r[0] = t0, r[1] = global_ns(), r[2] = unsigned(line) | (g_trace_unit << 16);
    r[3] = gridDim.x | (unsigned long long)(gridDim.y) << 24 | (unsigned long long)(gridDim.z) << 48;
  }
}
#define pdl_wait() pdl_wait_traced(__LINE__)
// A point inside a kernel (the calling thread; a grid of 0 marks it in the dump).
__device__ __forceinline__ void trace_point_at(int line) {
  TraceBuf* b = g_trace;
  if (!b) return;
  const unsigned long long t = global_ns(), slot = atomicAdd(&b->ticket, 1ull) % kTraceRecs;
  unsigned long long* r = b->rec[slot];
  r[0] = t, r[1] = t, r[2] = unsigned(line) | (g_trace_unit << 16), r[3] = 0;
}
#define trace_point() trace_point_at(__LINE__)
#else
__device__ __forceinline__ void pdl_wait() { pdl_wait_raw(); }
__device__ __forceinline__ void trace_point() {}
#endif
// Let the next kernel in the stream be scheduled (it still waits in pdl_wait for our completion).
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Whether this block is the last of `total` to arrive at *counter, after each has written its
// partial results (every thread calls it; it synchronises the block). One acq_rel atomic by
// thread 0 at GPU scope, between two barriers: it releases the block's earlier stores and, in the
// last block, orders the loads after it behind every other block's stores (read them through L2,
// __ldcg). That replaces a fence by every thread before the count and another after it.
__device__ __forceinline__ bool last_to_arrive(unsigned* counter, unsigned total) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned old;
    asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
    last = old == total - 1;
  }
  __syncthreads();
  return last;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* red /* [33] shared */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < nw ? red[lane] : 0.f;
  t = warp_sum(t);
  return t;
}
__device__ __forceinline__ float block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < nw ? red[lane] : -INFINITY;
  return warp_max(t);
}

// 16 bytes of streamed weights: read once, not kept in L1. ld_stream_first also marks the lines
// evict-first in L2, so the stream leaves in L2 the small data that other kernels reuse (the
// e4m3 block scales among it): the tensor-core GEMVs use it (run24 on the H200: FP8 b1 +5%, b8
// ~+1%). The FMA GEMVs of one bf16 token measured no faster with it, so ld_stream stays a plain
// load unless DSV3_STREAM_EVICT_FIRST=1 (a measurement form; DSV3_TCV_EVICT_FIRST=0 the other).
#ifndef DSV3_STREAM_EVICT_FIRST
#define DSV3_STREAM_EVICT_FIRST 0
#endif
#ifndef DSV3_TCV_EVICT_FIRST
#define DSV3_TCV_EVICT_FIRST 1
#endif
// The weight streams ask L2 to fetch 256 bytes around each miss (PTX's prefetch-size qualifier;
// rows are contiguous, so the rest of a row's next bytes are on their way): the tensor-core
// GEMVs' lanes read 64 bytes of a row per load, a row's 128 bytes an iteration (H200, run29:
// bf16 b8 1079-1083 -> 1164-1170 tok/s, FP8 b1 594-600 -> 604-610, b8 1549-1556 -> 1576-1586;
// 128 bytes: 1127, 602-610, 1588-1594); so does cp.async (H200 prefill 1024: FP8 27.3k -> 27.7k
// tok/s, fast 34.5k -> 35.5-35.6k, bf16 unchanged). DSV3_TCV_L2PF / DSV3_CPASYNC_L2PF /
// DSV3_STREAM_L2PF (the FMA GEMVs' plain stream, measured no faster with it): 0 (no hint), 64,
// 128 or 256.
#ifndef DSV3_TCV_L2PF
#define DSV3_TCV_L2PF 256
#endif
#ifndef DSV3_TCV_L2PF_FP8  // ... for e4m3 weights, whose shallower ring runs best with 128 (run33)
#define DSV3_TCV_L2PF_FP8 128
#endif
#ifndef DSV3_STREAM_L2PF
#define DSV3_STREAM_L2PF 0
#endif
#ifndef DSV3_CPASYNC_L2PF  // cp_async16 (mma.cuh): prefill's pipelined GEMM and attention
#define DSV3_CPASYNC_L2PF 256
#endif
// Each as PTX text: ".L2::<N>B", or nothing for 0.
#define DSV3_STR2(x) #x
#define DSV3_STR(x) DSV3_STR2(x)
#if DSV3_STREAM_L2PF
#define DSV3_STREAM_PF ".L2::" DSV3_STR(DSV3_STREAM_L2PF) "B"
#else
#define DSV3_STREAM_PF ""
#endif
#if DSV3_CPASYNC_L2PF
#define DSV3_CPASYNC_PF ".L2::" DSV3_STR(DSV3_CPASYNC_L2PF) "B"
#else
#define DSV3_CPASYNC_PF ""
#endif
__device__ __forceinline__ uint4 ld_stream_plain(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate" DSV3_STREAM_PF ".v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}
// PF: the prefetch size asked of L2 (0, 64, 128 or 256 bytes).
template <int PF = DSV3_TCV_L2PF>
__device__ __forceinline__ uint4 ld_stream_first(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  static_assert(PF == 0 || PF == 64 || PF == 128 || PF == 256, "L2 prefetch size");
  uint4 r;
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
#define DSV3_LD_FIRST(pf)                                                                      \
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint" pf ".v4.u32 {%0,%1,%2,%3}, [%4], %5;"     \
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)                                             \
      : "l"(p), "l"(pol))
  if constexpr (PF == 256) DSV3_LD_FIRST(".L2::256B");
  else if constexpr (PF == 128) DSV3_LD_FIRST(".L2::128B");
  else if constexpr (PF == 64) DSV3_LD_FIRST(".L2::64B");
  else DSV3_LD_FIRST("");
#undef DSV3_LD_FIRST
  return r;
#else
  return ld_stream_plain(p);
#endif
}
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  return DSV3_STREAM_EVICT_FIRST ? ld_stream_first(p) : ld_stream_plain(p);
}
template <int PF = DSV3_TCV_L2PF>
__device__ __forceinline__ uint4 ld_stream_tcv(const void* p) {
  return DSV3_TCV_EVICT_FIRST ? ld_stream_first<PF>(p) : ld_stream(p);
}

__device__ __forceinline__ float bf16_bits(uint32_t h) { return __uint_as_float(h << 16); }
// Two packed bf16 (low half first) to floats.
__device__ __forceinline__ float2 bf16x2_bits(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
__device__ __forceinline__ float e4m3_bits(uint32_t b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
  return __half2float(__half(h));
}
// Two packed e4m3 (low byte first) to floats; exact.
__device__ __forceinline__ float2 e4m3x2_bits(uint32_t v) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  return __half22float2(__half2(h));
}

// hi[i] = bf16(x) and, when lo is given, lo[i] = bf16(x - hi[i]): the split of the float32-grade
// tensor-core products.
__device__ __forceinline__ void split_bf16(float x, __nv_bfloat16* hi, __nv_bfloat16* lo, int64_t i) {
  const __nv_bfloat16 h = __float2bfloat16_rn(x);
  hi[i] = h;
  if (lo) lo[i] = __float2bfloat16_rn(x - __bfloat162float(h));
}

// Element `idx` of an absorbed cache (LayerCache::kv / pe), float32 or bf16 (MlaDims::kv16), and
// its write (bf16: rounded to nearest even, as the reference's bf16 kv_cache holds it).
__device__ __forceinline__ float cache_get(const float* c, bool kv16, int64_t idx) {
  return kv16 ? bf16_bits(reinterpret_cast<const uint16_t*>(c)[idx]) : c[idx];
}
__device__ __forceinline__ void cache_put(float* c, bool kv16, int64_t idx, float v) {
  if (kv16) reinterpret_cast<__nv_bfloat16*>(c)[idx] = __float2bfloat16_rn(v);
  else c[idx] = v;
}
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

template <int WT>
__host__ __device__ constexpr int chunk_elems() { return WT == kBF16 ? 8 : (WT == kFP8 ? 16 : 4); }
template <int WT>
__host__ __device__ constexpr int elem_bytes() { return WT == kBF16 ? 2 : (WT == kFP8 ? 1 : 4); }

// One 16-byte chunk of weights of type WT: CE elements, decoded to floats (unscaled for FP8).
template <int WT>
__device__ __forceinline__ void decode(const uint4& v, float* w) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
  if constexpr (WT == kBF16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 f = bf16x2_bits(u[i]);
      w[2 * i] = f.x, w[2 * i + 1] = f.y;
    }
  } else if constexpr (WT == kFP8) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 lo = e4m3x2_bits(u[i]), hi = e4m3x2_bits(u[i] >> 16);
      w[4 * i] = lo.x, w[4 * i + 1] = lo.y, w[4 * i + 2] = hi.x, w[4 * i + 3] = hi.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = __uint_as_float(u[i]);
  }
}

// Element (r, k) of a DevLinear as float (FP8 times its block scale), the slow generic path.
__device__ __forceinline__ float w_at(const DevLinear& L, int64_t r, int64_t k) {
  const int64_t rr = L.row0 + r, kk = L.col0 + k, off = rr * L.ld + kk;
  if (L.t == kBF16) return bf16_bits(static_cast<const uint16_t*>(L.w)[off]);
  if (L.t == kFP8) return e4m3_bits(static_cast<const uint8_t*>(L.w)[off]) * L.s[(rr >> 7) * L.lds + (kk >> 7)];
  return static_cast<const float*>(L.w)[off];
}

template <typename... KArgs, typename... Args>
void launch(const Launch& L, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = L.stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = L.pdl ? 1 : 0;
  DSV3_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

inline unsigned cdiv(int64_t a, int64_t b) { return unsigned((a + b - 1) / b); }

// A kernel launched with more than 48 KB of dynamic shared memory must say so first: once per
// kernel and size reached (one device per process).
template <typename F>
void allow_smem(F* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return;
  static std::mutex mu;
  static std::unordered_map<const void*, size_t> set;
  std::lock_guard<std::mutex> lock(mu);
  size_t& have = set[reinterpret_cast<const void*>(kernel)];
  if (have >= bytes) return;
  DSV3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  have = bytes;
}

}  // namespace dsv3::cuda
