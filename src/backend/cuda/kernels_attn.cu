// Prefill attention in one kernel (flash-attention style): a run of queries of one slot against
// K/V decompressed from the latent cache, causal, float32 online softmax, bf16 tensor cores
// (mma.sync m16n8k16) with float32 accumulation. Nothing of size queries x keys is written:
// scores stay in registers, the softmax is folded into the running output.
//   fast:  Q, K, V and the probabilities rounded once to bf16 (the reference's bf16 arithmetic);
//   split: each operand as bf16 hi + lo = bf16(x - hi), three products per MMA (hi·hi + hi·lo +
//          lo·hi): float32-grade, as the split GEMMs of kernels_tc.cu.
#include "backend/cuda/common.cuh"
#include "backend/cuda/mma.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

// Tile shapes: BQ queries per block (4 warps of 16 rows), BK keys per step, two stages of K/V
// in flight; shared rows padded by 8 elements so that ldmatrix's 8 rows of 16 bytes fall in
// distinct banks.
template <int NOPE, int R, int V, bool SPLIT>
struct FlashCfg {
  static constexpr int QK = NOPE + R, BQ = 64, BK = SPLIT ? 32 : 64, LQ = QK + 8, LV = V + 8, P = SPLIT ? 2 : 1;
  static constexpr int kThreads = 128;
  static constexpr int q_elems = BQ * LQ, k_elems = BK * LQ, v_elems = BK * LV;
  static constexpr int smem = P * (q_elems + 2 * (k_elems + v_elems)) * 2;
  static_assert(QK % 16 == 0 && V % 16 == 0 && NOPE % 4 == 0 && R % 4 == 0, "head dims in 16s");
};

// The operands in bf16 (hi, and lo = bf16(x - hi) for split), made by flash_pack_kernel.
struct FlashOps {
  const __nv_bfloat16 *qh, *ql;  // [m, H, QK]
  const __nv_bfloat16 *kh, *kl;  // [Lk, H, QK]: k_nope | pe
  const __nv_bfloat16 *vh, *vl;  // [Lk, H, V]
};

struct FlashArgs {
  FlashOps ops;
  int64_t m, pos0;   // queries; query i sits at position pos0 + i and sees keys [0, pos0 + i]
  float* out;        // [m, H * V]
  int H;
  float scale_log2;  // softmax scale * log2(e)
};

// The bf16 buffers flash_pack_kernel fills (FlashOps' layouts) and their sizes: m queries, Lk keys, H heads.
struct FlashPack {
  int64_t m, Lk;
  int H;
  __nv_bfloat16 *qh, *ql, *kh, *kl, *vh, *vl;
};

// Rows (t, h) < Lk * H: K = k_nope | pe, V; then rows (i, h) < m * H of Q. One warp per row.
// q [m, H, QK], kvb [Lk, H, NOPE + V], pe [Lk, R].
template <int NOPE, int R, int V>
__global__ void flash_pack_kernel(const float* __restrict__ q, const float* __restrict__ kvb,
                                  const float* __restrict__ pe, FlashPack P) {
  constexpr int QK = NOPE + R;
  const int64_t m = P.m, Lk = P.Lk;
  const int H = P.H;
  __nv_bfloat16 *qh = P.qh, *ql = P.ql, *kh = P.kh, *kl = P.kl, *vh = P.vh, *vl = P.vl;
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t w = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); w < (Lk + m) * H; w += warps) {
    if (w < Lk * H) {
      const int64_t t = w / H;
      const float* src = kvb + w * (NOPE + V);
      for (int c = lane; c < QK; c += 32) split_bf16(c < NOPE ? src[c] : pe[t * R + c - NOPE], kh, kl, w * QK + c);
      for (int c = lane; c < V; c += 32) split_bf16(src[NOPE + c], vh, vl, w * V + c);
    } else {
      const int64_t r = w - Lk * H;
      for (int c = lane; c < QK; c += 32) split_bf16(q[r * QK + c], qh, ql, r * QK + c);
    }
  }
}

