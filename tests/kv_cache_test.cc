// The paged KV cache: the block allocator's counts, and the model over it — sequences of
// different lengths sharing the pool with their blocks interleaved, block boundaries inside a
// prompt, a freed sequence's blocks reused, running out of blocks.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "golden_util.h"
#include "io/checkpoint.h"
#include "runtime/kv_cache.h"
#include "runtime/model.h"

namespace dsv3 {
namespace {

using testing_util::case_dir;

ModelArgs tiny_args() {
  ModelArgs a;
  a.n_layers = 2, a.kv_lora_rank = 8, a.qk_rope_head_dim = 4;
  return a;
}

TEST(KvCache, BlocksAreCountedAndComeBack) {
  auto be = make_ref_backend();
  KvCache::Options o;
  o.block = 4, o.n_blocks = 6, o.max_len = 40;
  KvCache c(tiny_args(), *be, o);
  EXPECT_EQ(c.free_blocks(), 6);
  EXPECT_EQ(c.width(), 10);
  BlockTable a, b;
  EXPECT_TRUE(c.grow(a, 9));  // 3 blocks
  EXPECT_EQ(a.blocks.size(), 3u);
  EXPECT_TRUE(c.grow(a, 12));  // still 3
  EXPECT_EQ(a.blocks.size(), 3u);
  EXPECT_FALSE(c.grow(b, 13));  // 4 blocks asked, 3 free: nothing taken
  EXPECT_TRUE(b.blocks.empty());
  EXPECT_EQ(c.free_blocks(), 3);
  EXPECT_TRUE(c.grow(b, 12));
  EXPECT_EQ(c.free_blocks(), 0);
  // Sharing: b takes a reference on a's first block; freeing a keeps it for b.
  c.retain(a.blocks[0]);
  EXPECT_EQ(c.refs(a.blocks[0]), 2);
  const int32_t shared = a.blocks[0];
  c.free(a);
  EXPECT_EQ(c.free_blocks(), 2);
  EXPECT_EQ(c.refs(shared), 1);
  c.truncate(b, 5);  // keeps 2 blocks
  EXPECT_EQ(b.blocks.size(), 2u);
  EXPECT_EQ(c.free_blocks(), 3);
  c.release(shared);
  EXPECT_EQ(c.free_blocks(), 4);
  c.free(b);
  EXPECT_EQ(c.free_blocks(), 6);
  EXPECT_EQ(c.used_blocks(), 0);
}

// A host backend that keeps its latent cache rows in bf16 (as the CUDA backend in fast mode) and
// counts the floats the cache asks it for.
class Bf16CacheBackend : public Backend {
 public:
  std::unique_ptr<Backend> in = make_ref_backend();
  size_t floats = 0;
  std::string name() const override { return "bf16-cache"; }
  bool bf16_latent_cache() const override { return true; }
  float* alloc(size_t n) override { return floats += n, in->alloc(n); }
  void release(float* p) override { in->release(p); }
  void upload(float* d, const float* h, size_t n) override { in->upload(d, h, n); }
  void download(float* h, const float* s, size_t n) override { in->download(h, s, n); }
  void embed(const Step&, const TensorView&, int64_t, float*) override { fail("not for this test"); }
  void rmsnorm(const float*, int64_t, int64_t, int64_t, const TensorView&, float, float*) override { fail("no"); }
  void linear(const float*, int64_t, const Linear&, float*) override { fail("not for this test"); }
  void add(float*, const float*, int64_t) override { fail("not for this test"); }
  void mla(const MlaCall&) override { fail("not for this test"); }
  void moe(const ModelArgs&, const MoEWeights&, const float*, int64_t, float*) override { fail("not for this test"); }
  void mlp(const MLPWeights&, const float*, int64_t, float*) override { fail("not for this test"); }
};

// A backend with bf16 latent rows gets a cache of half the bytes per position (two values a float
// slot); the naive form's K and V stay float32; odd row widths cannot be packed and are refused.
TEST(KvCache, Bf16LatentRowsTakeHalfTheBytes) {
  ModelArgs a = tiny_args();
  KvCache::Options o;
  o.block = 4, o.n_blocks = 6, o.max_len = 24;
  const int64_t rows = 4 * 6;
  Bf16CacheBackend be;
  {
    KvCache c(a, be, o);
    EXPECT_TRUE(c.bf16());
    EXPECT_EQ(c.position_bytes(), 2 * a.n_layers * (a.kv_lora_rank + a.qk_rope_head_dim));
    EXPECT_EQ(2 * c.position_bytes(), KvCache::bytes_per_position(a, AttnImpl::kAbsorb));
    EXPECT_EQ(c.bytes(), rows * c.position_bytes());
    EXPECT_EQ(be.floats, size_t(rows * a.n_layers * (a.kv_lora_rank + a.qk_rope_head_dim) / 2));
    for (const LayerCache& l : c.layers()) EXPECT_TRUE(l.bf16 && l.kv && l.pe);
  }
  be.floats = 0;
  o.attn = AttnImpl::kNaive;
  {
    KvCache c(a, be, o);
    EXPECT_FALSE(c.bf16());
    EXPECT_EQ(c.position_bytes(), KvCache::bytes_per_position(a, AttnImpl::kNaive));
    EXPECT_EQ(be.floats, size_t(rows * a.n_layers * a.n_heads * (a.qk_head_dim() + a.v_head_dim)));
    for (const LayerCache& l : c.layers()) EXPECT_FALSE(l.bf16);
  }
  o.attn = AttnImpl::kAbsorb;
  a.qk_rope_head_dim = 5;
  try {
    KvCache c(a, be, o);
    ADD_FAILURE() << "an odd rope dim packed into bf16 pairs";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("qk_rope_head_dim"), std::string::npos) << e.what();
  }
}

TEST(KvCache, OutOfBlocksIsAnErrorInTheCallersTerms) {
  auto be = make_ref_backend();
  KvCache::Options o;
  o.block = 8, o.n_blocks = 2, o.max_len = 64;
  KvCache c(tiny_args(), *be, o);
  BlockTable t;
  c.reserve(t, 8);
  BlockTable u;
  try {
    c.reserve(u, 20);
    FAIL() << "20 positions should not fit in the one free block";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("20 more positions needed, 8 free of the 16"), std::string::npos) << m;
  }
  EXPECT_TRUE(u.blocks.empty());
  EXPECT_EQ(c.free_blocks(), 1);
  EXPECT_THROW(KvCache(tiny_args(), *be, {AttnImpl::kAbsorb, 6, 2, 64}), Error);  // block not a power of two
  EXPECT_THROW(KvCache(tiny_args(), *be, {AttnImpl::kAbsorb, 8, 0, 64}), Error);  // no blocks
}

