// Byte-level BPE: vocab + ranked merges, applied lowest rank first (leftmost on ties), which is
// the order of HF tokenizers' `Word::merge_all` priority queue.
#include "text/bpe_model.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <climits>
#include <queue>
#include <unordered_map>

#include "core/error.h"

namespace dsv3 {

namespace {

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
}

struct ByteTable {
  std::string chars[256];  // byte -> UTF-8 of its stand-in character
  int16_t back[324];       // code point (< 324) -> byte, -1 if none
  ByteTable() {
    // GPT-2's bytes_to_unicode(): printable Latin-1 bytes stand for themselves, the other 68
    // bytes get the code points 256, 257, ... in byte order.
    std::fill(std::begin(back), std::end(back), int16_t(-1));
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      uint32_t cp = printable ? uint32_t(b) : next++;
      append_utf8(chars[b], cp);
      back[cp] = int16_t(b);
    }
  }
};

std::atomic<uint32_t> next_instance{0};  // numbers BpeModels, to tag their cache slots

const ByteTable& byte_table() {
  static const ByteTable t;
  return t;
}

}  // namespace

const std::string& byte_char(uint8_t b) { return byte_table().chars[b]; }

int char_byte(uint32_t cp) { return cp < 324 ? byte_table().back[cp] : -1; }

std::string token_to_bytes(std::string_view token) {
  std::string out;
  out.reserve(token.size());
  size_t i = 0;
  while (i < token.size()) {
    auto b0 = uint8_t(token[i]);
    uint32_t cp;
    size_t len;
    if (b0 < 0x80) {
      cp = b0, len = 1;
    } else if ((b0 & 0xE0) == 0xC0 && i + 1 < token.size()) {
      cp = ((b0 & 0x1F) << 6) | (uint8_t(token[i + 1]) & 0x3F), len = 2;
    } else {
      return std::string(token);  // 3+ byte characters are never byte characters
    }
    int b = char_byte(cp);
    if (b < 0) return std::string(token);
    out += char(b);
    i += len;
  }
  return out;
}

void BpeModel::PairMap::init(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;  // load factor <= 0.5 keeps probes short
  keys.assign(cap, 0);
  vals.assign(cap, Merge{});
  mask = cap - 1;
}

void BpeModel::PairMap::put(int32_t a, int32_t b, Merge m) {
  uint64_t k = ((uint64_t(uint32_t(a)) << 32) | uint32_t(b)) + 1;
  for (uint64_t h = hash(k) & mask;; h = (h + 1) & mask) {
    if (keys[h] == k) return;  // a repeated merge keeps its first (lowest) rank, as HF does
    if (keys[h] == 0) {
      keys[h] = k;
      vals[h] = m;
      return;
    }
  }
}

BpeModel::BpeModel(const std::vector<std::pair<std::string, int32_t>>& vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, int32_t unk_id,
                   const std::string& what)
    : unk_id_(unk_id), instance_(next_instance.fetch_add(1)) {
  std::unordered_map<std::string_view, int32_t> ids;
  ids.reserve(vocab.size());
  for (auto& [tok, id] : vocab) ids.emplace(tok, id);
  for (int b = 0; b < 256; ++b) {
    auto it = ids.find(byte_char(uint8_t(b)));
    byte_id_[b] = it == ids.end() ? -1 : it->second;
  }
  merges_.init(merges.size());
  std::string joined;
  for (size_t r = 0; r < merges.size(); ++r) {
    auto& [a, b] = merges[r];
    auto ia = ids.find(a), ib = ids.find(b);
    joined = a + b;
    auto ij = ids.find(joined);
    if (ia == ids.end() || ib == ids.end() || ij == ids.end())
      fail(what, ": merge #", r, " '", a, " ", b, "' uses a token missing from model.vocab ('",
           ia == ids.end() ? a : ib == ids.end() ? b : joined, "')");
    merges_.put(ia->second, ib->second, Merge{int32_t(r), ij->second});
  }
}

void BpeModel::merge_symbols(std::vector<int32_t>& syms) const {
  if (syms.size() <= kSmallPiece) merge_small(syms);
  else merge_large(syms);
}

// Quadratic in the piece length but allocation-free: the common case (words are short).
void BpeModel::merge_small(std::vector<int32_t>& syms) const {
  size_t n = syms.size();
  if (n < 2) return;
  Merge pair[kSmallPiece];  // pair[i]: merge of (syms[i], syms[i+1])
  for (size_t i = 0; i + 1 < n; ++i) pair[i] = merges_.get(syms[i], syms[i + 1]);
  while (n > 1) {
    size_t best = SIZE_MAX;
    int32_t best_rank = INT32_MAX;
    for (size_t i = 0; i + 1 < n; ++i)
      if (pair[i].rank >= 0 && pair[i].rank < best_rank) best_rank = pair[i].rank, best = i;
    if (best == SIZE_MAX) break;
    syms[best] = pair[best].new_id;
    for (size_t i = best + 1; i + 1 < n; ++i) syms[i] = syms[i + 1];
    for (size_t i = best + 1; i + 2 < n; ++i) pair[i] = pair[i + 1];
    --n;
    if (best > 0) pair[best - 1] = merges_.get(syms[best - 1], syms[best]);
    if (best + 1 < n) pair[best] = merges_.get(syms[best], syms[best + 1]);
  }
  syms.resize(n);
}

