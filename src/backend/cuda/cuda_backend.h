// The CUDA backend's options and the entry points beyond the Backend interface: device
// detection, random weights made directly in device memory (benchmarks), and test hooks.
#pragma once
#include <memory>
#include <string>

#include "backend/backend.h"

namespace dsv3 {

struct CudaOptions {
  bool graphs = true;   // record decode steps as CUDA graphs and replay them (DSV3_CUDA_GRAPH=0: off)
  bool pdl = true;      // programmatic dependent launch between kernels (DSV3_CUDA_PDL=0: off)
  bool fast = false;    // bf16 activations (one pass) in the MLP/expert tensor-core GEMMs, bf16 in the
                        // long-run attention GEMMs (DSV3_CUDA_FAST=1); default: bf16 hi + lo parts
                        // and float32 attention, float32-grade results
  bool wgmma = true;    // the pipelined kernel's sm_90a wgmma form where K % 64 == 0 (DSV3_CUDA_WGMMA=0: mma.sync)
  bool wg_async = false; // its wgmma form keeps one MMA group in flight (DSV3_CUDA_WG_ASYNC=1)
  bool flash = true;    // the long-run (prefill) attention as one kernel (kernels_attn.cu) where its head dims
                        // allow; off: cuBLAS scores, a softmax kernel and cuBLAS values (DSV3_CUDA_FLASH=0)
  bool decode_attn = true; // absorbed attention of up to 16 tokens (decode) as one launch; off: scores, values
                           // (and a split reduction) as separate kernels (DSV3_CUDA_DECODE_ATTN=0)
  bool decode_attn_warps = true; // ... with each warp folding its cache rows into a running softmax as they
                                 // arrive (one load round per 16 positions; DSV3_CUDA_DECODE_ATTN_WARPS=0:
                                 // score, softmax and value passes)
  int decode_heads = 0;   // heads per block of that attention: 1 or 2 (DSV3_CUDA_DECODE_HEADS; 0: one for a
                          // single token, else two)
  int decode_splits = 0;  // at most this many position splits per token there (DSV3_CUDA_DECODE_SPLITS; 0: by
                          // the cache length, up to 256 blocks for one token, 512 for more)
  bool pair_gemv = true; // two products of the same activations (wq and wkv_a) in one launch: the GEMVs at decode,
                         // the pipelined kernel at prefill (DSV3_CUDA_PAIR_GEMV=0: one launch each)
  bool qabs_vec = true;  // the decode q absorption with 16-byte weight loads (DSV3_CUDA_QABS_VEC=0: element-wise)
  int tc_gemv_max = 8;  // GEMVs (linears, MoE experts) of up to this many tokens on tensor cores where the
                        // weights fit (kernels_tcgemv.cu; DSV3_CUDA_TC_GEMV_MAX, 0: the FMA kernels only)
  int tc_gemv_bf16_min = 2; // ... for bf16 weights from this many tokens (DSV3_CUDA_TC_GEMV_BF16_MIN; 0: never).
                             // One token stays on the FMA GEMV: on the H200 it streams bf16 faster (the head:
                             // 4.2 against 3.2 TB/s); at 8 tokens the tensor cores win (b8 986 -> 1067 tok/s)
  int fp8_fma_one = 1;  // one token's e4m3 products on the FMA GEMVs instead of the tensor-core GEMV: 0 none,
                        // 1 the linears (the experts stay; H200 FP8 b1 600 against 586 tok/s with 0, 551 with
                        // 2), 2 all (DSV3_CUDA_FP8_FMA_ONE)
  int attn_chunk = 512; // queries per chunk of the cuBLAS long-run attention (DSV3_CUDA_ATTN_CHUNK)
  int tc_tm = 0;        // rows per tile of the pipelined kernel: 64, 128 (two warpgroups in the wgmma form), or 0:
                        // 128 for e4m3 weights, 64 for bf16 (DSV3_CUDA_TC_TM). H200 prefill 1024 (tok/s): FP8
                        // 20.0k -> 23.9k float32-grade, 30.7k -> 31.9k fast; bf16 31.6k / 45.7k at 64 against
                        // 27.4k / 44.0k at 128
  int tc_swap = 1;      // the MoE expert stages at prefill with the weight rows as the wgmma's M and each 128-token
                        // tile's tokens as its N, rounded up to 32, so an expert's last tile costs only the
                        // tokens it has: 0 never, 1 for e4m3 weights and for bf16 ones in fast mode (H200
                        // prefill 1024: FP8 23.9k -> 27.2-27.4k, fast 31.8k -> 34.5k; bf16 fast 43.0-44.9k ->
                        // 46.0-47.6k; bf16 float32-grade 30.9k -> 29.8-29.9k, so not there), 2 always
                        // (DSV3_CUDA_TC_SWAP)
  int fast_min = 64;    // fast mode only for steps of at least this many tokens (DSV3_CUDA_FAST_MIN)
  int gemv_max = 8;     // the GEMV kernels up to this many tokens, tensor cores above (DSV3_CUDA_GEMV_MAX)
  int tc_min = 9;       // from this many tokens: the pipelined bf16 GEMM (kernels_tc.cu) for bf16 weights
                        // (before the GEMV/WMMA choice) and, for long runs of one slot, cuBLAS
                        // attention over decompressed K/V (DSV3_CUDA_TC_MIN)
  int graph_max = 16;   // steps of up to this many tokens are recorded (DSV3_CUDA_GRAPH_MAX)
  bool profile = false; // time every op and kernel group with events, graphs off (DSV3_CUDA_PROFILE=1)
  bool progress = false; // a progress line while the weights go to the GPU (DSV3_CUDA_PROGRESS; default:
                         // when stderr is a terminal)
  size_t upload_chunk = size_t(64) << 20;  // bytes per pinned staging buffer of the weight upload (two)
  bool route_in_experts = true; // one token's routing done by each routed block of the expert GEMVs from the
                                 // gate's logits, not by the gate kernel's last block, so the gate ends
                                 // with its GEMV (DSV3_CUDA_ROUTE_IN_EXPERTS=0: the last block routes)
  bool vabs_splits = true; // one token's value absorption combines the decode attention's position splits
                           // itself (gemv_splits; where the FMA GEMV takes wkv_b), so the attention has
                           // no last-block combine (DSV3_CUDA_VABS_SPLITS=0: the attention combines)
  bool norm_in_gate = true; // one token's residual add + norm before a MoE layer done by the gate kernel's
                            // blocks (each for its row, block 0 writing h and x): one kernel fewer
                            // (DSV3_CUDA_NORM_IN_GATE=0: add_rmsnorm launched on its own)
  bool combine_in_gemv = true; // one token's MoE combine + residual add + next norm done by the next layer's
                               // paired wq / wkv_a GEMV (each block for its own use, block 0 writing y, h
                               // and x; where the FMA GEMV takes both): one one-block kernel fewer
                               // (DSV3_CUDA_COMBINE_IN_GEMV=0: moe_combine_add_rmsnorm launched on its own)
  bool fp8_wgmma = true; // FP8 weights in the pipelined kernel's wgmma form (widened to bf16 in shared memory)
                         // for products of tc_min+ tokens; off: the WMMA GEMM (DSV3_CUDA_FP8_WGMMA=0)
  // A measurement aid, never for results: decode-step kernel groups not launched at all
  // (comma-separated: norm, combine, pair, prep, attn, out, linear, gate, experts; experts0 or
  // experts1: one stage of the decode GEMV experts), so a benchmark's step time without them
  // shows what each costs inside the recorded step (DSV3_CUDA_KNOCKOUT). Their outputs keep
  // whatever the buffers held.
  std::string knockout;
  // Also a measurement aid: this many kernels that do nothing but wait after each MoE layer's
  // combine (negative: as many wide ones, two blocks per SM), so the step time shows what a kernel
  // boundary costs in the recorded chain (DSV3_CUDA_PAD_KERNELS).
  int pad_kernels = 0;
  // FP8 weights are always dequantised inside the kernels (no FP8 tensor-core arithmetic: that
  // would quantise the activations too, and even the reference's own gemm_impl="fp8" arithmetic,
  // done faithfully, misses the golden fp8gemm bar: bench/results/2026-12-03-h200-cuda/run29-fp8-act),
  // which is what DSV3_CUDA_FP8_DEQUANT=1 asks for; the variable is accepted for that reason.
  static CudaOptions from_env();
  // Throws Error naming the option (and its variable) when a value is out of range.
  void validate() const;
};

std::unique_ptr<Backend> make_cuda_backend(const CudaOptions& opt);

namespace cuda {

// Whether a CUDA device can be used; `why` gets the reason when not.
bool device_available(std::string* why = nullptr);

// Weights for `a` created directly in `cuda_backend`'s device memory (owned by it): linears in
// a.dtype ("bf16" or "fp8" e4m3 with 128x128 scales; the head stays bf16), embedding and gate
// bf16, norms 1. Pseudo-random (seeded), scaled so activations stay O(1). For benchmarks.
ModelWeights random_weights(Backend& cuda_backend, const ModelArgs& a, uint64_t seed);

// The device router on logits [n, E] already in device memory: expert indices and weights
// [n, K] to the host, in the order of model/gate.cc's route_token. For tests.
void route_for_test(Backend& cuda_backend, const ModelArgs& a, const float* logits, const float* bias, int64_t n,
                    int32_t* indices, float* weights);

// With CudaOptions::profile: milliseconds per step spent in each op / kernel group since the last
// reset, one line each, largest first.
std::string profile_report(Backend& cuda_backend, bool reset = true);

// act_quant (kernels.h) on x [rows, cols] already in `cuda_backend`'s memory; e4m3 bytes and
// scales to the host. For tests.
void act_quant_for_test(Backend& cuda_backend, const float* x, int64_t rows, int64_t cols, bool ue8m0, uint8_t* y,
                        float* s);

// Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written.
double copy_bandwidth_gbps(size_t bytes, int reps);

}  // namespace cuda
}  // namespace dsv3
