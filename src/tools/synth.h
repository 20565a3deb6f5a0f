// Random-weight checkpoints in Hugging Face layout (config.json, sharded safetensors with the
// real tensor names, model.safetensors.index.json, tokenizer files) for the shapes of the real
// DeepSeek models: benchmark and demo models without downloading hundreds of gigabytes.
// Weights are streamed to disk as they are generated; the model is never held in memory.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/shapes.h"

namespace dsv3 {

// The Hugging Face config.json text for `a` (DeepSeek-V2/V3 field names, rope_scaling,
// quantization_config for fp8). parse_model_args() of it gives back `a`.
std::string synth_config_json(const ModelArgs& a);

struct SynthOptions {
  std::string shape = "tiny";
  std::string dtype;              // "bf16" | "fp8" | "" (the shape's native dtype)
  int layers = 0;                 // 0 = the shape's num_hidden_layers
  // When set, these args are written instead of shape/dtype/layers (any valid ModelArgs; for
  // tests and benchmarks of custom shapes).
  const ModelArgs* args = nullptr;
  std::string out_dir;            // created (with parents); must not exist or be empty
  uint64_t seed = 0;
  double shard_gb = 4;            // shard size limit in GB (1e9 bytes); a larger tensor gets its own shard
  int threads = 0;                // 0 = the global ThreadPool
  bool force = false;             // replace an existing non-empty out_dir (only if it holds a config.json)
  bool tokenizer = true;          // copy tokenizer.json (+ tokenizer_config.json); Error if none found
  std::string tokenizer_dir;      // "" = find_tokenizer_dir("") (text/tokenizer.h)
  bool fsync = true;              // fsync each file before the final rename
  // Called after each write with (data bytes written, data bytes in total).
  std::function<void(uint64_t, uint64_t)> progress;
  const std::atomic<bool>* cancel = nullptr;  // when it becomes true: stop, clean up, throw Error
};

struct SynthResult {
  ModelArgs args;
  std::string out_dir;
  int n_shards = 0;
  int n_tensors = 0;
  uint64_t data_bytes = 0;  // tensor bytes (the index's total_size)
  double seconds = 0;
};

// Writes the checkpoint into `out_dir`.partial-<pid>/ and renames it to `out_dir` at the end, so
// an interrupted run never leaves a directory named `out_dir` (a killed run's partial directory
// is removed by the next synth of the same out_dir). On Error, nothing is left behind.
// Weights are deterministic in (seed, tensor name, element index): independent of the thread
// count, and the same underlying values for bf16 and fp8 (fp8 = their block-quantised form).
//   projections: uniform, variance 1/fan_in;  embedding: uniform, variance 1;
//   norms: 1 +- 0.05;  gate: uniform, variance 1/dim;  correction bias: +-0.02 (F32).
// fp8: every projection but lm_head is F8_E4M3 with weight_scale_inv F32
// [ceil(out/128), ceil(in/128)] = block amax / 448 (rounded up to a power of two for ue8m0).
SynthResult synthesize(const SynthOptions& opt);

// Exactly f32_to_e4m3 (round-to-nearest-even, saturating), by bit manipulation: the synthesiser
// converts billions of values. Exposed for its test.
uint8_t synth_f32_to_e4m3(float f);

}  // namespace dsv3
