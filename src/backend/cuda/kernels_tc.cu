// The prefill GEMM: bf16 activations (a high part and optionally the bf16 rounding of the
// remainder, split beforehand) times bf16 weights on mma.sync tensor cores, float32
// accumulation. 64x128 output tiles, K in steps of 32 through a 4-stage cp.async pipeline,
// operands read from shared memory with ldmatrix (XOR-swizzled rows, no bank conflicts).
// One launch covers a plain product or every active expert of a MoE stage (the router's
// 64-row tile table picks each block's expert and rows).
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

// TM (64 or 128 rows) and WM (rows per warp, 32 or 64) are template parameters: 4 warps of
// WM x 64 outputs (2 x 2) for TM 128, (2 x 2) of 32 x 64 for TM 64.
constexpr int TN = 128, TK = 32, kStages = 4;
constexpr int kBElems = TN * TK;  // per stage
template <int TM>
constexpr int smem_bytes() {      // per stage: A hi, A lo, B (bf16); 64 / 96 KiB
  return kStages * (2 * TM * TK + kBElems) * 2;
}
constexpr int kLdc = TN + 4;  // epilogue tile row
static_assert(64 * kLdc * 4 <= smem_bytes<64>() && 128 * kLdc * 4 <= smem_bytes<128>(),
              "epilogue tile must fit in the pipeline's memory");

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Element offset of (row, 8-element chunk) in a [rows][32] bf16 stage buffer: the chunk index
// is XORed with bits 1-2 of the row so the 8 rows one ldmatrix reads hit distinct banks.
__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ int swz(int row, int chunk) { return row * TK + ((chunk ^ ((row >> 1) & 3)) << 3); }

