// The CUDA backend's products: which kernel takes a linear of n tokens (the GEMVs at decode,
// on tensor cores where they fit; the pipelined tensor-core GEMM at prefill), two linears of the
// same activations in one launch, and the dense MLP.
#include <algorithm>

#include "backend/cuda/backend_impl.h"
#include "core/error.h"

namespace dsv3::cuda_impl {

// Attention projections and the head stay float32-grade in fast mode too: their errors reach
// every later token through the cache (with bf16 activations here as well, the golden cases' max
// error exceeds the reference's own bf16 row: measured). Fast mode is for the MLPs, experts and
// the attention core. FP8 GEMM mode takes every FP8 weight's product, as the reference's
// gemm_impl="fp8" does (the head's weights are bf16).
void CudaBackend::linear(const float* x, int64_t n, const Linear& w, float* y) {
  if (opt_.profile) mark(str("linear ", w.out(), "x", w.in(), " ", dtype_name(w.weight.dtype)));
  const DevLinear dw = dev_linear(w);
  run_linear(dw, x, n, y, dw.rows, /*fp8=*/true);
}

// y[n, out] = x[n, in] · Wᵀ.
void CudaBackend::run_linear(const DevLinear& w, const float* x, int64_t n, float* y, int64_t ldy, bool fp8) {
  if (long_k(n, w.t, w.cols) == 2 && tcv_chunked(w, nullptr, x, n, y, ldy)) return;
  if (fp8 && fp8_for(n, w)) {
    tc_linear(quant_input(x, n, w.cols), w, n, y, ldy);
  } else if (tc_for(n, w)) {
    tc_linear(split_input(x, n, w.cols, /*fast=*/false), w, n, y, ldy);
  } else if (n <= opt_.tune.gemv_max || w.t == cuda::kF32 || !cuda::gemm_ok(w)) {
    cuda::gemv(L_, w, nullptr, {.x = x, .ldx = w.cols, .m = n, .y = y, .ldy = ldy});
  } else {
    cuda::gemm(L_, w, nullptr, {.x = x, .ldx = w.cols, .m = n, .y = y, .ldy = ldy}, {});
  }
}

bool CudaBackend::tcv_chunked(const DevLinear& w, const DevLinear* w3, const float* x, int64_t n, float* y, int64_t ldy) {
  const int64_t K = w.cols, kc = cuda::tcv_chunk(w.t, K, n);
  if (kc == 0 || kc == K) return false;
  const int nc = int((K + kc - 1) / kc), P = w3 ? 2 : 1;
  const int64_t part = n * w.rows;  // one product of one chunk: [n, rows]
  float* parts = f32(kChunks, size_t(nc * P) * size_t(part));
  if (!cuda::tcv_gemv_chunks(L_, w, w3, {.x = x, .ldx = K, .m = n, .y = parts, .ldy = w.rows}, w3 ? parts + part : nullptr,
                             kc, P * part))
    return false;
  cuda::chunk_sum(L_, parts, nc, n, w.rows, w3 != nullptr, y, ldy);
  return true;
}

// y[n, out] = x · Wᵀ on the pipelined kernel, x already split into j's A operand.
void CudaBackend::tc_linear(cuda::TcJob j, const DevLinear& w, int64_t n, float* y, int64_t ldy) {
  j.w = w, j.M = n, j.c = y, j.ldc = ldy;
  // Few output tiles (the gate, wkv_a alone): split K so every SM gets work.
  set_form(j, w.cols % 64 == 0, w.t);
  const int64_t tiles = cuda::tc_out_tiles(n, w.rows, false, j.tm), ksteps = w.cols / 32;
  if (tiles < 132 && ksteps >= 16) {
    j.splits = int(std::min<int64_t>(ksteps / 8, (264 + tiles - 1) / tiles));
    if (j.splits > 1) j.ws = f32(kSplitK, size_t(j.splits * n * w.rows));
  }
  cuda::tc_gemm(L_, j, cuda::tc_tiles(n, j.tm), w.rows);
}

// Two products of x [n, in] in one launch: the pipelined kernel's pair where both weights suit it
// (prefill), else the streaming gemv2 (decode, n <= 8).
bool CudaBackend::pair_ok(const DevLinear& w1, const DevLinear& w2, const float* x, int64_t n) const {
  const bool first = tc_for(n, w1) || n <= std::min(opt_.tune.gemv_max, 8);
  if (long_k(n, w1.t, w1.cols) == 2) return false;  // (each alone, in K chunks)
  return first && (tc_pair_ok(w1, w2, n) || cuda::gemv2_ok(w1, w2, x, n));
}

void CudaBackend::linear_pair(const Op& a, const Op& b, const StepGraph& g) {
  const DevLinear w1 = dev_linear(*a.linear), w2 = dev_linear(*b.linear);
  const Value &x = g.val(a.in), &y1 = g.val(a.out), &y2 = g.val(b.out);
  const int64_t n = x.rows;
  if (opt_.profile)
    mark(str("linear pair ", tc_pair_ok(w1, w2, n) ? "tc " : "", w1.rows, "+", w2.rows, "x", w2.cols, " ",
             dtype_name(a.linear->weight.dtype)));
  if (tc_pair_ok(w1, w2, n)) {
    // One split (or quantisation) of x, one launch: the first's weight row tiles, then the second's.
    cuda::TcJob j = fp8_for(n, w2) ? quant_input(x.data, n, w2.cols) : split_input(x.data, n, w2.cols, /*fast=*/false);
    j.w = w1, j.M = n, j.c = y1.data, j.ldc = w1.rows;
    j.w_pair = w2, j.c_pair = y2.data, j.ldc_pair = w2.rows;
    set_form(j, w2.cols % 64 == 0, w2.t);
    cuda::tc_gemm(L_, j, cuda::tc_tiles(n, j.tm), cuda::tc_pair_rows(j));
    return;
  }
  cuda::gemv2(L_, w1, y1.data, w2, y2.data, x.data, n);
}

// Whether two linears of the same n activations run as one pipelined-kernel launch (w's row
// tiles, then w2's): both taken there with the same K and weight type.
bool CudaBackend::tc_pair_ok(const DevLinear& w, const DevLinear& w2, int64_t n) const {
  return tc_for(n, w) && tc_for(n, w2) && w.cols == w2.cols && w.t == w2.t;
}

// Tile rows for weights of type wtype: as asked, else 128 for e4m3 (the wgmma form's two
// warpgroups share each widened weight tile: half the widening per product) and 64 for bf16
// (more blocks per SM; 128 measured slower).
int CudaBackend::tile_m(int32_t wtype) const {
  return opt_.tune.tc_tm ? opt_.tune.tc_tm : (wtype == cuda::kFP8 ? 128 : 64);
}

// The pipelined kernel's form for a job: tile rows, and wgmma where the device and every K
// (k64: all multiples of 64) allow it.
void CudaBackend::set_form(cuda::TcJob& j, bool k64, int32_t wtype) const {
  j.tm = j.a_s ? 128 : tile_m(wtype);  // (e4m3 activations: the 128-row form only)
  j.wgmma = wgmma_ && k64;
  j.fp8 = wtype == cuda::kFP8;
  DSV3_CHECK(!j.fp8 || j.wgmma, "FP8 weights reach the pipelined kernel only in its wgmma form");
}

// Whether the pipelined kernel takes w: bf16 in either form; FP8 (widened to bf16 in shared
// memory, block scales on the partial sums) in the wgmma form.
bool CudaBackend::tc_takes(const DevLinear& w) const {
  if (w.t == cuda::kFP8) return wgmma_ && cuda::tc_ok_fp8(w);
  return cuda::tc_ok(w);
}

// A job whose A operand is x [n, cols] split into bf16 hi (+ lo unless fast) in kHi / kLo; with
// rows, its row r is x's row rows[r] (MoE pairs in expert order).
cuda::TcJob CudaBackend::split_input(const float* x, int64_t n, int64_t cols, bool fast, const int32_t* rows) {
  cuda::TcJob j;
  j.a_hi = scratch(kHi, size_t(n * cols) * 2);
  j.a_lo = fast ? nullptr : scratch(kLo, size_t(n * cols) * 2);
  j.lda = cols;
  cuda::split_rows(L_, x, n, cols, cols, const_cast<void*>(j.a_hi), const_cast<void*>(j.a_lo), rows);
  return j;
}

cuda::TcJob CudaBackend::quant_input(const float* x, int64_t n, int64_t cols, bool second, const int32_t* rows) {
  cuda::TcJob j;
  uint8_t* q = static_cast<uint8_t*>(scratch(second ? kQ2 : kQ, size_t(n * cols)));
  float* s = f32(second ? kQs2 : kQs, size_t(n * cols / 128));
  cuda::act_quant_rows(L_, x, rows, n, cols, ue8m0_, q, s);
  j.a_hi = q, j.lda = cols, j.a_s = s, j.ldas = cols / 128;
  return j;
}

void CudaBackend::mlp(const MLPWeights& w, const float* x, int64_t n, float* y) {
  const DevLinear w1 = dev_linear(w.w1), w3 = dev_linear(w.w3), w2 = dev_linear(w.w2);
  const int64_t inter = w1.rows, D = w2.rows;
  mark("mlp");
  // Both stages on the pipelined GEMM from tc_min tokens, or where the first stage's K is too long
  // for the tensor-core GEMV; when only the second's is (its K is the inter dim), that one alone.
  const bool all_tc = tc_takes(w1) && tc_takes(w3) && tc_takes(w2);
  if (all_tc && (use_tc(n) || long_k(n, w1.t, w1.cols) == 1)) {
    // FP8 GEMM mode: e4m3 x, the SwiGLU product out in float32, quantised again for w2.
    const bool f8 = fp8_for(n, w1) && fp8_for(n, w2);
    cuda::TcJob j0 = f8 ? quant_input(x, n, D) : split_input(x, n, D, fast_at(n));
    j0.w = w1, j0.w3 = w3, j0.swiglu = true, j0.M = n;
    j0.o_f32 = f8;
    j0.o_hi = scratch(kHi2, size_t(n * inter) * (f8 ? 4 : 2));
    j0.o_lo = fast_at(n) || f8 ? nullptr : scratch(kLo2, size_t(n * inter) * 2);
    j0.ldo = inter;
    set_form(j0, D % 64 == 0 && inter % 64 == 0, w1.t);
    cuda::tc_gemm(L_, j0, cuda::tc_tiles(n, j0.tm), inter);
    cuda::TcJob j1;
    if (f8) j1 = quant_input(static_cast<const float*>(j0.o_hi), n, inter, /*second=*/true);
    else j1.a_hi = j0.o_hi, j1.a_lo = j0.o_lo, j1.lda = inter;
    j1.w = w2, j1.M = n, j1.c = y, j1.ldc = D;
    set_form(j1, D % 64 == 0 && inter % 64 == 0, w2.t);
    cuda::tc_gemm(L_, j1, cuda::tc_tiles(n, j1.tm), D);
    return;
  }
  if (n <= opt_.tune.gemv_max || !cuda::gemm_ok(w1) || !cuda::gemm_ok(w2)) {
    float* h = f32(kH, size_t(n * inter));
    if (!(long_k(n, w1.t, w1.cols) == 2 && tcv_chunked(w1, &w3, x, n, h, inter)))
      cuda::gemv(L_, w1, &w3, {.x = x, .ldx = w1.cols, .m = n, .y = h, .ldy = inter});
    if (long_k(n, w2.t, w2.cols) == 2 && tcv_chunked(w2, nullptr, h, n, y, D)) return;
    if (fp8_for(n, w2)) tc_linear(quant_input(h, n, inter), w2, n, y, D);
    else if (tc_for(n, w2)) tc_linear(split_input(h, n, inter, fast_at(n)), w2, n, y, D);
    else cuda::gemv(L_, w2, nullptr, {.x = h, .ldx = inter, .m = n, .y = y, .ldy = D});
    return;
  }
  float* h = f32(kH, size_t(n * 2 * inter));  // [n, w1 x | w3 x]
  cuda::gemm(L_, w1, &w3, {.x = x, .ldx = w1.cols, .m = n, .y = h, .ldy = 2 * inter}, {.col1 = inter, .fast = fast_at(n)});
  cuda::gemm(L_, w2, nullptr, {.x = h, .ldx = 2 * inter, .m = n, .y = y, .ldy = D},
             {.silu_pair = true, .pair_off = inter, .fast = fast_at(n)});
}

}  // namespace dsv3::cuda_impl
