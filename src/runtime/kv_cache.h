// The paged KV cache: every layer's cache rows in fixed-size blocks of `block` positions (the
// absorbed form's kv_norm(latent) and roped key, or the naive form's full K and V), a block
// allocator with reference counts (sequences may share prefix blocks), each sequence's block
// table, and the prefix cache: full blocks published under their content (the chained hash of
// every token up to their end), found again by a later sequence with the same prefix, kept
// while unreferenced until their space is needed (least recently used first). Attention in
// every backend reads a sequence's position p at block table[p / block], row p % block
// (backend/graph.h KvView).
#pragma once
#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "model/config.h"

namespace dsv3 {

// A sequence's blocks: its positions [i * block, (i + 1) * block) live in physical block blocks[i].
struct BlockTable {
  std::vector<int32_t> blocks;
};

class KvCache {
 public:
  struct Options {
    AttnImpl attn = AttnImpl::kAbsorb;
    int block = 64;        // positions per block, a power of two
    int64_t n_blocks = 0;  // blocks in the pool (> 0)
    int max_len = 0;       // positions one sequence may reach (> 0)
  };
  // Bytes one position takes over all layers (the latent + rope key for absorbed MLA, float32 or
  // with bf16_latent bf16; full float32 K and V for naive).
  static int64_t bytes_per_position(const ModelArgs& a, AttnImpl attn, bool bf16_latent = false);

  KvCache(const ModelArgs& a, Backend& be, const Options& o);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const std::vector<LayerCache>& layers() const { return layers_; }
  AttnImpl attn() const { return opt_.attn; }
  int block() const { return opt_.block; }
  int max_len() const { return opt_.max_len; }
  int64_t width() const { return (opt_.max_len + opt_.block - 1) / opt_.block; }  // blocks of a full sequence
  int64_t n_blocks() const { return opt_.n_blocks; }
  // Blocks take() can give: free ones and cached ones no sequence holds (evicted when taken).
  int64_t free_blocks() const { return int64_t(free_.size() + lru_.size()); }
  int64_t used_blocks() const { return n_blocks() - free_blocks(); }  // held by a sequence
  int64_t cached_blocks() const { return int64_t(lru_.size()); }    // unreferenced, in the prefix cache
  int64_t bytes() const;
  int64_t position_bytes() const { return pos_bytes_; }  // bytes_per_position of this cache
  bool bf16() const { return bf16_; }                    // its rows are bf16 (LayerCache::bf16)

  // Blocks, counted: take() gives a block with one reference: a free one, else the least recently
  // used unreferenced cached one (forgotten by the prefix cache); -1 when every block is held.
  // release() drops one reference; at zero a published block stays cached, another is freed.
  int32_t take();
  void retain(int32_t b);
  void release(int32_t b);
  int refs(int32_t b) const { return refs_.at(size_t(b)); }

  // Grows t to hold `positions` positions (at most max_len()). All or nothing: false, with
  // nothing taken, when the pool has too few free blocks.
  bool grow(BlockTable& t, int64_t positions);
  // grow(), or an Error in the caller's terms: positions asked, positions free, the pool's size.
  void reserve(BlockTable& t, int64_t positions);
  // Releases the blocks of t past its first `positions` positions.
  void truncate(BlockTable& t, int64_t positions);
  // Releases every block of t and empties it.
  void free(BlockTable& t) { truncate(t, 0); }

  // The prefix cache. A full block's key is block_hash(parent, tokens): parent = the key of the
  // block before it (0 for the first), tokens = its `block` token ids.
  static uint64_t block_hash(uint64_t parent, const int32_t* tokens, int n);
  // Makes held block b findable under its content (a block whose every position is computed and
  // will not be written again). No effect when another block holds that content already.
  void publish(int32_t b, uint64_t parent, const int32_t* tokens);
  // The block holding exactly this content, with a reference taken (-1: none; the caller
  // computes it). The tokens and parent key are compared, not only the hash.
  int32_t lookup(uint64_t parent, const int32_t* tokens);

 private:
  struct Content {  // what a published block holds
    bool published = false;
    uint64_t key = 0, parent = 0;
    std::vector<int32_t> tokens;
  };
  void forget(int32_t b);  // removes b from the prefix cache
  Backend& be_;
  Options opt_;
  int64_t pos_bytes_ = 0;
  bool bf16_ = false;
  std::vector<LayerCache> layers_;
  std::vector<int32_t> refs_;  // [n_blocks]
  std::vector<int32_t> free_;  // free blocks, the most recently freed last (taken first)
  std::vector<Content> content_;                         // [n_blocks]
  std::unordered_map<uint64_t, int32_t> by_key_;         // published blocks by key
  std::list<int32_t> lru_;                               // unreferenced published blocks, oldest first
  std::vector<std::list<int32_t>::iterator> lru_pos_;    // [n_blocks] (valid while in lru_)
};

}  // namespace dsv3
