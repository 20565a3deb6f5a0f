// The CUDA backend: weights copied to device memory once (bf16 and e4m3 kept as stored), float32
// activations, every op a few kernel launches on one stream (kernels.h), decode steps recorded
// as CUDA graphs and replayed. The scalar ref backend is the oracle it is tested against.
#include "backend/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "backend/cuda/kernels.h"
#include "backend/cuda/upload.h"
#include "core/error.h"
#include "model/rope.h"

namespace dsv3 {

static_assert(sizeof(TokenPos) == sizeof(cuda::DevPos) && offsetof(TokenPos, pos) == offsetof(cuda::DevPos, pos));

static bool env_flag(const char* name, bool dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  return !(std::strcmp(v, "0") == 0 || std::strcmp(v, "false") == 0 || std::strcmp(v, "off") == 0);
}
static int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : dflt;
}

CudaOptions CudaOptions::from_env() {
  CudaOptions o;
  o.graphs = env_flag("DSV3_CUDA_GRAPH", o.graphs);
  o.pdl = env_flag("DSV3_CUDA_PDL", o.pdl);
  o.fast = env_flag("DSV3_CUDA_FAST", o.fast);
  o.gemv_max = env_int("DSV3_CUDA_GEMV_MAX", o.gemv_max);
  o.graph_max = env_int("DSV3_CUDA_GRAPH_MAX", o.graph_max);
  o.tc_min = env_int("DSV3_CUDA_TC_MIN", o.tc_min);
  o.fast_min = env_int("DSV3_CUDA_FAST_MIN", o.fast_min);
  o.tc_tm = env_int("DSV3_CUDA_TC_TM", o.tc_tm);
  o.tc_swap = env_int("DSV3_CUDA_TC_SWAP", o.tc_swap);
  o.wgmma = env_flag("DSV3_CUDA_WGMMA", o.wgmma);
  o.wg_async = env_flag("DSV3_CUDA_WG_ASYNC", o.wg_async);
  o.attn_chunk = env_int("DSV3_CUDA_ATTN_CHUNK", o.attn_chunk);
  o.flash = env_flag("DSV3_CUDA_FLASH", o.flash);
  o.fp8_wgmma = env_flag("DSV3_CUDA_FP8_WGMMA", o.fp8_wgmma);
  o.decode_attn = env_flag("DSV3_CUDA_DECODE_ATTN", o.decode_attn);
  o.decode_attn_warps = env_flag("DSV3_CUDA_DECODE_ATTN_WARPS", o.decode_attn_warps);
  o.pair_gemv = env_flag("DSV3_CUDA_PAIR_GEMV", o.pair_gemv);
  o.qabs_vec = env_flag("DSV3_CUDA_QABS_VEC", o.qabs_vec);
  o.decode_heads = env_int("DSV3_CUDA_DECODE_HEADS", o.decode_heads);
  o.decode_splits = env_int("DSV3_CUDA_DECODE_SPLITS", o.decode_splits);
  o.tc_gemv_max = env_int("DSV3_CUDA_TC_GEMV_MAX", o.tc_gemv_max);
  o.tc_gemv_bf16_min = env_int("DSV3_CUDA_TC_GEMV_BF16_MIN", o.tc_gemv_bf16_min);
  o.fp8_fma_one = env_int("DSV3_CUDA_FP8_FMA_ONE", o.fp8_fma_one);
  o.progress = env_flag("DSV3_CUDA_PROGRESS", isatty(2) != 0);
  o.profile = env_flag("DSV3_CUDA_PROFILE", o.profile);
  if (const char* k = std::getenv("DSV3_CUDA_KNOCKOUT")) o.knockout = k;
  o.pad_kernels = env_int("DSV3_CUDA_PAD_KERNELS", o.pad_kernels);
  o.route_in_experts = env_flag("DSV3_CUDA_ROUTE_IN_EXPERTS", o.route_in_experts);
  o.vabs_splits = env_flag("DSV3_CUDA_VABS_SPLITS", o.vabs_splits);
  o.norm_in_gate = env_flag("DSV3_CUDA_NORM_IN_GATE", o.norm_in_gate);
  o.combine_in_gemv = env_flag("DSV3_CUDA_COMBINE_IN_GEMV", o.combine_in_gemv);
  return o;
}

void CudaOptions::validate() const {
  if (decode_heads < 0 || decode_heads > 2)
    fail("CUDA backend: decode_heads (DSV3_CUDA_DECODE_HEADS) must be 0 (by the token count), 1 or 2, got ",
         decode_heads);
  if (decode_splits < 0)
    fail("CUDA backend: decode_splits (DSV3_CUDA_DECODE_SPLITS) must be 0 (by the cache length) or more, got ",
         decode_splits);
  if (tc_swap < 0 || tc_swap > 2)
    fail("CUDA backend: tc_swap (DSV3_CUDA_TC_SWAP) must be 0 (never), 1 (e4m3 weights or fast mode) or 2 (always), "
         "got ", tc_swap);
  if (tc_tm != 0 && tc_tm != 64 && tc_tm != 128)
    fail("CUDA backend: tc_tm (DSV3_CUDA_TC_TM) must be 0 (by the weight type), 64 or 128 rows per tile, got ", tc_tm);
  if (fp8_fma_one < 0 || fp8_fma_one > 2)
    fail("CUDA backend: fp8_fma_one (DSV3_CUDA_FP8_FMA_ONE) must be 0 (the tensor-core GEMV), 1 (the linears on the "
         "FMA GEMVs) or 2 (all), got ", fp8_fma_one);
}

namespace {

using cuda::DevExpert;
using cuda::DevLinear;
using cuda::DevPos;

#define CK(call) DSV3_CUDA_CHECK(call)

void cublas_check(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) throw Error(str(file, ":", line, ": cuBLAS error ", int(s), " from ", what));
}
#define CB(call) cublas_check((call), #call, __FILE__, __LINE__)

// cudaMalloc of `bytes` for `what`; out of device memory is said in the user's terms: what it
// was for, how much it asked, how much the device has free, and what to change.
void* device_malloc(size_t bytes, const char* what, const char* hint) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1));
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // (not sticky: clear it)
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    auto gib = [](size_t b) { return double(b) / double(1ull << 30); };
    throw Error(str("CUDA: out of device memory for ", what, ": ", gib(bytes), " GiB asked, ", gib(free_b),
                    " GiB free of ", gib(total_b), hint[0] ? "; " : "", hint));
  }
  DSV3_CUDA_CHECK(e);
  return p;
}

int32_t wtype_of(DType t) {
  switch (t) {
    case DType::BF16: return cuda::kBF16;
    case DType::F8_E4M3: return cuda::kFP8;
    case DType::F32: return cuda::kF32;
    default: fail("CUDA backend: device weight of dtype ", dtype_name(t), " (expected BF16, F8_E4M3 or F32)");
  }
}

DevLinear dev_linear(const Linear& l) {
  DevLinear d;
  d.w = l.weight.data;
  d.t = wtype_of(l.weight.dtype);
  d.rows = l.out();
  d.cols = l.in();
  d.ld = l.in();
  if (d.t == cuda::kFP8) {
    DSV3_CHECK(!l.scale.empty() && l.scale.dtype == DType::F32, "FP8 weight without float32 scales");
    d.s = l.scale.as<float>();
    d.lds = (l.in() + 127) / 128;
  }
  return d;
}

// Rows [r0, r0 + rows) and columns [c0, c0 + cols) of a weight.
DevLinear slice(DevLinear d, int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
  d.row0 += r0, d.rows = rows, d.col0 += c0, d.cols = cols;
  return d;
}

enum class Kind { kLinear, kScale, kNorm, kEmbed, kGate };

// Every tensor of a ModelWeights with its kind (empty views included).
template <class F>
void visit(ModelWeights& w, F&& f) {
  auto lin = [&](Linear& l) {
    f(l.weight, Kind::kLinear);
    f(l.scale, Kind::kScale);
  };
  auto mlp = [&](MLPWeights& m) {
    lin(m.w1);
    lin(m.w2);
    lin(m.w3);
  };
  f(w.embed, Kind::kEmbed);
  f(w.norm, Kind::kNorm);
  lin(w.head);
  for (LayerWeights& L : w.layers) {
    f(L.attn_norm, Kind::kNorm);
    f(L.ffn_norm, Kind::kNorm);
    AttnWeights& a = L.attn;
    for (Linear* l : {&a.wq, &a.wq_a, &a.wq_b, &a.wkv_a, &a.wkv_b, &a.wo}) lin(*l);
    f(a.q_norm, Kind::kNorm);
    f(a.kv_norm, Kind::kNorm);
    mlp(L.ffn);
    f(L.moe_w.gate, Kind::kGate);
    f(L.moe_w.bias, Kind::kNorm);
    for (MLPWeights& e : L.moe_w.experts) mlp(e);
    mlp(L.moe_w.shared_experts);
  }
}

