// Strict UTF-8 scanning (Unicode 15, table 3-7 "well-formed UTF-8 byte sequences").
#include "text/utf8.h"

namespace dsv3::utf8 {

Step step(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  uint8_t b0 = p[0];
  if (b0 < 0x80) return {1, true, false};
  size_t need;          // total length of the character that b0 starts
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;  // no overlong forms
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;  // no overlong forms
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {1, false, false};  // continuation byte, C0/C1 or F5..FF: never starts a character
  }
  for (size_t i = 1; i < need; ++i) {
    if (i >= n) return {i, false, true};
    uint8_t b = p[i];
    uint8_t l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (b < l || b > h) return {i, false, false};
  }
  return {need, true, false};
}

size_t first_invalid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII runs are the common case: skip them eight bytes at a time.
    while (i + 8 <= s.size()) {
      uint64_t w;
      __builtin_memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= s.size()) break;
    Step st = step(s.substr(i));
    if (!st.valid) return i;
    i += st.len;
  }
  return s.size();
}

std::string repair(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    Step st = step(s.substr(i));
    if (st.valid) out.append(s.data() + i, st.len);
    else out.append("\xEF\xBF\xBD");  // U+FFFD
    i += st.len;
  }
  return out;
}

size_t unfinished_tail(std::string_view s) {
  // A character is at most 4 bytes, so only a start byte among the last 3 can be unfinished.
  for (size_t k = 1; k <= 3 && k <= s.size(); ++k) {
    size_t at = s.size() - k;
    auto b = uint8_t(s[at]);
    if (b >= 0x80 && b <= 0xBF) continue;  // continuation byte: look further back
    Step st = step(s.substr(at));
    return (!st.valid && st.truncated && st.len == k) ? k : 0;
  }
  return 0;
}

}  // namespace dsv3::utf8
