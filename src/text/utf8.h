// UTF-8 checks for the tokenizer: strict validation (Unicode table 3-7, as Rust's `str` requires)
// and lossy repair the way Rust's String::from_utf8_lossy does it (what HF `tokenizers` decodes with).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dsv3::utf8 {

// One step of a left-to-right scan at the start of `s` (which must not be empty).
struct Step {
  size_t len;      // bytes consumed: the whole character, or the maximal invalid subpart (>= 1)
  bool valid;      // a complete, well-formed character
  bool truncated;  // invalid only because `s` ended: more bytes could still complete it
};
Step step(std::string_view s);

// Offset of the first byte that is not part of well-formed UTF-8, or s.size() when all of it is.
size_t first_invalid(std::string_view s);

// `s` with every maximal invalid subpart replaced by one U+FFFD (from_utf8_lossy).
std::string repair(std::string_view s);

// Number of bytes at the end of `s` that form a well-formed but unfinished character (0..3):
// the bytes a stream must hold back until the next piece arrives.
size_t unfinished_tail(std::string_view s);

}  // namespace dsv3::utf8
