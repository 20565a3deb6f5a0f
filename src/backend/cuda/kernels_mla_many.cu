// The absorbed attention of many tokens (serving batches) over a bf16 latent cache, on tensor
// cores (mla_decode_many in kernels_mla.cu chooses it; its float32 many_kernel is the twin). A
// block of 4 warps takes (token i, 16 heads, position split z). Cache rows go through shared
// memory kManyTcRows at a time by cp.async (two buffers), each row read once for all 16 heads:
//   scores S [16 heads, 32 rows] = Q [16, C + R] · Kᵀ   (m16n8k16 bf16 MMAs, heads as M; warp w
//                                                         the rows 8w .. 8w + 7)
//   a float32 online softmax over the rows, its weights P rounded to bf16
//   O [16 heads, C] += P [16, 32 rows] · latent [32 rows, C]   (warp w a quarter of the columns)
// Q is the absorbed query and the rope query rounded to bf16, as the reference's bf16 model
// holds them; every sum is float32.
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/mla_splits.cuh"
#include "backend/cuda/mma.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kHeads = 16;  // heads per block: the MMAs' M
constexpr int kPad = 8;     // bf16 values past each staged row: ldmatrix's eight rows in different banks

// Shared memory (bf16 elements unless said): Q [16][CRp], rows [2][32][CRp], P [16][32 + kPad],
// then float max [4][16], sums [4][16].
struct TcSmem {
  int CRp;
  DSV3_HD int q() const { return 0; }
  DSV3_HD int rows(int b) const { return kHeads * CRp + b * kManyTcRows * CRp; }
  DSV3_HD int p() const { return kHeads * CRp + 2 * kManyTcRows * CRp; }
  DSV3_HD int bf16_end() const { return p() + kHeads * (kManyTcRows + kPad); }
  DSV3_HD size_t bytes() const { return size_t(bf16_end()) * 2 + sizeof(float) * 2 * kWarps * kHeads; }
};

// Four 8x8 b16 matrices, the first two only (lanes 0-15 give the addresses).
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// Lane l's cache row of position t0 + l of sequence `slot`, or -1 past te (a tile's rows for
// tc_stage_rows, looked up a tile ahead so the table's latency hides under a tile's work).
__device__ __forceinline__ int64_t tile_row(const MlaDims& d, int32_t slot, int64_t t0, int64_t te) {
  const int64_t t = t0 + (threadIdx.x & 31);
  return t < te ? d.row(slot, t) : -1;
}

// A tile's 32 cache rows (bf16 latent | rope key) into dst [32][CRp] by cp.async, zeros for rows
// past the sequence's (row -1); one commit group. Lane l of every warp holds row l (tile_row); warp
// w copies rows w, w + 4, ..., each row's 16-byte pieces across its lanes.
__device__ __forceinline__ void tc_stage_rows(const MlaDims& d, int64_t mine, const DecodeAttn& a,
                                              __nv_bfloat16* dst, int CRp) {
  const int C8 = d.C / 8, R8 = d.R / 8, CR8 = C8 + R8, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint4* kv = reinterpret_cast<const uint4*>(a.cache_kv);
  const uint4* pe = reinterpret_cast<const uint4*>(a.cache_pe);
#pragma unroll
  for (int k = 0; k < kManyTcRows / kWarps; ++k) {
    const int r = warp + kWarps * k;
    const int64_t row = __shfl_sync(0xffffffffu, mine, r), rr = row < 0 ? 0 : row;
    for (int u = lane; u < CR8; u += 32) {
      const uint4* src = u < C8 ? kv + rr * C8 + u : pe + rr * R8 + (u - C8);
      cp_async16(smem_addr(dst + r * CRp + 8 * u), src, row >= 0);
    }
  }
  cp_async_commit();
}

