// The pre-tokenizer of a tokenizer.json: a Sequence of Split (regex or literal) steps and a final
// ByteLevel, cutting text into the pieces BPE merges within. Regexes are Oniguruma's dialect in
// the file (HF tokenizers uses onig); they run here on PCRE2 (UTF + UCP, JIT) after a small
// translation of the escapes whose meaning differs (see onig_to_pcre2).
#pragma once
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace dsv3 {

// Rewrites the Oniguruma escapes that PCRE2 reads differently: \s and \S (Onig: the Unicode
// White_Space property; PCRE2+UCP also counts U+180E), \h, \H (Onig: hex digit), and the general
// categories \p{L}, \p{M}, \p{N}, \p{P}, \p{S} (and \P{..} outside classes), which gain the
// characters of Unicode 15.0-16.0 that PCRE2 10.42 (Unicode 14) lacks. Other properties (\p{Lu},
// scripts, ...) pass through unchanged.
std::string onig_to_pcre2(std::string_view pattern);

class PreTokenizer {
 public:
  // `pre_tokenizer`: the object of that name in tokenizer.json; `what` names the file in errors.
  // Supported: Sequence, Split (Regex or String pattern, every behavior, invert), ByteLevel.
  PreTokenizer(const nlohmann::json& pre_tokenizer, const std::string& what);
  ~PreTokenizer();
  PreTokenizer(const PreTokenizer&) = delete;
  PreTokenizer& operator=(const PreTokenizer&) = delete;

  // Calls emit(piece) for the non-empty pieces of `text` (valid UTF-8), in order. A piece may
  // point into a temporary buffer: use it before emit returns.
  void split(std::string_view text, const std::function<void(std::string_view)>& emit) const;

 private:
  struct Step;
  void run(std::string_view text, size_t step, const std::function<void(std::string_view)>& emit) const;
  void add(const nlohmann::json& j, const std::string& what);
  std::vector<std::unique_ptr<Step>> steps_;
  bool has_byte_level_ = false;
};

}  // namespace dsv3
