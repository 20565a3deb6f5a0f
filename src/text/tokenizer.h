// Byte-level BPE tokenizer loaded from a Hugging Face tokenizer.json (DeepSeek-V3's: BPE vocab
// and merges, added/special tokens, a Sequence of Split pre-tokenizers, then ByteLevel).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dsv3 {

class Tokenizer {
 public:
  // Reads dir/tokenizer.json and, when present, dir/tokenizer_config.json (bos/eos tokens).
  // Throws Error naming the file and what is wrong (missing, not JSON, unsupported model type).
  static std::unique_ptr<Tokenizer> load(const std::string& dir);
  virtual ~Tokenizer() = default;

  // Ids of `text` without adding any special token; added tokens found inside the text are
  // matched before BPE. Invalid UTF-8 is rejected with an Error naming the byte offset.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Text of `ids`; ids out of range are an Error. skip_special drops special added tokens.
  virtual std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const = 0;
  // The raw bytes `ids` stand for, before UTF-8 repair (may end inside a character, or hold
  // invalid sequences); decode() is these bytes with each invalid subpart made U+FFFD, as Rust's
  // from_utf8_lossy does. StreamDecoder needs it. The default falls back to decode().
  virtual std::string decode_bytes(const std::vector<int32_t>& ids, bool skip_special = false) const {
    return decode(ids, skip_special);
  }

  virtual int vocab_size() const = 0;  // one past the largest id
  virtual bool is_special(int32_t id) const = 0;
  virtual std::optional<int32_t> token_id(std::string_view token) const = 0;  // exact token string
  virtual int32_t bos_id() const = 0;  // -1 when unknown
  virtual int32_t eos_id() const = 0;  // -1 when unknown
  virtual const std::string& bos_token() const = 0;  // "" when unknown
  virtual const std::string& eos_token() const = 0;
};

// Streams text for ids as they are generated: push() returns the text that is now complete,
// never a broken UTF-8 sequence (bytes of an unfinished character wait for the next id).
class StreamDecoder {
 public:
  StreamDecoder(const Tokenizer& tok, bool skip_special = true) : tok_(tok), skip_(skip_special) {}
  std::string push(int32_t id);
  std::string flush();  // whatever is left (incomplete bytes become U+FFFD)
 private:
  const Tokenizer& tok_;
  bool skip_;
  std::string pending_;
};

// Where the tokenizer files for a model live: `model_dir` when it has tokenizer.json, else the
// cache that scripts/fetch_tokenizer.sh fills ($DSV3_TOKENIZER_DIR, else
// ${DSV3_CACHE:-$HOME/.cache/dsv3}/tokenizer/deepseek-v3). Throws Error when neither has one.
// The only place that knows this search: commands, synth and the tests all call it.
std::string find_tokenizer_dir(const std::string& model_dir);

}  // namespace dsv3