// Runs token sequences through one model in interleaved steps: sequence 0's prompt, then
// sequence 1's, then decode steps of both together; returns every logit row per sequence.
struct Runner {
  Model& m;
  int V;
  std::vector<float> step(const std::vector<BlockTable*>& seqs, const std::vector<std::vector<int32_t>>& toks,
                          const std::vector<int>& start) {
    Model::Batch b;
    std::vector<int32_t> ids;
    std::vector<TokenPos> pos;
    for (size_t s = 0; s < seqs.size(); ++s) {
      m.kv_cache().reserve(*seqs[s], start[s] + int64_t(toks[s].size()));
      b.seqs.push_back(seqs[s]);
      for (size_t t = 0; t < toks[s].size(); ++t) {
        b.logit_rows.push_back(int64_t(ids.size()));
        ids.push_back(toks[s][t]);
        pos.push_back({int32_t(s), int32_t(start[s] + int(t))});
      }
    }
    b.tokens = ids.data(), b.pos = pos.data(), b.n = int64_t(ids.size());
    std::vector<float> out(b.logit_rows.size() * size_t(V));
    m.forward(b, out.data());
    return out;
  }
};

std::unique_ptr<Model> small_block_model(AttnImpl attn, int max_seqs) {
  ModelOptions opt;
  opt.attn = attn, opt.max_seqs = max_seqs, opt.kv_block = 4, opt.max_len = 64;
  return std::make_unique<Model>(Checkpoint::open(case_dir("v2lite_bf16") + "/hf"), make_ref_backend(), opt);
}

