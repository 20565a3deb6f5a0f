// The rewrites of runtime/rewrites.h: where they apply in a real model's step graph (a backend
// that accepts every fusion), that a backend's refusal or a rewrite switched off leaves the ops
// alone, and that the CPU backend's fused plan gives the unfused plan's logits exactly. (The CUDA
// backend's fusions have their fused-against-unfused tests in cuda_backend_test.cc.)
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "golden_util.h"
#include "io/checkpoint.h"
#include "runtime/model.h"
#include "runtime/rewrites.h"

namespace dsv3 {
namespace {

using testing_util::case_dir;

// The ref backend, accepting the fusions of `accept` (only for planning: it cannot run them).
class Accepting final : public Backend {
 public:
  explicit Accepting(std::set<Fusion> accept) : in_(make_ref_backend()), accept_(std::move(accept)) {}
  std::string name() const override { return "accepting"; }
  float* alloc(size_t n) override { return in_->alloc(n); }
  void release(float* p) override { in_->release(p); }
  void upload(float* d, const float* h, size_t n) override { in_->upload(d, h, n); }
  void download(float* h, const float* s, size_t n) override { in_->download(h, s, n); }
  bool fuses(const StepGraph&, Fusion f, int, int) const override { return accept_.count(f) > 0; }
  void embed(const Step& s, const TensorView& t, int64_t r0, float* y) override { in_->embed(s, t, r0, y); }
  void rmsnorm(const float* x, int64_t n, int64_t d, int64_t st, const TensorView& w, float e, float* y) override {
    in_->rmsnorm(x, n, d, st, w, e, y);
  }
  void linear(const float* x, int64_t n, const Linear& w, float* y) override { in_->linear(x, n, w, y); }
  void add(float* y, const float* x, int64_t n) override { in_->add(y, x, n); }
  void mla(const MlaCall& c) override { in_->mla(c); }
  void moe(const ModelArgs& a, const MoEWeights& w, const float* x, int64_t n, float* y) override {
    in_->moe(a, w, x, n, y);
  }
  void mlp(const MLPWeights& w, const float* x, int64_t n, float* y) override { in_->mlp(w, x, n, y); }

