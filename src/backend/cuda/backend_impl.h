// The CUDA backend's class, shared by the files that implement it by concern:
//   cuda_backend.cc  memory, weights, running a step graph (CUDA graphs, the step's metadata), fusions
//   cuda_linear.cc   which kernel takes a linear, a pair of linears, a dense MLP
//   cuda_moe.cc      the gate, the router, the experts and the combine
//   cuda_mla.cc      attention: the decode path and the long-run (prefill) path
//   cuda_sample.cc   argmax and sampling where the logits are; test hooks
// A node of a step graph is a few kernel launches on one stream; nothing is kept from one node
// for the next (a deferred MoE combine is an edge of the graph: the next node rebuilds the
// schedule's view of the same scratch).
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/kernels.h"
#ifdef DSV3_HAVE_NCCL
#include "backend/cuda/nccl.h"
#endif

namespace dsv3::cuda_impl {

using cuda::DevLinear;
using cuda::DevPos;

// Checked calls with the call's text.
void cublas_check(cublasStatus_t s, const char* what, const char* file, int line);
#define CK(call) DSV3_CUDA_CHECK(call)
#define CB(call) ::dsv3::cuda_impl::cublas_check((call), #call, __FILE__, __LINE__)

DevLinear dev_linear(const Linear& l);
// Rows [r0, r0 + rows) and columns [c0, c0 + cols) of a weight.
DevLinear slice(DevLinear d, int64_t r0, int64_t rows, int64_t c0, int64_t cols);
int32_t wtype_of(DType t);
size_t align256(size_t n);

// A MoE layer's experts as the kernels see them (the routed ones, then slices of the shared
// experts), built on first use.
struct MoeTable {
  cuda::DevExpert* dev = nullptr;  // [E + S]
  void* tmaps = nullptr;           // e4m3 or bf16 experts: their TMA tensor maps (cuda::moe_persist_tmaps), or null
  int S = 0;                  // shared-expert slices
  int64_t rows13 = 0;         // largest w1.rows
  int64_t rows2 = 0;          // w2.rows (dim)
  int32_t wtype = cuda::kBF16;
  bool gemm = false;          // every expert fits the tensor-core kernel
  bool tc = false;            // every expert fits the pipelined kernel (tc_takes)
  bool k64 = false;           // ... with every K a multiple of 64 (its wgmma form)
  bool tcv = false;           // every expert fits the tensor-core GEMV (cuda::tcv_ok)
  // The routed experts this rank holds, [local0, local1) (the others' weights are empty: expert
  // parallelism); partial: not all of them (their rows of the expert output are zeroed, not run).
  int local0 = 0, local1 = 0;
  bool partial = false;
};
// The shared-expert slices a MoE layer is cut into (balancing the work with the routed experts).
int shared_slices(const ModelArgs& a, const MoEWeights& w);

// Scratch buffers, one per use.
enum Slot {
  kTok, kPos, kTable, kH, kS, kPart, kMl, kLat, kKvb, kLogits, kSched, kMoeH, kMoeO, kHi, kLo, kHi2, kLo2, kSplitK,
  kCublasWs, kTopk, kGather, kComm, kChunks, kQ, kQs, kQ2, kQs2,
  kNumSlots
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const CudaOptions& opt);
  ~CudaBackend() override;
  std::string name() const override { return "cuda"; }

  // ---- memory and weights (cuda_backend.cc)
  float* alloc(size_t n) override;
  void release(float* p) override;
  void upload(float* dst, const float* host, size_t n) override;
  void download(float* host, const float* src, size_t n) override;
  WeightPlacement prepare_weights(const ModelArgs& args, ModelWeights& w, const WeightMemory& m = {}) override;
  int64_t device_free_bytes() const override;
  bool bf16_latent_cache() const override { return opt_.fast; }  // fast mode: the reference's bf16 cache rows
  ModelWeights random_weights(const ModelArgs& a, uint64_t seed, const Shard& shard);
  int64_t routed_experts_run() const override;
  void reset_counters() override;
  std::string profile_report(bool reset);

  // ---- steps (cuda_backend.cc)
  void run(const StepGraph& g, const Step& s, const AfterNode& after) override;
  bool fuses(const StepGraph& g, Fusion f, int first, int count) const override;
  void run_fused(const StepGraph& g, const Step& s, const Node& nd) override;
  void gather_rows(const float* x, int64_t d, const int64_t* rows, int64_t m, float* y) override;
  void embed(const Step& s, const TensorView& table, int64_t row0, float* y) override;
  void rmsnorm(const float* x, int64_t n, int64_t d, int64_t stride, const TensorView& w, float eps,
               float* y) override;
  void add(float* y, const float* x, int64_t n) override;
  // Collectives through NCCL on the backend's stream (recordable in a step's CUDA graph); a
  // stand-in world's (Comm::stand_in) as device copies that keep this rank's part.
  void all_reduce(Comm& comm, float* x, int64_t n) override;
  void all_gather(Comm& comm, const float* x, int64_t rows, int64_t d, float* y) override;
  bool stand_in_gather(Comm& comm, const float* x, int64_t rows, int64_t d, float* y);
  void gather_layout(const float* parts, int64_t P, int64_t rows, int64_t d, float* y);  // (test hook)
  int64_t graphs_recorded() const;