// A sequence's logits computed alone in a fresh model, every position.
std::vector<float> alone(AttnImpl attn, const std::vector<int32_t>& toks) {
  auto m = small_block_model(attn, 1);
  Runner r{*m, m->args().vocab_size};
  BlockTable t;
  return r.step({&t}, {toks}, {0});
}

TEST(PagedModel, SequencesSharingThePoolGiveTheirAloneLogits) {
  for (AttnImpl attn : {AttnImpl::kAbsorb, AttnImpl::kNaive}) {
    auto m = small_block_model(attn, 3);
    const int V = m->args().vocab_size;
    Runner r{*m, V};
    const std::vector<int32_t> a = {5, 9, 2, 7, 7, 1, 3, 8, 6, 4, 2, 9, 11, 3, 5};  // 15: blocks of 4 cut it thrice
    const std::vector<int32_t> b = {4, 4, 8, 1, 6, 2};
    const std::vector<float> want_a = alone(attn, a), want_b = alone(attn, b);
    BlockTable ta, tb;
    // Prompts of 6 and 3 tokens, then one token of each per step: their blocks interleave.
    std::vector<float> got_a = r.step({&ta}, {{a.begin(), a.begin() + 6}}, {0});
    std::vector<float> gb = r.step({&tb}, {{b.begin(), b.begin() + 3}}, {0});
    std::vector<float> got_b = gb;
    for (int s = 0; s < 9; ++s) {
      std::vector<BlockTable*> seqs = {&ta};
      std::vector<std::vector<int32_t>> toks = {{a[size_t(6 + s)]}};
      std::vector<int> start = {6 + s};
      if (3 + s < int(b.size())) seqs.push_back(&tb), toks.push_back({b[size_t(3 + s)]}), start.push_back(3 + s);
      std::vector<float> out = r.step(seqs, toks, start);
      got_a.insert(got_a.end(), out.begin(), out.begin() + V);
      if (seqs.size() > 1) got_b.insert(got_b.end(), out.begin() + V, out.end());
    }
    // The physical blocks of the two are interleaved: a's are not consecutive.
    bool gap = false;
    for (size_t i = 1; i < ta.blocks.size(); ++i) gap = gap || ta.blocks[i] != ta.blocks[i - 1] + 1;
    EXPECT_TRUE(gap);
    ASSERT_EQ(got_a.size(), want_a.size());
    ASSERT_EQ(got_b.size(), want_b.size());
    EXPECT_EQ(got_a, want_a) << (attn == AttnImpl::kAbsorb ? "absorb" : "naive");
    EXPECT_EQ(got_b, want_b) << (attn == AttnImpl::kAbsorb ? "absorb" : "naive");
    // a freed: its blocks go to the next sequence, which still gets its own logits.
    const std::vector<int32_t> freed = ta.blocks;
    m->kv_cache().free(ta);
    BlockTable tc;
    const std::vector<float> got_c = r.step({&tc}, {a}, {0});
    EXPECT_EQ(got_c, want_a);
    int reused = 0;
    for (int32_t blk : tc.blocks) reused += std::count(freed.begin(), freed.end(), blk) > 0;
    EXPECT_EQ(reused, int(freed.size()));
    m->kv_cache().free(tb);
    m->kv_cache().free(tc);
    EXPECT_EQ(m->kv_cache().used_blocks(), 0);
  }
}

}  // namespace
}  // namespace dsv3