// The dtype a tensor gets on the device.
DType device_dtype(const TensorView& t, Kind k) {
  switch (k) {
    case Kind::kScale:
    case Kind::kNorm: return DType::F32;
    default:
      if (t.dtype == DType::BF16 || t.dtype == DType::F8_E4M3 || t.dtype == DType::F32) return t.dtype;
      return DType::F32;  // F16 is widened exactly
  }
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

struct MoeTable {
  DevExpert* dev = nullptr;   // [E + S]
  int S = 0;                  // shared-expert slices
  int64_t rows13 = 0;         // largest w1.rows
  int64_t rows2 = 0;          // w2.rows (dim)
  int32_t wtype = cuda::kBF16;
  bool gemm = false;          // every expert fits the tensor-core kernel
  bool tc = false;            // every expert fits the pipelined kernel (tc_takes)
  bool k64 = false;           // ... with every K a multiple of 64 (its wgmma form)
  bool tcv = false;           // every expert fits the tensor-core GEMV (cuda::tcv_ok)
};

enum Slot {
  kTok, kPos, kH, kH2, kS, kPart, kMl, kLat, kKvb, kLogits, kSched, kMoeH, kMoeO, kHi, kLo, kHi2, kLo2, kSplitK, kCublasWs, kTopk,
  kNumSlots
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const CudaOptions& opt) : opt_(opt) {
    opt_.validate();
    std::string why;
    if (!cuda::device_available(&why)) fail("CUDA backend: ", why);
    CK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    int dev = 0;
    CK(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    L_.stream = stream_;
    L_.pdl = opt_.pdl && prop.major >= 9;
    L_.tcv_max = prop.major >= 8 ? opt_.tc_gemv_max : 0;  // mma.sync bf16 / f16: sm_80+
    L_.tcv_bf16_min = opt_.tc_gemv_bf16_min;
    L_.fp8_fma_one = opt_.fp8_fma_one;
    wgmma_ = opt_.wgmma && prop.major == 9;  // sm_90a code: Hopper only
    CK(cudaMallocHost(&staging_, kStagingBytes));
    // [gate + router][decode attention: kAttnCounters][pad][experts run: 8 bytes, 8-byte aligned]
    const size_t words = 2 + size_t(kAttnCounters) + 2;
    CK(cudaMalloc(&counter_, sizeof(unsigned) * words));
    CK(cudaMemset(counter_, 0, sizeof(unsigned) * words));
    attn_counters_ = counter_ + 1;
    experts_run_ = reinterpret_cast<unsigned long long*>(counter_ + 2 + kAttnCounters);
    CK(cudaEventCreateWithFlags(&staging_done_, cudaEventDisableTiming));
    // cuBLAS (the prefill attention) set up now: never during graph capture.
    CB(cublasCreate(&cublas_));
    CB(cublasSetStream(cublas_, stream_));
    CB(cublasSetWorkspace(cublas_, scratch(kCublasWs, 32 << 20), 32 << 20));
    if (std::getenv("DSV3_CUDA_TRACE")) cuda::trace_begin();  // (a DSV3_TRACE=1 build's kernel trace)
  }

  ~CudaBackend() override {
    if (capturing_) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(stream_, &g);
      if (g) cudaGraphDestroy(g);
    }
    cudaStreamSynchronize(stream_);
    drop_graphs();
    for (auto& s : scratch_)
      if (s.p) cudaFree(s.p);
    for (void* p : owned_) cudaFree(p);
    for (auto& [k, t] : moe_) cudaFree(t.dev);
    if (rope_dev_) cudaFree(rope_dev_);
    if (step_dev_) cudaFree(step_dev_);
    if (cublas_) cublasDestroy(cublas_);
    for (auto& m : marks_) cudaEventDestroy(m.second);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    cudaFreeHost(staging_);
    cudaFree(counter_);
    cudaEventDestroy(staging_done_);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override { return "cuda"; }

  // Routed experts given tokens, summed over MoE calls (the router adds each call's count on the
  // device; read after the stream drains).
  int64_t routed_experts_run() const override {
    unsigned long long v = 0;
    CK(cudaStreamSynchronize(stream_));
    CK(cudaMemcpy(&v, experts_run_, sizeof v, cudaMemcpyDeviceToHost));
    return int64_t(v);
  }
  void reset_counters() override {
    no_capture("reset_counters");
    flush_add();
    CK(cudaMemsetAsync(experts_run_, 0, sizeof(unsigned long long), stream_));
  }

  float* alloc(size_t n) override {
    no_capture("alloc");
    flush_add();
    void* p = device_malloc(std::max<size_t>(n, 1) * 4, "a device buffer (the KV cache is one per layer)",
                            "lower --kv-cache-gb or the batch, or use --backend cpu");
    CK(cudaMemsetAsync(p, 0, std::max<size_t>(n, 1) * 4, stream_));
    CK(cudaStreamSynchronize(stream_));
    return static_cast<float*>(p);
  }
  void release(float* p) override {
    no_capture("release");
    flush_add();
    CK(cudaStreamSynchronize(stream_));
    drop_graphs();  // recorded steps may point at it
    CK(cudaFree(p));
  }
  void upload(float* dst, const float* host, size_t n) override {
    no_capture("upload");
    flush_add();
    CK(cudaMemcpyAsync(dst, host, n * 4, cudaMemcpyHostToDevice, stream_));
    CK(cudaStreamSynchronize(stream_));
  }
  void download(float* host, const float* src, size_t n) override {
    no_capture("download");
    flush_add();
    flush_marks();
    CK(cudaMemcpyAsync(host, src, n * 4, cudaMemcpyDeviceToHost, stream_));
    CK(cudaStreamSynchronize(stream_));
  }

  void prepare_weights(const ModelArgs& args, ModelWeights& w) override {
    size_t total = 0;
    visit(w, [&](TensorView& t, Kind k) {
      if (!t.empty()) total += align256(size_t(t.numel()) * dtype_size(device_dtype(t, k)));
    });
    char* base = static_cast<char*>(device_bytes(total));
    size_t at = 0;
    std::vector<float> conv;
    cuda::Uploader up(base, total, opt_.upload_chunk, stream_, opt_.progress);
    visit(w, [&](TensorView& t, Kind k) {
      if (t.empty()) return;
      const DType dt = device_dtype(t, k);
      const size_t bytes = size_t(t.numel()) * dtype_size(dt);
      const void* src = t.data;
      if (dt != t.dtype) {
        DSV3_CHECK(dt == DType::F32);
        conv.resize(size_t(t.numel()));
        for (int64_t i = 0; i < t.numel(); ++i) conv[size_t(i)] = load_f32(t, i);
        src = conv.data();
      }
      up.put(at, src, bytes);
      t.data = base + at;
      t.dtype = dt;
      at += align256(bytes);
    });
    up.finish();
  }

  ModelWeights random_weights(const ModelArgs& a, uint64_t seed) {
    ModelWeights w;
    std::vector<WeightSpec> specs = weight_manifest(a, &w);
    const bool fp8 = a.dtype == "fp8";
    uint64_t k = 0;
    auto make = [&](TensorView& t, DType dt, std::vector<int64_t> shape, float amp, bool constant) {
      t.dtype = dt;
      t.shape = std::move(shape);
      void* p = device_bytes(size_t(t.numel()) * dtype_size(dt));
      cuda::fill_random(L_, p, wtype_of(dt), t.numel(), amp, seed * 1000003ull + ++k, constant);
      t.data = p;
    };
    for (const WeightSpec& s : specs) {
      if (s.kind == WeightKind::kBias) continue;  // optional; the random shapes route without it
      if (s.kind == WeightKind::kLinear) {
        const int64_t out = s.shape[0], in = s.shape[1];
        const float amp = std::sqrt(3.f / float(in));
        if (fp8 && s.name != "head") {
          make(s.linear->weight, DType::F8_E4M3, s.shape, 1.f, false);
          make(s.linear->scale, DType::F32, {(out + 127) / 128, (in + 127) / 128}, amp, true);
        } else {
          make(s.linear->weight, DType::BF16, s.shape, amp, false);
        }
      } else if (s.kind == WeightKind::kNorm) {
        make(*s.tensor, DType::F32, s.shape, 1.f, true);
      } else if (s.kind == WeightKind::kEmbed) {
        make(*s.tensor, DType::BF16, s.shape, 1.f, false);
      } else {  // gate
        make(*s.tensor, DType::BF16, s.shape, std::sqrt(3.f / float(s.shape[1])), false);
      }
    }
    CK(cudaStreamSynchronize(stream_));
    return w;
  }

  // ---- steps and graphs

  bool begin_step(const int32_t* tokens, const TokenPos* pos, int64_t n, const int64_t* rows, int64_t m) override {
    flush_add();
    if (capturing_) abort_capture();
    // The step's metadata goes to fixed device buffers in one copy: [tokens n][pos 2n][rows m].
    const size_t words = size_t(n) * 3 + size_t(m);
    if (words * 4 > kStagingBytes) return begin_plain(tokens, pos, n, rows, m);
    if (words > step_cap_) {
      CK(cudaStreamSynchronize(stream_));
      drop_graphs();
      if (step_dev_) CK(cudaFree(step_dev_));
      step_cap_ = std::max<size_t>(words, 4096);
      CK(cudaMalloc(&step_dev_, step_cap_ * 4));
    }
    CK(cudaEventSynchronize(staging_done_));  // the last step's copy has read the staging buffer
    int32_t* st = static_cast<int32_t*>(staging_);
    std::memcpy(st, tokens, size_t(n) * 4);
    std::memcpy(st + n, pos, size_t(n) * 8);
    for (int64_t r = 0; r < m; ++r) st[3 * n + r] = int32_t(rows[r]);
    CK(cudaMemcpyAsync(step_dev_, st, words * 4, cudaMemcpyHostToDevice, stream_));
    CK(cudaEventRecord(staging_done_, stream_));
    step_ = {tokens, pos, rows, n, m, true};
    // Steps with long runs of one slot (32+ tokens, see token_runs) carry host positions in their
    // attention launches: never recorded.
    if (!opt_.graphs || opt_.profile || n > opt_.graph_max || n >= 32) return false;
    GraphKey key{n, std::vector<int64_t>(rows, rows + m)};
    Graph& g = graphs_[key];
    if (g.exec) {
      replay_ = &g;
      return true;
    }
    if (++g.seen >= 2) {  // a shape seen before: record this run of it
      CK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      capturing_ = &g;
    }
    return false;
  }

  void end_step() override {
    flush_add();
    if (replay_) {
      CK(cudaGraphLaunch(replay_->exec, stream_));
      replay_ = nullptr;
    } else if (capturing_) {
      Graph* g = capturing_;
      capturing_ = nullptr;
      cudaGraph_t graph = nullptr;
      CK(cudaStreamEndCapture(stream_, &graph));
      const cudaError_t e = cudaGraphInstantiate(&g->exec, graph, 0);
      cudaGraphDestroy(graph);
      CK(e);
      CK(cudaGraphLaunch(g->exec, stream_));
    }
    step_.active = false;
    flush_marks();
  }

  std::string profile_report(bool reset) {
    flush_add();
    flush_marks();
    std::vector<std::pair<double, std::string>> v;
    double total = 0;
    for (auto& [k, ms] : prof_) v.push_back({ms, k}), total += ms;
    std::sort(v.rbegin(), v.rend());
    const double steps = std::max<int64_t>(prof_steps_, 1);
    std::string out = str("profile over ", prof_steps_, " steps: ", total / steps, " ms per step\n");
    for (auto& [ms, k] : v) {
      char line[160];
      std::snprintf(line, sizeof line, "  %8.4f ms %5.1f%%  %s\n", ms / steps, 100.0 * ms / std::max(total, 1e-9),
                    k.c_str());
      out += line;
    }
    if (reset) prof_.clear(), prof_steps_ = 0;
    return out;
  }

  void gather_rows(const float* x, int64_t d, const int64_t* rows, int64_t m, float* y) override {
    flush_add();
    mark("gather");
    for (int64_t r = 0; r < m; ++r)  // device-to-device copies: recordable, no host round trip
      CK(cudaMemcpyAsync(y + r * d, x + rows[r] * d, size_t(d) * 4, cudaMemcpyDeviceToDevice, stream_));
  }

  // ---- ops

  void embed(const int32_t* tokens, int64_t n, const TensorView& table, float* y) override {
    flush_add();
    mark("embed");
    const int32_t* tok = step_.active && tokens == step_.tokens && n == step_.n ? step_tok() : upload_ints(tokens, n);
    cuda::embed(L_, tok, n, table.data, wtype_of(table.dtype), table.dim(1), y);
  }

  void rmsnorm(const float* x, int64_t n, int64_t d, int64_t stride, const TensorView& w, float eps,
               float* y) override {
    DSV3_CHECK(w.dtype == DType::F32, "norm weight not on the device");
    flush_linear();
    if (pend_.y && pend_.y == x && stride == d && pend_.n == n * d) {  // the residual add, fused
      if (pend_.from_moe) {
        // Kept for the next op: for one token the paired GEMV of the next layer's attention does
        // it (linear); otherwise, or before anything else, it is launched alone (flush_norm).
        pcomb_ = {pmoe_.s, pmoe_.o, pmoe_.d, pmoe_.y, pend_.y, w.as<float>(), eps, y};
        pmoe_.active = false;
        if (ko("combine")) pcomb_ = {};
        else if (!(opt_.combine_in_gemv && n == 1 && !opt_.pad_kernels)) flush_norm();
        if (opt_.pad_kernels) cuda::empty_kernels(L_, std::abs(opt_.pad_kernels), opt_.pad_kernels < 0);
      } else if (opt_.norm_in_gate && n == 1 && cuda::gate_norm_ok(d) && !ko("norm")) {
        // One token: kept for the next op; a MoE layer's gate kernel does it (moe), anything else
        // launches it first (flush_norm).
        pnorm_ = {pend_.y, pend_.x, w.as<float>(), eps, y, d};
      } else {
        mark("add+rmsnorm");
        if (!ko("norm")) cuda::add_rmsnorm(L_, pend_.y, pend_.x, n, d, w.as<float>(), eps, y);
      }
      pend_ = {};
      return;
    }
    flush_add();
    mark("rmsnorm");
    cuda::rmsnorm(L_, x, n, d, stride, w.as<float>(), eps, y);
  }

  // Deferred to the next op: fused into rmsnorm when that reads the sum (the layer loop's
  // residual-add-then-norm), launched alone before anything else.
  void add(float* y, const float* x, int64_t n) override {
    flush_linear();
    if (pmoe_.active && x == pmoe_.y && n == pmoe_.s.n * pmoe_.d && !pend_.y) {
      pend_ = {y, x, n, true};  // y += (the pending MoE output)
      return;
    }
    flush_add();
    pend_ = {y, x, n, false};
  }

  void linear(const float* x, int64_t n, const Linear& w, float* y) override {
    const DevLinear dw = dev_linear(w);
    // Two products of the pipelined kernel on the same activations (wq and wkv_a at prefill):
    // one split of x, one launch (the first's weight row tiles, then the second's).
    if (plin_.x == x && plin_.n == n && tc_pair_ok(plin_.w, dw, n)) {
      const PendingLinear p = plin_;
      plin_ = {};
      flush_add();
      if (opt_.profile) mark(str("linear pair tc ", p.w.rows, "+", dw.rows, "x", dw.cols, " ", dtype_name(w.weight.dtype)));
      cuda::TcJob j = split_input(x, n, dw.cols, /*fast=*/false);
      j.w = p.w, j.M = n, j.c = p.y, j.ldc = p.w.rows;
      j.w_pair = dw, j.c_pair = y, j.ldc_pair = dw.rows;
      set_form(j, dw.cols % 64 == 0, dw.t);
      cuda::tc_gemm(L_, j, cuda::tc_tiles(n, j.tm), cuda::tc_pair_rows(j));
      return;
    }
    // Two GEMVs on the same activations (wq and wkv_a at decode) share one launch: the first one
    // waits in plin_ for the next op. A kept MoE combine + add + norm that made x goes into it.
    if (plin_.x == x && plin_.n == n && cuda::gemv2_ok(plin_.w, dw, x, n)) {
      const PendingLinear p = plin_;
      plin_ = {};
      const cuda::CombineNorm cn = pcomb_;
      const bool comb = cn.h && cn.x == x && !ko("pair") && cuda::gemv2_combine_ok(L_, p.w, dw, cn);
      if (comb) pcomb_ = {};
      flush_add();
      if (opt_.profile) mark(str("linear pair ", p.w.rows, "+", dw.rows, "x", dw.cols, " ", dtype_name(w.weight.dtype)));
      if (comb) cuda::gemv2_combine(L_, p.w, p.y, dw, y, cn);
      else if (!ko("pair")) cuda::gemv2(L_, p.w, p.y, dw, y, x, n);
      return;
    }
    const bool tc = use_tc(n) && tc_takes(dw);
    const bool pair = opt_.pair_gemv && (tc || n <= std::min(opt_.gemv_max, 8));
    cuda::CombineNorm keep;  // a kept combine + norm for x stays kept while this linear waits for a partner
    if (pair && pcomb_.h && pcomb_.x == x && plin_.x != x) keep = pcomb_, pcomb_ = {};
    flush_add();
    if (pair) {
      pcomb_ = keep;
      plin_ = {dw, x, n, y};
      return;
    }
    if (opt_.profile) mark(str("linear ", w.out(), "x", w.in(), " ", dtype_name(w.weight.dtype)));
    // Attention projections and the head stay float32-grade in fast mode too: their errors
    // reach every later token through the cache (with bf16 activations here as well, the golden
    // cases' max error exceeds the reference's own bf16 row: measured). Fast mode is for the
    // MLPs, experts and the attention core.
    if (!ko("linear")) run_linear(dw, x, n, y, w.out(), /*exact=*/true);
  }
  // The add + norm waiting for a MoE gate, or the combine + add + norm waiting for a paired
  // GEMV, alone.
  void flush_norm() {
    if (pcomb_.h) {
      const cuda::CombineNorm c = pcomb_;
      pcomb_ = {};
      mark("moe.combine+add+rmsnorm");
      cuda::moe_combine_add_rmsnorm(L_, c.s, c.o, c.d, c.y, c.h, c.w, c.eps, c.x);
    }
    if (!pnorm_.h) return;
    const cuda::GateNorm p = pnorm_;
    pnorm_ = {};
    mark("add+rmsnorm");
    cuda::add_rmsnorm(L_, p.h, p.r, 1, p.d, p.w, p.eps, p.x);
  }
  // The linear waiting for a partner, alone (after the add + norm that may feed it).
  void flush_linear() {
    flush_norm();
    if (!plin_.x) return;
    const PendingLinear p = plin_;
    plin_ = {};
    if (opt_.profile) mark(str("linear ", p.w.rows, "x", p.w.cols));
    run_linear(p.w, p.x, p.n, p.y, p.w.rows, /*exact=*/true);
  }

  void mlp(const MLPWeights& w, const float* x, int64_t n, float* y) override {
    const DevLinear w1 = dev_linear(w.w1), w3 = dev_linear(w.w3), w2 = dev_linear(w.w2);
    const int64_t inter = w1.rows, D = w2.rows;
    flush_add();
    mark("mlp");
    if (use_tc(n) && tc_takes(w1) && tc_takes(w3) && tc_takes(w2)) {
      cuda::TcJob j0 = split_input(x, n, D, fast_at(n));
      j0.w = w1, j0.w3 = w3, j0.swiglu = true, j0.M = n;
      j0.o_hi = scratch(kHi2, size_t(n * inter) * 2);
      j0.o_lo = fast_at(n) ? nullptr : scratch(kLo2, size_t(n * inter) * 2);
      j0.ldo = inter;
      set_form(j0, D % 64 == 0 && inter % 64 == 0, w1.t);
      cuda::tc_gemm(L_, j0, cuda::tc_tiles(n, j0.tm), inter);
      cuda::TcJob j1;
      j1.a_hi = j0.o_hi, j1.a_lo = j0.o_lo, j1.lda = inter, j1.w = w2, j1.M = n, j1.c = y, j1.ldc = D;
      set_form(j1, D % 64 == 0 && inter % 64 == 0, w2.t);
      cuda::tc_gemm(L_, j1, cuda::tc_tiles(n, j1.tm), D);
      return;
    }
    if (n <= opt_.gemv_max || !cuda::gemm_ok(w1) || !cuda::gemm_ok(w2)) {
      float* h = f32(kH, size_t(n * inter));
      cuda::gemv(L_, w1, &w3, x, w1.cols, nullptr, n, h, inter);
      cuda::gemv(L_, w2, nullptr, h, inter, nullptr, n, y, D);
      return;
    }
    float* h = f32(kH, size_t(n * 2 * inter));  // [n, w1 x | w3 x]
    cuda::gemm(L_, w1, &w3, inter, x, w1.cols, nullptr, false, 0, n, h, 2 * inter, fast_at(n));
    cuda::gemm(L_, w2, nullptr, 0, h, 2 * inter, nullptr, true, inter, n, y, D, fast_at(n));
  }

  void moe(const ModelArgs& a, const MoEWeights& w, const float* x, int64_t n, float* y) override {
    const DevLinear gate = dev_linear(Linear{w.gate, {}});
    const bool fused_gate = n <= std::min(opt_.gemv_max, 8) && gate.t != cuda::kFP8 && !(use_tc(n) && tc_takes(gate));
    cuda::GateNorm norm;  // the kept add + norm that made x, for the gate kernel to do
    if (pnorm_.x == x && n == 1 && fused_gate && !ko("gate")) norm = pnorm_, pnorm_ = {};
    flush_add();  // (a kept add + norm that the gate does not take runs here)
    mark("moe.gate");
    const MoeTable& T = moe_table(a, w);
    const int E = a.n_routed_experts, K = a.n_activated_experts;
    // Gate logits [n, E] in float32, then the device router.
    float* logits = f32(kLogits, size_t(n * E));
    cuda::MoeSched s = sched(n, E, K, T.S);
    const bool tc = use_tc(n) && T.tc;
    const bool swap = tc && moe_swap(T, n);
    if (tc) s.tile_rows = swap ? 128 : tile_m(T.wtype);
    cuda::RouteArgs r;
    r.E = E, r.K = K, r.G = a.n_expert_groups, r.topk_groups = a.n_limited_groups;
    r.sigmoid = a.score_func != "softmax", r.norm = a.norm_topk_prob, r.route_scale = a.route_scale;
    const float* bias = w.bias.empty() ? nullptr : w.bias.as<float>();
    const int64_t P = s.P(), D = a.dim;
    const bool gemvs = !tc && (n <= opt_.gemv_max || !T.gemm);
    cuda::TcJob xs;  // x's split when the gate made it
    if (fused_gate) {
      // One token on the expert GEMVs: their blocks route it from the logits (no last-block router).
      const bool rie = opt_.route_in_experts && gemvs && n == 1 && E <= 256 && !ko("experts");
      if (!ko("gate")) cuda::gate_route(L_, gate, x, n, logits, r, bias, s, counter_, !rie, norm.h ? &norm : nullptr);
      if (rie) s.route_logits = logits, s.route_bias = bias, s.route = r;
    } else if (tc && tc_takes(gate) && gate.cols == D) {
      // x split once (hi + lo) for the gate (exact) and the experts' first stage (hi only when fast).
      xs = split_input(x, n, D, /*fast=*/false);
      tc_linear(xs, gate, n, logits, E);
      mark("moe.route");
      cuda::moe_route(L_, r, logits, bias, s, nullptr, nullptr);
    } else {
      run_linear(gate, x, n, logits, E, /*exact=*/true);  // routing: no bf16 shortcut
      mark("moe.route");
      cuda::moe_route(L_, r, logits, bias, s, nullptr, nullptr);
    }
    mark("moe.experts");
    float* o = f32(kMoeO, size_t(P * D));
    if (tc) {
      cuda::TcJob j0 = xs.a_hi ? xs : split_input(x, n, D, fast_at(n));
      if (fast_at(n)) j0.a_lo = nullptr;
      set_form(j0, T.k64, T.wtype);  // tile rows as the schedule's (by the weight type)
      if (swap) j0.tm = 128, j0.swap = true;  // (moe_swap: the wgmma form)
      j0.grouped = true, j0.experts = T.dev, j0.a_idx = s.perm;
      j0.cnt = s.cnt, j0.off = s.off, j0.tile_e = s.tile_e, j0.tile_m0 = s.tile_m0, j0.n_tiles = s.n_tiles;
      cuda::TcJob j1 = j0;
      j0.stage = 0, j0.swiglu = true;
      j0.o_hi = scratch(kHi2, size_t(P * T.rows13) * 2);
      j0.o_lo = fast_at(n) ? nullptr : scratch(kLo2, size_t(P * T.rows13) * 2);
      j0.ldo = T.rows13;
      cuda::tc_gemm(L_, j0, s.max_tiles(), T.rows13);
      j1.stage = 1, j1.a_idx = nullptr, j1.a_hi = j0.o_hi, j1.a_lo = j0.o_lo, j1.lda = T.rows13;
      j1.c = o, j1.ldc = D;
      cuda::tc_gemm(L_, j1, s.max_tiles(), T.rows2);
    } else if (ko("experts")) {
    } else if (gemvs) {
      // GEMVs: on tensor cores where they take the experts (tcv_moe), else the FMA kernels.
      float* h = f32(kMoeH, size_t(P * T.rows13));
      if (!ko("experts0") && !(T.tcv && cuda::tcv_moe(L_, 0, T.dev, T.rows13, T.wtype, s, x, D, h, T.rows13)))
        cuda::moe_gemv(L_, 0, T.dev, T.rows13, T.wtype, s, x, D, h, T.rows13);
      if (!ko("experts1") && !(T.tcv && cuda::tcv_moe(L_, 1, T.dev, T.rows2, T.wtype, s, h, T.rows13, o, D)))
        cuda::moe_gemv(L_, 1, T.dev, T.rows2, T.wtype, s, h, T.rows13, o, D);
    } else {
      float* h = f32(kMoeH, size_t(P * 2 * T.rows13));
      cuda::moe_gemm(L_, 0, T.dev, T.rows13, T.wtype, s, x, D, T.rows13, h, 2 * T.rows13, fast_at(n));
      cuda::moe_gemm(L_, 1, T.dev, T.rows2, T.wtype, s, h, 2 * T.rows13, T.rows13, o, D, fast_at(n));
    }
    // The weighted un-permute waits for the next op: the layer loop adds y to the residual and
    // normalises, and that fuses (see rmsnorm).
    pmoe_ = {s, o, D, y, true};
  }

  void mla(const ModelArgs& a, AttnImpl impl, const AttnWeights& w, const RopeTable& rope, const TokenPos* tp,
           int64_t n, float* q, float* kv, const LayerCache& cache, int64_t max_len, float* out) override {
    flush_add();
    cuda::MlaDims d;
    d.H = a.n_heads, d.nope = a.qk_nope_head_dim, d.R = a.qk_rope_head_dim, d.C = a.kv_lora_rank;
    d.V = a.v_head_dim, d.max_len = max_len, d.scale = a.softmax_scale(), d.eps = a.rms_norm_eps;
    DSV3_CHECK(max_len <= rope.n_positions(), "rope table shorter than the cache");
    const DevPos* pos = step_.active && tp == step_.pos && n == step_.n ? step_pos() : upload_pos(tp, n);
    const float* cs = rope_table(rope);
    DSV3_CHECK(w.kv_norm.dtype == DType::F32, "kv_norm not on the device");
    const DevLinear wkv_b = dev_linear(w.wkv_b);
    const int64_t H = d.H, C = d.C, V = d.V, nope = d.nope;
    flush_add();
    mark("mla.prep");
    if (impl == AttnImpl::kAbsorb) {
      std::vector<std::pair<int64_t, int64_t>> runs;
      if (use_tc(n)) runs = token_runs(tp, n);
      if (!runs.empty()) {
        cuda::mla_prep(L_, d, false, pos, n, q, kv, w.kv_norm.as<float>(), cs, cache.kv, cache.pe, nullptr, nullptr);
        float* S = use_flash(d) ? nullptr : f32(kS, size_t(n * H * max_len));  // score rows of the cuBLAS form
        mla_runs(d, pos, runs, tp, n, q, cache, wkv_b, S, out);
        return;
      }
      float* ol = f32(kKvb, size_t(n * H * C));
      const DevLinear wv = slice(wkv_b, nope, V, 0, C);
      cuda::GemvShift sh;
      sh.xs = C, sh.ys = V, sh.wrows = nope + V;
      const int hb = opt_.decode_heads ? opt_.decode_heads : cuda::mla_decode_heads(n);
      const bool one = opt_.decode_attn && n <= 16 && cuda::mla_decode_ok(d, n, kAttnCounters, hb);
      const int ns = one ? cuda::mla_decode_splits(d, n, opt_.decode_splits, hb) : cuda::mla_splits(d, n);
      float* part = ns > 1 ? f32(kPart, size_t(ns * n * H * C)) : nullptr;
      float* ml = ns > 1 ? f32(kMl, size_t(ns * n * H * 2)) : nullptr;
      // One token: the value absorption combines the attention's splits.
      const bool splits_to_vabs = one && opt_.vabs_splits && n == 1 && ns > 1 && opt_.decode_attn_warps &&
                                  !ko("attn") && !ko("out") && !(use_tc(n) && tc_takes(wv)) &&
                                  cuda::gemv_splits_ok(L_, wv);
      {
        float* qa = f32(kLat, size_t(n * H * C));
        if (ko("prep")) {
        } else if (nope <= 128) {
          cuda::mla_prep_qabs(L_, d, pos, n, q, kv, w.kv_norm.as<float>(), cs, cache.kv, cache.pe, wkv_b, qa,
                              opt_.qabs_vec);
        } else {
          cuda::mla_prep(L_, d, false, pos, n, q, kv, w.kv_norm.as<float>(), cs, cache.kv, cache.pe, nullptr,
                         nullptr);
          mark("mla.qabs");
          cuda::mla_qabs(L_, d, wkv_b, q, n, qa);
        }
        if (ko("attn")) {
        } else if (one) {
          mark("mla.attn1");
          cuda::mla_decode_attn(L_, d, pos, n, qa, q, cache.kv, cache.pe, ns, part, ml, attn_counters_, ol,
                                opt_.decode_attn_warps, hb, !splits_to_vabs);
        } else {
          float* S = f32(kS, size_t(n * H * max_len));
          mark("mla.scores");
          cuda::mla_scores(L_, d, pos, n, qa, q, cache.kv, cache.pe, S);
          mark("mla.values");
          cuda::mla_values(L_, d, pos, n, S, cache.kv, ns, part, ml, ol);
        }
      }
      // out[i, h*V + v] = ol[i, h, :] · wkv_b[h*(nope+V) + nope + v, :], a GEMV per head.
      mark("mla.out");
      if (ko("out")) return;
      if (splits_to_vabs) {
        cuda::gemv_splits(L_, wv, int(H), sh, pos, ns, part, ml, ol, out);
        return;
      }
      if (use_tc(n) && tc_takes(wv)) {
        cuda::TcJob j;
        j.a_hi = scratch(kHi2, size_t(n * H * C) * 2);
        j.a_lo = scratch(kLo2, size_t(n * H * C) * 2);
        cuda::split_rows(L_, ol, n * H, C, C, const_cast<void*>(j.a_hi), const_cast<void*>(j.a_lo));
        j.lda = H * C, j.w = wv, j.M = n, j.c = out, j.ldc = H * V, j.shift = sh;
        set_form(j, C % 64 == 0, wv.t);
        cuda::tc_gemm(L_, j, cuda::tc_tiles(n, j.tm), V, int(H));
        return;
      }
      const bool tc = n > opt_.gemv_max && wv.t != cuda::kF32 && cuda::gemm_ok(wv) &&
                      (wv.t != cuda::kFP8 || (nope + V) % 128 == 0);
      if (tc) cuda::gemm(L_, wv, nullptr, 0, ol, H * C, nullptr, false, 0, n, out, H * V, false, int(H), sh);
      else cuda::gemv(L_, wv, nullptr, ol, H * C, nullptr, n, out, H * V, int(H), sh);
      return;
    }
    float* lat = f32(kLat, size_t(n * C));
    cuda::mla_prep(L_, d, true, pos, n, q, kv, w.kv_norm.as<float>(), cs, nullptr, nullptr, lat, cache.k);
    float* kvb = f32(kKvb, size_t(n * H * (nope + V)));
    run_linear(wkv_b, lat, n, kvb, H * (nope + V), /*exact=*/true);
    cuda::mla_naive_store(L_, d, pos, n, kvb, cache.k, cache.v);
    float* S = f32(kS, size_t(n * H * max_len));
    cuda::mla_naive_scores(L_, d, pos, n, q, cache.k, S);
    cuda::mla_naive_values(L_, d, pos, n, S, cache.v, out);
  }

  // The host sampler's checks and messages for logit row r of x (device): `bad` the index of a
  // NaN / +inf logit (< 0: none), `none` every one of its `limit` logits -inf.
  void check_logit_row(const float* x, int64_t r, int64_t cols, int64_t limit, int32_t bad, bool none) {
    if (bad >= 0) {
      float v = 0.f;
      CK(cudaMemcpy(&v, x + r * cols + bad, 4, cudaMemcpyDeviceToHost));
      fail("sampling: logit of token ", bad, " is ", v, " (must be finite or -inf)");
    }
    if (none) fail("sampling: every one of the ", limit, " logits is -inf");
  }

  bool argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t limit, int32_t* ids) override {
    no_capture("argmax_rows");
    flush_add();
    flush_marks();
    int32_t* d = static_cast<int32_t*>(scratch(kTopk, size_t(rows) * 12));
    cuda::argmax_rows(L_, x, rows, cols, limit, d);
    std::vector<int32_t> h(static_cast<size_t>(rows) * 3);
    CK(cudaMemcpyAsync(h.data(), d, h.size() * 4, cudaMemcpyDeviceToHost, stream_));
    CK(cudaStreamSynchronize(stream_));
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* o = &h[size_t(r) * 3];
      check_logit_row(x, r, cols, limit, o[1], o[2] != 0);
      ids[r] = o[0];
    }
    return true;
  }

  bool sample_rows(const float* x, int64_t rows, int64_t cols, int64_t limit, const SampleSpec* spec, int32_t* ids,
                   float* host_logits) override {
    no_capture("sample_rows");
    flush_add();
    flush_marks();
    std::vector<cuda::DevSample> hs(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      const SampleSpec& s = spec[r];
      hs[size_t(r)] = {s.temperature, s.top_p, s.min_p, s.top_k, s.u, s.host ? 1 : 0, 0};
    }
    const size_t sb = hs.size() * sizeof(cuda::DevSample), ob = (size_t(rows) * 12 + 15) / 16 * 16;
    char* d = static_cast<char*>(scratch(kTopk, sb + ob + size_t(rows * limit) * sizeof(double)));
    auto* ds = reinterpret_cast<cuda::DevSample*>(d);
    auto* dout = reinterpret_cast<int32_t*>(d + sb);
    auto* dw = reinterpret_cast<double*>(d + sb + ob);
    CK(cudaMemcpyAsync(ds, hs.data(), sb, cudaMemcpyHostToDevice, stream_));
    cuda::sample_rows(L_, x, rows, cols, limit, ds, dout, dw);
    std::vector<int32_t> h(static_cast<size_t>(rows) * 3);
    CK(cudaMemcpyAsync(h.data(), dout, h.size() * 4, cudaMemcpyDeviceToHost, stream_));
    CK(cudaStreamSynchronize(stream_));
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* o = &h[size_t(r) * 3];  // {id, status, index}: cuda::sample_rows
      check_logit_row(x, r, cols, limit, o[1] == 2 ? o[2] : -1, o[1] == 3);
      ids[r] = o[1] == 0 ? o[0] : -1;
      if (o[1] == 1) CK(cudaMemcpy(host_logits + r * cols, x + r * cols, size_t(cols) * 4, cudaMemcpyDeviceToHost));
    }
    return true;
  }

  // Test hook: act_quant.
  void act_quant(const float* x, int64_t rows, int64_t cols, bool ue8m0, uint8_t* y, float* s) {
    flush_add();
    const size_t n = size_t(rows * cols), nb = n / 128;
    uint8_t* dy = static_cast<uint8_t*>(scratch(kTopk, n + nb * 4 + 16));
    float* ds = reinterpret_cast<float*>(dy + (n + 15) / 16 * 16);
    cuda::act_quant(L_, x, rows, cols, ue8m0, dy, ds);
    CK(cudaMemcpyAsync(y, dy, n, cudaMemcpyDeviceToHost, stream_));
    CK(cudaMemcpyAsync(s, ds, nb * 4, cudaMemcpyDeviceToHost, stream_));
    CK(cudaStreamSynchronize(stream_));
  }

  // Test hook: the router alone.
  void route(const ModelArgs& a, const float* logits, const float* bias, int64_t n, int32_t* idx, float* wts) {
    flush_add();
    const int E = a.n_routed_experts, K = a.n_activated_experts;
    cuda::MoeSched s = sched(n, E, K, 0);
    cuda::RouteArgs r;
    r.E = E, r.K = K, r.G = a.n_expert_groups, r.topk_groups = a.n_limited_groups;
    r.sigmoid = a.score_func != "softmax", r.norm = a.norm_topk_prob, r.route_scale = a.route_scale;
    int32_t* di = static_cast<int32_t*>(scratch(kTopk, size_t(n * K) * 8));
    float* dw = reinterpret_cast<float*>(di + n * K);
    cuda::moe_route(L_, r, logits, bias, s, di, dw);
    CK(cudaMemcpyAsync(idx, di, size_t(n * K) * 4, cudaMemcpyDeviceToHost, stream_));
    CK(cudaMemcpyAsync(wts, dw, size_t(n * K) * 4, cudaMemcpyDeviceToHost, stream_));
    CK(cudaStreamSynchronize(stream_));
  }

 private:
  static constexpr size_t kStagingBytes = 1 << 20;

  struct StepInfo {
    const int32_t* tokens = nullptr;
    const TokenPos* pos = nullptr;
    const int64_t* rows = nullptr;
    int64_t n = 0, m = 0;
    bool active = false;
  };
  struct GraphKey {
    int64_t n;
    std::vector<int64_t> rows;
    bool operator<(const GraphKey& o) const { return n != o.n ? n < o.n : rows < o.rows; }
  };
  struct Graph {
    int seen = 0;
    cudaGraphExec_t exec = nullptr;
  };
  struct Buf {
    void* p = nullptr;
    size_t bytes = 0;
  };

  bool begin_plain(const int32_t* tokens, const TokenPos* pos, int64_t n, const int64_t* rows, int64_t m) {
    step_ = StepInfo{};  // too large for the staging buffer: ops upload their own metadata
    return false;
  }
  const int32_t* step_tok() const { return static_cast<const int32_t*>(step_dev_); }
  const DevPos* step_pos() const { return reinterpret_cast<const DevPos*>(static_cast<int32_t*>(step_dev_) + step_.n); }

  // Launches whatever was deferred: the MoE un-permute, then the residual add.
  void flush_add() {
    flush_linear();
    if (pmoe_.active) {
      mark("moe.combine");
      cuda::moe_combine(L_, pmoe_.s, pmoe_.o, pmoe_.d, pmoe_.y);
      pmoe_.active = false;
    }
    if (!pend_.y) return;
    mark("add");
    cuda::add(L_, pend_.y, pend_.x, pend_.n);
    pend_ = {};
  }

  // CudaOptions::knockout names `group` (a measurement aid).
  bool ko(const char* group) const {
    if (opt_.knockout.empty()) return false;
    const std::string k = "," + opt_.knockout + ",";
    return k.find(str(",", group, ",")) != std::string::npos;
  }

  // Profiling: an event at each stage boundary; the time to the next one goes to the stage.
  void mark(const std::string& name) {
    if (!opt_.profile) return;
    cudaEvent_t e = nullptr;
    if (!free_events_.empty()) e = free_events_.back(), free_events_.pop_back();
    else CK(cudaEventCreate(&e));
    CK(cudaEventRecord(e, stream_));
    marks_.push_back({name, e});
  }
  void flush_marks() {
    if (!opt_.profile || marks_.empty()) return;
    mark("(end)");
    CK(cudaEventSynchronize(marks_.back().second));
    for (size_t i = 0; i + 1 < marks_.size(); ++i) {
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, marks_[i].second, marks_[i + 1].second));
      prof_[marks_[i].first] += ms;
    }
    for (auto& m : marks_) free_events_.push_back(m.second);
    marks_.clear();
    ++prof_steps_;
  }

  void no_capture(const char* what) const {
    if (capturing_) fail("CUDA backend: ", what, " while recording a step");
  }
  void abort_capture() {
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream_, &g);
    if (g) cudaGraphDestroy(g);
    capturing_->seen = -1000;  // never record this shape again
    capturing_ = nullptr;
    cudaGetLastError();
  }
  void drop_graphs() {
    for (auto& [k, g] : graphs_)
      if (g.exec) cudaGraphExecDestroy(g.exec);
    graphs_.clear();
  }

  void* device_bytes(size_t bytes) {
    no_capture("weight allocation");
    void* p = device_malloc(bytes, "the model's weights",
                            "this backend runs on one GPU: the checkpoint must fit it (or use --backend cpu)");
    owned_.push_back(p);
    return p;
  }

  // A scratch buffer of at least `bytes`; grows (and forgets recorded steps) when needed.
  void* scratch(Slot s, size_t bytes) {
    Buf& b = scratch_[s];
    if (b.bytes >= bytes) return b.p;
    no_capture("scratch growth");
    CK(cudaStreamSynchronize(stream_));
    drop_graphs();
    if (b.p) CK(cudaFree(b.p));
    b.bytes = align256(bytes + bytes / 4);
    CK(cudaMalloc(&b.p, b.bytes));
    return b.p;
  }
  float* f32(Slot s, size_t n) { return static_cast<float*>(scratch(s, n * 4)); }

  const int32_t* upload_ints(const int32_t* v, int64_t n) {
    no_capture("token upload");
    void* d = scratch(kTok, size_t(n) * 4);
    CK(cudaMemcpyAsync(d, v, size_t(n) * 4, cudaMemcpyHostToDevice, stream_));
    CK(cudaStreamSynchronize(stream_));
    return static_cast<const int32_t*>(d);
  }
  const DevPos* upload_pos(const TokenPos* p, int64_t n) {
    no_capture("position upload");
    void* d = scratch(kPos, size_t(n) * 8);
    CK(cudaMemcpyAsync(d, p, size_t(n) * 8, cudaMemcpyHostToDevice, stream_));
    CK(cudaStreamSynchronize(stream_));
    return static_cast<const DevPos*>(d);
  }

  // The rope table on the device, uploaded again when the host table changes (pointer, size or
  // a sample of its values: a new table can reuse a freed one's address).
  const float* rope_table(const RopeTable& rope) {
    const float* host = rope.at(0);
    const size_t n = size_t(rope.n_positions()) * size_t(2 * rope.half());
    std::vector<float> fp;
    for (size_t i = 0; i < 64 && n > 0; ++i) fp.push_back(host[(i * 2654435761u) % n]);
    fp.push_back(host[n - 1]);
    if (host == rope_host_ && n == rope_n_ && fp == rope_fp_) return rope_dev_;
    rope_fp_ = fp;
    no_capture("rope upload");
    if (rope_dev_) CK(cudaFree(rope_dev_));
    CK(cudaMalloc(&rope_dev_, n * 4));
    CK(cudaMemcpy(rope_dev_, host, n * 4, cudaMemcpyHostToDevice));
    rope_host_ = host, rope_n_ = n;
    return rope_dev_;
  }

  cuda::MoeSched sched(int64_t n, int E, int K, int S) {
    cuda::MoeSched s;
    s.n = n, s.E = E, s.K = K, s.S = S;
    s.experts_run = experts_run_;
    const int64_t NE = s.NE(), P = s.P(), T = s.max_tiles(), Kt = K + S;
    const size_t words = size_t(3 * NE + 2 + P + 2 * n * Kt + 2 * T);
    int32_t* b = static_cast<int32_t*>(scratch(kSched, words * 4));
    s.cnt = b, b += NE;
    s.off = b, b += NE;
    s.active = b, b += NE;
    s.n_active = b++;
    s.n_tiles = b++;
    s.perm = b, b += P;
    s.pair_of = b, b += n * Kt;
    s.pw = reinterpret_cast<float*>(b), b += n * Kt;
    s.tile_e = b, b += T;
    s.tile_m0 = b;
    return s;
  }

  const MoeTable& moe_table(const ModelArgs& a, const MoEWeights& w) {
    const void* key = w.experts.at(0).w1.weight.data;
    auto it = moe_.find(key);
    if (it != moe_.end()) return it->second;
    no_capture("MoE table build");
    MoeTable T;
    std::vector<DevExpert> v;
    for (const MLPWeights& e : w.experts) v.push_back({dev_linear(e.w1), dev_linear(e.w3), dev_linear(e.w2)});
    if (w.has_shared) {
      const DevLinear s1 = dev_linear(w.shared_experts.w1), s3 = dev_linear(w.shared_experts.w3),
                      s2 = dev_linear(w.shared_experts.w2);
      const int64_t mi = a.moe_inter_dim, ns = s1.rows / std::max<int64_t>(mi, 1);
      // Slices of moe_inter_dim rows balance the work with the routed experts; FP8 slices must
      // start on a 128-row scale block for the tensor-core kernel, else one slice.
      const bool split = ns > 1 && ns * mi == s1.rows && (s1.t != cuda::kFP8 || mi % 128 == 0);
      const int64_t S = split ? ns : 1, rows = s1.rows / S;
      for (int64_t j = 0; j < S; ++j)
        v.push_back({slice(s1, j * rows, rows, 0, s1.cols), slice(s3, j * rows, rows, 0, s3.cols),
                     slice(s2, 0, s2.rows, j * rows, rows)});
      T.S = int(S);
    }
    T.wtype = v[0].w1.t;
    T.gemm = true;
    T.tc = true;
    T.k64 = true;
    T.tcv = true;
    for (DevExpert& e : v) {
      for (const DevLinear* l : {&e.w1, &e.w3, &e.w2}) {
        if (l->t != T.wtype) fail("CUDA backend: MoE layer mixes weight dtypes");
        T.tcv = T.tcv && cuda::tcv_ok(*l);
        T.gemm = T.gemm && cuda::gemm_ok(*l) && l->t != cuda::kF32;
        T.tc = T.tc && tc_takes(*l);
        T.k64 = T.k64 && l->cols % 64 == 0;
      }
      e.vec13 = cuda::vec_ok(e.w1) && cuda::vec_ok(e.w3);
      e.vec2 = cuda::vec_ok(e.w2);
      T.rows13 = std::max(T.rows13, e.w1.rows);
      T.rows2 = std::max(T.rows2, e.w2.rows);
    }
    CK(cudaMalloc(&T.dev, v.size() * sizeof(DevExpert)));
    CK(cudaMemcpy(T.dev, v.data(), v.size() * sizeof(DevExpert), cudaMemcpyHostToDevice));
    return moe_.emplace(key, T).first->second;
  }

  // y[n, out] = x[n, in] · Wᵀ.
  void run_linear(const DevLinear& w, const float* x, int64_t n, float* y, int64_t ldy, bool exact = false) {
    const bool fast = fast_at(n) && !exact;
    if (use_tc(n) && tc_takes(w)) {
      tc_linear(split_input(x, n, w.cols, fast), w, n, y, ldy);
    } else if (n <= opt_.gemv_max || w.t == cuda::kF32 || !cuda::gemm_ok(w)) {
      cuda::gemv(L_, w, nullptr, x, w.cols, nullptr, n, y, ldy);
    } else {
      cuda::gemm(L_, w, nullptr, 0, x, w.cols, nullptr, false, 0, n, y, ldy, fast);
    }
  }

  // y[n, out] = x · Wᵀ on the pipelined kernel, x already split into j's A operand.
  void tc_linear(cuda::TcJob j, const DevLinear& w, int64_t n, float* y, int64_t ldy) {
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

  bool use_tc(int64_t n) const { return n >= opt_.tc_min; }
  // A MoE layer's grouped stages of n tokens with the weights as the MMA's A and each tile's
  // tokens as its N (CudaOptions::tc_swap), where the wgmma form takes them.
  bool moe_swap(const MoeTable& T, int64_t n) const {
    const bool want = opt_.tc_swap == 2 || (opt_.tc_swap == 1 && (T.wtype == cuda::kFP8 || fast_at(n)));
    return want && wgmma_ && T.k64 && !opt_.wg_async;
  }
  // Whether two linears of the same n activations run as one pipelined-kernel launch (w's row
  // tiles, then w2's): both taken there with the same K and weight type.
  bool tc_pair_ok(const cuda::DevLinear& w, const cuda::DevLinear& w2, int64_t n) const {
    return opt_.pair_gemv && use_tc(n) && tc_takes(w) && tc_takes(w2) && w.cols == w2.cols && w.t == w2.t;
  }
  // Tile rows for weights of type wtype: as asked, else 128 for e4m3 (the wgmma form's two
  // warpgroups share each widened weight tile: half the widening per product) and 64 for bf16
  // (more blocks per SM; 128 measured slower, CudaOptions::tc_tm).
  int tile_m(int32_t wtype) const { return opt_.tc_tm ? opt_.tc_tm : (wtype == cuda::kFP8 ? 128 : 64); }
  // The pipelined kernel's form for a job: tile rows, and wgmma where the device and every K
  // (k64: all multiples of 64) allow it.
  void set_form(cuda::TcJob& j, bool k64, int32_t wtype) const {
    j.tm = tile_m(wtype);
    j.wgmma = wgmma_ && k64;
    j.fp8 = wtype == cuda::kFP8;
    j.wg_async = opt_.wg_async && !j.fp8 && j.tm == 64;
    DSV3_CHECK(!j.fp8 || j.wgmma, "FP8 weights reach the pipelined kernel only in its wgmma form");
  }
  // Whether the pipelined kernel takes w: bf16 in either form; FP8 (widened to bf16 in shared
  // memory, block scales on the partial sums) in the wgmma form.
  bool tc_takes(const cuda::DevLinear& w) const {
    if (w.t == cuda::kFP8) return opt_.fp8_wgmma && wgmma_ && cuda::tc_ok_fp8(w);
    return cuda::tc_ok(w);
  }
  // Fast mode's bf16 activations for products of prefill size only: decode is bound by the weight
  // reads, so one bf16 pass would gain nothing there and its errors would reach every step.
  bool fast_at(int64_t n) const { return opt_.fast && n >= opt_.fast_min; }

  // A job whose A operand is x [n, cols] split into bf16 hi (+ lo unless fast) in kHi / kLo.
  cuda::TcJob split_input(const float* x, int64_t n, int64_t cols, bool fast) {
    cuda::TcJob j;
    j.a_hi = scratch(kHi, size_t(n * cols) * 2);
    j.a_lo = fast ? nullptr : scratch(kLo, size_t(n * cols) * 2);
    j.lda = cols;
    cuda::split_rows(L_, x, n, cols, cols, const_cast<void*>(j.a_hi), const_cast<void*>(j.a_lo));
    return j;
  }

  bool use_flash(const cuda::MlaDims& d) const { return opt_.flash && cuda::flash_prefill_ok(d); }

  // Runs of tokens of one slot at consecutive positions; empty when there are too many (the
  // cuBLAS attention pays per run).
  std::vector<std::pair<int64_t, int64_t>> token_runs(const TokenPos* tp, int64_t n) const {
    std::vector<std::pair<int64_t, int64_t>> runs;
    for (int64_t i = 0; i < n; ++i) {
      if (i > 0 && tp[i].slot == tp[i - 1].slot && tp[i].pos == tp[i - 1].pos + 1) runs.back().second = i + 1;
      else runs.push_back({i, i + 1});
    }
    if (int64_t(runs.size()) * 32 > n) runs.clear();
    return runs;
  }

  // MLA for long runs of a slot (prefill) over the latent cache: K/V of the run's positions
  // [0, end) decompressed through wkv_b (as the naive form; 192 + 128 multiply-adds per
  // (query, key, head) instead of the absorbed form's 1088), then per head cuBLAS GEMMs for the
  // scores (nope part batched over heads, rope part shared), a causal softmax and the values,
  // in chunks of `attn_chunk` (512) queries. Float32 GEMMs (bf16 tensor cores in fast mode). out [n, H * V].
  void mla_runs(const cuda::MlaDims& d, const DevPos* pos, const std::vector<std::pair<int64_t, int64_t>>& runs,
                const TokenPos* tp, int64_t tp_n, const float* q, const LayerCache& cache, const DevLinear& wkv_b,
                float* S, float* out) {
    const int64_t H = d.H, C = d.C, R = d.R, nope = d.nope, V = d.V, qk = nope + R, ML = d.max_len, KV = nope + V;
    const bool flash = use_flash(d);
    // Fast mode: bf16 tensor cores with float32 accumulation (the reference's attention arithmetic).
    const cublasComputeType_t ct = fast_at(tp_n) ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F;
    const float one = 1.f, zero = 0.f, scale = d.scale;
    for (auto [r0, r1] : runs) {
      const int64_t slot = tp[r0].slot, end = tp[r1 - 1].pos + 1;
      const float* kvs = cache.kv + slot * ML * C;
      const float* pes = cache.pe + slot * ML * R;
      mark("mla.expand");
      float* kvb = f32(kKvb, size_t(end * H * KV));  // [end, H, nope + V]
      run_linear(wkv_b, kvs, end, kvb, H * KV, /*exact=*/true);
      mark("mla.attn");
      if (flash) {
        const int64_t m = r1 - r0, pos0 = tp[r0].pos;
        void* ws = scratch(kS, cuda::flash_prefill_ws(d, m, pos0));
        cuda::flash_prefill(L_, d, q + r0 * H * qk, m, pos0, kvb, pes, out + r0 * H * V, !fast_at(tp_n), ws);
        continue;
      }
      const int64_t chunk = std::max(opt_.attn_chunk, 1);
      for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
        const int64_t c1 = std::min(r1, c0 + chunk), Lk = tp[c1 - 1].pos + 1, m = c1 - c0;
        float* Sc = S + c0 * H * ML;
        // S[i, h, t] = scale * (q_nope[i, h] · k_nope[t, h] + q_pe[i, h] · pe[t])
        CB(cublasGemmStridedBatchedEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(Lk), int(m), int(nope), &scale, kvb,
                                      CUDA_R_32F, int(H * KV), KV, q + c0 * H * qk, CUDA_R_32F, int(H * qk), qk, &zero,
                                      Sc, CUDA_R_32F, int(H * ML), ML, int(H), ct, CUBLAS_GEMM_DEFAULT));
        CB(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(Lk), int(m * H), int(R), &scale, pes, CUDA_R_32F, int(R),
                        q + c0 * H * qk + nope, CUDA_R_32F, int(qk), &one, Sc, CUDA_R_32F, int(ML), ct,
                        CUBLAS_GEMM_DEFAULT));
        cuda::causal_softmax_rows(L_, Sc, m * H, ML, Lk, pos, c0, int(H));
        // out[i, h*V + v] = sum_t P[i, h, t] * v[t, h, v]
        CB(cublasGemmStridedBatchedEx(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, int(V), int(m), int(Lk), &one, kvb + nope,
                                      CUDA_R_32F, int(H * KV), KV, Sc, CUDA_R_32F, int(H * ML), ML, &zero,
                                      out + c0 * H * V, CUDA_R_32F, int(H * V), V, int(H), ct, CUBLAS_GEMM_DEFAULT));
      }
    }
  }

  CudaOptions opt_;
  cudaStream_t stream_ = nullptr;
  cuda::Launch L_;
  cublasHandle_t cublas_ = nullptr;
  bool wgmma_ = false;  // the pipelined kernel's wgmma form may run (option and an sm_90 device)
  std::vector<void*> owned_;
  Buf scratch_[kNumSlots];
  std::map<const void*, MoeTable> moe_;
  float* rope_dev_ = nullptr;
  const float* rope_host_ = nullptr;
  std::vector<float> rope_fp_;
  size_t rope_n_ = 0;
  void* staging_ = nullptr;
  // Zeroed device words that kernels leave zeroed: the first for the fused gate + router, the
  // next kAttnCounters (attn_counters_) for the one-launch decode attention.
  static constexpr int64_t kAttnCounters = 4096;
  unsigned* counter_ = nullptr;
  unsigned* attn_counters_ = nullptr;
  unsigned long long* experts_run_ = nullptr;  // in counter_'s allocation, after the attention counters
  cudaEvent_t staging_done_ = nullptr;
  void* step_dev_ = nullptr;
  size_t step_cap_ = 0;
  StepInfo step_;
  std::map<GraphKey, Graph> graphs_;
  Graph* capturing_ = nullptr;
  Graph* replay_ = nullptr;
  struct PendingAdd {
    float* y = nullptr;
    const float* x = nullptr;
    int64_t n = 0;
    bool from_moe = false;  // x is the pending MoE output
  } pend_;
  struct PendingLinear {
    cuda::DevLinear w;
    const float* x = nullptr;
    int64_t n = 0;
    float* y = nullptr;
  } plin_;
  struct PendingMoe {
    cuda::MoeSched s;
    const float* o = nullptr;
    int64_t d = 0;
    float* y = nullptr;
    bool active = false;
  } pmoe_;
  cuda::GateNorm pnorm_;  // an add + norm of one token, kept for the next op (rmsnorm)
  cuda::CombineNorm pcomb_;  // a MoE combine + add + norm of one token, kept for the next op (rmsnorm)
  std::vector<std::pair<std::string, cudaEvent_t>> marks_;
  std::vector<cudaEvent_t> free_events_;
  std::map<std::string, double> prof_;
  int64_t prof_steps_ = 0;
};