  // ---- linears (cuda_linear.cc)
  void linear(const float* x, int64_t n, const Linear& w, float* y) override;
  void mlp(const MLPWeights& w, const float* x, int64_t n, float* y) override;

  // ---- MoE (cuda_moe.cc)
  void moe(const ModelArgs& a, const MoEWeights& w, const float* x, int64_t n, float* y) override {
    moe_op(a, w, x, n, y, nullptr, false);
  }
  void route(const ModelArgs& a, const float* logits, const float* bias, int64_t n, int32_t* idx, float* wts);
  int64_t persist_stages() const { return persist_stages_; }

  // ---- attention (cuda_mla.cc)
  void mla(const MlaCall& c) override;

  // ---- sampling (cuda_sample.cc)
  bool argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t limit, int32_t* ids) override;
  bool sample_rows(const float* x, int64_t rows, int64_t cols, int64_t limit, const SampleSpec* spec, int32_t* ids,
                   float* host_logits) override;
  void act_quant(const float* x, int64_t rows, int64_t cols, bool ue8m0, uint8_t* y, float* s);

 private:
  // ---- linears (cuda_linear.cc)
  // Float32-grade, or with fp8 on e4m3 activations where FP8 GEMM mode takes it (fp8_for).
  void run_linear(const DevLinear& w, const float* x, int64_t n, float* y, int64_t ldy, bool fp8);
  void tc_linear(cuda::TcJob j, const DevLinear& w, int64_t n, float* y, int64_t ldy);
  // Two linears of the same x [n, in] in one launch: the pipelined kernel's pair or gemv2.
  bool pair_ok(const DevLinear& w1, const DevLinear& w2, const float* x, int64_t n) const;
  void linear_pair(const Op& a, const Op& b, const StepGraph& g);
  bool use_tc(int64_t n) const { return n >= opt_.tune.tc_min; }
  // Fewer tokens than tc_min (2 or more) that would go to the tensor-core GEMV (n <= tcv_max) but
  // whose K it cannot stage: tune.long_k's path for them (0: none, the FMA GEMV).
  int long_k(int64_t n, int32_t wtype, int64_t K) const {
    const bool is = n >= 2 && n < opt_.tune.tc_min && n <= opt_.tune.tcv_max && !cuda::tcv_holds(wtype, K, n);
    return is ? opt_.tune.long_k : 0;
  }
  // The pipelined GEMM for n tokens of w: use_tc, or long_k's path 1.
  bool tc_for(int64_t n, const DevLinear& w) const { return tc_takes(w) && (use_tc(n) || long_k(n, w.t, w.cols) == 1); }
  // long_k's path 2: y [n, rows] = x · Wᵀ (w3: silu(x · Wᵀ) * (x · W3ᵀ)), x [n, w.cols], on the
  // tensor-core GEMV in K chunks (cuda::tcv_chunk); false (nothing launched) where it does not apply.
  bool tcv_chunked(const DevLinear& w, const DevLinear* w3, const float* x, int64_t n, float* y, int64_t ldy);
  bool tc_pair_ok(const DevLinear& w, const DevLinear& w2, int64_t n) const;
  int tile_m(int32_t wtype) const;
  void set_form(cuda::TcJob& j, bool k64, int32_t wtype) const;
  bool tc_takes(const DevLinear& w) const;
  bool fast_at(int64_t n) const { return opt_.fast && n >= opt_.tune.fast_min; }
  bool fp8_at(int64_t n) const { return opt_.fp8_gemm && wgmma_ && n >= opt_.tune.fast_min; }
  cuda::TcJob split_input(const float* x, int64_t n, int64_t cols, bool fast, const int32_t* rows = nullptr);
  // FP8 GEMM mode (CudaOptions::fp8_gemm): n tokens of w on e4m3 activations — FP8 weights on the
  // pipelined kernel's wgmma form, K a multiple of 128, steps of fast_min tokens or more.
  bool fp8_for(int64_t n, const DevLinear& w) const {
    return fp8_at(n) && w.t == cuda::kFP8 && w.cols % 128 == 0 && tc_for(n, w);
  }
  // A job whose A operand is act_quant(x [n, cols]) (slot: kQ, or kQ2 for a second stage's input);
  // with rows, output row r quantises row rows[r] of x (act_quant_rows).
  cuda::TcJob quant_input(const float* x, int64_t n, int64_t cols, bool second = false, const int32_t* rows = nullptr);

  // ---- MoE (cuda_moe.cc)
  // The MoE of x [n, dim] into y: gate, router, experts, then the combine unless `defer` (the
  // next node combines: combine_view). `norm`: the residual add + norm that makes x, done by the
  // gate kernel (one token).
  void moe_op(const ModelArgs& a, const MoEWeights& w, const float* x, int64_t n, float* y, const cuda::GateNorm* norm,
              bool defer);
  // Whether the gate kernel takes n tokens of this gate (and with them the add + norm before it).
  bool fused_gate(const DevLinear& gate, int64_t n) const;
  // The deferred combine of the MoE op `moe` (its schedule and expert outputs in scratch).
  cuda::CombineNorm combine_view(const StepGraph& g, const Op& moe, const Op& add, const Op& norm);
  const MoeTable& moe_table(const ModelArgs& a, const MoEWeights& w);
  cuda::MoeSched sched(int64_t n, int E, int K, int S);
  bool moe_swap(const MoeTable& T, int64_t n) const;
  bool fp8_moe(const MoeTable& T, int64_t n, int64_t dim) const;
  bool absorbed_step(const Step& s) const;

  // ---- attention (cuda_mla.cc)
  cuda::MlaDims mla_dims(const MlaCall& c, const DevPos** pos);
  void mla_absorbed(const MlaCall& c, const cuda::MlaDims& d, const cuda::MlaPrep& prep, const DevLinear& wkv_b);
  void mla_runs(const cuda::MlaDims& d, const std::vector<std::pair<int64_t, int64_t>>& runs, const MlaCall& c,
                const DevLinear& wkv_b);
  void check_logit_row(const float* x, int64_t r, int64_t cols, int64_t limit, int32_t bad, bool none);

  // ---- steps, scratch, profiling (cuda_backend.cc)
  struct GraphKey {
    uint64_t graph;
    int64_t table_rows;
    std::vector<int64_t> rows;
    bool operator<(const GraphKey& o) const {
      if (graph != o.graph) return graph < o.graph;
      if (table_rows != o.table_rows) return table_rows < o.table_rows;
      return rows < o.rows;
    }
  };
  struct Graph {
    int seen = 0;
    cudaGraphExec_t exec = nullptr;
  };
  struct Buf {
    void* p = nullptr;
    size_t bytes = 0;
  };
  // The step's metadata on the device: [tokens n][pos 2n][block tables rows x width].
  void put_step(const Step& s);
  const int32_t* step_tok(const Step& s);
  const DevPos* step_pos(const Step& s);
  const int32_t* step_table(const Step& s);
  void run_node(const StepGraph& g, const Step& s, const Node& nd);
  void no_capture(const char* what) const;
  // Waits for the stream to drain; with NCCL communicators, a bounded wait (NcclComms::wait).
  void sync() const;
  // With NCCL communicators, the bounded wait; else nothing. Before a copy to pageable host
  // memory, which blocks (unbounded) until the stream reaches it.
  void wait_collectives() const;
  // Makes this backend's GPU current in the calling thread (steps may run on another thread).
  void on_device() const {
    if (device_ != 0) CK(cudaSetDevice(device_));
  }
  void abort_capture();
  void drop_graphs();
  void* device_bytes(size_t bytes);
  void* scratch(Slot s, size_t bytes);
  float* f32(Slot s, size_t n) { return static_cast<float*>(scratch(s, n * 4)); }
  template <class T>
  const T* upload_vec(Slot s, const T* v, int64_t n);
  void mark(const std::string& name);
  void flush_marks();

  CudaOptions opt_;
  int device_ = 0;  // local_rank() % devices under mpirun, else the current device (0)
  cudaStream_t stream_ = nullptr;
  cuda::Launch L_;
  cublasHandle_t cublas_ = nullptr;
  bool wgmma_ = false;  // the pipelined kernel's wgmma form may run (an sm_90 device)
  bool tmaps_warned_ = false;  // the warning that the experts lack tensor maps was printed
  int64_t persist_stages_ = 0;  // MoE stages run on the persistent kernel (persistent_moe_stages)
  bool ue8m0_ = false;  // the model's activation scales are powers of two (scale_fmt "ue8m0": act_quant)
  std::vector<void*> owned_;
  Buf scratch_[kNumSlots];
  std::map<const void*, MoeTable> moe_;
  void* staging_ = nullptr;  // pinned: the step's metadata on its way to step_dev_
  size_t staging_bytes_ = 0;
  // Zeroed device words that kernels leave zeroed: the first for the fused gate + router, the
  // next kAttnCounters (attn_counters_) for the one-launch decode attention.
  static constexpr int64_t kAttnCounters = 4096;
  unsigned* counter_ = nullptr;
  unsigned* attn_counters_ = nullptr;
  unsigned long long* experts_run_ = nullptr;  // in counter_'s allocation, after the attention counters
  cudaEvent_t staging_done_ = nullptr;
  void* step_dev_ = nullptr;
  size_t step_cap_ = 0;
  const Step* step_ = nullptr;  // the step being run (its metadata is in step_dev_)
  std::map<GraphKey, Graph> graphs_;
  Graph* capturing_ = nullptr;
  std::vector<std::pair<std::string, cudaEvent_t>> marks_;
  std::vector<cudaEvent_t> free_events_;
  std::map<std::string, double> prof_;
  int64_t prof_steps_ = 0;
#ifdef DSV3_HAVE_NCCL
  std::unique_ptr<cuda::NcclComms> nccl_;  // made on the first collective
#endif
};

}  // namespace dsv3::cuda_impl
