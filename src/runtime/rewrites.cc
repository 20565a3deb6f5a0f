#include "runtime/rewrites.h"

namespace dsv3 {
namespace {

struct Planner {
  StepGraph& g;
  const Backend& be;
  uint32_t on;

  const Op* at(int i) const { return i >= 0 && i < int(g.ops.size()) ? &g.ops[size_t(i)] : nullptr; }
  bool is(int i, OpKind k) const { return at(i) && at(i)->kind == k; }
  bool accepts(Rewrite r, Fusion f, int first, int count) const { return (on & r) && be.fuses(g, f, first, count); }

  // add(h += y) then rmsnorm(h -> x) over whole rows: the norm reads the sum.
  bool add_then_norm(int i) const {
    if (!is(i, OpKind::kAdd) || !is(i + 1, OpKind::kRmsNorm)) return false;
    const Op &a = *at(i), &r = *at(i + 1);
    const Value& h = g.val(a.out);
    return r.in == a.out && h.stride == h.cols && r.out != r.in;
  }
  // Two linears of the same input.
  bool linear_pair(int i) const {
    return is(i, OpKind::kLinear) && is(i + 1, OpKind::kLinear) && at(i)->in == at(i + 1)->in &&
           at(i)->out != at(i)->in && at(i + 1)->in != at(i)->out;
  }
  // add; rmsnorm; moe of the norm.
  bool add_norm_moe(int i) const {
    return add_then_norm(i) && is(i + 2, OpKind::kMoe) && at(i + 2)->in == at(i + 1)->out;
  }

  // The node starting at op i (after its MoE, whether the combine is deferred to the next node).
  void step(int& i) {
    if (add_norm_moe(i) && accepts(kRewriteAddRmsNormMoe, Fusion::kAddRmsNormMoe, i, 3)) {
      push(Fusion::kAddRmsNormMoe, i, 3);
      i += 3;
      after_moe(i);
      return;
    }
    if (add_then_norm(i) && accepts(kRewriteAddRmsNorm, Fusion::kAddRmsNorm, i, 2)) {
      push(Fusion::kAddRmsNorm, i, 2);
      i += 2;
      return;
    }
    if (linear_pair(i) && accepts(kRewriteLinearPair, Fusion::kLinearPair, i, 2)) {
      push(Fusion::kLinearPair, i, 2);
      i += 2;
      return;
    }
    push(Fusion::kNone, i, 1);
    ++i;
    if (g.ops[size_t(i - 1)].kind == OpKind::kMoe) after_moe(i);
  }

  // Op i follows a MoE (the last op of the last node): moe_combine_into_norm, then combine_into_pair.
  void after_moe(int& i) {
    const Op& moe = g.ops[size_t(i - 1)];
    if (!add_then_norm(i) || at(i)->in != moe.out || !accepts(kRewriteMoeCombineIntoNorm, Fusion::kCombineAddRmsNorm, i, 2)) return;
    g.nodes.back().defer_combine = true;
    if (linear_pair(i + 2) && at(i + 2)->in == at(i + 1)->out && accepts(kRewriteCombineIntoPair, Fusion::kCombineAddRmsNormPair, i, 4)) {
      push(Fusion::kCombineAddRmsNormPair, i, 4);
      i += 4;
      return;
    }
    push(Fusion::kCombineAddRmsNorm, i, 2);
    i += 2;
  }

  void push(Fusion f, int first, int count) { g.nodes.push_back({f, first, count, false}); }
};

}  // namespace

const char* rewrite_name(Rewrite r) {
  switch (r) {
    case kRewriteAddRmsNorm: return "add_rmsnorm";
    case kRewriteLinearPair: return "linear_pair";
    case kRewriteAddRmsNormMoe: return "add_rmsnorm_moe";
    case kRewriteMoeCombineIntoNorm: return "moe_combine_into_norm";
    case kRewriteCombineIntoPair: return "combine_into_pair";
    default: return "?";
  }
}

void plan(StepGraph& g, const Backend& be, uint32_t rewrites) {
  g.nodes.clear();
  Planner p{g, be, rewrites};
  for (int i = 0; i < int(g.ops.size());) p.step(i);
}

}  // namespace dsv3
