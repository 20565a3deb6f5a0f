// Tensor-core GEMM for many tokens (prefill): C = A · Wᵀ with float32 activations A and bf16 or
// e4m3 weights W, 64x128 tiles, bf16 WMMA with float32 accumulation. A is split into a bf16
// high part and the bf16 rounding of the remainder, two products per tile, so the result keeps
// ~16 bits of each activation (float32-grade logits); `fast` keeps only the high part.
// FP8 weights are widened to bf16 exactly; their 128x128 block scale is constant over a tile
// (tiles are aligned to the blocks) and is folded into A before the split.
#include <mma.h>

#include "backend/cuda/common.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

using namespace nvcuda;

constexpr int BM = 64, BN = 128, BK = 32, LDA = BK + 8, LDC = BN + 4, kThreads = 256;

struct SmemAB {
  __nv_bfloat16 ah[2][BM][LDA];
  __nv_bfloat16 al[2][BM][LDA];
  __nv_bfloat16 b[2][BN][LDA];
};
constexpr size_t kSmemBytes = sizeof(SmemAB) > sizeof(float) * BM * LDC ? sizeof(SmemAB) : sizeof(float) * BM * LDC;

// One output tile: rows [m0, m0 + 64) of the job's M rows, weight rows [n0, n0 + 128).
struct Tile {
  DevLinear w;
  bool bvec;           // weight readable in 16-byte chunks
  const float* a;      // row i of the job: a + (idx ? idx[i] : i) * lda
  int64_t lda;
  const int32_t* idx;
  bool silu_pair;      // A value = silu(row[k]) * row[pair_off + k]
  int64_t pair_off;
  bool avec;           // activations readable as float4
  int64_t M, m0, n0;
  float* c;            // row i of the job: c + i * ldc, column col + r
  int64_t ldc, col;
  bool fast;
};