template <int TM, int WM>
__global__ void __launch_bounds__(TM / WM * 64) tc_gemm_kernel(TcJob j) {
  constexpr int kThreads = TM / WM * 64, kAElems = TM * TK, kBPer = TN * 4 / kThreads, kAPer = TM * 4 / kThreads,
                MI = WM / 16;
  extern __shared__ __align__(128) unsigned char smem[];
  pdl_wait();
  pdl_trigger();
  // ---- which tile
  int64_t m0, Mv, arow0;  // first job row, valid rows, row offset of the group (pair rows)
  DevLinear W0, W1;  // W1: SwiGLU's w3 (tile columns 64..127)
  // x: row tiles (fastest, so the blocks sharing a weight tile run together and it is read from
  // memory once), y: weight row tiles.
  int64_t n0 = int64_t(blockIdx.y) * (j.swiglu ? TN / 2 : TN);
  const unsigned mt = blockIdx.x;
  if (j.grouped) {
    if (int(mt) >= *j.n_tiles) return;
    const int e = j.tile_e[mt];
    m0 = j.tile_m0[mt];
    arow0 = j.off[e];
    Mv = imin(TM, j.cnt[e] - m0);
    const DevExpert& X = j.experts[e];
    W0 = j.stage == 0 ? X.w1 : X.w2;
    W1 = X.w3;
  } else {
    m0 = int64_t(mt) * TM;
    arow0 = 0;
    Mv = imin(TM, j.M - m0);
    W0 = j.w;
    W1 = j.w3;
  }
  const int64_t N = W0.rows, K = W0.cols;
  if (n0 >= N) return;
  const int64_t bz = j.splits > 1 ? 0 : blockIdx.z;  // batch copy (z is the K split otherwise)
  const __nv_bfloat16* ahi = static_cast<const __nv_bfloat16*>(j.a_hi) + bz * j.shift.xs;
  const __nv_bfloat16* alo = j.a_lo ? static_cast<const __nv_bfloat16*>(j.a_lo) + bz * j.shift.xs : nullptr;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
  __nv_bfloat16* sbase = reinterpret_cast<__nv_bfloat16*>(smem);
  auto sA = [&](int st, int part) { return sbase + st * (2 * kAElems + kBElems) + part * kAElems; };
  auto sB = [&](int st) { return sbase + st * (2 * kAElems + kBElems) + 2 * kAElems; };

  // ---- loaders: A rows (2 chunks per thread per part), B rows (4 chunks per thread)
  const __nv_bfloat16* a_src[kAPer];
  bool a_ok[kAPer];
  int a_dst[kAPer];
#pragma unroll
  for (int i = 0; i < kAPer; ++i) {
    const int c = tid + i * kThreads, r = c >> 2, ch = c & 3;
    a_ok[i] = r < Mv;
    int64_t row = arow0 + m0 + (a_ok[i] ? r : 0);
    if (j.a_idx) row = j.a_idx[row];
    a_src[i] = ahi + row * j.lda + ch * 8;
    a_dst[i] = swz(r, ch);
  }
  const __nv_bfloat16* b_src[kBPer];
  bool b_ok[kBPer];
  int b_dst[kBPer];
#pragma unroll
  for (int i = 0; i < kBPer; ++i) {
    const int c = tid + i * kThreads, r = c >> 2, ch = c & 3;
    const bool second = j.swiglu && r >= TN / 2;
    const DevLinear& W = second ? W1 : W0;
    const int64_t wr = second ? n0 + r - TN / 2 : n0 + r;
    b_ok[i] = wr < N;
    const int64_t rr = W.row0 + bz * j.shift.wrows + (b_ok[i] ? wr : 0);
    b_src[i] = static_cast<const __nv_bfloat16*>(W.w) + rr * W.ld + W.col0 + ch * 8;
    b_dst[i] = swz(r, ch);
  }
  const int64_t lo_off = alo ? alo - ahi : 0;
  auto load_stage = [&](int st, int kt) {
    const int64_t k = int64_t(kt) * TK;
#pragma unroll
    for (int i = 0; i < kAPer; ++i) {
      cp_async16(smem_addr(sA(st, 0) + a_dst[i]), a_src[i] + k, a_ok[i]);
      if (alo) cp_async16(smem_addr(sA(st, 1) + a_dst[i]), a_src[i] + lo_off + k, a_ok[i]);
    }
#pragma unroll
    for (int i = 0; i < kBPer; ++i) cp_async16(smem_addr(sB(st) + b_dst[i]), b_src[i] + k, b_ok[i]);
  };

  float acc[MI][8][4];
#pragma unroll
  for (int a = 0; a < MI; ++a)
#pragma unroll
    for (int b = 0; b < 8; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;

  int kt0 = 0, nk = int(K / TK);
  if (j.splits > 1) {
    const int all = nk;
    kt0 = int(int64_t(all) * blockIdx.z / j.splits);
    nk = int(int64_t(all) * (blockIdx.z + 1) / j.splits) - kt0;
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load_stage(s, kt0 + s);
    cp_async_commit();
  }
  // ldmatrix lanes: A rows (lane % 16) at chunk (lane / 16); B: two n-fragments per x4.
  const int a_r = lane & 15, a_c = lane >> 4;
  const int b_r = (lane & 7) + ((lane >> 4) << 3), b_c = (lane >> 3) & 1;
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int nx = kt + kStages - 1;
    if (nx < nk) load_stage(nx % kStages, kt0 + nx);
    cp_async_commit();
    const int st = kt % kStages;
    const __nv_bfloat16* A0 = sA(st, 0);
    const __nv_bfloat16* A1 = sA(st, 1);
    const __nv_bfloat16* B = sB(st);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      uint32_t ah[MI][4], al[MI][4], bf[4][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int r = wm * WM + mi * 16 + a_r;
        ldmatrix_x4(ah[mi], smem_addr(A0 + swz(r, kk * 2 + a_c)));
        if (alo) ldmatrix_x4(al[mi], smem_addr(A1 + swz(r, kk * 2 + a_c)));
      }
#pragma unroll
      for (int nj = 0; nj < 4; ++nj) {
        const int r = wn * 64 + nj * 16 + b_r;
        ldmatrix_x4(bf[nj], smem_addr(B + swz(r, kk * 2 + b_c)));
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
          const uint32_t b0 = bf[ni >> 1][(ni & 1) * 2], b1 = bf[ni >> 1][(ni & 1) * 2 + 1];
          mma_bf16(acc[mi][ni], ah[mi], b0, b1);
          if (alo) mma_bf16(acc[mi][ni], al[mi], b0, b1);
        }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- epilogue through shared memory: tile [64][128] float32
  float* ct = reinterpret_cast<float*>(smem);
  {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < 8; ++ni) {
        const int r = wm * WM + mi * 16 + g, c = wn * 64 + ni * 8 + 2 * t;
        ct[r * kLdc + c] = acc[mi][ni][0];
        ct[r * kLdc + c + 1] = acc[mi][ni][1];
        ct[(r + 8) * kLdc + c] = acc[mi][ni][2];
        ct[(r + 8) * kLdc + c + 1] = acc[mi][ni][3];
      }
  }
  __syncthreads();
  if (j.swiglu) {  // out[row, n0 + c] = silu(w1 row) * (w3 row) as bf16 hi (+ lo)
    const int64_t nv = imin(TN / 2, N - n0);
    for (int e = tid; e < TM * TN / 2; e += kThreads) {
      const int r = e / (TN / 2), c = e % (TN / 2);
      if (r >= Mv || c >= nv) continue;
      const float v = silu(ct[r * kLdc + c]) * ct[r * kLdc + TN / 2 + c];
      const int64_t orow = arow0 + m0 + r, oi = orow * j.ldo + n0 + c;
      const __nv_bfloat16 h = __float2bfloat16_rn(v);
      static_cast<__nv_bfloat16*>(j.o_hi)[oi] = h;
      if (j.o_lo) static_cast<__nv_bfloat16*>(j.o_lo)[oi] = __float2bfloat16_rn(v - __bfloat162float(h));
    }
  } else {
    const int64_t nv = imin(TN, N - n0);
    if (j.splits > 1) {
      float* wz = j.ws + int64_t(blockIdx.z) * j.M * N;
      for (int e = tid; e < TM * TN; e += kThreads) {
        const int r = e / TN, c = e % TN;
        if (r < Mv && c < nv) wz[(m0 + r) * N + n0 + c] = ct[r * kLdc + c];
      }
      return;
    }
    float* cb = j.c + bz * j.shift.ys;
    for (int e = tid; e < TM * TN; e += kThreads) {
      const int r = e / TN, c = e % TN;
      if (r >= Mv || c >= nv) continue;
      const int64_t orow = arow0 + m0 + r;
      cb[orow * j.ldc + j.col + n0 + c] = ct[r * kLdc + c];
    }
  }
}

