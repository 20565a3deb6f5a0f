// One token's value absorption and output projection in one launch (CudaOptions::vo_fuse):
// the decode attention's position splits combined, wkv_b's value rows and wo, with no kernel
// boundary between the absorption and wo. Block (g, b) takes head b and row group g of wo:
//   before its wait: head b's value rows [V, C] into shared memory (cp.async), its rows of wo
//     over head b's V columns into registers;
//   after it: head b's latent o_b (split_factors / split_column, as gemv_splits), then
//     a_b = wv_b · o_b (the streaming GEMV's arithmetic per row: same bits as gemv_splits),
//     then the partial wo[rows, bV .. bV + V) · a_b;
//   the last of the row group's H blocks to arrive adds the heads' partials in head order.
// Every block of a head recomputes a_b (V x C multiply-adds, from shared memory): the groups
// share nothing, so nothing waits on another block but the final sum.
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gemv_dot.cuh"
#include "backend/cuda/mla_splits.cuh"
#include "backend/cuda/mma.cuh"
#include "core/error.h"

namespace dsv3::cuda {
namespace {

constexpr int kVoThreads = 256;
constexpr int kVoMaxC = 512;
constexpr size_t kVoMaxSmem = 200 * 1024;
constexpr int kVoScales = 32;  // e4m3 scale blocks of one head's value rows (V <= 512, C <= 512: 5 x 5 at most)

// 16-byte chunks of wo a thread holds from before the wait.
template <int WT>
__host__ __device__ constexpr int vo_regs() { return WT == kFP8 ? 8 : 16; }

struct VoJob {
  DevLinear wv, wo;  // wv: head 0's value rows of wkv_b [V, C]; head b's are b * wrows rows further
  int64_t wrows;
  int heads, rg;  // rg: rows of wo per block
  const DevPos* pos;
  int nsplit;
  const float *part, *ml, *ol;
  float* part_y;       // [heads][wo.rows]
  unsigned* counters;  // [row groups]
  float* y;            // [wo.rows]
};

// (bf16 at the 16B shape fits one block per SM by its shared memory: its registers may use that.)
template <int WT>
__global__ void __launch_bounds__(kVoThreads, WT == kFP8 ? 2 : 1) vo_kernel(VoJob J) {
  extern __shared__ __align__(16) char smem[];
  __shared__ float fz[kDecMaxSplits];
  __shared__ float lsum;
  __shared__ float svs[kVoScales];  // e4m3: the block scales of head b's value rows, [rows][cols]
  constexpr int CE = chunk_elems<WT>(), EB = elem_bytes<WT>(), NR = vo_regs<WT>();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t b = blockIdx.y, C = J.wv.cols, V = J.wv.rows, D = J.wo.rows;
  const int64_t r0 = int64_t(blockIdx.x) * J.rg, nr = min(int64_t(J.rg), D - r0);
  const int64_t cpr = C / CE;   // chunks per value row
  const int ncw = int(V / CE);  // chunks per row of wo in head b's columns (a power of two <= 32)
  const int lg = __ffs(ncw) - 1;
  uint4* wvs = reinterpret_cast<uint4*>(smem);              // [V][cpr]
  float* xs = reinterpret_cast<float*>(smem + V * C * EB);  // [C]
  float* oh = xs + C;                                       // [V]

  // Weights first (no earlier kernel writes them).
  const int64_t vrow0 = J.wv.row0 + b * J.wrows;
  copy_rows_async<EB>(J.wv, b * J.wrows, V, wvs);
  cp_async_commit();
  // (e4m3) their scales too, and those of this thread's wo chunks: no scale load after the wait
  const ScaleTile vsc(svs, J.wv, b * J.wrows, V, WT == kFP8);
  const char* wob = static_cast<const char*>(J.wo.w);
  const int64_t oc0 = J.wo.col0 + b * V;  // head b's first column of wo
  uint4 wr[NR];
  float wsc[NR];
#pragma unroll
  for (int u = 0; u < NR; ++u) {  // chunk i of the block: row i / ncw, chunk i % ncw of it
    const int64_t i = tid + int64_t(u) * kVoThreads, r = i >> lg, c = i & (ncw - 1);
    wr[u] = r < nr ? ld_stream(wob + ((J.wo.row0 + r0 + r) * J.wo.ld + oc0) * EB + c * 16) : make_uint4(0u, 0u, 0u, 0u);
    wsc[u] = WT == kFP8 && r < nr ? J.wo.s[((J.wo.row0 + r0 + r) >> 7) * J.wo.lds + ((oc0 + c * CE) >> 7)] : 1.f;
  }

  pdl_wait();
  // Head b's latent: its splits combined (ol where the token's length took one split).
  const int64_t len = int64_t(J.pos[0].pos) + 1;
  const int ns = dec_splits(len, dec_chunk(len, J.nsplit));
  if (ns == 1) {
    for (int64_t c = tid; c < C; c += kVoThreads) xs[c] = __ldcg(J.ol + b * C + c);
  } else {
    if (tid < 32) {
      const float L = split_factors(J.ml, ns, J.heads, b, fz);
      if (tid == 0) lsum = L;
    }
    __syncthreads();
    for (int64_t c = tid; c < C; c += kVoThreads) xs[c] = split_column(J.part, ns, J.heads, C, b, c, fz, lsum);
  }
  cp_async_wait<0>();
  __syncthreads();

  // a_b = wv_b · o_b: warp w the rows w, w + 8, ..., kRows of them at a time (independent chains:
  // their shared-memory loads and shuffles overlap); per row a lane its chunks lane, lane + 32, ...
  // in order, then the warp's sum (the streaming GEMV's order, so gemv_splits' bits).
  constexpr int kRows = 4;
  const float* xr[1] = {xs};
  for (int64_t v0 = warp; v0 < V; v0 += kRows * (kVoThreads / 32)) {
    float acc[kRows];
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      const int64_t v = v0 + q * (kVoThreads / 32);
      float unused = 0.f;
      acc[q] = 0.f;
      if (v >= V) continue;
      for (int64_t c = lane; c < cpr; c += 32) {
        const uint4 w = wvs[v * cpr + c];
        chunk_dot2<WT, 1, true>(w, w, false, WT == kFP8 ? vsc.at(vrow0 + v, J.wv.col0 + c * CE) : 1.f, 1.f, xr,
                                c * CE, &acc[q], &unused);
      }
    }
#pragma unroll
    for (int q = 0; q < kRows; ++q) acc[q] = warp_sum(acc[q]);
    if (lane == 0) {
#pragma unroll
      for (int q = 0; q < kRows; ++q)
        if (v0 + q * (kVoThreads / 32) < V) oh[v0 + q * (kVoThreads / 32)] = acc[q];
    }
  }
  __syncthreads();

