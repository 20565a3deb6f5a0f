// The CUDA kernels' host-side launchers and the plain structs they share with device code
// (compiled by both nvcc and the host compiler). All launches go to Launch::stream; with
// Launch::pdl they may overlap their start with the previous kernel's tail (programmatic
// dependent launch): every kernel waits for its predecessors before touching memory.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#ifdef __CUDACC__
#define DSV3_HD __host__ __device__
#else
#define DSV3_HD
#endif

namespace dsv3::cuda {

enum WType : int32_t { kBF16 = 0, kFP8 = 1, kF32 = 2 };

// A linear weight on the device, or a rectangle of one: element (r, k), r < rows, k < cols, is
// w[(row0 + r) * ld + col0 + k]; for FP8 its scale is s[((row0 + r) / 128) * lds + (col0 + k) / 128].
struct DevLinear {
  const void* w = nullptr;
  const float* s = nullptr;
  int64_t rows = 0, cols = 0, ld = 0, lds = 0, row0 = 0, col0 = 0;
  int32_t t = kBF16;
};

// One routed expert (or a slice of the shared experts): w2(silu(w1 x) * w3 x).
struct DevExpert {
  DevLinear w1, w3, w2;
  int32_t vec13 = 0, vec2 = 0;  // vec_ok() of w1 and w3, of w2
};

struct DevSample {  // one row's draw for sample_rows (Backend::SampleSpec)
  float temperature, top_p, min_p;
  int32_t top_k;
  double u;
  int32_t host, pad;
};

struct DevPos {  // same layout as dsv3::TokenPos
  int32_t slot, pos;
};

struct Launch {
  cudaStream_t stream = nullptr;
  bool pdl = false;
  int tcv_max = 0;        // GEMVs of up to this many tokens on tensor cores where they fit (kernels_tcgemv.cu); 0: off
  int tcv_bf16_min = 0;   // ... for bf16 weights from this many tokens (0: e4m3 only)
  int fp8_fma_one = 0;    // CudaOptions::fp8_fma_one: read it through the two functions below
  // Whether an e4m3 linear of m tokens, or an e4m3 expert stage of n tokens, runs on the FMA
  // GEMVs although the tensor-core GEMV would take it.
  bool fp8_linear_on_fma(int64_t m) const { return m == 1 && fp8_fma_one >= 1; }
  bool fp8_experts_on_fma(int64_t n) const { return n == 1 && fp8_fma_one >= 2; }
};

// Multiprocessors of the current device (queried once; 132 if the query fails).
int device_sms();

// ---- measurement (trace.cu): with kernels built with DSV3_TRACE=1, every kernel's block 0 records
// its wait (common.cuh); otherwise these do nothing.
constexpr int kTraceRecs = 16384;
// Allocates and binds the trace buffer (once).
void trace_begin();
// Appends the records of the last tickets, in launch order, to `path` under a "# label" line,
// and empties the buffer for the next dump.
void trace_dump(const char* path, const char* label);

// Throws dsv3::Error with the call's text and file:line when a CUDA call fails.
void check(cudaError_t e, const char* what, const char* file, int line);
#define DSV3_CUDA_CHECK(call) ::dsv3::cuda::check((call), #call, __FILE__, __LINE__)

// ---- elementwise (kernels_basic.cu)
// An embedding table's rows [row0, row0 + rows) (a rank's slice of the vocabulary), [rows, d] of
// type `type` (kBF16 or kF32).
struct EmbedTable {
  const void* data = nullptr;
  int32_t type = kBF16;
  int64_t row0 = 0, rows = 0, d = 0;
};
// y[i, :] = table[tok[i] - row0, :] as float; zeros for a token outside the table's rows.
void embed(const Launch& L, const int32_t* tok, int64_t n, const EmbedTable& table, float* y);
// y[i, :d] = x[i, :d] / rms * w; rows `stride` apart; y may alias x.
void rmsnorm(const Launch& L, const float* x, int64_t n, int64_t d, int64_t stride, const float* w, float eps,
             float* y);
void add(const Launch& L, float* y, const float* x, int64_t n);
// h[i, :d] += r[i, :d]; y[i, :d] = rmsnorm(h[i]) * w (rows contiguous).
void add_rmsnorm(const Launch& L, float* h, const float* r, int64_t n, int64_t d, const float* w, float eps, float* y);
// Per row of x [rows, cols]: out[r] = {the lowest index of the largest value in [0, limit), the
// first NaN / +inf index or -1, 1 if every value is -inf}.
void argmax_rows(const Launch& L, const float* x, int64_t rows, int64_t cols, int64_t limit, int32_t* out);
// Per row of x [rows, cols] (kernels_sample.cu): the host sampler's draw for spec[r] (device memory)
// over columns [0, limit) without penalties; out[r] = {id, status, index}: status 0 drawn, 1 left
// to the host (spec host), 2 a NaN / +inf logit at index, 3 every logit -inf. w: float64 scratch
// [rows, limit] (the long draw keeps the row's weights there).
void sample_rows(const Launch& L, const float* x, int64_t rows, int64_t cols, int64_t limit, const DevSample* spec,
                 int32_t* out, double* w);
// kernel.py's act_quant(x, 128, scale_fmt) on x [rows, cols] (cols % 128 == 0): y e4m3 bytes
// [rows, cols], s [rows, cols / 128]; bit-identical to the reference (tests: golden kernels).
void act_quant(const Launch& L, const float* x, int64_t rows, int64_t cols, bool ue8m0, uint8_t* y, float* s);
// The same with output row r taken from row idx[r] of x (idx null: row r; the MoE's tokens gathered
// into pair order).
void act_quant_rows(const Launch& L, const float* x, const int32_t* idx, int64_t rows, int64_t cols, bool ue8m0,
                    uint8_t* y, float* s);
// Fills n elements of type t with reproducible pseudo-random values uniform in [-a, a]
// (FP8: the e4m3 byte of such a value); kF32 with `a` exactly when const_value.
void fill_random(const Launch& L, void* p, int32_t t, int64_t n, float a, uint64_t seed, bool const_value);

// ---- matrix-vector products for few tokens (kernels_gemv.cu)
// Whether a weight rectangle can be read in aligned 16-byte chunks.
bool vec_ok(const DevLinear& w);
struct GemvShift {
  int64_t xs = 0, ys = 0, wrows = 0;
};
// The activations and outputs of a product: token j < m reads xj = x + (idx ? idx[j] : j) * ldx and
// writes the row y + j * ldy. `batch` > 1 runs independent copies (blockIdx.y or .z = b) with x, y
// shifted by b * shift.xs, b * shift.ys elements and the weight rows by b * shift.wrows (attention
// heads).
struct ProductRows {
  const float* x = nullptr;
  int64_t ldx = 0;
  const int32_t* idx = nullptr;
  int64_t m = 0;
  float* y = nullptr;
  int64_t ldy = 0;
  int batch = 1;
  GemvShift shift = {};
};
// Plain: y[j * ldy + r] = xj · W[r]. Fused (w3 given, same shape): y[j * ldy + r] =
// silu(xj · W[r]) * (xj · W3[r]).
void gemv(const Launch& L, const DevLinear& w, const DevLinear* w3, const ProductRows& io);

// Two products of the same m <= 8 activation rows x [m, K] in one launch (the streaming path):
// y[j * w.rows + r] = x_j · w[r], y2[j * w2.rows + r] = x_j · w2[r]. gemv2_ok: same dtype and K,
// 16-byte rows and x.
bool gemv2_ok(const DevLinear& w, const DevLinear& w2, const float* x, int64_t m);
// One token's value absorption after mla_decode_attn with combine = false: head b's input is the
// token's a.nsplit position splits of a.part [nsplit][heads][C] combined as a.ml [nsplit][heads][2]
// weighs them (a.ol [heads][C] where its length took one split), then y[b * shift.ys + r] = that ·
// w[b * shift.wrows + r] (C = w.cols). gemv_splits_ok: the FMA streaming GEMV would take w (C <= 512).
struct DecodeAttn;
bool gemv_splits_ok(const Launch& L, const DevLinear& w);
void gemv_splits(const Launch& L, const DevLinear& w, int heads, GemvShift shift, const DevPos* pos,
                 const DecodeAttn& a, float* y);
void gemv2(const Launch& L, const DevLinear& w, float* y, const DevLinear& w2, float* y2, const float* x, int64_t m);

// ---- the same products of m <= 8 tokens on tensor cores (kernels_tcgemv.cu); gemv, gemv2 and
// the backend's MoE try these first. Each returns false (launching nothing) where it does not
// apply: m > L.tcv_max, bf16 weights below L.tcv_bf16_min, weights that are not bf16 / e4m3 with K
// a multiple of 64 / 128 (e4m3:
// columns and row tiles on scale blocks), unaligned activations, or too little shared memory.
bool tcv_ok(const DevLinear& w);
// Whether their shared memory holds m activation rows of K columns for weights of type wtype (the
// 671B shape's 7168-column products from 7 tokens, its 16384 and 18432 from 3 and 4, do not fit).
bool tcv_holds(int32_t wtype, int64_t K, int64_t m);
// K cut into equal chunks (a multiple of the iteration each) for K too long: K where it holds
// them whole, else the chunk for two blocks per multiprocessor; 0 where there is none.
int64_t tcv_chunk(int32_t wtype, int64_t K, int64_t m);
// Partial products over K in chunks of kc, every chunk's blocks in one launch: chunk c's of x · w
// at io.y + c * chunk_y ([m, w.rows], io.ldy = w.rows), and with w2 (same K and type) x · w2's at
// y2 + c * chunk_y. One row block (io.batch 1, no shift); false (nothing launched) where the
// tensor-core GEMV does not take a chunk.
bool tcv_gemv_chunks(const Launch& L, const DevLinear& w, const DevLinear* w2, const ProductRows& io, float* y2,
                     int64_t kc, int64_t chunk_y);
// y[t * ldy + r] = the sum over chunks c < nc (in order) of part[(c * P * m + t) * rows + r], P = 1;
// swiglu (P = 2: each chunk's second product follows its first): silu(first sum) * second sum.
void chunk_sum(const Launch& L, const float* part, int nc, int64_t m, int64_t rows, bool swiglu, float* y, int64_t ldy);
bool tcv_gemv(const Launch& L, const DevLinear& w, const DevLinear* w3, const ProductRows& io);
bool tcv_gemv2(const Launch& L, const DevLinear& w, float* y, const DevLinear& w2, float* y2, const float* x,
               int64_t m, int64_t ldx = 0);  // (ldx 0: w.cols)

// ---- tensor-core GEMM for many tokens (kernels_gemm.cu)
// y[i * ldy + col + r] = A_i · W[r] for i < m, r < W.rows over K = W.cols, where A_i is the input
// row xi (ProductRows), or with silu_pair silu(xi[k]) * xi[pair_off + k]. bf16 tensor cores with
// float32 accumulation; A is split into bf16 hi + lo parts unless fast (one bf16 pass). Needs
// gemm_ok(W), for each batched copy too. Up to two weights (w1 writes at col1).
struct GemmForm {
  int64_t col1 = 0;
  bool silu_pair = false;
  int64_t pair_off = 0;
  bool fast = false;
};
bool gemm_ok(const DevLinear& w);
void gemm(const Launch& L, const DevLinear& w0, const DevLinear* w1, const ProductRows& io, const GemmForm& f = {});

// ---- pipelined tensor-core GEMM on bf16 operands (kernels_tc.cu)
// Whether a bf16 weight (rectangle) suits tc_gemm: cols a multiple of 32, 16-byte aligned rows.
bool tc_ok(const DevLinear& w);
// Whether an FP8 weight suits tc_gemm's wgmma form (TcJob::fp8): cols a multiple of 64, rows and
// columns starting on 128x128 scale blocks (row tiles must not straddle a block; batched copies
// must shift the rows by multiples of 128).
bool tc_ok_fp8(const DevLinear& w);
// C = A · Wᵀ with A in bf16 (a_hi, plus a_lo = the rounding of the remainder when given: float32-
// grade products), float32 accumulation. Row i of A is a_hi + (a_idx ? a_idx[i] : i) * lda.
// Plain: rows i < M with weight w (and w3 for SwiGLU). Grouped: every active expert of a MoE
// stage, rows = pair rows of the router's tile table, weights from `experts` (stage 0: w1/w3,
// stage 1: w2), a_idx = the pair -> token map for stage 0.
// Output: C[i, col + r] (float32, ldc), or with swiglu out[i, r] = silu(A_i·w1[r]) * (A_i·w3[r])
// as bf16 hi (+ lo) [*, ldo] — the next product's split input.
// `shift` runs `batch` independent copies (grid z, attention heads): A by xs, C by ys elements,
// weight rows by wrows.
struct TcJob {
  const void* a_hi = nullptr;
  const void* a_lo = nullptr;
  int64_t lda = 0;
  // e4m3 activations (fp8 weights only, every K a multiple of 128): a_hi holds act_quant's bytes
  // [rows, lda] and a_s its scales [rows, ldas] (one per 128 columns); the products run as e4m3 x
  // e4m3 MMAs, each 128-K block's partial sum times its activation and weight scales.
  const float* a_s = nullptr;
  int64_t ldas = 0;
  const int32_t* a_idx = nullptr;
  bool grouped = false;
  int stage = 0;
  const DevExpert* experts = nullptr;
  DevLinear w, w3;
  int64_t M = 0;
  bool swiglu = false;
  float* c = nullptr;
  int64_t ldc = 0, col = 0;
  // A second linear of the same activations in the same launch (wq and wkv_a at prefill): the
  // weight row tiles past w's go to w_pair, written to c_pair [M, ldc_pair] (plain jobs only).
  DevLinear w_pair;
  float* c_pair = nullptr;
  int64_t ldc_pair = 0;
  void* o_hi = nullptr;
  void* o_lo = nullptr;
  int64_t ldo = 0;
  bool o_f32 = false;  // SwiGLU output as float32 in o_hi (for act_quant) instead of bf16 hi + lo
  // moe_persist_gemm's e4m3 stage 0: the SwiGLU output quantised as act_quant would (TcJob::ue8m0
  // scales or not) into o_q [M, ldo] and o_qs [M, ldo / 128], instead of float32 in o_hi
  uint8_t* o_q = nullptr;
  float* o_qs = nullptr;
  bool ue8m0 = false;
  GemvShift shift;
  // grouped: the router's schedule (copied by value; pointers into device memory)
  const int32_t* cnt = nullptr;
  const int32_t* off = nullptr;
  const int32_t* tile_e = nullptr;
  const int32_t* tile_m0 = nullptr;
  const int32_t* n_tiles = nullptr;
  // split-K (plain float32 output, batch 1): `splits` partial products into ws [splits, M, rows],
  // summed in a second pass (deterministic); for weights with few row tiles
  int splits = 1;
  float* ws = nullptr;
  int tm = 64;  // rows per tile: 64 or 128 (grouped: must match the schedule's tile_rows)
  bool wgmma = false;     // sm_90a warpgroup MMAs (a warpgroup per 64 tile rows; every K a multiple of 64)
  bool wg_async = false;  // ... keeping one MMA group in flight behind the next stage's loads (tm 64)
  bool fp8 = false;       // e4m3 weights with 128x128 block scales (tc_ok_fp8; wgmma form, no in-flight group)
  bool swap = false;      // grouped stages, wgmma form, tm 128: weight rows as the MMA's M, the tile's tokens
                          // as its N (rounded up to 32), so a partly filled tile costs only its tokens
  const void* tmaps = nullptr;  // grouped, moe_persist_gemm: the experts' tensor maps (moe_persist_tmaps)
};
// Output tiles of a plain job (occupancy: split-K pays below ~2 tiles per SM).
int64_t tc_out_tiles(int64_t M, int64_t N, bool swiglu, int tm);
// grid_m: M tiles (tc_tiles(M, tm)) or, grouped, the schedule's max_tiles(); max_n: largest weight rows.
void tc_gemm(const Launch& L, const TcJob& j, int64_t grid_m, int64_t max_n, int batch = 1);
int64_t tc_tiles(int64_t M, int tm);
// Grouped MoE stages with swapped operands (swap, tm 128, tokens in pair order: M pair rows, no
// a_idx) on the persistent warp-specialized kernel (kernels_moe_persist.cu): FP8 GEMM mode's (a_s,
// e4m3 experts; SwiGLU output in float32) or fast mode's bf16 experts (bf16 tokens, no lo part;
// SwiGLU output bf16). tc_gemm's swapped forms are its twins. grid_m and max_n as tc_gemm's.
void moe_persist_gemm(const Launch& L, const TcJob& j, int64_t grid_m, int64_t max_n);
// The TMA tensor maps moe_persist_gemm reads the experts' weights (all e4m3 or all bf16) through,
// two for each of the n experts: w1 | w3 (interleaved every 8 rows in one 128-row box) and w2,
// rows of 128 bytes, 128-byte swizzle, in device memory (cudaFree it); null where the driver or a
// weight does not allow them, *why then says which.
void* moe_persist_tmaps(const DevExpert* experts, int n, std::string* why);
// max_n of a pair job (w_pair): the first weight's rows rounded up to whole tiles, then the second's.
int64_t tc_pair_rows(const TcJob& j);
// hi = bf16(x), lo = bf16(x - hi) (lo may be null) for `rows` rows of `cols` floats `ldx` apart,
// written densely [rows, cols]; with idx, row r of the output is x's row idx[r].
void split_rows(const Launch& L, const float* x, int64_t rows, int64_t cols, int64_t ldx, void* hi, void* lo,
                const int32_t* idx = nullptr);
// Causal softmax of attention score rows: row r (< rows) belongs to token i0 + r / H, whose
// position p gives its length p + 1; S[r, t] for t < len becomes the softmax, t in [len, Lk) 0.
void causal_softmax_rows(const Launch& L, float* S, int64_t rows, int64_t ld, int64_t Lk, const DevPos* pos,
                         int64_t i0, int H);

// ---- MoE (kernels_moe.cu)
// Routing and the grouping of (token, expert) pairs by expert, all on the device.
// "Experts" are the E routed ones followed by S slices of the shared experts that every token
// uses with weight 1. Pair p (< P = n * (K + S)) is row p of the grouped buffers.
struct RouteArgs {
  int E = 0, K = 0, G = 1, topk_groups = 1;
  bool sigmoid = false, norm = false;
  float route_scale = 1.f;
};
struct MoeSched {
  int32_t* cnt = nullptr;      // [NE] pairs per expert
  int32_t* off = nullptr;      // [NE] first pair row of each expert
  int32_t* active = nullptr;   // [NE] experts with pairs, ascending; count in *n_active
  int32_t* n_active = nullptr; // [1]
  int32_t* perm = nullptr;     // [P] token of each pair row
  int32_t* pair_of = nullptr;  // [n, K + S] pair row of each (token, choice), routed ones by expert index
  float* pw = nullptr;         // [n, K + S] routing weight of each (token, choice)
  int32_t* tile_e = nullptr;   // [max_tiles] expert of each GEMM tile (tile_rows rows)
  int32_t* tile_m0 = nullptr;  // [max_tiles] first row (within the expert) of each tile
  int32_t* n_tiles = nullptr;  // [1]
  unsigned long long* experts_run = nullptr;  // [1] or null: += the routed experts given pairs (counters)
  int64_t n = 0;
  int E = 0, K = 0, S = 0;
  int tile_rows = 64;          // rows per tile (64, or 128 for tc_gemm's large tiles; 8: tcv_moe's tiles)
  // The routed experts this rank holds, [local0, local1) (expert parallelism): the others' pairs
  // keep their rows and weights but are neither active nor tiled (no kernel runs them; their rows
  // of the expert output stay as the caller zeroed them). Default: every expert.
  int local0 = 0, local1 = 1 << 30;
  // One token whose gate kernel wrote only the logits (gate_route with route = false): every
  // routed block of the expert GEMVs routes it itself (route_one_block) and the first one of stage
  // 0 writes the schedule (for the combine).
  const float* route_logits = nullptr;
  const float* route_bias = nullptr;
  RouteArgs route;
  DSV3_HD int NE() const { return E + S; }
  DSV3_HD int64_t P() const { return n * (K + S); }
  DSV3_HD int64_t max_tiles() const { return (P() + tile_rows - 1) / tile_rows + NE(); }
  DSV3_HD int64_t max_slots() const { return n * K + S < NE() ? n * K + S : NE(); }  // of an expert GEMV launch
};
// The gate's logits [n, E] = x [n, D] · gateᵀ in float32 FMAs (many tokens whose x the experts
// take in another form: no split of x for the gate alone); gate bf16 or float32 (gate_logits_ok).
bool gate_logits_ok(const DevLinear& gate);
void gate_logits(const Launch& L, const DevLinear& gate, const float* x, int64_t n, float* logits);
// logits [n, E]; bias [E] or null. Fills `s`; topk_idx/topk_w [n, K] when given (tests).
void moe_route(const Launch& L, const RouteArgs& r, const float* logits, const float* bias, const MoeSched& s,
               int32_t* topk_idx, float* topk_w);
// One stage of the experts over the router's pairs: stage 0: out[p, r] = silu(x_tok · w1[r]) *
// (x_tok · w3[r]); stage 1: out[p, :] = w2 · in[p]. x_tok is row perm[p] of `in` (stage 0), row p
// (stage 1), ldin apart.
struct MoeStage {
  int stage = 0;
  const DevExpert* table = nullptr;  // [NE] on the device
  int64_t max_rows = 0;              // the largest w1.rows (stage 0) or w2.rows (stage 1)
  int32_t wtype = kBF16;
  const float* in = nullptr;
  int64_t ldin = 0;
  float* out = nullptr;
  int64_t ldout = 0;
  // tcv_moe, stage 0 of K too long for the tensor-core GEMV to stage whole (2 to 8 tokens): scratch
  // for its chunks' partial products, moe_chunk_floats(...) of them; null: not in chunks
  float* parts = nullptr;
};
// The scratch tcv_moe's stage 0 in chunks takes: n tokens, P = MoeSched::P() rows of out, K = ldin.
int64_t moe_chunk_floats(int32_t wtype, int64_t K, int64_t n, int64_t P, int64_t ldout);
void moe_gemv(const Launch& L, const MoeStage& st, const MoeSched& s);
// moe_gemv on tensor cores (kernels_tcgemv.cu; the largest K is ldin); false where it does not
// apply (as tcv_gemv). Every expert of `table` must satisfy tcv_ok. More than 8 tokens: a block
// row per tile of the router's table, which s.tile_rows = 8 makes (tcv_moe_tiles says where).
bool tcv_moe(const Launch& L, const MoeStage& st, const MoeSched& s);
// Whether tcv_moe takes n > 8 tokens in 8-pair tiles for these weights (stage 0's K = dim, stage
// 1's = inter); stage 0 then needs MoeStage::parts where moe_chunk_floats(wtype, dim, 8, ...) > 0.
bool tcv_moe_tiles(const Launch& L, int32_t wtype, int64_t dim, int64_t inter);
// The tensor-core form: stage 0 writes w1 · x at column 0 and w3 · x at column `half` of
// h [P, 2 * half]; stage 1 reads silu(h[p, k]) * h[p, half + k].
void moe_gemm(const Launch& L, const MoeStage& st, const MoeSched& s, int64_t half, bool fast);
// y[i, :d] = sum_k pw[i,k] * o[pair_of[i,k], :d] (routed, by expert index) + shared slices.
void moe_combine(const Launch& L, const MoeSched& s, const float* o, int64_t d, float* y);
// A MoE layer's pending output, to be made into the next layer's input: y = the combine of o
// (moe_combine), h += y, x = rmsnorm(h) * w (d values).
struct CombineNorm {
  MoeSched s;
  const float* o = nullptr;
  int64_t d = 0;
  float* y = nullptr;
  float* h = nullptr;
  const float* w = nullptr;
  float eps = 0.f;
  float* x = nullptr;
};
// moe_combine, then h += y and x = rmsnorm(h) * w, for cn.s.n tokens.
void moe_combine_add_rmsnorm(const Launch& L, const CombineNorm& cn);
// gemv2 of one token on the FMA streaming GEMV whose input cn.x is made first by each block
// from cn (every block for its own use, block 0 writing y, h and x): no combine launch.
// gemv2_combine_ok: gemv2_ok, the FMA GEMV takes both weights (not the tensor-core one: measured
// slower there), w.cols == d <= 2048 with d % 4 == 0, 16-byte aligned rows, at most 32 pairs.
bool gemv2_combine_ok(const Launch& L, const DevLinear& w, const DevLinear& w2, const CombineNorm& cn);
void gemv2_combine(const Launch& L, const DevLinear& w, float* y, const DevLinear& w2, float* y2,
                   const CombineNorm& cn);
// The layer's residual add and norm before the gate, for one token (add_rmsnorm's h += r and
// x = rmsnorm(h) * w, d values): gate_norm_ok(d).
struct GateNorm {
  float* h = nullptr;
  const float* r = nullptr;
  const float* w = nullptr;
  float eps = 0.f;
  float* x = nullptr;
  int64_t d = 0;
};
bool gate_norm_ok(int64_t d);
// The gate GEMV (logits [n, E], n <= 8) and moe_route in one launch; `counter` is a zeroed
// device word that the kernel leaves zeroed. route = false: the logits only (one token, routed by
// the expert GEMVs: MoeSched::route_logits). norm: the add + norm first (x is then norm->x).
struct GateRoute {
  const float* x = nullptr;  // [n, gate.cols]
  int64_t n = 0;
  float* logits = nullptr;
  const float* bias = nullptr;  // [E] or null
  unsigned* counter = nullptr;
  bool route = true;
  const GateNorm* norm = nullptr;
};
void gate_route(const Launch& L, const DevLinear& gate, const RouteArgs& r, const MoeSched& s, const GateRoute& g);

// ---- MLA (kernels_mla.cu; the decode attention, mla_decode_*: kernels_mla_decode.cu)
struct MlaDims {
  int H = 0, nope = 0, R = 0, C = 0, V = 0;
  int64_t max_len = 0;     // positions a sequence may reach (score rows of S are this long)
  float scale = 1.f, eps = 1e-6f;
  // The paged cache (runtime/kv_cache.h): sequence s's position t is cache row
  // table[s * table_w + t / block] * block + t % block, block = 1 << block_shift.
  const int32_t* table = nullptr;  // [sequences, table_w] (device)
  int64_t table_w = 0;
  int block_shift = 6;
  bool kv16 = false;  // the absorbed cache rows are bf16 (LayerCache::bf16; cache_get / cache_put in common.cuh)
  DSV3_HD int qk() const { return nope + R; }
  DSV3_HD int64_t row(int32_t slot, int64_t t) const {
    return (int64_t(table[slot * table_w + (t >> block_shift)]) << block_shift) + (t & ((int64_t(1) << block_shift) - 1));
  }
};
// The latent and rope cache rows [0, len) of sequence `slot`, contiguous: kv [len, C], pe [len, R]
// (the prefill attention's operands).
void gather_cache_rows(const Launch& L, const MlaDims& d, int32_t slot, int64_t len, const float* cache_kv,
                       const float* cache_pe, float* kv, float* pe);
// Prefill attention in one kernel (kernels_attn.cu).
// A run of m queries of one sequence, query i at position pos0 + i attending keys [0, pos0 + i]:
// q [m, H, nope + R] (roped), kvb [pos0 + m, H, nope + V] (k_nope | v, decompressed through
// wkv_b), pe [pos0 + m, R] (the roped key, shared by the heads); out [m, H * V]. Float32 online
// softmax; bf16 tensor cores, operands rounded once (fast) or as hi + lo parts (split:
// float32-grade). flash_prefill_ok: the head dims it is built for (128/64/128 and 32/16/32).
// ws: device scratch of flash_prefill_ws(d, m, pos0) bytes (the operands in bf16).
bool flash_prefill_ok(const MlaDims& d);
size_t flash_prefill_ws(const MlaDims& d, int64_t m, int64_t pos0);
struct FlashRun {
  const float* q = nullptr;    // [m, H, nope + R]
  int64_t m = 0, pos0 = 0;
  const float* kvb = nullptr;  // [pos0 + m, H, nope + V]
  const float* pe = nullptr;   // [pos0 + m, R]
  float* out = nullptr;        // [m, H * V]
  bool split = true;
  void* ws = nullptr;
};
void flash_prefill(const Launch& L, const MlaDims& d, const FlashRun& r);

// RoPE on q's rope parts (in place) and on kv's key; kv_norm of the latent. Absorbed: writes
// cache_kv/cache_pe rows. Naive: writes latent [n, C] and the rope part of cache_k.
struct MlaPrep {
  const DevPos* pos = nullptr;
  int64_t n = 0;
  float* q = nullptr;             // [n, H, nope + R]
  const float* kv = nullptr;      // [n, C + R] (wkv_a's output)
  const float* kv_norm_w = nullptr;
  const float* rope = nullptr;
  float* cache_kv = nullptr;
  float* cache_pe = nullptr;
  float* latent = nullptr;        // naive
  float* cache_k = nullptr;       // naive
  bool qabs_bf16 = false;         // mla_prep_qabs's tensor-core form on q_nope rounded to bf16 (fast mode: as
                                  // the reference's bf16 model holds q), one MMA per product instead of three
};
void mla_prep(const Launch& L, const MlaDims& d, bool naive, const MlaPrep& p);
// mla_prep (absorbed) and mla_qabs in one launch. vec: the absorption with 16-byte weight loads
// where the layout allows (decode), else (and as its reference twin) the element-wise form.
void mla_prep_qabs(const Launch& L, const MlaDims& d, const MlaPrep& p, const DevLinear& wkv_b, float* qa,
                   bool vec = true);
// qa[i, h, c] = sum_{d < nope} q[i, h, d] * wkv_b[h * (nope + V) + d, c]
void mla_qabs(const Launch& L, const MlaDims& d, const DevLinear& wkv_b, const float* q, int64_t n, float* qa);
// The absorbed attention's operands and outputs (mla_scores, mla_values, mla_decode_attn,
// mla_decode_many, gemv_splits: each says which fields it uses).
struct DecodeAttn {
  const float* qa = nullptr;        // [n, H, C] absorbed queries
  const float* q = nullptr;         // [n, H, qk] (the rope parts)
  const float* cache_kv = nullptr;  // the paged latent cache
  const float* cache_pe = nullptr;  // the paged rope-key cache
  int nsplit = 1;
  float* part = nullptr;            // [nsplit, n, H, C] split partial sums (nsplit > 1)
  float* ml = nullptr;              // [nsplit, n, H, 2] their (max, sum)
  unsigned* counters = nullptr;
  float* ol = nullptr;              // [n, H, C] the weighted latent sums
  int hb = 2;
  bool combine = true;  // false: with several splits only part and ml are written (gemv_splits combines them)
  int64_t len_max = 0;  // mla_decode_many: positions no token of the step passes (its splits' size; 0: max_len)
  bool simple = false;  // mla_decode_many: the float32 kernel even where the tensor-core one applies (its twin; tests)
};
// S[i, h, t] = (qa[i,h]·kv[t] + q_pe[i,h]·pe[t]) * scale for t <= pos_i (S rows max_len long),
// from a.qa, a.q, a.cache_kv, a.cache_pe.
void mla_scores(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const DecodeAttn& a, float* S);
// a.ol[i, h, :] = softmax(S[i, h, :pos_i + 1]) · kv, over a.nsplit position ranges when > 1
// (a.part: [nsplit, n, H, C], a.ml: [nsplit, n, H, 2]); mla_splits gives the count for n tokens.
int mla_splits(const MlaDims& d, int64_t n);
void mla_values(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const float* S, const DecodeAttn& a);
// mla_scores + mla_values in one launch for few tokens (decode): each warp folds its cache rows
// into a running softmax; several position splits are combined by the last block of each (token,
// head block), counted in `counters` (zeroed device words, at least n * ceil(H / hb), left
// zeroed). mla_decode_ok: the shapes it takes. mla_decode_splits: its position splits for n
// tokens (from max_len, not the positions: a recorded step replays with others); each token's
// positions spread over as many of them as give chunks of at least 16 rows, decided on the
// device. hb: heads per block (1 or 2); mla_decode_heads: the choice for n tokens (one head per
// block for a single token: twice the blocks over a short cache); cap: at most this many splits
// (0: none).
int mla_decode_heads(int64_t n);
bool mla_decode_ok(const MlaDims& d, int64_t n, int64_t counters, int hb = 2);
int mla_decode_splits(const MlaDims& d, int64_t n, int cap = 0, int hb = 2);
void mla_decode_attn(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const DecodeAttn& a);
// The same attention for any number of tokens (serving batches; kernels_mla.cu): a block per
// (token, 16 heads, position split) stages tiles of cache rows in shared memory for all its
// heads. Uses a.qa, q, cache_kv, cache_pe, nsplit (mla_many_splits for the same len_max), len_max,
// part and ml (nsplit > 1; combined by a second launch), ol and simple. A recorded step must pass
// len_max = 0 (its splits then cover max_len). mla_many_ok: C and R multiples of 4, C <= 512.
// A bf16 cache (d.kv16) of the shapes mla_many_tc_ok takes runs on tensor cores (mla_many_tc,
// kernels_mla_many.cu: bf16 products, float32 sums); other shapes and a.simple on float32 FMAs.
bool mla_many_ok(const MlaDims& d);
int mla_many_splits(const MlaDims& d, int64_t n, int64_t len_max);
void mla_decode_many(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const DecodeAttn& a);
constexpr int kManyTcRows = 32;  // cache rows per tile of mla_many_tc (its splits: whole tiles)
// d.kv16, C a multiple of 64 up to 512, R a multiple of 16.
bool mla_many_tc_ok(const MlaDims& d);
void mla_many_tc(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const DecodeAttn& a, int64_t chunk);
// Naive: k_nope and v of the new tokens from kvb [n, H * (nope + V)] into the caches.
void mla_naive_store(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const float* kvb,
                     float* cache_k, float* cache_v);
void mla_naive_scores(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const float* q,
                      const float* cache_k, float* S);
void mla_naive_values(const Launch& L, const MlaDims& d, const DevPos* pos, int64_t n, const float* S,
                      const float* cache_v, float* out);

}  // namespace dsv3::cuda