__global__ void __launch_bounds__(kWarps * 32, 2) many_tc_kernel(MlaDims d, const DevPos* __restrict__ pos, int64_t n,
                                                                 DecodeAttn a, int64_t chunk) {
  extern __shared__ uint4 sm_tc[];
  const int CR = d.C + d.R;
  const TcSmem S{CR + kPad};
  __nv_bfloat16* sb = reinterpret_cast<__nv_bfloat16*>(sm_tc);
  __nv_bfloat16* qs = sb + S.q();
  __nv_bfloat16* ps = sb + S.p();
  constexpr int PS = kManyTcRows + kPad;  // P's row stride
  float* wmax = reinterpret_cast<float*>(sb + S.bf16_end());  // [4][16]
  float* wsum = wmax + kWarps * kHeads;                       // [4][16]
  pdl_wait();
  pdl_trigger();
  const int64_t i = blockIdx.x;
  const int h0 = blockIdx.y * kHeads, hb = min(kHeads, d.H - h0), z = blockIdx.z;
  const DevPos p = pos[i];
  const int64_t len = int64_t(p.pos) + 1, ck = many_chunk(chunk, len, a.nsplit), ts = int64_t(z) * ck,
                te = min(len, ts + ck);
  if (ts >= len) return;  // (the reduction skips this split)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  tc_stage_rows(d, tile_row(d, p.slot, ts, te), a, sb + S.rows(0), S.CRp);
  int64_t next = tile_row(d, p.slot, ts + kManyTcRows, te);  // the next tile's rows
  for (int e = tid; e < kHeads * CR; e += kWarps * 32) {
    const int h = e / CR, j = e % CR;
    const int64_t ih = i * d.H + h0 + h;
    const float v = h >= hb ? 0.f : (j < d.C ? a.qa[ih * d.C + j] : a.q[ih * d.qk() + d.nope + (j - d.C)]);
    qs[h * S.CRp + j] = __float2bfloat16_rn(v);
  }
  // The thread's MMA fragments: accumulator rows (heads) g and g + 8, columns 2 q4 and 2 q4 + 1.
  const int g = lane >> 2, q4 = lane & 3;
  // ldmatrix addresses: an A tile's row and column offset (x4), a B tile's row and column (x4 / x2).
  const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);
  const int b_row = lane & 7, b_col = 8 * (lane >> 3);
  const int nt = d.C / 32;  // the warp's n-tiles of 8 latent columns: [warp * C / 4, (warp + 1) * C / 4)
  float acc[16][4];
