// The MoE router (the reference's Gate.forward) on one token's expert scores.
#pragma once
#include <cstdint>

#include "model/config.h"

namespace dsv3 {

// logits: [n_routed_experts] = x · gate.weightᵀ for one token; bias: [n_routed_experts] or null.
// Writes the chosen experts to indices[n_activated] and their weights to weights[n_activated]:
// 1. scores = softmax(logits) or sigmoid(logits); 2. choice scores = scores + bias (choosing
// only); 3. with groups, keep the best topk_group groups (group score = max without bias, sum of
// the top 2 with bias), others -inf; 4. top-k of the choice scores (ties: lower index first);
// weights = unbiased scores of those, normalised when norm_topk_prob, times route_scale.
// `scratch` needs 2 * n_routed_experts + n_group floats.
void route_token(const ModelArgs& a, const float* logits, const float* bias, int32_t* indices, float* weights,
                 float* scratch);

}  // namespace dsv3