template <int WT>
__device__ __forceinline__ void gemm_tile(const Tile& T, unsigned char* smem_raw) {
  SmemAB& sm = *reinterpret_cast<SmemAB*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
  const int64_t K = T.w.cols;
  const int nk = int((K + BK - 1) / BK);

  // A: thread -> row ar, 8 consecutive k at ak.
  const int ar = tid >> 2, ak = (tid & 3) * 8;
  const int64_t agr = T.m0 + ar;
  const float* arow = agr < T.M ? T.a + (T.idx ? int64_t(T.idx[agr]) : agr) * T.lda : nullptr;
  float av[8];
  auto load_a = [&](int kt) {
    const int64_t k = int64_t(kt) * BK + ak;
    if (arow && T.avec && k < K) {  // K % 8 == 0 here: the 8 values are all in or all out
      const float4 x0 = *reinterpret_cast<const float4*>(arow + k), x1 = *reinterpret_cast<const float4*>(arow + k + 4);
      av[0] = x0.x, av[1] = x0.y, av[2] = x0.z, av[3] = x0.w, av[4] = x1.x, av[5] = x1.y, av[6] = x1.z, av[7] = x1.w;
      if (T.silu_pair) {
        const float4 y0 = *reinterpret_cast<const float4*>(arow + T.pair_off + k);
        const float4 y1 = *reinterpret_cast<const float4*>(arow + T.pair_off + k + 4);
        const float g[8] = {y0.x, y0.y, y0.z, y0.w, y1.x, y1.y, y1.z, y1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) av[e] = silu(av[e]) * g[e];
      }
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float v = 0.f;
        if (arow && k + e < K) {
          v = arow[k + e];
          if (T.silu_pair) v = silu(v) * arow[T.pair_off + k + e];
        }
        av[e] = v;
      }
    }
  };
  auto store_a = [&](int kt, int buf) {
    float s = 1.f;
    if (WT == kFP8) s = T.w.s[((T.w.row0 + T.n0) >> 7) * T.w.lds + ((T.w.col0 + int64_t(kt) * BK) >> 7)];
    alignas(16) __nv_bfloat16 h[8];
    alignas(16) __nv_bfloat16 l[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float v = av[e] * s;
      h[e] = __float2bfloat16_rn(v);
      l[e] = __float2bfloat16_rn(v - __bfloat162float(h[e]));
    }
    *reinterpret_cast<uint4*>(&sm.ah[buf][ar][ak]) = *reinterpret_cast<const uint4*>(h);
    if (!T.fast) *reinterpret_cast<uint4*>(&sm.al[buf][ar][ak]) = *reinterpret_cast<const uint4*>(l);
  };

  // B: bf16: two chunks of 8 (rows tid/4 and 64 + tid/4); fp8: one chunk of 16 (row tid/2).
  uint4 bv[2];
  auto load_b = [&](int kt) {
    const int64_t kb = int64_t(kt) * BK;
    if constexpr (WT == kBF16) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int ch = tid + q * kThreads, r = ch >> 2, kk = (ch & 3) * 8;
        const int64_t gr = T.n0 + r, k = kb + kk;
        const uint16_t* p = static_cast<const uint16_t*>(T.w.w) + (T.w.row0 + gr) * T.w.ld + T.w.col0 + k;
        if (gr < T.w.rows && T.bvec && k < K) {
          bv[q] = __ldg(reinterpret_cast<const uint4*>(p));
        } else {
          alignas(16) uint16_t e8[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) e8[e] = (gr < T.w.rows && k + e < K) ? p[e] : uint16_t(0);
          bv[q] = *reinterpret_cast<const uint4*>(e8);
        }
      }
    } else {
      const int r = tid >> 1, kk = (tid & 1) * 16;
      const int64_t gr = T.n0 + r, k = kb + kk;
      const uint8_t* p = static_cast<const uint8_t*>(T.w.w) + (T.w.row0 + gr) * T.w.ld + T.w.col0 + k;
      if (gr < T.w.rows && T.bvec && k < K) {
        bv[0] = __ldg(reinterpret_cast<const uint4*>(p));
      } else {
        alignas(16) uint8_t e16[16];
#pragma unroll
        for (int e = 0; e < 16; ++e) e16[e] = (gr < T.w.rows && k + e < K) ? p[e] : uint8_t(0);
        bv[0] = *reinterpret_cast<const uint4*>(e16);
      }
    }
  };
  auto store_b = [&](int buf) {
    if constexpr (WT == kBF16) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int ch = tid + q * kThreads, r = ch >> 2, kk = (ch & 3) * 8;
        *reinterpret_cast<uint4*>(&sm.b[buf][r][kk]) = bv[q];
      }
    } else {
      const int r = tid >> 1, kk = (tid & 1) * 16;
      const uint32_t u[4] = {bv[0].x, bv[0].y, bv[0].z, bv[0].w};
      alignas(16) __nv_bfloat16 h[16];
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // e4m3 -> float -> bf16 is exact
        const float2 lo = e4m3x2_bits(u[i]), hi = e4m3x2_bits(u[i] >> 16);
        h[4 * i] = __float2bfloat16_rn(lo.x), h[4 * i + 1] = __float2bfloat16_rn(lo.y);
        h[4 * i + 2] = __float2bfloat16_rn(hi.x), h[4 * i + 3] = __float2bfloat16_rn(hi.y);
      }
      *reinterpret_cast<uint4*>(&sm.b[buf][r][kk]) = *reinterpret_cast<const uint4*>(h);
      *reinterpret_cast<uint4*>(&sm.b[buf][r][kk + 8]) = *reinterpret_cast<const uint4*>(h + 8);
    }
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  load_a(0);
  load_b(0);
  store_a(0, 0);
  store_b(0);
  __syncthreads();
  for (int kt = 0; kt < nk; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < nk) {
      load_a(kt + 1);
      load_b(kt + 1);
    }
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> bf[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(bf[j], &sm.b[buf][wn * 32 + j * 16][kk], LDA);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, &sm.ah[buf][wm * 32 + i * 16][kk], LDA);
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa, bf[j], acc[i][j]);
        if (!T.fast) {
          wmma::load_matrix_sync(fa, &sm.al[buf][wm * 32 + i * 16][kk], LDA);
#pragma unroll
          for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa, bf[j], acc[i][j]);
        }
      }
    }
    if (kt + 1 < nk) {
      store_a(kt + 1, buf ^ 1);
      store_b(buf ^ 1);
    }
    __syncthreads();
  }
  // Epilogue through shared memory (the A/B buffers are free after the last barrier).
  float* cs = reinterpret_cast<float*>(smem_raw);
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(cs + (wm * 32 + i * 16) * LDC + wn * 32 + j * 16, acc[i][j], LDC, wmma::mem_row_major);
  __syncthreads();
  for (int e = tid; e < BM * BN; e += kThreads) {
    const int i = e / BN, j = e % BN;
    if (T.m0 + i < T.M && T.n0 + j < T.w.rows) T.c[(T.m0 + i) * T.ldc + T.col + T.n0 + j] = cs[i * LDC + j];
  }
}

struct DenseArgs {
  DevLinear w[2];
  bool bvec[2];
  int64_t col[2];
  int64_t ntiles0;  // blockIdx.x < ntiles0: weight 0
  const float* a;
  int64_t lda;
  const int32_t* idx;
  bool silu_pair;
  int64_t pair_off;
  bool avec;
  int64_t M;
  float* c;
  int64_t ldc;
  bool fast;
  GemvShift shift;
};

template <int WT>
__global__ void __launch_bounds__(kThreads) gemm_kernel(DenseArgs D) {
  __shared__ __align__(128) unsigned char smem[kSmemBytes];
  pdl_wait();
  pdl_trigger();
  const int j = int(blockIdx.x) < D.ntiles0 ? 0 : 1;
  Tile T;
  const int64_t b = blockIdx.z;
  T.w = D.w[j], T.bvec = D.bvec[j], T.col = D.col[j];
  T.w.row0 += b * D.shift.wrows;
  T.n0 = (int64_t(blockIdx.x) - (j ? D.ntiles0 : 0)) * BN;
  T.a = D.a + b * D.shift.xs, T.lda = D.lda, T.idx = D.idx, T.silu_pair = D.silu_pair, T.pair_off = D.pair_off;
  T.avec = D.avec && T.w.cols % 8 == 0;
  T.M = D.M, T.m0 = int64_t(blockIdx.y) * BM;
  T.c = D.c + b * D.shift.ys, T.ldc = D.ldc, T.fast = D.fast;
  if (T.n0 >= T.w.rows) return;
  gemm_tile<WT>(T, smem);
}

