// Split/ByteLevel pre-tokenization with the semantics of HF tokenizers: `Pattern::find_matches`
// (matches and the gaps between them), `NormalizedString::split` (the five delimiter behaviors)
// and `PreTokenizedString::split` (empty pieces dropped).
#include "text/bpe_pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace dsv3 {

namespace {

// Unicode White_Space (what Oniguruma's \s means), as PCRE2 class members.
constexpr const char* kWhiteSpace =
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

// GPT-2's pattern, which ByteLevel applies when use_regex is true.
constexpr const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// Characters that Oniguruma 6.9.10 (Unicode 16.0, in HF tokenizers 0.23) puts in a general
// category but PCRE2 10.42 (Unicode 14.0) does not know yet: everything assigned in Unicode 15.0
// to 16.0, by category. Found by running each \p{X} over every code point through HF tokenizers
// 0.23.2 and PCRE2 and keeping the difference; it was purely additive. With a newer PCRE2 these
// are merely repeated; a PCRE2 past Unicode 16 would know characters the oracle does not.
struct CategoryAdditions {
  char category;
  const char* members;  // PCRE2 class members
};
constexpr CategoryAdditions kUnicode16Additions[] = {
    {'L',
     "\\x{1C89}-\\x{1C8A}\\x{A7CB}-\\x{A7CD}\\x{A7DA}-\\x{A7DC}\\x{105C0}-\\x{105F3}"
     "\\x{10D4A}-\\x{10D65}\\x{10D6F}-\\x{10D85}\\x{10EC2}-\\x{10EC4}\\x{1123F}-\\x{11240}"
     "\\x{11380}-\\x{11389}\\x{1138B}\\x{1138E}\\x{11390}-\\x{113B5}\\x{113B7}\\x{113D1}"
     "\\x{113D3}\\x{11BC0}-\\x{11BE0}\\x{11F02}\\x{11F04}-\\x{11F10}\\x{11F12}-\\x{11F33}"
     "\\x{1342F}\\x{13441}-\\x{13446}\\x{13460}-\\x{143FA}\\x{16100}-\\x{1611D}"
     "\\x{16D40}-\\x{16D6C}\\x{18CFF}\\x{1B132}\\x{1B155}\\x{1DF25}-\\x{1DF2A}"
     "\\x{1E030}-\\x{1E06D}\\x{1E4D0}-\\x{1E4EB}\\x{1E5D0}-\\x{1E5ED}\\x{1E5F0}\\x{2B739}"
     "\\x{2EBF0}-\\x{2EE5D}\\x{31350}-\\x{323AF}"},
    {'M',
     "\\x{897}\\x{CF3}\\x{ECE}\\x{10D69}-\\x{10D6D}\\x{10EFC}-\\x{10EFF}\\x{11241}"
     "\\x{113B8}-\\x{113C0}\\x{113C2}\\x{113C5}\\x{113C7}-\\x{113CA}\\x{113CC}-\\x{113D0}"
     "\\x{113D2}\\x{113E1}-\\x{113E2}\\x{11F00}-\\x{11F01}\\x{11F03}\\x{11F34}-\\x{11F3A}"
     "\\x{11F3E}-\\x{11F42}\\x{11F5A}\\x{13440}\\x{13447}-\\x{13455}\\x{1611E}-\\x{1612F}"
     "\\x{1E08F}\\x{1E4EC}-\\x{1E4EF}\\x{1E5EE}-\\x{1E5EF}"},
    {'N',
     "\\x{10D40}-\\x{10D49}\\x{116D0}-\\x{116E3}\\x{11BF0}-\\x{11BF9}\\x{11F50}-\\x{11F59}"
     "\\x{16130}-\\x{16139}\\x{16D70}-\\x{16D79}\\x{1CCF0}-\\x{1CCF9}\\x{1D2C0}-\\x{1D2D3}"
     "\\x{1E4F0}-\\x{1E4F9}\\x{1E5F1}-\\x{1E5FA}"},
    {'P',
     "\\x{1B4E}-\\x{1B4F}\\x{1B7F}\\x{10D6E}\\x{113D4}-\\x{113D5}\\x{113D7}-\\x{113D8}"
     "\\x{11B00}-\\x{11B09}\\x{11BE1}\\x{11F43}-\\x{11F4F}\\x{16D6D}-\\x{16D6F}\\x{1E5FF}"},
    {'S',
     "\\x{2427}-\\x{2429}\\x{2FFC}-\\x{2FFF}\\x{31E4}-\\x{31E5}\\x{31EF}\\x{10D8E}-\\x{10D8F}"
     "\\x{1CC00}-\\x{1CCEF}\\x{1CD00}-\\x{1CEB3}\\x{1F6DC}\\x{1F774}-\\x{1F776}"
     "\\x{1F77B}-\\x{1F77F}\\x{1F7D9}\\x{1F8B2}-\\x{1F8BB}\\x{1F8C0}-\\x{1F8C1}"
     "\\x{1FA75}-\\x{1FA77}\\x{1FA87}-\\x{1FA89}\\x{1FA8F}\\x{1FAAD}-\\x{1FAAF}"
     "\\x{1FABB}-\\x{1FABF}\\x{1FAC6}\\x{1FACE}-\\x{1FACF}\\x{1FADA}-\\x{1FADC}\\x{1FADF}"
     "\\x{1FAE8}-\\x{1FAE9}\\x{1FAF7}-\\x{1FAF8}\\x{1FBCB}-\\x{1FBEF}"},
};

const char* category_additions(std::string_view name) {
  for (auto& a : kUnicode16Additions)
    if (name.size() == 1 && name[0] == a.category) return a.members;
  return nullptr;
}

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Per-thread PCRE2 matching state: match data (only the whole-match pair is read) and a JIT stack.
struct MatchState {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mc = nullptr;
  pcre2_jit_stack* js = nullptr;
  MatchState() {
    md = pcre2_match_data_create(1, nullptr);
    mc = pcre2_match_context_create(nullptr);
    js = pcre2_jit_stack_create(64 * 1024, 16 * 1024 * 1024, nullptr);
    DSV3_CHECK(md && mc && js, "PCRE2 allocation failed");
    pcre2_jit_stack_assign(mc, nullptr, js);
  }
  ~MatchState() {
    pcre2_jit_stack_free(js);
    pcre2_match_context_free(mc);
    pcre2_match_data_free(md);
  }
};

MatchState& match_state() {
  thread_local MatchState s;
  return s;
}

size_t utf8_char_len(uint8_t b) { return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; }

}  // namespace