// rows x (COLS bf16) from src + r * ld (elements) into shared rows of ldd elements with cp.async;
// rows >= valid are zero-filled.
template <int kThreads, int ROWS, int COLS>
__device__ __forceinline__ void load_rows(__nv_bfloat16* dst, int ldd, int valid, const __nv_bfloat16* src,
                                          int64_t ld) {
  constexpr int CH = COLS / 8, N = ROWS * CH;
  static_assert(COLS % 8 == 0, "16-byte chunks");
#pragma unroll
  for (int e0 = 0; e0 < N; e0 += kThreads) {
    const int e = e0 + int(threadIdx.x);
    if (N % kThreads != 0 && e >= N) break;
    const int r = e / CH, c = (e - r * CH) * 8;
    const bool ok = r < valid;
    cp_async16(smem_addr(dst + r * ldd + c), src + (ok ? r : 0) * ld + c, ok);
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
// The remainder a - bf16(a), b - bf16(b) as bf16.
__device__ __forceinline__ uint32_t pack_bf16_lo(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  const float2 f = __bfloat1622float2(h);
  return pack_bf16(a - f.x, b - f.y);
}

// Two n-tiles of 8: c0 += a · (b[0], b[1]), c1 += a · (b[2], b[3]); split adds a · bl + al · b.
template <bool SPLIT>
__device__ __forceinline__ void mma_pair(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                         const uint32_t (&al)[4], const uint32_t (&b)[4], const uint32_t (&bl)[4]) {
  mma_bf16(c0, a, b[0], b[1]);
  mma_bf16(c1, a, b[2], b[3]);
  if (SPLIT) {
    mma_bf16(c0, a, bl[0], bl[1]);
    mma_bf16(c1, a, bl[2], bl[3]);
    mma_bf16(c0, al, b[0], b[1]);
    mma_bf16(c1, al, b[2], b[3]);
  }
}

template <int NOPE, int R, int V, bool SPLIT>
__global__ void __launch_bounds__(128) flash_prefill_kernel(FlashArgs A) {
  using C = FlashCfg<NOPE, R, V, SPLIT>;
  constexpr int QK = C::QK, BQ = C::BQ, BK = C::BK, LQ = C::LQ, LV = C::LV, NT = BK / 8, VT = V / 8, T = C::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // [Q hi, Q lo][stage 0: K hi, K lo, V hi, V lo][stage 1: ...]
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  auto sK = [&](int st, int part) { return sQ + C::P * C::q_elems + st * C::P * (C::k_elems + C::v_elems) + part * C::k_elems; };
  auto sV = [&](int st, int part) {
    return sQ + C::P * C::q_elems + st * C::P * (C::k_elems + C::v_elems) + C::P * C::k_elems + part * C::v_elems;
  };
  pdl_wait();
  pdl_trigger();
  const int H = A.H, h = blockIdx.y;
  // Longest query blocks first (causal: later queries see more keys).
  const int64_t i0 = int64_t(gridDim.x - 1 - blockIdx.x) * BQ;
  const int qv = int(A.m - i0 < BQ ? A.m - i0 : BQ);
  const int64_t kmax = A.pos0 + i0 + qv;  // keys this block needs: [0, kmax)
  const int ntiles = int((kmax + BK - 1) / BK);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const FlashOps& O = A.ops;

  auto load_kv = [&](int kt) {
    const int st = kt & 1;
    const int64_t k0 = int64_t(kt) * BK;
    const int kv = int(kmax - k0 < BK ? kmax - k0 : BK);
    const int64_t kro = (k0 * H + h) * QK, vro = (k0 * H + h) * V;
    load_rows<T, BK, QK>(sK(st, 0), LQ, kv, O.kh + kro, int64_t(H) * QK);
    load_rows<T, BK, V>(sV(st, 0), LV, kv, O.vh + vro, int64_t(H) * V);
    if (SPLIT) {
      load_rows<T, BK, QK>(sK(st, 1), LQ, kv, O.kl + kro, int64_t(H) * QK);
      load_rows<T, BK, V>(sV(st, 1), LV, kv, O.vl + vro, int64_t(H) * V);
    }
  };
  const int64_t qro = (i0 * H + h) * QK;
  load_rows<T, BQ, QK>(sQ, LQ, qv, O.qh + qro, int64_t(H) * QK);
  if (SPLIT) load_rows<T, BQ, QK>(sQ + C::q_elems, LQ, qv, O.ql + qro, int64_t(H) * QK);
  load_kv(0);
  cp_async_commit();

  // ldmatrix lanes: A operand (rows lane % 16, 8-column chunk lane / 16); B from [n][k] rows
  // (non-transposed: K); B from [k][n] rows (transposed: V).
  const int a_r = lane & 15, a_c = lane >> 4;
  const int b_r = (lane & 7) + ((lane >> 4) << 3), b_c = (lane >> 3) & 1;
  const int v_r = (lane & 7) + (((lane >> 3) & 1) << 3), v_c = lane >> 4;
  const int64_t p_row0 = A.pos0 + i0 + warp * 16 + g;  // positions of this thread's rows: +0, +8

  float o[VT][4];
#pragma unroll
  for (int i = 0; i < VT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  for (int kt = 0; kt < ntiles; ++kt) {
    if (kt + 1 < ntiles) load_kv(kt + 1);  // its stage was last read in iteration kt - 1
    cp_async_commit();
    cp_async_wait<1>();  // tile kt (and Q) landed
    __syncthreads();
    const int st = kt & 1;
    const int64_t k0 = int64_t(kt) * BK;
    const __nv_bfloat16 *Kh = sK(st, 0), *Kl = sK(st, 1), *Vh = sV(st, 0), *Vl = sV(st, 1);

    // ---- S = Q K^T for this warp's 16 rows x BK keys
    float s[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < QK / 16; ++ks) {
      uint32_t a[4], al[4];
      const int qo = (warp * 16 + a_r) * LQ + ks * 16 + a_c * 8;
      ldmatrix_x4(a, smem_addr(sQ + qo));
      if (SPLIT) ldmatrix_x4(al, smem_addr(sQ + C::q_elems + qo));
#pragma unroll
      for (int nj = 0; nj < BK / 16; ++nj) {
        uint32_t b[4], bl[4];
        const int ko = (nj * 16 + b_r) * LQ + ks * 16 + b_c * 8;
        ldmatrix_x4(b, smem_addr(Kh + ko));
        if (SPLIT) ldmatrix_x4(bl, smem_addr(Kl + ko));
        mma_pair<SPLIT>(s[2 * nj], s[2 * nj + 1], a, al, b, bl);
      }
    }

    // ---- causal mask, online softmax (base 2; scale folded in)
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t key = k0 + ni * 8 + 2 * t + (c & 1);
        float v = s[ni][c] * A.scale_log2;
        if (key > p_row0 + (c >> 1) * 8) v = -INFINITY;
        s[ni][c] = v;
        mx[c >> 1] = fmaxf(mx[c >> 1], v);
      }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float mn = fmaxf(m_run[r], mx[r]);  // finite: key 0 is in every row's range
      alpha[r] = exp2f(m_run[r] - mn);
      m_run[r] = mn;
    }
    float ls[2] = {0.f, 0.f};
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float p = exp2f(s[ni][c] - m_run[c >> 1]);
        s[ni][c] = p;
        ls[c >> 1] += p;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + ls[r];
#pragma unroll
    for (int i = 0; i < VT; ++i) o[i][0] *= alpha[0], o[i][1] *= alpha[0], o[i][2] *= alpha[1], o[i][3] *= alpha[1];

    // ---- O += P V: the score accumulators of two key n-tiles are one A fragment
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t pa[4], pl[4];
      pa[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      if (SPLIT) {
        pl[0] = pack_bf16_lo(s[2 * kk][0], s[2 * kk][1]);
        pl[1] = pack_bf16_lo(s[2 * kk][2], s[2 * kk][3]);
        pl[2] = pack_bf16_lo(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pl[3] = pack_bf16_lo(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      }
#pragma unroll
      for (int vn = 0; vn < V / 16; ++vn) {
        uint32_t b[4], bl[4];
        const int vo = (kk * 16 + v_r) * LV + vn * 16 + v_c * 8;
        ldmatrix_x4_trans(b, smem_addr(Vh + vo));
        if (SPLIT) ldmatrix_x4_trans(bl, smem_addr(Vl + vo));
        mma_pair<SPLIT>(o[2 * vn], o[2 * vn + 1], pa, pl, b, bl);
      }
    }
    __syncthreads();  // every warp is done with stage st before iteration kt + 1 refills it
  }
  cp_async_wait<0>();

  // ---- normalise and write this thread's rows g and g + 8
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    const int row = warp * 16 + g + r * 8;
    if (row >= qv) continue;
    const float inv = 1.f / l_run[r];
    float* dst = A.out + (i0 + row) * int64_t(H) * V + int64_t(h) * V;
#pragma unroll
    for (int vn = 0; vn < VT; ++vn)
      *reinterpret_cast<float2*>(dst + vn * 8 + 2 * t) = make_float2(o[vn][2 * r] * inv, o[vn][2 * r + 1] * inv);
  }
}

template <int NOPE, int R, int V, bool SPLIT>
void flash_launch(const Launch& L, const FlashArgs& a) {
  using C = FlashCfg<NOPE, R, V, SPLIT>;
  allow_smem(flash_prefill_kernel<NOPE, R, V, SPLIT>, size_t(C::smem));
  launch(L, flash_prefill_kernel<NOPE, R, V, SPLIT>, dim3(cdiv(a.m, C::BQ), unsigned(a.H)), dim3(C::kThreads),
         size_t(C::smem), a);
}

template <int NOPE, int R, int V>
void flash_run(const Launch& L, const FlashRun& r, int H, float scale_log2) {
  constexpr int QK = NOPE + R;
  const int64_t m = r.m, pos0 = r.pos0;
  const bool split = r.split;
  void* ws = r.ws;
  const int64_t Lk = pos0 + m;
  auto* b = static_cast<__nv_bfloat16*>(ws);
  FlashArgs a;
  FlashOps& o = a.ops;
  auto take = [&](int64_t n) {  // n elements, 256-byte aligned
    __nv_bfloat16* p = b;
    b += (n + 127) / 128 * 128;
    return p;
  };
  __nv_bfloat16 *qh = take(m * H * QK), *kh = take(Lk * H * QK), *vh = take(Lk * H * V);
  __nv_bfloat16 *ql = split ? take(m * H * QK) : nullptr, *kl = split ? take(Lk * H * QK) : nullptr,
                *vl = split ? take(Lk * H * V) : nullptr;
  const FlashPack P{m, Lk, H, qh, ql, kh, kl, vh, vl};
  launch(L, flash_pack_kernel<NOPE, R, V>, dim3(cdiv((Lk + m) * H, 8)), dim3(256), 0, r.q, r.kvb, r.pe, P);
  o.qh = qh, o.ql = ql, o.kh = kh, o.kl = kl, o.vh = vh, o.vl = vl;
  a.m = m, a.pos0 = pos0, a.out = r.out, a.H = H, a.scale_log2 = scale_log2;
  if (split) flash_launch<NOPE, R, V, true>(L, a);
  else flash_launch<NOPE, R, V, false>(L, a);
}

template <int NOPE, int R, int V>
size_t flash_ws(int64_t m, int64_t pos0, int H) {
  constexpr int QK = NOPE + R;
  auto r = [](int64_t n) { return size_t((n + 127) / 128 * 128) * 2; };
  const int64_t Lk = pos0 + m;
  return 2 * (r(m * H * QK) + r(Lk * H * QK) + r(Lk * H * V));
}

}  // namespace

bool flash_prefill_ok(const MlaDims& d) {
  return (d.nope == 128 && d.R == 64 && d.V == 128) || (d.nope == 32 && d.R == 16 && d.V == 32);
}

size_t flash_prefill_ws(const MlaDims& d, int64_t m, int64_t pos0) {
  DSV3_CHECK(flash_prefill_ok(d), "flash_prefill: unsupported head dims ", d.nope, "/", d.R, "/", d.V);
  return d.nope == 128 ? flash_ws<128, 64, 128>(m, pos0, d.H) : flash_ws<32, 16, 32>(m, pos0, d.H);
}

void flash_prefill(const Launch& L, const MlaDims& d, const FlashRun& r) {
  DSV3_CHECK(flash_prefill_ok(d), "flash_prefill: unsupported head dims ", d.nope, "/", d.R, "/", d.V);
  const float sl2 = d.scale * 1.4426950408889634f;
  if (d.nope == 128) flash_run<128, 64, 128>(L, r, d.H, sl2);
  else flash_run<32, 16, 32>(L, r, d.H, sl2);
}

}  // namespace dsv3::cuda
