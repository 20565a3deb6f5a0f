// Matrix-vector products for a few tokens (decode): each warp streams one or two weight rows
// once, 16 bytes per lane per load, dequantising in registers (bf16 by a shift; e4m3 by the
// hardware conversion, times its 128x128 block scale), and dots them with up to NT tokens'
// float32 activations (read through L1). float32 accumulation throughout.
#include "backend/cuda/common.cuh"
#include <algorithm>

#include "core/error.h"

namespace dsv3::cuda {
namespace {

constexpr int kWarps = 8;  // 256 threads per block
constexpr int kUnroll = 4; // 16-byte loads in flight per row per lane

template <int WT>
__host__ __device__ constexpr int chunk_elems() { return WT == kBF16 ? 8 : (WT == kFP8 ? 16 : 4); }
template <int WT>
__host__ __device__ constexpr int elem_bytes() { return WT == kBF16 ? 2 : (WT == kFP8 ? 1 : 4); }

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// Weights of one 16-byte chunk as floats (unscaled for FP8).
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

// acc[j] += (w · x_j[k .. k + CE)) * scale for the live tokens.
template <int WT, int NT>
__device__ __forceinline__ void chunk_dot(const float* w, float scale, const float* const* xr, int64_t k, float* acc) {
  constexpr int CE = chunk_elems<WT>();
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (!xr[j]) continue;
    const float4* xp = reinterpret_cast<const float4*>(xr[j] + k);
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < CE / 4; ++q) {
      const float4 xv = __ldg(xp + q);
      s = fmaf(w[4 * q], xv.x, s);
      s = fmaf(w[4 * q + 1], xv.y, s);
      s = fmaf(w[4 * q + 2], xv.z, s);
      s = fmaf(w[4 * q + 3], xv.w, s);
    }
    acc[j] = WT == kFP8 ? fmaf(s, scale, acc[j]) : acc[j] + s;
  }
}

struct Job {
  DevLinear a, b;  // b: second row source (w3 when fused, else a)
  bool fused;
  const float* x;
  int64_t ldx;
  const int32_t* idx;
  int64_t m;
  float* y;
  int64_t ldy;
  bool vec;
};

