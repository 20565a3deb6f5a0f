// The CUDA backend's core: weights copied to device memory once (bf16 and e4m3 kept as stored),
// float32 activations, each node of a step graph a few kernel launches on one stream; decode
// steps recorded as CUDA graphs and replayed. The fusions it accepts are decided here (fuses) and
// run here (run_fused). The scalar ref backend is the oracle it is tested against.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <unistd.h>

#include "backend/cuda/backend_impl.h"
#include "backend/cuda/upload.h"
#include "core/error.h"
#include "dist/comm.h"

namespace dsv3 {

static_assert(sizeof(TokenPos) == sizeof(cuda::DevPos) && offsetof(TokenPos, pos) == offsetof(cuda::DevPos, pos));

CudaOptions CudaOptions::from_env() {
  auto flag = [](const char* name, bool dflt) {
    const char* v = std::getenv(name);
    if (!v || !*v) return dflt;
    return !(std::strcmp(v, "0") == 0 || std::strcmp(v, "false") == 0 || std::strcmp(v, "off") == 0);
  };
  CudaOptions o;
  o.graphs = flag("DSV3_CUDA_GRAPH", o.graphs);
  o.pdl = flag("DSV3_CUDA_PDL", o.pdl);
  o.fast = flag("DSV3_CUDA_FAST", o.fast);
  o.fp8_gemm = flag("DSV3_CUDA_FP8_GEMM", o.fp8_gemm);
  o.progress = flag("DSV3_CUDA_PROGRESS", isatty(2) != 0);
  return o;
}

void CudaOptions::validate() const {
  if (tune.tc_swap < 0 || tune.tc_swap > 2)
    fail("CUDA backend: tc_swap must be 0 (never), 1 (e4m3 weights or fast mode) or 2 (always), got ", tune.tc_swap);
  if (tune.tc_tm != 0 && tune.tc_tm != 64 && tune.tc_tm != 128)
    fail("CUDA backend: tc_tm must be 0 (by the weight type), 64 or 128 rows per tile, got ", tune.tc_tm);
  if (tune.gemv_max < 0 || tune.gemv_max > 8) fail("CUDA backend: gemv_max must be in [0, 8], got ", tune.gemv_max);
  if (tune.moe_tiles < 0) fail("CUDA backend: moe_tiles must be 0 (never) or more, got ", tune.moe_tiles);
  if (tune.moe_persist_bf16_min < 0)
    fail("CUDA backend: moe_persist_bf16_min must be 0 (always) or more, got ", tune.moe_persist_bf16_min);
  if (tune.mla_group_rows < 1) fail("CUDA backend: mla_group_rows must be 1 or more, got ", tune.mla_group_rows);
  if (tune.moe_tiles_fp8gemm < 0)
    fail("CUDA backend: moe_tiles_fp8gemm must be 0 (never) or more, got ", tune.moe_tiles_fp8gemm);
}

namespace cuda_impl {

void cublas_check(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) throw Error(str(file, ":", line, ": cuBLAS error ", int(s), " from ", what));
}

namespace {

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

// The dtype a tensor gets on the device.
DType device_dtype(const TensorView& t, TensorRole k) {
  switch (k) {
    case TensorRole::kScale:
    case TensorRole::kNorm: return DType::F32;
    default:
      if (t.dtype == DType::BF16 || t.dtype == DType::F8_E4M3 || t.dtype == DType::F32) return t.dtype;
      return DType::F32;  // F16 is widened exactly
  }
}

}  // namespace

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

DevLinear slice(DevLinear d, int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
  d.row0 += r0, d.rows = rows, d.col0 += c0, d.cols = cols;
  return d;
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// ---- construction and memory

CudaBackend::CudaBackend(const CudaOptions& opt) : opt_(opt) {
  opt_.validate();
  std::string why;
  if (!cuda::device_available(&why)) fail("CUDA backend: ", why);
  // Under mpirun each rank takes a GPU by its rank on the node, before anything is allocated.
  if (const int lr = local_rank(); lr >= 0) {
    int n = 0;
    CK(cudaGetDeviceCount(&n));
    device_ = lr % n;
    CK(cudaSetDevice(device_));
  } else {
    CK(cudaGetDevice(&device_));
  }
  CK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, device_));
  L_.stream = stream_;
  L_.pdl = opt_.pdl && prop.major >= 9;
  L_.tcv_max = prop.major >= 8 ? opt_.tune.tcv_max : 0;  // mma.sync bf16 / f16: sm_80+
  L_.tcv_bf16_min = opt_.tune.tcv_bf16_min;
  L_.fp8_fma_one = 1;  // one token's e4m3 linears on the FMA GEMVs (faster there); its experts on tensor cores
  wgmma_ = opt_.tune.wgmma && prop.major == 9;  // sm_90a code: Hopper only
  staging_bytes_ = 1 << 20;
  CK(cudaMallocHost(&staging_, staging_bytes_));
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
}

