#include "runtime/kv_cache.h"

#include <algorithm>

#include "core/error.h"

namespace dsv3 {

int64_t KvCache::bytes_per_position(const ModelArgs& a, AttnImpl attn, bool bf16_latent) {
  if (attn == AttnImpl::kAbsorb)
    return int64_t(a.kv_lora_rank + a.qk_rope_head_dim) * (bf16_latent ? 2 : 4) * a.n_layers;
  return int64_t(a.n_heads) * (a.qk_head_dim() + a.v_head_dim) * int64_t(sizeof(float)) * a.n_layers;
}

KvCache::KvCache(const ModelArgs& a, Backend& be, const Options& o) : be_(be), opt_(o) {
  if (o.block <= 0 || (o.block & (o.block - 1)) != 0) fail("KV cache: block of ", o.block, " positions (a power of two)");
  if (o.n_blocks <= 0 || o.n_blocks > INT32_MAX) fail("KV cache: ", o.n_blocks, " blocks");
  if (o.max_len <= 0) fail("KV cache: a sequence of ", o.max_len, " positions");
  bf16_ = o.attn == AttnImpl::kAbsorb && be.bf16_latent_cache();
  if (bf16_ && (a.kv_lora_rank % 2 != 0 || a.qk_rope_head_dim % 2 != 0))
    fail("KV cache: bf16 rows need an even kv_lora_rank and qk_rope_head_dim, got ", a.kv_lora_rank, " and ",
         a.qk_rope_head_dim);
  pos_bytes_ = bytes_per_position(a, o.attn, bf16_);
  const size_t rows = size_t(o.n_blocks) * size_t(o.block), per = bf16_ ? 2 : 1;  // values per float slot
  layers_.resize(size_t(a.n_layers));
  for (LayerCache& c : layers_) {
    if (o.attn == AttnImpl::kAbsorb) {
      c.kv = be_.alloc(rows * size_t(a.kv_lora_rank) / per);
      c.pe = be_.alloc(rows * size_t(a.qk_rope_head_dim) / per);
      c.bf16 = bf16_;
    } else {
      c.k = be_.alloc(rows * size_t(a.n_heads) * size_t(a.qk_head_dim()));
      c.v = be_.alloc(rows * size_t(a.n_heads) * size_t(a.v_head_dim));
    }
  }
  refs_.assign(size_t(o.n_blocks), 0);
  content_.resize(size_t(o.n_blocks));
  lru_pos_.resize(size_t(o.n_blocks));
  free_.reserve(size_t(o.n_blocks));
  for (int64_t b = o.n_blocks - 1; b >= 0; --b) free_.push_back(int32_t(b));  // block 0 taken first
}

KvCache::~KvCache() {
  for (LayerCache& c : layers_)
    for (float* p : {c.kv, c.pe, c.k, c.v})
      if (p) be_.release(p);
}

int64_t KvCache::bytes() const { return n_blocks() * opt_.block * pos_bytes_; }

int32_t KvCache::take() {
  int32_t b = -1;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    b = lru_.front();
    lru_.pop_front();
    forget(b);
  } else {
    return -1;
  }
  refs_[size_t(b)] = 1;
  return b;
}

void KvCache::retain(int32_t b) {
  DSV3_CHECK(b >= 0 && b < n_blocks() && refs_[size_t(b)] > 0, "retain of block ", b);
  ++refs_[size_t(b)];
}

void KvCache::release(int32_t b) {
  DSV3_CHECK(b >= 0 && b < n_blocks() && refs_[size_t(b)] > 0, "release of block ", b);
  if (--refs_[size_t(b)] > 0) return;
  if (content_[size_t(b)].published) lru_pos_[size_t(b)] = lru_.insert(lru_.end(), b);
  else free_.push_back(b);
}

uint64_t KvCache::block_hash(uint64_t parent, const int32_t* tokens, int n) {
  uint64_t h = parent ^ 0x9e3779b97f4a7c15ull;
  auto mix = [](uint64_t z) {  // splitmix64's finaliser
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (int i = 0; i < n; ++i) h = mix(h + 0x9e3779b97f4a7c15ull + uint64_t(uint32_t(tokens[i])));
  return mix(h + uint64_t(n));
}

void KvCache::publish(int32_t b, uint64_t parent, const int32_t* tokens) {
  DSV3_CHECK(b >= 0 && b < n_blocks() && refs_[size_t(b)] > 0, "publish of block ", b);
  Content& c = content_[size_t(b)];
  if (c.published) return;
  const uint64_t key = block_hash(parent, tokens, opt_.block);
  if (by_key_.count(key)) return;
  c.published = true, c.key = key, c.parent = parent;
  c.tokens.assign(tokens, tokens + opt_.block);
  by_key_[key] = b;
}

int32_t KvCache::lookup(uint64_t parent, const int32_t* tokens) {
  auto it = by_key_.find(block_hash(parent, tokens, opt_.block));
  if (it == by_key_.end()) return -1;
  const int32_t b = it->second;
  const Content& c = content_[size_t(b)];
  if (c.parent != parent || !std::equal(c.tokens.begin(), c.tokens.end(), tokens)) return -1;
  if (refs_[size_t(b)] == 0) lru_.erase(lru_pos_[size_t(b)]);
  ++refs_[size_t(b)];
  return b;
}

void KvCache::forget(int32_t b) {
  Content& c = content_[size_t(b)];
  if (!c.published) return;
  by_key_.erase(c.key);
  c = Content{};
}

bool KvCache::grow(BlockTable& t, int64_t positions) {
  DSV3_CHECK(positions <= opt_.max_len, "a sequence of ", positions, " positions past the cache's ", opt_.max_len);
  const int64_t need = (positions + opt_.block - 1) / opt_.block - int64_t(t.blocks.size());
  if (need <= 0) return true;
  if (need > free_blocks()) return false;
  for (int64_t i = 0; i < need; ++i) t.blocks.push_back(take());
  return true;
}

void KvCache::reserve(BlockTable& t, int64_t positions) {
  if (grow(t, positions)) return;
  const int64_t have = int64_t(t.blocks.size()) * opt_.block;
  fail("out of KV cache: ", positions - have, " more positions needed, ", free_blocks() * opt_.block,
       " free of the ", n_blocks() * opt_.block, " the cache holds (", double(bytes()) / 1e9,
       " GB; raise --kv-cache-gb or run fewer sequences at once)");
}

void KvCache::truncate(BlockTable& t, int64_t positions) {
  const size_t keep = size_t((std::max<int64_t>(positions, 0) + opt_.block - 1) / opt_.block);
  while (t.blocks.size() > keep) {
    release(t.blocks.back());
    t.blocks.pop_back();
  }
}

}  // namespace dsv3