// c[i * ldc + col + r] = sum over the splits of ws[z, i, r].
__global__ void splitk_sum_kernel(const float* __restrict__ ws, int splits, int64_t M, int64_t N, float* c, int64_t ldc,
                                  int64_t col) {
  pdl_wait();
  pdl_trigger();
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < M * N; e += int64_t(gridDim.x) * blockDim.x) {
    float v = 0.f;
    for (int z = 0; z < splits; ++z) v += ws[z * M * N + e];
    const int64_t i = e / N, r = e - i * N;
    c[i * ldc + col + r] = v;
  }
}

// hi = bf16(x), lo = bf16(x - hi) for rows of `cols` floats `ldx` apart, into [rows, cols].
__global__ void split_rows_kernel(const float* __restrict__ x, int64_t rows, int64_t cols, int64_t ldx,
                                  __nv_bfloat16* __restrict__ hi, __nv_bfloat16* __restrict__ lo) {
  pdl_wait();
  pdl_trigger();
  const int64_t total = rows * cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    const float v = x[r * ldx + c];
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    hi[i] = h;
    if (lo) lo[i] = __float2bfloat16_rn(v - __bfloat162float(h));
  }
}

// One block per score row; see causal_softmax_rows.
__global__ void causal_softmax_kernel(float* S, int64_t ld, int64_t Lk, const DevPos* __restrict__ pos, int64_t i0,
                                      int H) {
  __shared__ float red[33];
  pdl_wait();
  pdl_trigger();
  const int64_t r = blockIdx.x;
  float* row = S + r * ld;
  const int64_t len = int64_t(pos[i0 + r / H].pos) + 1;
  float m = -INFINITY;
  for (int64_t t = threadIdx.x; t < len; t += blockDim.x) m = fmaxf(m, row[t]);
  m = block_max(m, red);
  float sum = 0.f;
  for (int64_t t = threadIdx.x; t < len; t += blockDim.x) {
    const float e = expf(row[t] - m);
    row[t] = e;
    sum += e;
  }
  sum = block_sum(sum, red);
  const float inv = 1.f / sum;
  for (int64_t t = threadIdx.x; t < Lk; t += blockDim.x) row[t] = t < len ? row[t] * inv : 0.f;
}

}  // namespace