 private:
  std::unique_ptr<Backend> in_;
  std::set<Fusion> accept_;
};

const std::set<Fusion> kAll = {Fusion::kAddRmsNorm, Fusion::kLinearPair, Fusion::kAddRmsNormMoe,
                               Fusion::kCombineAddRmsNorm, Fusion::kCombineAddRmsNormPair};

// The plan as text: one node per line, "fusion: op.layer op.layer ...", "+defer" where the
// node's MoE leaves its combine to the next.
std::string plan_text(const StepGraph& g) {
  std::string s;
  for (const Node& nd : g.nodes) {
    s += fusion_name(nd.fusion);
    s += ":";
    for (int i = nd.first; i < nd.first + nd.count; ++i)
      s += std::string(" ") + g.ops[size_t(i)].name + "." + std::to_string(g.ops[size_t(i)].layer);
    if (nd.defer_combine) s += " +defer";
    s += "\n";
  }
  return s;
}

std::string planned(const std::string& c, std::set<Fusion> accept, uint32_t rewrites = kRewritesAll) {
  ModelOptions opt;
  opt.max_seqs = 1, opt.max_len = 64, opt.rewrites = rewrites;
  Model m(Checkpoint::open(case_dir(c) + "/hf"), std::make_unique<Accepting>(std::move(accept)), opt);
  return plan_text(m.graph(1, 1));
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(Rewrites, ApplyWhereTheOpsMatchInAModelsGraph) {
  // v2lite_bf16: layer 0 dense, then MoE layers; q without LoRA (wq and wkv_a of x).
  const std::string p = planned("v2lite_bf16", kAll);
  EXPECT_TRUE(has(p, "none: embed.-1\nnone: attn_norm.0\nlinear_pair: wq.0 wkv_a.0\nnone: attn.0\nnone: wo.0\n"
                     "add_rmsnorm: attn_residual.0 ffn_norm.0\nnone: ffn.0\nadd_rmsnorm: ffn_residual.0 attn_norm.1\n"
                     "linear_pair: wq.1 wkv_a.1\nnone: attn.1\nnone: wo.1\n"
                     "add_rmsnorm_moe: attn_residual.1 ffn_norm.1 ffn.1 +defer\n"
                     "combine_add_rmsnorm_pair: ffn_residual.1 attn_norm.2 wq.2 wkv_a.2\n")) << p;
  // The last layer's MoE has no norm after it: it combines itself.
  const std::string last = std::to_string(load_model_args(*Checkpoint::open(case_dir("v2lite_bf16") + "/hf")).n_layers - 1);
  EXPECT_TRUE(has(p, " ffn." + last + "\nnone: ffn_residual." + last + "\nnone: last.-1\nnone: norm.-1\n"
                     "none: head.-1\n")) << p;
  // v3_fp8: q LoRA; wq_a and wkv_a are the two products of x.
  const std::string q = planned("v3_fp8", kAll);
  EXPECT_TRUE(has(q, "linear_pair: wq_a.0 wkv_a.0\nnone: q_norm.0\nnone: wq_b.0\n")) << q;
}

TEST(Rewrites, RefusedOrSwitchedOffLeaveTheOpsAlone) {
  const std::string none = planned("v2lite_bf16", {});
  EXPECT_FALSE(has(none, "add_rmsnorm")) << none;
  EXPECT_FALSE(has(none, "pair")) << none;
  EXPECT_FALSE(has(none, "defer")) << none;
  // Only add_rmsnorm accepted: no pairs, no deferred combine, the MoE's add + norm plain.
  const std::string one = planned("v2lite_bf16", {Fusion::kAddRmsNorm});
  EXPECT_TRUE(has(one, "add_rmsnorm: attn_residual.1 ffn_norm.1\nnone: ffn.1\nadd_rmsnorm: ffn_residual.1 attn_norm.2"))
      << one;
  EXPECT_FALSE(has(one, "pair")) << one;
  // Everything accepted, but combine_into_pair switched off: the combine alone, then the pair.
  const std::string off = planned("v2lite_bf16", kAll, kRewritesAll & ~kRewriteCombineIntoPair);
  EXPECT_TRUE(has(off, "+defer\ncombine_add_rmsnorm: ffn_residual.1 attn_norm.2\nlinear_pair: wq.2 wkv_a.2\n")) << off;
  // moe_combine_into_norm off: no MoE defers (and combine_into_pair cannot apply).
  const std::string nodefer = planned("v2lite_bf16", kAll, kRewritesAll & ~kRewriteMoeCombineIntoNorm);
  EXPECT_FALSE(has(nodefer, "defer")) << nodefer;
  EXPECT_FALSE(has(nodefer, "combine")) << nodefer;
  EXPECT_EQ(planned("v2lite_bf16", kAll, 0), none);
}

TEST(Rewrites, GraphsAreRecordedOncePerShape) {
  ModelOptions opt;
  opt.max_seqs = 1, opt.max_len = 64;
  Model m(Checkpoint::open(case_dir("v2lite_bf16") + "/hf"), make_ref_backend(), opt);
  const StepGraph* a = &m.graph(3, 1);
  EXPECT_EQ(&m.graph(3, 1), a);
  EXPECT_NE(m.graph(2, 1).id, a->id);
}

// The CPU backend runs add_rmsnorm fused: a prefill and decode steps give the unfused logits.
TEST(Rewrites, CpuFusedPlanGivesTheUnfusedLogits) {
  for (const std::string c : {"v2lite_bf16", "v3_fp8"}) {
    std::vector<float> out[2];
    for (int fused = 0; fused < 2; ++fused) {
      ModelOptions opt;
      opt.max_seqs = 2, opt.max_len = 64, opt.rewrites = fused ? uint32_t(kRewritesAll) : 0u;
      Model m(Checkpoint::open(case_dir(c) + "/hf"), make_cpu_backend(), opt);
      if (fused) {
        EXPECT_TRUE(has(plan_text(m.graph(9, 2)), "add_rmsnorm:"));
      }
      const int V = m.args().vocab_size;
      std::vector<int32_t> toks = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3};
      std::vector<float> logits(size_t(2 * V));
      m.forward(toks.data(), 2, 9, 0, logits.data());
      out[fused].insert(out[fused].end(), logits.begin(), logits.end());
      for (int s = 0; s < 3; ++s) {
        int32_t next[2] = {int32_t(s + 10), int32_t(s + 20)};
        m.forward(next, 2, 1, 9 + s, logits.data());
        out[fused].insert(out[fused].end(), logits.begin(), logits.end());
      }
    }
    EXPECT_EQ(out[0], out[1]) << c;
  }
}

}  // namespace
}  // namespace dsv3
