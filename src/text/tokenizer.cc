// Loads a Hugging Face tokenizer.json (byte-level BPE) and encodes/decodes with the semantics of
// HF tokenizers 0.23: added tokens split out first (leftmost-longest, the non-normalized ones
// before the normalized ones), then the pre-tokenizer, then BPE per piece.
#include "text/tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/error.h"
#include "io/mmap_file.h"
#include "text/bpe_model.h"
#include "text/bpe_pretokenizer.h"
#include "text/utf8.h"

namespace dsv3 {

using json = nlohmann::json;

namespace {

// Rust's char::is_whitespace (Unicode White_Space), for added tokens' lstrip/rstrip.
bool is_white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Decodes the character at s[i] (valid UTF-8); returns its length.
size_t decode_char(std::string_view s, size_t i, uint32_t& cp) {
  auto b = [&](size_t k) { return uint32_t(uint8_t(s[i + k])); };
  uint32_t b0 = b(0);
  if (b0 < 0x80) return cp = b0, 1;
  if (b0 < 0xE0) return cp = ((b0 & 0x1F) << 6) | (b(1) & 0x3F), 2;
  if (b0 < 0xF0) return cp = ((b0 & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F), 3;
  return cp = ((b0 & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F), 4;
}

struct AddedToken {
  std::string content;
  int32_t id;
  bool special, normalized, lstrip, rstrip;
};

// Finds added tokens in text the way HF's AddedVocabulary does with its aho-corasick automaton
// (MatchKind::LeftmostLongest): the leftmost match, the longest one there, then on from its end.
class AddedMatcher {
 public:
  void add(const AddedToken* t) {
    if (t->content.empty()) return;
    int node = 0;
    for (char ch : t->content) {
      auto b = uint8_t(ch);
      int child = find(node, b);
      if (child < 0) {
        child = int(nodes_.size());
        nodes_[node].kids.push_back({b, child});
        nodes_.push_back({});
      }
      node = child;
    }
    nodes_[node].token = t;
    first_byte_[uint8_t(t->content[0])] = true;
    any_ = true;
  }

  // Calls on_text(gap) for text between tokens and on_token(id) for each token found.
  template <class OnText, class OnToken>
  void split(std::string_view s, OnText&& on_text, OnToken&& on_token) const {
    if (!any_) {
      if (!s.empty()) on_text(s);
      return;
    }
    size_t done = 0;  // end of the last token (start_offset in HF)
    size_t i = 0;
    while (i < s.size()) {
      if (!first_byte_[uint8_t(s[i])]) {
        ++i;
        continue;
      }
      const AddedToken* t = nullptr;
      size_t end = 0;
      int node = 0;
      for (size_t j = i; j < s.size(); ++j) {
        node = find(node, uint8_t(s[j]));
        if (node < 0) break;
        if (nodes_[node].token) t = nodes_[node].token, end = j + 1;
      }
      if (!t) {
        ++i;
        continue;
      }
      size_t start = i, stop = end;
      i = end;
      if (t->lstrip) {  // swallow whitespace before it, but not what a previous token took
        size_t k = start;
        while (k > done) {
          size_t b = k - 1;
          while (b > done && (uint8_t(s[b]) & 0xC0) == 0x80) --b;
          uint32_t cp;
          decode_char(s, b, cp);
          if (!is_white_space(cp)) break;
          k = b;
        }
        start = k;
      }
      if (t->rstrip) {  // and after it
        uint32_t cp;
        while (stop < s.size()) {
          size_t len = decode_char(s, stop, cp);
          if (!is_white_space(cp)) break;
          stop += len;
        }
        i = stop;
      }
      if (done < start) on_text(s.substr(done, start - done));
      on_token(t->id);
      done = stop;
    }
    if (done < s.size()) on_text(s.substr(done));
  }

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int>> kids;
    const AddedToken* token = nullptr;
  };
  int find(int node, uint8_t b) const {
    for (auto& [k, c] : nodes_[node].kids)
      if (k == b) return c;
    return -1;
  }
  std::vector<Node> nodes_{1};
  bool first_byte_[256] = {};
  bool any_ = false;
};

// "bos_token": "..." or {"content": "...", ...} or null.
std::string token_field(const json& cfg, const char* key) {
  if (!cfg.contains(key)) return "";
  const json& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}

// Normalizers we can honour: none, or (possibly nested) empty Sequences.
bool is_identity_normalizer(const json& n) {
  if (n.is_null()) return true;
  if (!n.is_object() || n.value("type", "") != "Sequence" || !n.contains("normalizers")) return false;
  for (auto& x : n["normalizers"])
    if (!is_identity_normalizer(x)) return false;
  return true;
}

json parse_json_file(const std::string& path) {
  std::string text = read_text_file(path);
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    fail(path, ": not valid JSON (", e.what(), ")");
  }
}

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(const std::string& dir);

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const override;
  std::string decode_bytes(const std::vector<int32_t>& ids, bool skip_special) const override;

