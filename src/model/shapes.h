// The shapes of the released DeepSeek models by name, as ModelArgs: for random-weight checkpoints
// (dsv3 synth) and benchmarks of weights made in memory (dsv3 bench --synthetic).
#pragma once
#include <string>
#include <vector>

#include "model/config.h"

namespace dsv3 {

// The shapes known, in the order they are listed.
const std::vector<std::string>& model_shape_names();

// The ModelArgs of a named shape: "tiny" (a small V3-style model with every feature: q LoRA,
// expert groups, sigmoid routing with a correction bias, FP8 blocks with ragged edges),
// "16B" (DeepSeek-V2-Lite), "236B" (DeepSeek-V2), "671B" (DeepSeek-V3), "v3.1" (DeepSeek-V3.1:
// 671B with ue8m0 scales). Every shape uses the DeepSeek-V3 tokenizer's vocab_size (129280).
// dtype is the shape's native one (bf16 for 16B/236B, fp8 otherwise). Throws Error listing the
// shapes.
ModelArgs model_shape(const std::string& name);

// model_shape(name) with `dtype` ("bf16", "fp8"; "" keeps the native one) and `layers` (0 keeps
// the shape's; first_k_dense_replace is capped at it). Validated; Error on bad input.
ModelArgs shape_args(const std::string& shape, const std::string& dtype, int layers);

}  // namespace dsv3