std::string onig_to_pcre2(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  int depth = 0;  // inside a character class (Oniguruma allows nested ones)
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char e = p[++i];
      if ((e == 'p' || e == 'P') && i + 1 < p.size() && p[i + 1] == '{') {
        size_t close = p.find('}', i + 1);
        const char* more = close == std::string_view::npos ? nullptr : category_additions(p.substr(i + 2, close - i - 2));
        if (more && (e == 'p' || !depth)) {
          std::string cls = str("\\p{", p.substr(i + 2, close - i - 2), "}", more);
          out += depth ? cls : str(e == 'p' ? "[" : "[^", cls, "]");
          i = close;
          continue;
        }
      }
      if (e == 's') out += depth ? std::string(kWhiteSpace) : str("[", kWhiteSpace, "]");
      else if (e == 'S' && !depth) out += str("[^", kWhiteSpace, "]");
      else if (e == 'h') out += depth ? "0-9a-fA-F" : "[0-9a-fA-F]";
      else if (e == 'H' && !depth) out += "[^0-9a-fA-F]";
      else out += c, out += e;
      continue;
    }
    if (c == '[') ++depth;
    else if (c == ']' && depth) --depth;
    out += c;
  }
  return out;
}

struct PreTokenizer::Step {
  enum Kind { kSplit, kPrefixSpace } kind = kSplit;
  pcre2_code* re = nullptr;
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  ~Step() { pcre2_code_free(re); }
};

PreTokenizer::~PreTokenizer() = default;

PreTokenizer::PreTokenizer(const nlohmann::json& j, const std::string& what) {
  if (j.is_null()) fail(what, ": pre_tokenizer is null; a byte-level BPE needs a ByteLevel pre_tokenizer");
  add(j, what);
  if (!has_byte_level_) fail(what, ": pre_tokenizer has no ByteLevel step (only byte-level BPE is supported)");
}

static pcre2_code* compile(const std::string& pattern, bool literal, const std::string& what) {
  int err = 0;
  PCRE2_SIZE off = 0;
  uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
  pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts, &err,
                                 &off, nullptr);
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    fail(what, ": pre_tokenizer regex '", pattern, "' does not compile at offset ", off, ": ",
         reinterpret_cast<const char*>(msg));
  }
  pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  // when JIT is unavailable the interpreter runs it
  return re;
}