CudaBackend& as_cuda(Backend& b) {
  auto* c = dynamic_cast<CudaBackend*>(&b);
  if (!c) fail("expected the CUDA backend, got '", b.name(), "'");
  return *c;
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const CudaOptions& opt) { return std::make_unique<CudaBackend>(opt); }
std::unique_ptr<Backend> make_cuda_backend() { return make_cuda_backend(CudaOptions::from_env()); }

namespace cuda {

bool device_available(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why) *why = str("no usable CUDA device (", cudaGetErrorString(e), ")");
    cudaGetLastError();
    return false;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device";
    return false;
  }
  return true;
}

ModelWeights random_weights(Backend& b, const ModelArgs& a, uint64_t seed) { return as_cuda(b).random_weights(a, seed); }

std::string profile_report(Backend& b, bool reset) { return as_cuda(b).profile_report(reset); }

void route_for_test(Backend& b, const ModelArgs& a, const float* logits, const float* bias, int64_t n, int32_t* idx,
                    float* w) {
  as_cuda(b).route(a, logits, bias, n, idx, w);
}

void act_quant_for_test(Backend& b, const float* x, int64_t rows, int64_t cols, bool ue8m0, uint8_t* y, float* s) {
  as_cuda(b).act_quant(x, rows, cols, ue8m0, y, s);
}

double copy_bandwidth_gbps(size_t bytes, int reps) {
  void *a = nullptr, *b = nullptr;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));  // warm-up
  CK(cudaEventRecord(e0));
  for (int r = 0; r < reps; ++r) CK(cudaMemcpyAsync(r % 2 ? a : b, r % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice));
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) * reps / (double(ms) * 1e-3) / 1e9;
}

}  // namespace cuda
}  // namespace dsv3
