// The byte-level BPE model of a tokenizer.json: vocab, ranked merges, and the merge loop that
// turns one pre-tokenized piece (raw bytes) into ids, as HF tokenizers' `BPE::tokenize` does.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dsv3 {

// The GPT-2 byte <-> printable character table used by byte-level BPE vocabularies: the string
// (UTF-8) that stands for byte b, and the inverse (code point -> byte, -1 if not a byte char).
const std::string& byte_char(uint8_t b);
int char_byte(uint32_t code_point);

// Bytes that a vocab entry stands for: each character mapped back through the byte table; when
// some character is not a byte character (added tokens such as "<｜User｜>"), the token's own
// UTF-8 bytes, as HF's ByteLevel decoder does.
std::string token_to_bytes(std::string_view token);

class BpeModel {
 public:
  // vocab: (token string, id); merges: (left, right) token strings in rank order. `what` names the
  // source in error messages. unk_id < 0: characters missing from the vocab are dropped.
  BpeModel(const std::vector<std::pair<std::string, int32_t>>& vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, int32_t unk_id,
           const std::string& what);

  // Appends the ids of one piece given as raw bytes (the ByteLevel mapping is implied).
  void encode_piece(std::string_view bytes, std::vector<int32_t>& out) const;

  // The merge loop without the cache: lowest rank first, leftmost on ties. Pieces of up to
  // kSmallPiece symbols take a quadratic loop without allocation, longer ones a priority queue.
  void merge_symbols(std::vector<int32_t>& syms) const;
  static constexpr size_t kSmallPiece = 48;

 private:
  struct Merge {
    int32_t rank = -1;
    int32_t new_id = -1;
  };
  // Open-addressing map from the pair (left id, right id) to its merge; read-only after load.
  struct PairMap {
    std::vector<uint64_t> keys;  // [capacity] (left << 32 | right) + 1; 0 = empty slot
    std::vector<Merge> vals;     // [capacity]
    uint64_t mask = 0;
    void init(size_t n);
    void put(int32_t a, int32_t b, Merge m);
    Merge get(int32_t a, int32_t b) const {
      uint64_t k = ((uint64_t(uint32_t(a)) << 32) | uint32_t(b)) + 1;
      for (uint64_t h = hash(k) & mask;; h = (h + 1) & mask) {
        if (keys[h] == k) return vals[h];
        if (keys[h] == 0) return {};
      }
    }
    static uint64_t hash(uint64_t k) {
      k ^= k >> 33;
      k *= 0xff51afd7ed558ccdull;
      k ^= k >> 33;
      return k;
    }
  };
  void merge_small(std::vector<int32_t>& syms) const;
  void merge_large(std::vector<int32_t>& syms) const;

  int32_t byte_id_[256];  // id of the single-byte token for each byte; -1 if the vocab lacks it
  int32_t unk_id_;
  PairMap merges_;

  // Pieces repeat a lot in real text, so each thread keeps a direct-mapped cache of piece ->
  // ids (no lock; slots tagged with the model's instance number). See encode_piece.
  uint32_t instance_;
};

}  // namespace dsv3
