// dsv3 cast-bf16: the reference's inference/fp8_cast_bf16.py. An FP8 Hugging Face checkpoint
// becomes a bf16 one: every F8_E4M3 weight is dequantised with its weight_scale_inv (w * scale
// per 128x128 block, in float32) and rounded to bf16 (round-to-nearest-even), the scale tensors
// are dropped, every other tensor is copied; each shard keeps its file name.
// model.safetensors.index.json is rewritten (weight_map without the scales, metadata total_size
// recomputed), config.json is copied without quantization_config, every other file is copied.
// Streams shard by shard and tensor by tensor in bounded memory.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

namespace dsv3 {

struct CastOptions {
  std::string in_dir;   // FP8 checkpoint: *.safetensors (+ index, config.json, other files)
  std::string out_dir;  // must not exist or be empty; written whole or not at all
  std::function<void(uint64_t, uint64_t)> progress;  // (input bytes done, total)
  const std::atomic<bool>* cancel = nullptr;         // when it becomes true: stop, clean up, Error
};

struct CastResult {
  int n_files = 0;         // safetensors shards
  int n_cast = 0;          // F8_E4M3 weights dequantised to bf16
  int n_copied = 0;        // tensors copied unchanged
  int n_scales = 0;        // weight_scale_inv tensors dropped
  int n_other_files = 0;   // files copied besides the shards, the index and config.json
  uint64_t bytes_in = 0;   // tensor bytes read
  uint64_t bytes_out = 0;  // tensor bytes written (the index's total_size)
};

// Throws Error (naming the file, tensor, field) on bad input before anything is written; on any
// failure nothing is left at out_dir.
CastResult cast_fp8_to_bf16(const CastOptions& opt);

}  // namespace dsv3
