// The paged KV cache: every layer's cache rows in fixed-size blocks of `block` positions (the
// absorbed form's kv_norm(latent) and roped key, or the naive form's full K and V), a block
// allocator with reference counts (sequences may share prefix blocks), and each sequence's block
// table. Attention in every backend reads a sequence's position p at block table[p / block],
// row p % block (backend/graph.h KvView).
#pragma once
#include <cstdint>
#include <string>
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
  // Bytes one position takes over all layers (float32 latent + rope key for absorbed MLA, full K
  // and V for naive).
  static int64_t bytes_per_position(const ModelArgs& a, AttnImpl attn);

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
  int64_t free_blocks() const { return int64_t(free_.size()); }
  int64_t used_blocks() const { return n_blocks() - free_blocks(); }
  int64_t bytes() const;

  // Blocks, counted: take() gives a free block with one reference (-1 when none is free);
  // release() drops one and frees the block at zero.
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

 private:
  Backend& be_;
  Options opt_;
  int64_t pos_bytes_ = 0;
  std::vector<LayerCache> layers_;
  std::vector<int32_t> refs_;  // [n_blocks]
  std::vector<int32_t> free_;  // free blocks, the most recently freed last (taken first)
};

}  // namespace dsv3
