// dsv3 convert: the reference's inference/convert.py. A Hugging Face checkpoint (every
// *.safetensors of a directory) becomes the reference's layout for N model-parallel ranks:
// model{r}-mp{N}.safetensors per rank, tensors renamed to the reference's short names, routed
// experts partitioned (rank r keeps experts [r*E/N, (r+1)*E/N)), the other tensors with a split
// dim narrowed to their 1/N slice along it, the rest replicated; the *token* files copied.
// Streams shard by shard: every rank's file is written as its tensors are read, so memory holds
// one bounded buffer, never the model.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

namespace dsv3 {

struct ConvertOptions {
  std::string hf_dir;    // input: *.safetensors (+ optional config.json, *token* files)
  std::string save_dir;  // output: must not exist or be empty; written whole or not at all
  int n_experts = 0;     // E: routed experts; divisible by mp
  int mp = 0;            // N: model-parallel ranks
  std::function<void(uint64_t, uint64_t)> progress;  // (input bytes done, total)
  const std::atomic<bool>* cancel = nullptr;         // when it becomes true: stop, clean up, Error
};

struct ConvertResult {
  int n_inputs = 0;           // safetensors files read
  int n_tensors = 0;          // tensors converted
  int n_skipped = 0;          // tensors of layers past the model's (multi-token prediction)
  uint64_t bytes_in = 0;      // data bytes of the converted tensors
  uint64_t bytes_out = 0;     // data bytes of all ranks' files together
  int n_copied = 0;           // *token* files copied
};

// Throws Error (naming the file, tensor, numbers) on bad input before anything is written;
// on any failure nothing is left at save_dir.
ConvertResult convert_checkpoint(const ConvertOptions& opt);

}  // namespace dsv3