CudaBackend::~CudaBackend() {
  if (device_ != 0) cudaSetDevice(device_);
  if (capturing_) {
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream_, &g);
    if (g) cudaGraphDestroy(g);
  }
#ifdef DSV3_HAVE_NCCL
  if (nccl_ && !nccl_->empty()) nccl_->drained(stream_, "the last step's collectives");  // (bounded)
#endif
  cudaStreamSynchronize(stream_);
  drop_graphs();
  for (auto& s : scratch_)
    if (s.p) cudaFree(s.p);
  for (void* p : owned_) cudaFree(p);
  for (auto& [k, t] : moe_) cudaFree(t.dev), cudaFree(t.tmaps);
  if (step_dev_) cudaFree(step_dev_);
  if (cublas_) cublasDestroy(cublas_);
  for (auto& m : marks_) cudaEventDestroy(m.second);
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  cudaFreeHost(staging_);
  cudaFree(counter_);
  cudaEventDestroy(staging_done_);
#ifdef DSV3_HAVE_NCCL
  nccl_.reset();
#endif
  cudaStreamDestroy(stream_);
}

// Routed experts given tokens, summed over MoE calls (the router adds each call's count on the
// device; read after the stream drains).
int64_t CudaBackend::routed_experts_run() const {
  on_device();
  unsigned long long v = 0;
  sync();
  CK(cudaMemcpy(&v, experts_run_, sizeof v, cudaMemcpyDeviceToHost));
  return int64_t(v);
}

void CudaBackend::reset_counters() {
  on_device();
  no_capture("reset_counters");
  CK(cudaMemsetAsync(experts_run_, 0, sizeof(unsigned long long), stream_));
}

float* CudaBackend::alloc(size_t n) {
  on_device();
  no_capture("alloc");
  void* p = device_malloc(std::max<size_t>(n, 1) * 4, "a device buffer (the KV cache is one per layer)",
                          "lower --kv-cache-gb or the batch, or use --backend cpu");
  CK(cudaMemsetAsync(p, 0, std::max<size_t>(n, 1) * 4, stream_));
  sync();
  return static_cast<float*>(p);
}

void CudaBackend::release(float* p) {
  on_device();
  no_capture("release");
  sync();
  drop_graphs();  // recorded steps may point at it
  CK(cudaFree(p));
}

void CudaBackend::upload(float* dst, const float* host, size_t n) {
  on_device();
  no_capture("upload");
  CK(cudaMemcpyAsync(dst, host, n * 4, cudaMemcpyHostToDevice, stream_));
  sync();
}

void CudaBackend::download(float* host, const float* src, size_t n) {
  on_device();
  no_capture("download");
  flush_marks();
  wait_collectives();
  CK(cudaMemcpyAsync(host, src, n * 4, cudaMemcpyDeviceToHost, stream_));
  sync();
}

int64_t CudaBackend::device_free_bytes() const {
  on_device();
  size_t free_b = 0, total_b = 0;
  CK(cudaMemGetInfo(&free_b, &total_b));
  return int64_t(free_b);
}