  int vocab_size() const override { return int(id_bytes_.size()); }
  bool is_special(int32_t id) const override {
    return id >= 0 && size_t(id) < kind_.size() && kind_[id] == kSpecial;
  }
  std::optional<int32_t> token_id(std::string_view token) const override {
    auto it = token_ids_.find(std::string(token));
    if (it == token_ids_.end()) return std::nullopt;
    return it->second;
  }
  int32_t bos_id() const override { return bos_id_; }
  int32_t eos_id() const override { return eos_id_; }
  const std::string& bos_token() const override { return bos_token_; }
  const std::string& eos_token() const override { return eos_token_; }

 private:
  void load_model(const json& model, const std::string& what);
  void load_added_tokens(const json& added, const std::string& what);
  void load_config(const std::string& path);

  enum : uint8_t { kNone = 0, kModel, kAdded, kSpecial };

  std::unique_ptr<BpeModel> bpe_;
  std::unique_ptr<PreTokenizer> pre_;
  std::vector<AddedToken> added_;
  AddedMatcher raw_matcher_, normalized_matcher_;  // HF: split_trie, split_normalized_trie
  std::vector<std::string> id_bytes_;  // [vocab_size] the bytes each id decodes to
  std::vector<uint8_t> kind_;          // [vocab_size] kNone for ids that name no token
  std::unordered_map<std::string, int32_t> token_ids_;
  std::string bos_token_, eos_token_;
  int32_t bos_id_ = -1, eos_id_ = -1;
};

BpeTokenizer::BpeTokenizer(const std::string& dir) {
  const std::string path = dir + "/tokenizer.json";
  if (!file_exists(dir)) fail("tokenizer directory '", dir, "' does not exist");
  if (!file_exists(path)) fail("tokenizer directory '", dir, "' has no tokenizer.json");
  json j = parse_json_file(path);
  try {
    if (!j.is_object()) fail(path, ": expected a JSON object at the top level");
    if (!j.contains("model") || !j["model"].is_object()) fail(path, ": no 'model' object");
    if (!is_identity_normalizer(j.value("normalizer", json())))
      fail(path, ": unsupported normalizer ", j["normalizer"].dump().substr(0, 200),
           " (only null or an empty Sequence)");
    load_model(j["model"], path);
    load_added_tokens(j.value("added_tokens", json::array()), path);
    pre_ = std::make_unique<PreTokenizer>(j.value("pre_tokenizer", json()), path);
    const json dec = j.value("decoder", json());
    if (!dec.is_object() || dec.value("type", "") != "ByteLevel")
      fail(path, ": unsupported decoder ", dec.dump().substr(0, 200), " (only ByteLevel)");
  } catch (const json::exception& e) {  // a field of the wrong JSON type
    fail(path, ": unexpected structure (", e.what(), ")");
  }
  load_config(dir + "/tokenizer_config.json");
}

void BpeTokenizer::load_model(const json& m, const std::string& what) {
  std::string type = m.value("type", "BPE");  // HF infers BPE from vocab + merges when absent
  if (type != "BPE") fail(what, ": model type '", type, "' is not supported (only BPE)");
  if (!m.contains("vocab") || !m["vocab"].is_object()) fail(what, ": model.vocab must be an object");
  if (!m.contains("merges") || !m["merges"].is_array()) fail(what, ": model.merges must be an array");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(k) && !m[k].is_null() && m[k] != "") fail(what, ": model.", k, " is not supported");
  if (m.value("byte_fallback", false)) fail(what, ": model.byte_fallback is not supported");
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0.0)
    fail(what, ": BPE dropout is not supported (inference tokenizes deterministically)");

  std::vector<std::pair<std::string, int32_t>> vocab;
  vocab.reserve(m["vocab"].size());
  int64_t max_id = -1;
  for (auto& [tok, idj] : m["vocab"].items()) {
    if (!idj.is_number_integer()) fail(what, ": model.vocab['", tok, "'] is not an integer id");
    int64_t id = idj.get<int64_t>();
    if (id < 0 || id >= (1 << 24)) fail(what, ": model.vocab['", tok, "'] has id ", id, " out of range");
    vocab.emplace_back(tok, int32_t(id));
    max_id = std::max(max_id, id);
  }
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(m["merges"].size());
  for (auto& mj : m["merges"]) {
    if (mj.is_string()) {  // "left right"
      const std::string& s = mj.get_ref<const std::string&>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        fail(what, ": merge #", merges.size(), " '", s, "' is not two tokens separated by one space");
      merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
    } else if (mj.is_array() && mj.size() == 2 && mj[0].is_string() && mj[1].is_string()) {
      merges.emplace_back(mj[0].get<std::string>(), mj[1].get<std::string>());  // ["left", "right"]
    } else {
      fail(what, ": merge #", merges.size(), " must be \"a b\" or [\"a\", \"b\"]");
    }
  }
  int32_t unk_id = -1;
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    std::string unk = m["unk_token"];
    for (auto& [tok, id] : vocab)
      if (tok == unk) unk_id = id;
    if (unk_id < 0) fail(what, ": model.unk_token '", unk, "' is not in model.vocab");
  }
  bpe_ = std::make_unique<BpeModel>(vocab, merges, unk_id, what);

  id_bytes_.assign(size_t(max_id + 1), std::string());
  kind_.assign(size_t(max_id + 1), kNone);
  token_ids_.reserve(vocab.size() + 1024);
  for (auto& [tok, id] : vocab) {
    id_bytes_[id] = token_to_bytes(tok);
    kind_[id] = kModel;
    token_ids_[tok] = id;
  }
}