#pragma unroll
  for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float mrun[2] = {-INFINITY, -INFINITY}, lpart[2] = {0.f, 0.f};  // heads g, g + 8
  int buf = 0;
  for (int64_t t0 = ts; t0 < te; t0 += kManyTcRows, buf ^= 1) {
    const int tn = int(min(int64_t(kManyTcRows), te - t0));
    if (t0 + kManyTcRows < te) {  // the next tile into the other buffer (free since the last barrier)
      tc_stage_rows(d, next, a, sb + S.rows(buf ^ 1), S.CRp);
      next = tile_row(d, p.slot, t0 + 2 * kManyTcRows, te);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const __nv_bfloat16* ks = sb + S.rows(buf);
    // Scores of rows 8 warp .. 8 warp + 7: c[0..1] head g, c[2..3] head g + 8, rows 2 q4, 2 q4 + 1;
    // four accumulators in turn (four short chains of dependent MMAs, not one long one), summed.
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    {
      float c1[4] = {0.f, 0.f, 0.f, 0.f}, c2[4] = {0.f, 0.f, 0.f, 0.f}, c3[4] = {0.f, 0.f, 0.f, 0.f};
      const uint32_t qa_addr = smem_addr(qs + a_row * S.CRp + a_col);
      const uint32_t kb_addr = smem_addr(ks + (8 * warp + b_row) * S.CRp + b_col);
      int k0 = 0;
      for (; k0 + 64 <= CR; k0 += 64) {
        uint32_t b[4], b2[4], a0[4], a1[4], a2[4], a3[4];
        ldmatrix_x4(b, kb_addr + 2 * k0);
        ldmatrix_x4(b2, kb_addr + 2 * (k0 + 32));
        ldmatrix_x4(a0, qa_addr + 2 * k0);
        ldmatrix_x4(a1, qa_addr + 2 * (k0 + 16));
        ldmatrix_x4(a2, qa_addr + 2 * (k0 + 32));
        ldmatrix_x4(a3, qa_addr + 2 * (k0 + 48));
        mma_bf16(c, a0, b[0], b[1]);
        mma_bf16(c1, a1, b[2], b[3]);
        mma_bf16(c2, a2, b2[0], b2[1]);
        mma_bf16(c3, a3, b2[2], b2[3]);
      }
      if (k0 + 32 <= CR) {
        uint32_t b[4], a0[4], a1[4];
        ldmatrix_x4(b, kb_addr + 2 * k0);
        ldmatrix_x4(a0, qa_addr + 2 * k0);
        ldmatrix_x4(a1, qa_addr + 2 * (k0 + 16));
        mma_bf16(c, a0, b[0], b[1]);
        mma_bf16(c1, a1, b[2], b[3]);
        k0 += 32;
      }
      if (k0 < CR) {  // a last 16 columns (C + R an odd multiple of 16)
        uint32_t b[2], a0[4];
        ldmatrix_x2(b, kb_addr + 2 * k0);
        ldmatrix_x4(a0, qa_addr + 2 * k0);
        mma_bf16(c2, a0, b[0], b[1]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) c[e] = (c[e] + c1[e]) + (c2[e] + c3[e]);
    }
    const int r0 = 8 * warp + 2 * q4;
#pragma unroll
    for (int e = 0; e < 4; ++e) c[e] = r0 + (e & 1) < tn ? c[e] * d.scale : -INFINITY;
    // The tile's max per head: the warp's 8 rows (the 4 lanes of a head), then the 4 warps.
    float wm[2] = {fmaxf(c[0], c[1]), fmaxf(c[2], c[3])};
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      wm[u] = fmaxf(wm[u], __shfl_xor_sync(0xffffffffu, wm[u], 1));
      wm[u] = fmaxf(wm[u], __shfl_xor_sync(0xffffffffu, wm[u], 2));
    }
    if (q4 == 0) wmax[warp * kHeads + g] = wm[0], wmax[warp * kHeads + g + 8] = wm[1];
    __syncthreads();
    float alpha[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int h = g + 8 * u;
      float mt = wmax[h];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) mt = fmaxf(mt, wmax[w * kHeads + h]);
      const float mnew = fmaxf(mrun[u], mt);
      alpha[u] = expf(mrun[u] - mnew);
      mrun[u] = mnew;
      const __nv_bfloat162 pw = __floats2bfloat162_rn(expf(c[2 * u] - mnew), expf(c[2 * u + 1] - mnew));
      *reinterpret_cast<__nv_bfloat162*>(ps + h * PS + r0) = pw;
      lpart[u] = lpart[u] * alpha[u] + __low2float(pw) + __high2float(pw);
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (j < nt) acc[j][0] *= alpha[0], acc[j][1] *= alpha[0], acc[j][2] *= alpha[1], acc[j][3] *= alpha[1];
    }
    __syncthreads();
    // O [16, the warp's columns] += P [16, 32] · rows [32, columns]: two k-steps of 16 rows.
#pragma unroll
    for (int ks16 = 0; ks16 < kManyTcRows; ks16 += 16) {
      uint32_t pa[4];
      ldmatrix_x4(pa, smem_addr(ps + a_row * PS + ks16 + a_col));
      const uint32_t vb = smem_addr(ks + (ks16 + a_row) * S.CRp + warp * (d.C / 4) + a_col);
#pragma unroll
      for (int j = 0; j < 16; j += 2) {
        if (j < nt) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, vb + 2 * 8 * j);
          mma_bf16(acc[j], pa, b[0], b[1]);
          mma_bf16(acc[j + 1], pa, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // (this buffer and P are free for the next tile)
  }
  // The sums of every head: the thread's rows, its 4 lanes, then the 4 warps.
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    lpart[u] += __shfl_xor_sync(0xffffffffu, lpart[u], 1);
    lpart[u] += __shfl_xor_sync(0xffffffffu, lpart[u], 2);
  }
  if (q4 == 0) wsum[warp * kHeads + g] = lpart[0], wsum[warp * kHeads + g + 8] = lpart[1];
  __syncthreads();
  float lsum[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    lsum[u] = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) lsum[u] += wsum[w * kHeads + g + 8 * u];
  }
  const bool split = gridDim.z > 1;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int h = g + 8 * u;
    if (h >= hb) continue;
    const int64_t ih = i * d.H + h0 + h;
    const float inv = split ? 1.f : 1.f / lsum[u];
    float* dst = split ? a.part + (int64_t(z) * n * d.H + ih) * d.C : a.ol + ih * d.C;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (j < nt) {
        const int col = warp * (d.C / 4) + 8 * j + 2 * q4;
        *reinterpret_cast<float2*>(dst + col) = make_float2(acc[j][2 * u] * inv, acc[j][2 * u + 1] * inv);
      }
    }
    if (split && q4 == 0) {
      a.ml[(int64_t(z) * n * d.H + ih) * 2] = mrun[u];
      a.ml[(int64_t(z) * n * d.H + ih) * 2 + 1] = lsum[u];
    }
  }
}

}  // namespace

bool mla_many_tc_ok(const MlaDims& d) {
  return d.kv16 && d.C % 64 == 0 && d.C <= 512 && d.R % 16 == 0 && TcSmem{d.C + d.R + kPad}.bytes() <= (size_t(110) << 10);
}

void mla_many_tc(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const DecodeAttn& a, int64_t chunk) {
  DSV3_CHECK(mla_many_tc_ok(d) && (chunk > 0 ? chunk : -chunk) % kManyTcRows == 0,
             "tensor-core many-token attention: shape");
  const size_t smem = TcSmem{d.C + d.R + kPad}.bytes();
  allow_smem(many_tc_kernel, smem);
  launch(L, many_tc_kernel, dim3(unsigned(n), cdiv(d.H, kHeads), unsigned(a.nsplit)), dim3(kWarps * 32), smem, d,
         pos, n, a, chunk);
}

}  // namespace dsv3::cuda