WeightPlacement CudaBackend::prepare_weights(const ModelArgs& args, ModelWeights& w, const WeightMemory&) {
  on_device();
  ue8m0_ = args.scale_fmt == "ue8m0";
  size_t total = 0;
  bool fp8 = false;  // FP8 weights (FP8 GEMM mode has products to take)
  for_each_tensor(w, [&](TensorView& t, TensorRole k) {
    if (!t.empty()) total += align256(size_t(t.numel()) * dtype_size(device_dtype(t, k)));
    fp8 = fp8 || t.dtype == DType::F8_E4M3;
  });
  char* base = static_cast<char*>(device_bytes(total));
  size_t at = 0;
  std::vector<float> conv;
  cuda::Uploader up(base, total, opt_.upload_chunk, stream_, opt_.progress);
  for_each_tensor(w, [&](TensorView& t, TensorRole k) {
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
  w.owned.clear();
  WeightPlacement p;
  p.note = str("weights: ", double(int64_t(double(total) / 1e7)) / 100.0, " GB in GPU memory");
  if (opt_.fp8_gemm && !(fp8 && wgmma_))
    std::fprintf(stderr, "dsv3: warning: DSV3_CUDA_FP8_GEMM has no effect: %s\n",
                 fp8 ? "its e4m3 products need a Hopper (sm_90) GPU" : "the checkpoint has no FP8 weights");
  p.off_checkpoint = true;
  return p;
}

ModelWeights CudaBackend::random_weights(const ModelArgs& a, uint64_t seed, const Shard& shard) {
  on_device();
  check_shardable(a, shard.size);
  ModelWeights w;
  std::vector<WeightSpec> specs = weight_manifest(a, &w);
  w.vocab0 = shard_vocab0(a, shard);
  const bool fp8 = a.dtype == "fp8";
  // One allocation in manifest order, as prepare_weights places a checkpoint: each expert's w3
  // then lies after its w1 in one block (the FP8 experts' tensor maps, moe_persist_tmaps, need that).
  struct Fill {
    TensorView* t;
    float amp;
    bool constant;
    size_t at;
  };
  std::vector<Fill> fills;
  size_t total = 0;
  auto make = [&](TensorView& t, DType dt, std::vector<int64_t> shape, float amp, bool constant) {
    t.dtype = dt;
    t.shape = std::move(shape);
    fills.push_back({&t, amp, constant, total});
    total += align256(size_t(t.numel()) * dtype_size(dt));
  };
  for (const WeightSpec& s : specs) {
    if (s.kind == WeightKind::kBias) continue;  // optional; the random shapes route without it
    std::vector<int64_t> shape;
    if (!shard_shape(s, a, shard, &shape)) continue;  // another rank's expert
    if (s.kind == WeightKind::kLinear) {
      const int64_t out = shape[0], in = shape[1];
      const float amp = std::sqrt(3.f / float(s.shape[1]));  // (the whole K: a row-parallel part sums with the others)
      if (fp8 && s.name != "head") {
        make(s.linear->weight, DType::F8_E4M3, shape, 1.f, false);
        make(s.linear->scale, DType::F32, {(out + 127) / 128, (in + 127) / 128}, amp, true);
      } else {
        make(s.linear->weight, DType::BF16, shape, amp, false);
      }
    } else if (s.kind == WeightKind::kNorm) {
      make(*s.tensor, DType::F32, shape, 1.f, true);
    } else if (s.kind == WeightKind::kEmbed) {
      make(*s.tensor, DType::BF16, shape, 1.f, false);
    } else {  // gate
      make(*s.tensor, DType::BF16, shape, std::sqrt(3.f / float(shape[1])), false);
    }
  }
  char* base = static_cast<char*>(device_bytes(total));
  uint64_t k = 0;
  for (const Fill& f : fills) {
    f.t->data = base + f.at;
    cuda::fill_random(L_, base + f.at, wtype_of(f.t->dtype), f.t->numel(), f.amp, seed * 1000003ull + ++k,
                      f.constant);
  }
  sync();
  return w;
}

// ---- steps

void CudaBackend::put_step(const Step& s) {
  const size_t table = size_t(s.kv.rows * s.kv.width), words = size_t(s.n) * 3 + table;
  if (words > step_cap_) {
    sync();
    drop_graphs();  // they read the old buffer
    if (step_dev_) CK(cudaFree(step_dev_));
    step_cap_ = std::max<size_t>(words, 4096);
    CK(cudaMalloc(&step_dev_, step_cap_ * 4));
  }
  CK(cudaEventSynchronize(staging_done_));  // the last step's copy has read the staging buffer
  if (words * 4 > staging_bytes_) {
    CK(cudaFreeHost(staging_));
    staging_bytes_ = words * 4;
    CK(cudaMallocHost(&staging_, staging_bytes_));
  }
  int32_t* st = static_cast<int32_t*>(staging_);
  std::memcpy(st, s.tokens, size_t(s.n) * 4);
  std::memcpy(st + s.n, s.pos, size_t(s.n) * 8);
  if (table) std::memcpy(st + 3 * s.n, s.kv.table, table * 4);
  CK(cudaMemcpyAsync(step_dev_, st, words * 4, cudaMemcpyHostToDevice, stream_));
  CK(cudaEventRecord(staging_done_, stream_));
}

template <class T>
const T* CudaBackend::upload_vec(Slot slot, const T* v, int64_t n) {
  no_capture("step metadata upload");
  void* d = scratch(slot, size_t(n) * sizeof(T));
  CK(cudaMemcpyAsync(d, v, size_t(n) * sizeof(T), cudaMemcpyHostToDevice, stream_));
  sync();
  return static_cast<const T*>(d);
}

// The step's metadata on the device: copied by run() for the step it runs, else (an op called on
// its own, in tests) uploaded for the call.
const int32_t* CudaBackend::step_tok(const Step& s) {
  return &s == step_ ? static_cast<const int32_t*>(step_dev_) : upload_vec(kTok, s.tokens, s.n);
}
const DevPos* CudaBackend::step_pos(const Step& s) {
  if (&s == step_) return reinterpret_cast<const DevPos*>(static_cast<const int32_t*>(step_dev_) + s.n);
  return reinterpret_cast<const DevPos*>(upload_vec(kPos, reinterpret_cast<const int32_t*>(s.pos), 2 * s.n));
}
const int32_t* CudaBackend::step_table(const Step& s) {
  if (&s == step_) return static_cast<const int32_t*>(step_dev_) + 3 * s.n;
  return upload_vec(kTable, s.kv.table, s.kv.rows * s.kv.width);
}

void CudaBackend::run(const StepGraph& g, const Step& s, const AfterNode& after) {
  on_device();
  if (capturing_) abort_capture();
  put_step(s);
  step_ = &s;
  struct Done {
    const Step*& p;
    ~Done() { p = nullptr; }
  } done{step_};
  // Steps of up to graph_max tokens are recorded the second time their graph runs (the first
  // grows the scratch buffers) and replayed after. Steps with long runs of one sequence (32+
  // tokens) carry host positions in their attention launches: never recorded.
  const bool record = opt_.graphs && !opt_.profile && !after && s.n <= opt_.tune.graph_max && absorbed_step(s);
  if (record) {
    Graph& gr = graphs_[GraphKey{g.id, s.kv.rows, std::vector<int64_t>(s.logit_rows, s.logit_rows + s.m)}];
    if (gr.exec) {
      CK(cudaGraphLaunch(gr.exec, stream_));
      return;
    }
    if (++gr.seen >= 2) {
      CK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      capturing_ = &gr;
    }
  }
  try {
    for (const Node& nd : g.nodes) {
      if (opt_.profile) mark(str(fusion_name(nd.fusion), " ", g.ops[size_t(nd.first)].name));
      if (nd.fusion == Fusion::kNone && !nd.defer_combine) run_op(g, s, g.ops[size_t(nd.first)]);
      else run_fused(g, s, nd);
      if (after) after(nd.first + nd.count - 1);
    }
  } catch (...) {
    if (capturing_) abort_capture();
    throw;
  }
  if (capturing_) {
    Graph* gr = capturing_;
    capturing_ = nullptr;
    cudaGraph_t graph = nullptr;
    CK(cudaStreamEndCapture(stream_, &graph));
    const cudaError_t e = cudaGraphInstantiate(&gr->exec, graph, 0);
    cudaGraphDestroy(graph);
    CK(e);
    CK(cudaGraphLaunch(gr->exec, stream_));
  }
  flush_marks();
}

// The fusions this backend runs (runtime/rewrites.h), and where.
bool CudaBackend::fuses(const StepGraph& g, Fusion f, int first, int count) const {
  const Op* o = &g.ops[size_t(first)];
  switch (f) {
    case Fusion::kAddRmsNorm:  // add_rmsnorm: whole rows
    case Fusion::kCombineAddRmsNorm:  // moe_combine_add_rmsnorm: every MoE's output
      return true;
    case Fusion::kLinearPair:
      return pair_ok(dev_linear(*o[0].linear), dev_linear(*o[1].linear), g.val(o[0].in).data, g.val(o[0].in).rows);
    case Fusion::kAddRmsNormMoe: {
      const Value& h = g.val(o[0].out);
      return h.rows == 1 && cuda::gate_norm_ok(h.cols) && fused_gate(dev_linear(Linear{o[2].moe->gate, {}}), 1);
    }
    case Fusion::kCombineAddRmsNormPair: {
      // One token; the pair on the FMA GEMVs (gemv2), whose blocks do the combine + add + norm.
      const Op& moe = o[-1];
      const Value& x = g.val(o[1].out);
      const DevLinear w1 = dev_linear(*o[2].linear), w2 = dev_linear(*o[3].linear);
      if (x.rows != 1 || !pair_ok(w1, w2, x.data, 1) || tc_pair_ok(w1, w2, 1)) return false;
      cuda::CombineNorm cn;
      cn.s.n = 1, cn.s.K = g.args->n_activated_experts, cn.s.S = shared_slices(*g.args, *moe.moe);
      cn.o = reinterpret_cast<const float*>(uintptr_t(256));  // (the kMoeO scratch: cudaMalloc, 256-byte aligned)
      cn.d = x.cols, cn.y = g.val(moe.out).data, cn.h = g.val(o[0].out).data, cn.x = x.data;
      cn.w = o[1].weight->as<float>(), cn.eps = o[1].eps;
      return cuda::gemv2_combine_ok(L_, w1, w2, cn);
    }
    case Fusion::kNone: return false;
  }
  return false;
}

void CudaBackend::run_fused(const StepGraph& g, const Step& s, const Node& nd) {
  const Op* o = &g.ops[size_t(nd.first)];
  switch (nd.fusion) {
    case Fusion::kNone: {  // a MoE whose combine the next node does
      DSV3_CHECK(o->kind == OpKind::kMoe && nd.defer_combine, "a deferred combine without a MoE");
      const Value &x = g.val(o->in), &y = g.val(o->out);
      moe_op(*g.args, *o->moe, x.data, x.rows, y.data, nullptr, true);
      return;
    }
    case Fusion::kAddRmsNorm: {
      const Value &h = g.val(o[0].out), &r = g.val(o[0].in), &x = g.val(o[1].out);
      cuda::add_rmsnorm(L_, h.data, r.data, h.rows, h.cols, o[1].weight->as<float>(), o[1].eps, x.data);
      return;
    }
    case Fusion::kLinearPair: linear_pair(o[0], o[1], g); return;
    case Fusion::kAddRmsNormMoe: {
      const Value &h = g.val(o[0].out), &r = g.val(o[0].in), &x = g.val(o[1].out), &y = g.val(o[2].out);
      cuda::GateNorm gn;
      gn.h = h.data, gn.r = r.data, gn.w = o[1].weight->as<float>(), gn.eps = o[1].eps, gn.x = x.data, gn.d = h.cols;
      moe_op(*g.args, *o[2].moe, x.data, x.rows, y.data, &gn, nd.defer_combine);
      return;
    }
    case Fusion::kCombineAddRmsNorm: {
      const cuda::CombineNorm cn = combine_view(g, o[-1], o[0], o[1]);
      cuda::moe_combine_add_rmsnorm(L_, cn);
      return;
    }
    case Fusion::kCombineAddRmsNormPair: {
      const cuda::CombineNorm cn = combine_view(g, o[-1], o[0], o[1]);
      cuda::gemv2_combine(L_, dev_linear(*o[2].linear), g.val(o[2].out).data, dev_linear(*o[3].linear),
                          g.val(o[3].out).data, cn);
      return;
    }
  }
}

void CudaBackend::gather_rows(const float* x, int64_t d, const int64_t* rows, int64_t m, float* y) {
  // Device-to-device copies (recordable, no host round trip), one per run of consecutive rows: a
  // decode step's rows are a single run (not a copy per row: 256 at 256 tokens).
  for (int64_t r = 0; r < m;) {
    int64_t e = r + 1;
    while (e < m && rows[e] == rows[e - 1] + 1) ++e;
    CK(cudaMemcpyAsync(y + r * d, x + rows[r] * d, size_t((e - r) * d) * 4, cudaMemcpyDeviceToDevice, stream_));
    r = e;
  }
}

void CudaBackend::embed(const Step& s, const TensorView& table, int64_t row0, float* y) {
  cuda::EmbedTable t;
  t.data = table.data, t.type = wtype_of(table.dtype), t.row0 = row0, t.rows = table.dim(0), t.d = table.dim(1);
  cuda::embed(L_, step_tok(s), s.n, t, y);
}

void CudaBackend::rmsnorm(const float* x, int64_t n, int64_t d, int64_t stride, const TensorView& w, float eps,
                          float* y) {
  DSV3_CHECK(w.dtype == DType::F32, "norm weight not on the device");
  cuda::rmsnorm(L_, x, n, d, stride, w.as<float>(), eps, y);
}

void CudaBackend::add(float* y, const float* x, int64_t n) { cuda::add(L_, y, x, n); }

// ---- collectives

// A stand-in world (Comm::stand_in: one rank's share measured alone) moves nothing: all_reduce
// keeps this rank's part, all_gather copies it into every rank's columns, both on the stream.
bool CudaBackend::stand_in_gather(Comm& comm, const float* x, int64_t rows, int64_t d, float* y) {
  if (!comm.stand_in()) return false;
  const int64_t P = comm.size();
  for (int64_t p = 0; p < P; ++p)
    if (y + p * d != x)
      CK(cudaMemcpy2DAsync(y + p * d, size_t(P * d) * 4, x, size_t(d) * 4, size_t(d) * 4, size_t(rows),
                           cudaMemcpyDeviceToDevice, stream_));
  return true;
}

#ifdef DSV3_HAVE_NCCL
void CudaBackend::all_reduce(Comm& comm, float* x, int64_t n) {
  if (comm.stand_in()) return;
  if (!nccl_) nccl_ = std::make_unique<cuda::NcclComms>(comm_timeout_s());
  if (!nccl_->has(comm)) no_capture("NCCL communicator set-up");  // (a step's first run is never recorded)
  nccl_->all_reduce(comm, x, n, stream_);
}

// NCCL gathers [parts, rows * d]; the op's y is [rows, parts * d]: one token's rows land in place,
// more go through scratch and a strided copy per rank.
void CudaBackend::all_gather(Comm& comm, const float* x, int64_t rows, int64_t d, float* y) {
  if (stand_in_gather(comm, x, rows, d, y)) return;
  if (!nccl_) nccl_ = std::make_unique<cuda::NcclComms>(comm_timeout_s());
  if (!nccl_->has(comm)) no_capture("NCCL communicator set-up");
  const int64_t P = comm.size();
  if (rows == 1 || P == 1) return nccl_->all_gather(comm, x, rows * d, y, stream_);
  float* g = f32(kComm, size_t(P * rows * d));  // [P, rows, d]
  nccl_->all_gather(comm, x, rows * d, g, stream_);
  cuda::parts_to_columns(g, P, rows, d, y, stream_);
}

void CudaBackend::gather_layout(const float* parts, int64_t P, int64_t rows, int64_t d, float* y) {
  cuda::parts_to_columns(parts, P, rows, d, y, stream_);
  sync();
}

void CudaBackend::wait_collectives() const {
  if (nccl_ && !nccl_->empty()) nccl_->wait(stream_, "a step's collectives");
}
#else
void CudaBackend::all_reduce(Comm& comm, float* x, int64_t n) {
  if (!comm.stand_in()) Backend::all_reduce(comm, x, n);
}

void CudaBackend::all_gather(Comm& comm, const float* x, int64_t rows, int64_t d, float* y) {
  if (!stand_in_gather(comm, x, rows, d, y)) Backend::all_gather(comm, x, rows, d, y);
}

void CudaBackend::wait_collectives() const {}

void CudaBackend::gather_layout(const float*, int64_t, int64_t, int64_t, float*) {
  fail("CUDA backend: built without NCCL");
}

#endif

void CudaBackend::sync() const {
  wait_collectives();
  CK(cudaStreamSynchronize(stream_));
}

int64_t CudaBackend::graphs_recorded() const {
  int64_t n = 0;
  for (auto& [k, g] : graphs_) n += g.exec != nullptr;
  return n;
}

// ---- scratch, recording, profiling

void CudaBackend::no_capture(const char* what) const {
  if (capturing_) fail("CUDA backend: ", what, " while recording a step");
}

void CudaBackend::abort_capture() {
  cudaGraph_t g = nullptr;
  cudaStreamEndCapture(stream_, &g);
  if (g) cudaGraphDestroy(g);
  capturing_->seen = -1000;  // never record this shape again
  capturing_ = nullptr;
  cudaGetLastError();
}

void CudaBackend::drop_graphs() {
  for (auto& [k, g] : graphs_)
    if (g.exec) cudaGraphExecDestroy(g.exec);
  graphs_.clear();
}

void* CudaBackend::device_bytes(size_t bytes) {
  no_capture("weight allocation");
  void* p = device_malloc(bytes, "the model's weights",
                          "this backend runs on one GPU: the checkpoint must fit it (or use --backend cpu)");
  owned_.push_back(p);
  return p;
}

// A scratch buffer of at least `bytes`; grows (and forgets recorded steps) when needed.
void* CudaBackend::scratch(Slot s, size_t bytes) {
  Buf& b = scratch_[s];
  if (b.bytes >= bytes) return b.p;
  no_capture("scratch growth");
  sync();
  drop_graphs();
  if (b.p) CK(cudaFree(b.p));
  b.bytes = align256(bytes + bytes / 4);
  CK(cudaMalloc(&b.p, b.bytes));
  return b.p;
}

// Profiling: an event at each node boundary; the time to the next one goes to the node.
void CudaBackend::mark(const std::string& name) {
  if (!opt_.profile) return;
  cudaEvent_t e = nullptr;
  if (!free_events_.empty()) e = free_events_.back(), free_events_.pop_back();
  else CK(cudaEventCreate(&e));
  CK(cudaEventRecord(e, stream_));
  marks_.push_back({name, e});
}

void CudaBackend::flush_marks() {
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

std::string CudaBackend::profile_report(bool reset) {
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

CudaBackend& as_cuda(Backend& b) {
  auto* c = dynamic_cast<CudaBackend*>(&b);
  if (!c) fail("expected the CUDA backend, got '", b.name(), "'");
  return *c;
}

}  // namespace cuda_impl

using cuda_impl::as_cuda;

std::unique_ptr<Backend> make_cuda_backend(const CudaOptions& opt) {
  return std::make_unique<cuda_impl::CudaBackend>(opt);
}
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

ModelWeights random_weights(Backend& b, const ModelArgs& a, uint64_t seed, const Shard& shard) {
  return as_cuda(b).random_weights(a, seed, shard);
}

std::string profile_report(Backend& b, bool reset) { return as_cuda(b).profile_report(reset); }

bool nccl_built() {
#ifdef DSV3_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

void gather_layout_for_test(Backend& b, const float* parts, int64_t P, int64_t rows, int64_t d, float* y) {
  as_cuda(b).gather_layout(parts, P, rows, d, y);
}

int64_t graphs_recorded(Backend& b) { return as_cuda(b).graphs_recorded(); }

void route_for_test(Backend& b, const ModelArgs& a, const float* logits, const float* bias, int64_t n, int32_t* idx,
                    float* w) {
  as_cuda(b).route(a, logits, bias, n, idx, w);
}

int64_t persistent_moe_stages(Backend& b) { return as_cuda(b).persist_stages(); }

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