void PreTokenizer::add(const nlohmann::json& j, const std::string& what) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    fail(what, ": pre_tokenizer entry without a string 'type': ", j.dump().substr(0, 200));
  std::string type = j["type"];
  if (type == "Sequence") {
    if (!j.contains("pretokenizers") || !j["pretokenizers"].is_array())
      fail(what, ": pre_tokenizer Sequence without a 'pretokenizers' array");
    for (auto& s : j["pretokenizers"]) add(s, what);
  } else if (type == "Split") {
    auto step = std::make_unique<Step>();
    const auto& pat = j.at("pattern");
    if (pat.contains("Regex")) step->re = compile(onig_to_pcre2(pat["Regex"].get<std::string>()), false, what);
    else if (pat.contains("String")) step->re = compile(pat["String"].get<std::string>(), true, what);
    else fail(what, ": Split pattern must have 'Regex' or 'String': ", pat.dump().substr(0, 200));
    std::string b = j.value("behavior", "Isolated");
    if (b == "Removed") step->behavior = Behavior::kRemoved;
    else if (b == "Isolated") step->behavior = Behavior::kIsolated;
    else if (b == "MergedWithPrevious") step->behavior = Behavior::kMergedWithPrevious;
    else if (b == "MergedWithNext") step->behavior = Behavior::kMergedWithNext;
    else if (b == "Contiguous") step->behavior = Behavior::kContiguous;
    else fail(what, ": unknown Split behavior '", b, "'");
    step->invert = j.value("invert", false);
    steps_.push_back(std::move(step));
  } else if (type == "ByteLevel") {
    // HF ByteLevel::pre_tokenize: an optional leading space, the GPT-2 regex when use_regex, then
    // bytes to characters (implied here: BPE works on the bytes).
    if (j.value("add_prefix_space", false)) {
      auto step = std::make_unique<Step>();
      step->kind = Step::kPrefixSpace;
      steps_.push_back(std::move(step));
    }
    if (j.value("use_regex", true)) {
      auto step = std::make_unique<Step>();
      step->re = compile(onig_to_pcre2(kGpt2Pattern), false, what);
      steps_.push_back(std::move(step));
    }
    has_byte_level_ = true;
  } else {
    fail(what, ": unsupported pre_tokenizer type '", type, "' (supported: Sequence, Split, ByteLevel)");
  }
}

void PreTokenizer::split(std::string_view text, const std::function<void(std::string_view)>& emit) const {
  if (!text.empty()) run(text, 0, emit);
}

void PreTokenizer::run(std::string_view text, size_t k,
                       const std::function<void(std::string_view)>& emit) const {
  if (k == steps_.size()) {
    emit(text);
    return;
  }
  const Step& st = *steps_[k];
  if (st.kind == Step::kPrefixSpace) {
    if (text[0] == ' ') {
      run(text, k + 1, emit);
    } else {
      std::string with_space = " " + std::string(text);
      run(with_space, k + 1, emit);
    }
    return;
  }

  // Pattern::find_matches: (start, end, is_match) covering the text; onig's find_iter never
  // yields an empty match right where the previous match ended.
  struct Span {
    size_t start, end;
    bool flag;  // is_match, later: remove
  };
  std::vector<Span> spans;
  MatchState& ms = match_state();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0, prev_end = 0;
  bool have_prev = false;
  while (pos <= text.size()) {
    int rc = pcre2_match(st.re, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, ms.md, ms.mc);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      fail("pre-tokenizer regex failed on a ", text.size(), "-byte piece: ", reinterpret_cast<const char*>(msg));
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ms.md);
    size_t s = ov[0], e = ov[1];
    if (s == e && have_prev && prev_end == e) {
      if (pos >= text.size()) break;
      pos += utf8_char_len(uint8_t(text[pos]));
      continue;
    }
    if (s != prev_end) spans.push_back({prev_end, s, st.invert});
    spans.push_back({s, e, !st.invert});
    prev_end = e;
    have_prev = true;
    pos = e;
  }
  if (prev_end != text.size()) spans.push_back({prev_end, text.size(), st.invert});

  // NormalizedString::split: turn is_match into "remove" and merge spans per the behavior.
  std::vector<Span> out;
  out.reserve(spans.size());
  switch (st.behavior) {
    case Behavior::kIsolated:
      for (auto& s : spans) out.push_back({s.start, s.end, false});
      break;
    case Behavior::kRemoved:
      out = spans;
      break;
    case Behavior::kContiguous: {
      bool prev_match = false;
      for (auto& s : spans) {
        if (s.flag == prev_match && !out.empty()) out.back().end = s.end;
        else out.push_back({s.start, s.end, false});
        prev_match = s.flag;
      }
      break;
    }
    case Behavior::kMergedWithPrevious: {
      bool prev_match = false;
      for (auto& s : spans) {
        if (s.flag && !prev_match && !out.empty()) out.back().end = s.end;
        else out.push_back({s.start, s.end, false});
        prev_match = s.flag;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool prev_match = false;
      for (size_t i = spans.size(); i-- > 0;) {
        auto& s = spans[i];
        if (s.flag && !prev_match && !out.empty()) out.back().start = s.start;
        else out.push_back({s.start, s.end, false});
        prev_match = s.flag;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
  }
  for (auto& s : out)
    if (!s.flag && s.end > s.start) run(text.substr(s.start, s.end - s.start), k + 1, emit);
}

}  // namespace dsv3