void BpeTokenizer::load_added_tokens(const json& added, const std::string& what) {
  if (!added.is_array()) fail(what, ": added_tokens must be an array");
  added_.reserve(added.size());
  for (auto& a : added) {
    if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") ||
        !a["content"].is_string())
      fail(what, ": added_tokens entry needs an integer 'id' and a string 'content': ", a.dump().substr(0, 200));
    int64_t id = a["id"].get<int64_t>();
    std::string content = a["content"];
    if (id < 0 || id >= (1 << 24)) fail(what, ": added token '", content, "' has id ", id, " out of range");
    if (a.value("single_word", false))
      fail(what, ": added token '", content, "' has single_word set, which is not supported");
    if (utf8::first_invalid(content) != content.size())
      fail(what, ": added token id ", id, " is not valid UTF-8");
    added_.push_back({content, int32_t(id), a.value("special", false), a.value("normalized", !a.value("special", false)),
                      a.value("lstrip", false), a.value("rstrip", false)});
  }
  for (auto& t : added_) {
    if (size_t(t.id) >= id_bytes_.size()) {
      id_bytes_.resize(t.id + 1);
      kind_.resize(t.id + 1, kNone);
    }
    // HF's id_to_token asks the added vocabulary first, so an added token wins over the model's.
    id_bytes_[t.id] = token_to_bytes(t.content);
    kind_[t.id] = t.special ? kSpecial : kAdded;
    token_ids_[t.content] = t.id;
    (t.normalized ? normalized_matcher_ : raw_matcher_).add(&t);
  }
}