// One warp: rows ra of a and rb of b (rb < 0: none) for all m tokens, NT at a time.
template <int WT, int NT>
__device__ void warp_rows(const Job& J, int64_t ra, int64_t rb) {
  constexpr int CE = chunk_elems<WT>();
  const int lane = threadIdx.x & 31;
  const DevLinear& A = J.a;
  const DevLinear& B = J.b;
  const int64_t K = A.cols;
  const bool has_b = rb >= 0;
  for (int64_t t0 = 0; t0 < J.m; t0 += NT) {
    const float* xr[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int64_t t = t0 + j;
      xr[j] = t < J.m ? J.x + (J.idx ? int64_t(J.idx[t]) : t) * J.ldx : nullptr;
    }
    float a0[NT], a1[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) a0[j] = a1[j] = 0.f;
    if (J.vec) {
      const int64_t nch = K / CE;
      const uint4* pa = reinterpret_cast<const uint4*>(static_cast<const char*>(A.w) +
                                                       ((A.row0 + ra) * A.ld + A.col0) * elem_bytes<WT>());
      const uint4* pb = has_b ? reinterpret_cast<const uint4*>(static_cast<const char*>(B.w) +
                                                               ((B.row0 + rb) * B.ld + B.col0) * elem_bytes<WT>())
                              : pa;
      const float* sa = WT == kFP8 ? A.s + ((A.row0 + ra) >> 7) * A.lds : nullptr;
      const float* sb = WT == kFP8 && has_b ? B.s + ((B.row0 + rb) >> 7) * B.lds : nullptr;
      for (int64_t c0 = lane; c0 < nch; c0 += 32 * kUnroll) {
        uint4 wa[kUnroll], wb[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t c = c0 + 32 * u;
          if (c < nch) {
            wa[u] = ld_stream(pa + c);
            if (has_b) wb[u] = ld_stream(pb + c);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t c = c0 + 32 * u;
          if (c < nch) {
            const int64_t k = c * CE;
            float w[CE];
            decode<WT>(wa[u], w);
            chunk_dot<WT, NT>(w, WT == kFP8 ? sa[(A.col0 + k) >> 7] : 1.f, xr, k, a0);
            if (has_b) {
              decode<WT>(wb[u], w);
              chunk_dot<WT, NT>(w, WT == kFP8 ? sb[(B.col0 + k) >> 7] : 1.f, xr, k, a1);
            }
          }
        }
      }
    } else {
      for (int64_t k = lane; k < K; k += 32) {
        const float wa = w_at(A, ra, k), wb = has_b ? w_at(B, rb, k) : 0.f;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          if (!xr[j]) continue;
          const float xv = xr[j][k];
          a0[j] = fmaf(wa, xv, a0[j]);
          a1[j] = fmaf(wb, xv, a1[j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      a0[j] = warp_sum(a0[j]);
      a1[j] = warp_sum(a1[j]);
    }
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (!xr[j]) continue;
        float* yj = J.y + (t0 + j) * J.ldy;
        if (J.fused) {
          yj[ra] = silu(a0[j]) * a1[j];
        } else {
          yj[ra] = a0[j];
          if (has_b) yj[rb] = a1[j];
        }
      }
    }
  }
}

template <int WT, int NT>
__device__ __forceinline__ void run_job(const Job& J, int64_t row_block) {
  const int warp = threadIdx.x >> 5;
  const int64_t rows = J.a.rows;
  if (J.fused) {
    const int64_t r = row_block * kWarps + warp;
    if (r < rows) warp_rows<WT, NT>(J, r, r);
  } else {
    const int64_t r = (row_block * kWarps + warp) * 2;
    if (r < rows) warp_rows<WT, NT>(J, r, r + 1 < rows ? r + 1 : -1);
  }
}

template <int WT, int NT>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(Job J, GemvShift sh) {
  pdl_wait();
  pdl_trigger();
  const int64_t b = blockIdx.y;
  J.x += b * sh.xs;
  J.y += b * sh.ys;
  J.a.row0 += b * sh.wrows;
  J.b.row0 += b * sh.wrows;
  run_job<WT, NT>(J, blockIdx.x);
}

template <int WT, int NT>
__global__ void __launch_bounds__(kWarps * 32) moe_gemv_kernel(int stage, const DevExpert* __restrict__ table,
                                                               MoeSched s, const float* in, int64_t ldin, bool xvec,
                                                               float* out, int64_t ldout) {
  pdl_wait();
  pdl_trigger();
  if (int(blockIdx.y) >= *s.n_active) return;
  const int e = s.active[blockIdx.y];
  const int64_t off = s.off[e], cnt = s.cnt[e];
  const DevExpert& X = table[e];
  Job J;
  if (stage == 0) {
    J.a = X.w1, J.b = X.w3, J.fused = true;
    J.x = in, J.ldx = ldin, J.idx = s.perm + off;
    J.vec = X.vec13 && xvec;
  } else {
    J.a = X.w2, J.b = X.w2, J.fused = false;
    J.x = in + off * ldin, J.ldx = ldin, J.idx = nullptr;
    J.vec = X.vec2 && xvec;
  }
  J.m = cnt;
  J.y = out + off * ldout;
  J.ldy = ldout;
  run_job<WT, NT>(J, blockIdx.x);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int WT, int NT>
void launch_gemv(const Launch& L, const Job& J, int batch, GemvShift sh) {
  const int64_t rows_per_block = J.fused ? kWarps : 2 * kWarps;
  launch(L, gemv_kernel<WT, NT>, dim3(cdiv(J.a.rows, rows_per_block), unsigned(batch)), dim3(kWarps * 32), 0, J, sh);
}

template <int WT>
void dispatch_nt(const Launch& L, const Job& J, int batch, GemvShift sh) {
  if (J.m == 1) launch_gemv<WT, 1>(L, J, batch, sh);
  else launch_gemv<WT, 8>(L, J, batch, sh);
}

}  // namespace

// Whether a weight rectangle can be read in 16-byte chunks.
bool vec_ok(const DevLinear& w) {
  const int ce = w.t == kBF16 ? 8 : (w.t == kFP8 ? 16 : 4);
  return aligned16(w.w) && w.cols % ce == 0 && w.ld % ce == 0 && w.col0 % ce == 0;
}

void gemv(const Launch& L, const DevLinear& w, const DevLinear* w3, const float* x, int64_t ldx, const int32_t* idx,
          int64_t m, float* y, int64_t ldy, int batch, GemvShift shift) {
  if (m <= 0 || w.rows <= 0) return;
  Job J;
  J.a = w;
  J.fused = w3 != nullptr;
  J.b = w3 ? *w3 : w;
  DSV3_CHECK(!w3 || (w3->t == w.t && w3->rows == w.rows && w3->cols == w.cols));
  J.x = x, J.ldx = ldx, J.idx = idx, J.m = m, J.y = y, J.ldy = ldy;
  // Activation rows must be float4-aligned for the vector path (also after the batch shift).
  const bool xvec = aligned16(x) && ldx % 4 == 0 && shift.xs % 4 == 0;
  J.vec = xvec && vec_ok(w) && (!w3 || vec_ok(*w3));
  switch (w.t) {
    case kBF16: dispatch_nt<kBF16>(L, J, batch, shift); break;
    case kFP8: dispatch_nt<kFP8>(L, J, batch, shift); break;
    default: dispatch_nt<kF32>(L, J, batch, shift); break;
  }
}

void moe_gemv(const Launch& L, int stage, const DevExpert* table, int64_t max_rows, int32_t wtype, const MoeSched& s,
              const float* in, int64_t ldin, float* out, int64_t ldout) {
  const int64_t rows_per_block = stage == 0 ? kWarps : 2 * kWarps;
  const int64_t max_active = std::min<int64_t>(s.NE(), s.n * s.K + s.S);
  const dim3 grid(cdiv(max_rows, rows_per_block), unsigned(max_active));
  const bool xvec = aligned16(in) && ldin % 4 == 0;
  const bool one = s.n == 1;  // each expert then sees exactly one token
  switch (wtype) {
    case kBF16:
      if (one) launch(L, moe_gemv_kernel<kBF16, 1>, grid, dim3(kWarps * 32), 0, stage, table, s, in, ldin, xvec, out, ldout);
      else launch(L, moe_gemv_kernel<kBF16, 8>, grid, dim3(kWarps * 32), 0, stage, table, s, in, ldin, xvec, out, ldout);
      break;
    case kFP8:
      if (one) launch(L, moe_gemv_kernel<kFP8, 1>, grid, dim3(kWarps * 32), 0, stage, table, s, in, ldin, xvec, out, ldout);
      else launch(L, moe_gemv_kernel<kFP8, 8>, grid, dim3(kWarps * 32), 0, stage, table, s, in, ldin, xvec, out, ldout);
      break;
    default:
      if (one) launch(L, moe_gemv_kernel<kF32, 1>, grid, dim3(kWarps * 32), 0, stage, table, s, in, ldin, xvec, out, ldout);
      else launch(L, moe_gemv_kernel<kF32, 8>, grid, dim3(kWarps * 32), 0, stage, table, s, in, ldin, xvec, out, ldout);
      break;
  }
}

}  // namespace dsv3::cuda