template <int WT>
__global__ void __launch_bounds__(kThreads) moe_gemm_kernel(MoeStage st, const DevExpert* __restrict__ table, MoeSched s,
                                                            int64_t ntiles0, bool avec, int64_t half, bool fast) {
  __shared__ __align__(128) unsigned char smem[kSmemBytes];
  const int stage = st.stage;
  const float* in = st.in;
  float* out = st.out;
  const int64_t ldin = st.ldin, ldout = st.ldout;
  pdl_wait();
  pdl_trigger();
  if (int(blockIdx.y) >= *s.n_tiles) return;
  const int e = s.tile_e[blockIdx.y];
  const int64_t off = s.off[e];
  const DevExpert& X = table[e];
  Tile T;
  if (stage == 0) {
    const int j = int(blockIdx.x) < ntiles0 ? 0 : 1;
    T.w = j ? X.w3 : X.w1;
    T.col = j ? half : 0;
    T.n0 = (int64_t(blockIdx.x) - (j ? ntiles0 : 0)) * BN;
    T.bvec = X.vec13;
    T.a = in, T.lda = ldin, T.idx = s.perm + off, T.silu_pair = false, T.pair_off = 0;
  } else {
    T.w = X.w2;
    T.col = 0;
    T.n0 = int64_t(blockIdx.x) * BN;
    T.bvec = X.vec2;
    T.a = in + off * ldin, T.lda = ldin, T.idx = nullptr, T.silu_pair = true, T.pair_off = half;
  }
  T.avec = avec && T.w.cols % 8 == 0;
  T.M = s.cnt[e], T.m0 = s.tile_m0[blockIdx.y];
  T.c = out + off * ldout, T.ldc = ldout, T.fast = fast;
  if (T.n0 >= T.w.rows) return;
  gemm_tile<WT>(T, smem);
}

bool a16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool gemm_ok(const DevLinear& w) {
  if (w.t == kBF16) return true;
  // FP8: every 128-row tile and 32-column step must sit inside one scale block.
  return w.t == kFP8 && w.row0 % 128 == 0 && w.col0 % 32 == 0;
}

void gemm(const Launch& L, const DevLinear& w0, const DevLinear* w1, const ProductRows& io, const GemmForm& f) {
  const int64_t M = io.m, pair_off = f.pair_off;
  const int batch = io.batch;
  const GemvShift shift = io.shift;
  if (M <= 0) return;
  DSV3_CHECK(gemm_ok(w0) && (!w1 || (gemm_ok(*w1) && w1->t == w0.t && w1->cols == w0.cols)));
  DenseArgs D;
  D.w[0] = w0, D.w[1] = w1 ? *w1 : w0;
  D.bvec[0] = vec_ok(D.w[0]), D.bvec[1] = vec_ok(D.w[1]);
  D.col[0] = 0, D.col[1] = f.col1;
  D.ntiles0 = cdiv(w0.rows, BN);
  const int64_t ntiles = D.ntiles0 + (w1 ? cdiv(w1->rows, BN) : 0);
  D.a = io.x, D.lda = io.ldx, D.idx = io.idx, D.silu_pair = f.silu_pair, D.pair_off = pair_off;
  D.avec = a16(io.x) && io.ldx % 4 == 0 && pair_off % 4 == 0;
  D.M = M, D.c = io.y, D.ldc = io.ldy, D.fast = f.fast, D.shift = shift;
  D.avec = D.avec && shift.xs % 4 == 0;
  DSV3_CHECK(batch == 1 || w0.t != kFP8 || shift.wrows % 128 == 0, "batched FP8 GEMM off the scale blocks");
  const dim3 grid(unsigned(ntiles), cdiv(M, BM), unsigned(batch));
  if (w0.t == kFP8) launch(L, gemm_kernel<kFP8>, grid, dim3(kThreads), 0, D);
  else launch(L, gemm_kernel<kBF16>, grid, dim3(kThreads), 0, D);
}

void moe_gemm(const Launch& L, const MoeStage& st, const MoeSched& s, int64_t half, bool fast) {
  const int64_t nt = cdiv(st.max_rows, BN);
  const dim3 grid(unsigned(st.stage == 0 ? 2 * nt : nt), unsigned(s.max_tiles()));
  const bool avec = a16(st.in) && st.ldin % 4 == 0 && half % 4 == 0;
  if (st.wtype == kFP8) launch(L, moe_gemm_kernel<kFP8>, grid, dim3(kThreads), 0, st, st.table, s, nt, avec, half, fast);
  else launch(L, moe_gemm_kernel<kBF16>, grid, dim3(kThreads), 0, st, st.table, s, nt, avec, half, fast);
}

}  // namespace dsv3::cuda