void BpeTokenizer::load_config(const std::string& path) {
  if (!file_exists(path)) return;
  json cfg = parse_json_file(path);
  if (!cfg.is_object()) fail(path, ": expected a JSON object at the top level");
  bos_token_ = token_field(cfg, "bos_token");
  eos_token_ = token_field(cfg, "eos_token");
  if (auto id = token_id(bos_token_); id && !bos_token_.empty()) bos_id_ = *id;
  if (auto id = token_id(eos_token_); id && !eos_token_.empty()) eos_id_ = *id;
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  if (size_t bad = utf8::first_invalid(text); bad != text.size()) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02X", unsigned(uint8_t(text[bad])));
    fail("input text is not valid UTF-8 at byte offset ", bad, " (byte ", hex, ")");
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  auto push_id = [&](int32_t id) { ids.push_back(id); };
  const std::function<void(std::string_view)> bpe = [&](std::string_view piece) {
    bpe_->encode_piece(piece, ids);
  };
  // The normalizer is the identity, so "normalized" tokens are found in the same text, after
  // the others have been split out (HF AddedVocabulary::extract_and_normalize).
  raw_matcher_.split(
      text,
      [&](std::string_view gap) {
        normalized_matcher_.split(gap, [&](std::string_view g) { pre_->split(g, bpe); }, push_id);
      },
      push_id);
  return ids;
}

std::string BpeTokenizer::decode_bytes(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    int32_t id = ids[i];
    if (id < 0 || size_t(id) >= kind_.size() || kind_[id] == kNone)
      fail("token id ", id, " (position ", i, ") is not in the vocabulary (size ", vocab_size(), ")");
    if (skip_special && kind_[id] == kSpecial) continue;
    out += id_bytes_[id];
  }
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string bytes = decode_bytes(ids, skip_special);
  if (utf8::first_invalid(bytes) == bytes.size()) return bytes;
  return utf8::repair(bytes);
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& dir) {
  return std::make_unique<BpeTokenizer>(dir);
}

std::string StreamDecoder::push(int32_t id) {
  pending_ += tok_.decode_bytes({id}, skip_);
  // Hold back a character that the next token may finish; everything before it is final.
  size_t keep = utf8::unfinished_tail(pending_);
  std::string_view ready(pending_.data(), pending_.size() - keep);
  std::string out = utf8::first_invalid(ready) == ready.size() ? std::string(ready) : utf8::repair(ready);
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = utf8::repair(pending_);
  pending_.clear();
  return out;
}

std::string find_tokenizer_dir(const std::string& model_dir) {
  if (!model_dir.empty() && file_exists(model_dir + "/tokenizer.json")) return model_dir;
  std::string cache;
  if (const char* d = std::getenv("DSV3_TOKENIZER_DIR"); d && *d) {
    cache = d;
  } else if (const char* c = std::getenv("DSV3_CACHE"); c && *c) {
    cache = std::string(c) + "/tokenizer/deepseek-v3";
  } else if (const char* h = std::getenv("HOME"); h && *h) {
    cache = std::string(h) + "/.cache/dsv3/tokenizer/deepseek-v3";
  }
  if (!cache.empty() && file_exists(cache + "/tokenizer.json")) return cache;
  fail("no tokenizer.json found in ",
       model_dir.empty() ? std::string() : str("the model directory '", model_dir, "' nor "),
       cache.empty() ? std::string("the cache (HOME is not set)") : str("'", cache, "'"),
       "; run scripts/fetch_tokenizer.sh or set DSV3_TOKENIZER_DIR");
}

}  // namespace dsv3
