// The fusions of a step graph, in one place: each a named rewrite that groups adjacent ops into
// one node where the backend says it runs that fusion (Backend::fuses). The fused and unfused
// plans compute the same values (tests run both).
//
//   add_rmsnorm               add(h += y); rmsnorm(h -> x)               -> kAddRmsNorm
//   linear_pair               linear(x -> a); linear(x -> b)             -> kLinearPair
//   add_rmsnorm_moe           add; rmsnorm(h -> x); moe(x)               -> kAddRmsNormMoe
//   moe_combine_into_norm     moe(x -> y); add(h += y); rmsnorm(h -> x') -> the MoE node defers its combine,
//                                                                            kCombineAddRmsNorm does it
//   combine_into_pair         kCombineAddRmsNorm; kLinearPair of its x'  -> kCombineAddRmsNormPair
#pragma once
#include <cstdint>

#include "backend/backend.h"

namespace dsv3 {

// The rewrites, as bits of a set (combine_into_pair needs moe_combine_into_norm).
enum Rewrite : uint32_t {
  kRewriteAddRmsNorm = 1u << 0,
  kRewriteLinearPair = 1u << 1,
  kRewriteAddRmsNormMoe = 1u << 2,
  kRewriteMoeCombineIntoNorm = 1u << 3,
  kRewriteCombineIntoPair = 1u << 4,
  kRewritesAll = (1u << 5) - 1,
};
const char* rewrite_name(Rewrite r);

// Replaces g.nodes with the plan `be` runs: every rewrite of `rewrites` where the ops match and
// the backend accepts it, tried in the order of the table at each op. rewrites = 0: one node
// per op.
void plan(StepGraph& g, const Backend& be, uint32_t rewrites = kRewritesAll);

}  // namespace dsv3