void causal_softmax_rows(const Launch& L, float* S, int64_t rows, int64_t ld, int64_t Lk, const DevPos* pos,
                         int64_t i0, int H) {
  launch(L, causal_softmax_kernel, dim3(unsigned(rows)), dim3(256), 0, S, ld, Lk, pos, i0, H);
}

bool tc_ok(const DevLinear& w) {
  return w.t == kBF16 && w.cols > 0 && w.cols % TK == 0 && w.ld % 8 == 0 && w.col0 % 8 == 0 &&
         reinterpret_cast<uintptr_t>(w.w) % 16 == 0;
}

template <int TM, int WM>
void tc_launch(const Launch& L, const TcJob& j, int64_t grid_m, int64_t max_n, int batch) {
  static bool attr_set = false;  // per process: one device
  if (!attr_set) {
    DSV3_CUDA_CHECK(
        cudaFuncSetAttribute(tc_gemm_kernel<TM, WM>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<TM>()));
    attr_set = true;
  }
  const int64_t tn = j.swiglu ? TN / 2 : TN;
  launch(L, tc_gemm_kernel<TM, WM>, dim3(unsigned(grid_m), cdiv(max_n, tn), unsigned(j.splits > 1 ? j.splits : batch)),
         dim3(TM / WM * 64), size_t(smem_bytes<TM>()), j);
}

void tc_gemm(const Launch& L, const TcJob& j, int64_t grid_m, int64_t max_n, int batch) {
  if (j.splits > 1) DSV3_CHECK(batch == 1 && !j.grouped && !j.swiglu && j.ws, "split-K: plain single products only");
  if (j.tm == 128) tc_launch<128, 64>(L, j, grid_m, max_n, batch);
  else tc_launch<64, 32>(L, j, grid_m, max_n, batch);
  if (j.splits > 1) {
    const int64_t total = j.M * j.w.rows;
    launch(L, splitk_sum_kernel, dim3(unsigned(std::min<int64_t>((total + 255) / 256, 132 * 8))), dim3(256), 0,
           static_cast<const float*>(j.ws), j.splits, j.M, j.w.rows, j.c, j.ldc, j.col);
  }
}

int64_t tc_out_tiles(int64_t M, int64_t N, bool swiglu, int tm) {
  return (M + tm - 1) / tm * ((N + (swiglu ? TN / 2 : TN) - 1) / (swiglu ? TN / 2 : TN));
}

int64_t tc_tiles(int64_t M, int tm) { return (M + tm - 1) / tm; }

void split_rows(const Launch& L, const float* x, int64_t rows, int64_t cols, int64_t ldx, void* hi, void* lo) {
  const int64_t total = rows * cols;
  const unsigned blocks = unsigned(std::min<int64_t>((total + 255) / 256, 132 * 16));
  launch(L, split_rows_kernel, dim3(blocks), dim3(256), 0, x, rows, cols, ldx, static_cast<__nv_bfloat16*>(hi),
         static_cast<__nv_bfloat16*>(lo));
}

}  // namespace dsv3::cuda
