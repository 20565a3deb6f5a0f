// The CUDA backend's options and the entry points beyond the Backend interface: device
// detection, random weights made directly in device memory (benchmarks), and test hooks.
#pragma once
#include <memory>
#include <string>

#include "backend/backend.h"

namespace dsv3 {

struct CudaOptions {
  // What a user sets (environment variables; README):
  bool graphs = true;    // record decode steps as CUDA graphs and replay them (DSV3_CUDA_GRAPH=0: launch every kernel)
  bool pdl = true;       // programmatic dependent launch between kernels (DSV3_CUDA_PDL=0: off)
  bool fast = false;     // bf16 activations (one pass) in the prefill MLP/expert tensor-core GEMMs, bf16 in the
                         // prefill attention and a bf16 latent cache (DSV3_CUDA_FAST=1); default: float32-grade results
  bool fp8_gemm = false; // FP8 weights' products in steps of fast_min+ tokens on e4m3 activations quantised per 128
                         // columns (the reference's gemm_impl="fp8": act_quant + fp8_gemm) (DSV3_CUDA_FP8_GEMM=1)
  bool progress = false; // a progress line while the weights go to the GPU (DSV3_CUDA_PROGRESS; default: when
                         // stderr is a terminal)
  // Which kernels take a product, for tests that reach every kernel on small shapes and for
  // benchmarks (no environment variable; the defaults are what runs):
  struct Tuning {
    int gemv_max = 8;      // the GEMV kernels up to this many tokens, tensor cores above
    int tc_min = 9;        // from this many tokens: the pipelined tensor-core GEMM for bf16 (and e4m3) weights and,
                           // for long runs of one sequence, the prefill attention over decompressed K/V
    int graph_max = 256;   // steps of up to this many tokens are recorded
    int attn_many_min = 17;  // decode attention of at least this many tokens on the many-token kernel (mla_decode_many)
    int fast_min = 64;     // fast mode and FP8 GEMM mode only for steps of at least this many tokens
    int tcv_max = 8;       // GEMVs of up to this many tokens on tensor cores where the weights fit (kernels_tcgemv.cu)
    int tcv_bf16_min = 2;  // ... for bf16 weights from this many tokens (one token streams bf16 faster on the FMA GEMV)
    int long_k = 2;        // 2 to 8 tokens of a product whose rows the tensor-core GEMV cannot stage (tcv_holds): 0 on the
                           // FMA GEMV, 1 on the pipelined GEMM, 2 on the tensor-core GEMV in K chunks (tcv_chunk; the MoE
                           // stages: as 1)
    int tc_tm = 0;         // rows per tile of the pipelined kernel: 64, 128, or 0: 128 for e4m3 weights, 64 for bf16
    int moe_tiles = 12;    // MoE steps of tc_min tokens or more over e4m3 experts whose routed pairs average at most
                           // this many per expert: the tensor-core GEMV over tiles of 8 pairs, not the grouped GEMM (0: never)
    int moe_tiles_fp8gemm = 5;  // ... at most this many in FP8 GEMM mode, whose grouped GEMM reads e4m3 tiles unwidened
    int tc_swap = 1;       // MoE prefill stages with weight rows as the wgmma's M: 0 never, 1 for e4m3 weights and in
                           // fast mode, 2 always
    bool moe_persist = true;  // swapped MoE stages (FP8 GEMM mode's, fast mode's bf16) on the persistent kernel (off: tc_gemm's form, its twin)
    bool moe_quant_fused = true;  // ... FP8 GEMM mode's stage 0 quantising its output for stage 1 in its epilogue
                                  // (off: float32 out, then act_quant)
    int moe_persist_bf16_min = 256;  // ... for bf16 experts only when the routed pairs average at least this many per
                                     // expert (fewer: tc_gemm's form streams them faster; 0: always)
    int mla_group_rows = 16384;  // prefill runs of one step whose prefixes add up to at most this many rows share
                                 // one wkv_b product (a run longer than this: alone)
    bool wgmma = true;     // the pipelined kernel's sm_90a wgmma form (off: mma.sync, as on other GPUs)
    bool route_in_experts = true;  // one token: its expert GEMVs' blocks route it (off: the gate kernel does)
    bool gate_fma = true;  // the gate of many tokens whose experts take x in pair order in float32 FMAs (gate_logits;
                           // off: x split for the gate's tensor-core product)
  } tune;
  bool profile = false;  // benchmarks: time every node with events, graphs off (profile_report)
  size_t upload_chunk = size_t(64) << 20;  // bytes per pinned staging buffer of the weight upload (two)
  // The user options from the environment.
  static CudaOptions from_env();
  // Throws Error naming the option when a value is out of range.
  void validate() const;
};

std::unique_ptr<Backend> make_cuda_backend(const CudaOptions& opt);

namespace cuda {

// Whether a CUDA device can be used; `why` gets the reason when not.
bool device_available(std::string* why = nullptr);

// Weights for `a` created directly in `cuda_backend`'s device memory (owned by it): linears in
// a.dtype ("bf16" or "fp8" e4m3 with 128x128 scales; the head stays bf16), embedding and gate
// bf16, norms 1. Pseudo-random (seeded), scaled so activations stay O(1). For benchmarks.
// shard: one rank's slices of a model spread over shard.size ranks (its routed experts only).
ModelWeights random_weights(Backend& cuda_backend, const ModelArgs& a, uint64_t seed, const Shard& shard = {});

// The device router on logits [n, E] already in device memory: expert indices and weights
// [n, K] to the host, in the order of model/gate.cc's route_token. For tests.
void route_for_test(Backend& cuda_backend, const ModelArgs& a, const float* logits, const float* bias, int64_t n,
                    int32_t* indices, float* weights);

// MoE stages `cuda_backend` has run on the persistent kernel (moe_persist_gemm) so far. For tests.
int64_t persistent_moe_stages(Backend& cuda_backend);

// With CudaOptions::profile: milliseconds per step spent in each op / kernel group since the last
// reset, one line each, largest first.
std::string profile_report(Backend& cuda_backend, bool reset = true);

// act_quant (kernels.h) on x [rows, cols] already in `cuda_backend`'s memory; e4m3 bytes and
// scales to the host. For tests.
void act_quant_for_test(Backend& cuda_backend, const float* x, int64_t rows, int64_t cols, bool ue8m0, uint8_t* y,
                        float* s);

// Whether this build runs collectives through NCCL (DSV3_HAVE_NCCL); without it a CUDA backend
// has no multi-rank path.
bool nccl_built();
// Backend::all_gather's reordering alone: y [rows, P * d] = parts [P, rows, d] (device memory of
// `cuda_backend`; NCCL builds). For tests.
void gather_layout_for_test(Backend& cuda_backend, const float* parts, int64_t P, int64_t rows, int64_t d, float* y);
// How many recorded steps (CUDA graphs) `cuda_backend` holds. For tests.
int64_t graphs_recorded(Backend& cuda_backend);

// Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written.
double copy_bandwidth_gbps(size_t bytes, int reps);

}  // namespace cuda
}  // namespace dsv3