// For long pieces (runs of one character, long numbers without splits, ...): a priority queue of
// candidate merges over a linked list of symbols, O(n log n).
void BpeModel::merge_large(std::vector<int32_t>& syms) const {
  const int n = int(syms.size());
  std::vector<int> prev(n), next(n);
  std::vector<char> alive(n, 1);
  for (int i = 0; i < n; ++i) prev[i] = i - 1, next[i] = i + 1 < n ? i + 1 : -1;
  struct Cand {
    int32_t rank, pos, new_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> q;
  for (int i = 0; i + 1 < n; ++i)
    if (Merge m = merges_.get(syms[i], syms[i + 1]); m.rank >= 0) q.push({m.rank, i, m.new_id});
  while (!q.empty()) {
    Cand c = q.top();
    q.pop();
    int p = c.pos;
    if (!alive[p] || next[p] < 0) continue;
    int r = next[p];
    // A stale entry: the pair at p changed since it was queued (its text grew, so its id did too).
    if (merges_.get(syms[p], syms[r]).new_id != c.new_id) continue;
    syms[p] = c.new_id;
    alive[r] = 0;
    next[p] = next[r];
    if (next[r] >= 0) prev[next[r]] = p;
    if (prev[p] >= 0)
      if (Merge m = merges_.get(syms[prev[p]], syms[p]); m.rank >= 0) q.push({m.rank, prev[p], m.new_id});
    if (next[p] >= 0)
      if (Merge m = merges_.get(syms[p], syms[next[p]]); m.rank >= 0) q.push({m.rank, p, m.new_id});
  }
  size_t k = 0;
  for (int i = 0; i < n; ++i)
    if (alive[i]) syms[k++] = syms[i];
  syms.resize(k);
}

namespace {

// A direct-mapped cache of short pieces, one per thread: 2^15 slots of 64 bytes (2 MiB).
// A slot holds a piece of up to 18 bytes and its ids if there are at most 8; longer pieces
// are rare in real text and are merged every time.
struct PieceCache {
  static constexpr size_t kSlots = size_t(1) << 15;
  static constexpr size_t kMaxBytes = 18, kMaxIds = 8;
  struct Slot {
    uint64_t hash;
    uint32_t owner;  // BpeModel::instance_ + 1; 0 = empty
    uint8_t len, n_ids;
    char bytes[kMaxBytes];
    int32_t ids[kMaxIds];
  };
  static_assert(sizeof(Slot) == 64);
  std::vector<Slot> slots = std::vector<Slot>(kSlots, Slot{});
};

uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ n;
  while (n >= 8) {
    uint64_t w;
    __builtin_memcpy(&w, p, 8);
    h = (h ^ w) * 0xff51afd7ed558ccdull;
    h ^= h >> 32;
    p += 8, n -= 8;
  }
  if (n) {
    uint64_t w = 0;
    __builtin_memcpy(&w, p, n);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
  }
  return h;
}

}  // namespace

void BpeModel::encode_piece(std::string_view bytes, std::vector<int32_t>& out) const {
  PieceCache::Slot* slot = nullptr;
  uint64_t h = 0;
  if (bytes.size() <= PieceCache::kMaxBytes) {
    thread_local std::unique_ptr<PieceCache> cache;
    if (!cache) cache = std::make_unique<PieceCache>();
    h = hash_bytes(bytes.data(), bytes.size());
    slot = &cache->slots[(h >> 7) & (PieceCache::kSlots - 1)];
    if (slot->hash == h && slot->owner == instance_ + 1 && slot->len == bytes.size() &&
        __builtin_memcmp(slot->bytes, bytes.data(), bytes.size()) == 0) {
      out.insert(out.end(), slot->ids, slot->ids + slot->n_ids);
      return;
    }
  }
  thread_local std::vector<int32_t> syms;  // reused: no allocation per piece
  syms.clear();
  for (char ch : bytes) {
    int32_t id = byte_id_[uint8_t(ch)];
    if (id >= 0) syms.push_back(id);
    else if (unk_id_ >= 0) syms.push_back(unk_id_);  // (no unk token: HF drops the character)
  }
  merge_symbols(syms);
  out.insert(out.end(), syms.begin(), syms.end());
  if (slot && syms.size() <= PieceCache::kMaxIds) {
    slot->hash = h;
    slot->owner = instance_ + 1;
    slot->len = uint8_t(bytes.size());
    slot->n_ids = uint8_t(syms.size());
    __builtin_memcpy(slot->bytes, bytes.data(), bytes.size());
    std::copy(syms.begin(), syms.end(), slot->ids);
  }
}

}  // namespace dsv3
