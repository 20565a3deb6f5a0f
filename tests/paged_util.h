// Paged-cache fixtures for op-level attention tests: block tables whose physical blocks are
// interleaved across sequences and out of order, so a kernel that ignored the table (or
// assumed a sequence's rows contiguous past a block) would read another sequence's rows.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "model/rope.h"

namespace dsv3::test {

struct Paged {
  int seqs = 0, block = 16;
  int64_t width = 0;           // blocks per sequence
  std::vector<int32_t> table;  // [seqs, width]
  // Sequence s's logical block b lives in physical block (seqs * width - 1) - (b * seqs + s).
  Paged(int n_seqs, int64_t max_len, int block_positions = 16)
      : seqs(n_seqs), block(block_positions), width((max_len + block_positions - 1) / block_positions) {
    table.resize(size_t(seqs * width));
    for (int s = 0; s < seqs; ++s)
      for (int64_t b = 0; b < width; ++b) table[size_t(s * width + b)] = int32_t(seqs * width - 1 - (b * seqs + s));
  }
  int64_t rows() const { return int64_t(seqs) * width * block; }  // cache rows the tables address
  KvView view() const { return {table.data(), seqs, width, block}; }
  Step step(const std::vector<TokenPos>& tp) const {
    Step s;
    s.pos = tp.data(), s.n = int64_t(tp.size()), s.kv = view();
    return s;
  }
};

inline RopeView rope_view(const RopeTable& r, const float* data = nullptr) {
  return {r.at(0), data ? data : r.at(0), r.n_positions(), r.half()};
}

}  // namespace dsv3::test