  // This block's rows of wo over head b's columns; a row's ncw chunks sit in neighbouring lanes.
  const float* ar[1] = {oh};
#pragma unroll
  for (int u = 0; u < NR; ++u) {
    const int64_t i = tid + int64_t(u) * kVoThreads, r = i >> lg;
    const int c = int(i & (ncw - 1));
    float s = 0.f, unused = 0.f;
    if (r < nr) chunk_dot2<WT, 1, true>(wr[u], wr[u], false, wsc[u], 1.f, ar, c * CE, &s, &unused);
    for (int o = ncw >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (c == 0 && r < nr) J.part_y[b * D + r0 + r] = s;
  }

  // The last of the row group's blocks adds the heads' partials in head order.
  if (!last_to_arrive(J.counters + blockIdx.x, unsigned(J.heads))) return;
  for (int64_t r = tid; r < nr; r += kVoThreads) {
    float s = 0.f;
#pragma unroll 4
    for (int h = 0; h < J.heads; ++h) s += __ldcg(J.part_y + h * D + r0 + r);
    J.y[r0 + r] = s;
  }
  if (tid == 0) J.counters[blockIdx.x] = 0;  // ready for the next launch
}

size_t vo_smem(const DevLinear& wv) {
  const size_t eb = wv.t == kFP8 ? 1 : 2;
  return (size_t(wv.rows * wv.cols) * eb + size_t(wv.cols + wv.rows) * 4 + 15) / 16 * 16;
}

// Rows of wo per block: the blocks fill the SMs once where the registers allow.
int64_t vo_rows(const DevLinear& wv, const DevLinear& wo, int heads) {
  const int64_t ce = wv.t == kFP8 ? 16 : 8, regs = wv.t == kFP8 ? vo_regs<kFP8>() : vo_regs<kBF16>();
  const int64_t rmax = regs * kVoThreads / (wv.rows / ce), D = wo.rows;
  const int64_t want = std::max<int64_t>(1, std::min<int64_t>(device_sms() / heads, (D + 15) / 16));
  const int64_t g = std::max<int64_t>((D + rmax - 1) / rmax, want);
  return (D + g - 1) / g;
}

// The launch, past 48 KB of dynamic shared memory where it needs to be (allow_smem).
template <int WT>
void launch_vo(const Launch& L, dim3 grid, size_t smem, const VoJob& J) {
  allow_smem(vo_kernel<WT>, smem);
  launch(L, vo_kernel<WT>, grid, dim3(kVoThreads), smem, J);
}

}  // namespace

int vo_groups(const DevLinear& wv, const DevLinear& wo, int heads) {
  return int(cdiv(wo.rows, vo_rows(wv, wo, heads)));
}

bool vo_ok(const DevLinear& wv, const DevLinear& wo, int heads) {
  if (wv.t != wo.t || (wv.t != kFP8 && wv.t != kBF16) || heads < 1 || wo.rows < 1) return false;
  const int64_t ce = wv.t == kFP8 ? 16 : 8, V = wv.rows, C = wv.cols;
  if (C < 1 || C > kVoMaxC || C % ce != 0 || V < 1 || V % ce != 0) return false;
  const int64_t ncw = V / ce;
  if (ncw > 32 || (ncw & (ncw - 1)) != 0 || wo.cols != heads * V) return false;
  if (!vec_ok(wv) || !vec_ok(wo) || vo_smem(wv) > std::min(kVoMaxSmem, device_smem_optin())) return false;
  return vo_groups(wv, wo, heads) <= kVoMaxGroups;
}

void vo(const Launch& L, const DevLinear& wv, int64_t wrows, const DevLinear& wo, int heads, const DevPos* pos,
        int nsplit, const float* part, const float* ml, const float* ol, float* part_y, unsigned* counters, float* y) {
  DSV3_CHECK(vo_ok(wv, wo, heads) && nsplit >= 1 && nsplit <= kDecMaxSplits, "vo: ", wv.rows, "x", wv.cols,
             " value rows, wo ", wo.rows, "x", wo.cols, ", ", heads, " heads, ", nsplit, " splits");
  VoJob J;
  const int64_t rg = vo_rows(wv, wo, heads);
  J.wv = wv, J.wo = wo, J.wrows = wrows, J.heads = heads, J.rg = int(rg);
  J.pos = pos, J.nsplit = nsplit, J.part = part, J.ml = ml, J.ol = ol;
  J.part_y = part_y, J.counters = counters, J.y = y;
  const dim3 grid(cdiv(wo.rows, rg), unsigned(heads));
  const size_t smem = vo_smem(wv);
  if (wv.t == kFP8) launch_vo<kFP8>(L, grid, smem, J);
  else launch_vo<kBF16>(L, grid, smem, J);
}

}  // namespace dsv3::cuda
