// Tokenizer (src/text/): every text of the golden corpora (HF tokenizers 0.23 as the oracle) must
// give the exact ids and decodes; streaming, UTF-8 handling, load errors and the CLI.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "io/mmap_file.h"
#include "text/bpe_model.h"
#include "text/bpe_pretokenizer.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

using namespace dsv3;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// $DSV3_TOKENIZER_DIR (scripts/test.sh sets it), else the usual search. Empty + message if none.
std::string tokenizer_dir(std::string* why = nullptr) {
  try {
    return find_tokenizer_dir("");
  } catch (const Error& e) {
    if (why) *why = e.what();
    return "";
  }
}

// One shared instance: loading parses 8 MB of JSON.
const Tokenizer* shared_tokenizer(std::string* why) {
  static std::string error;
  static std::unique_ptr<Tokenizer> tok = [&]() -> std::unique_ptr<Tokenizer> {
    std::string dir = tokenizer_dir(&error);
    if (dir.empty()) return nullptr;
    try {
      return Tokenizer::load(dir);
    } catch (const Error& e) {
      error = e.what();
      return nullptr;
    }
  }();
  *why = "no usable DeepSeek-V3 tokenizer (run scripts/fetch_tokenizer.sh and/or set DSV3_TOKENIZER_DIR): " + error;
  return tok.get();
}

#define GET_TOKENIZER(var)                       \
  std::string var##_why;                         \
  const Tokenizer* var##_p = shared_tokenizer(&var##_why); \
  ASSERT_NE(var##_p, nullptr) << var##_why;      \
  const Tokenizer& var = *var##_p

json golden(const char* name) {
  return json::parse(read_text_file(std::string(DSV3_TEST_DATA) + "/golden/" + name));
}

bool is_valid_utf8(const std::string& s) { return utf8::first_invalid(s) == s.size(); }

std::string ids_str(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? " " : "") + std::to_string(v[i]);
  return s;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no Error thrown)";
}

// Checks every text of a golden file: exact ids, both decodes, and the stream decoder.
void check_golden_texts(const Tokenizer& tok, const char* file) {
  json g = golden(file);
  ASSERT_TRUE(g.contains("texts")) << file;
  ASSERT_GT(g["texts"].size(), 0u) << file;
  size_t n = 0;
  for (auto& c : g["texts"]) {
    const std::string text = c["text"];
    const auto want = c["ids"].get<std::vector<int32_t>>();
    SCOPED_TRACE(str(file, " text #", n++, ": ", json(text).dump()));
    std::vector<int32_t> got;
    ASSERT_NO_THROW(got = tok.encode(text));
    EXPECT_EQ(ids_str(got), ids_str(want));
    EXPECT_EQ(tok.decode(want, false), c["decoded"].get<std::string>());
    EXPECT_EQ(tok.decode(want, true), c["decoded_skip_special"].get<std::string>());
  }
}

}  // namespace

TEST(TokenizerGolden, CasesEncodeAndDecodeExactly) {
  GET_TOKENIZER(tok);
  check_golden_texts(tok, "tokenizer_cases.json");
}

TEST(TokenizerGolden, RandomPublicEncodeAndDecodeExactly) {
  GET_TOKENIZER(tok);
  check_golden_texts(tok, "tokenizer_random_public.json");
}

// Characters of Unicode 15.0-16.0, which HF tokenizers' Oniguruma knows and PCRE2 10.42 does
// not (see kUnicode16Additions). Ids from HF tokenizers 0.23.2 (the npm build), as the corpora.
TEST(TokenizerGolden, Unicode16CharactersSplitAsTheOracle) {
  GET_TOKENIZER(tok);
  const std::pair<const char*, const char*> cases[] = {
      {"a\U00031350b \U00031350\U00031351 \u4E2D\U0002EBF0\u6587",
       "67 175 112 238 241 68 86387 112 238 241 175 112 238 242 223 525 175 109 110 111 978"},
      {"x\U00010D40\U00010D41\U00010D42\U00010D43y",
       "90 120577 116 225 120577 116 226 120577 116 227 120577 116 228 91"},
      {"tab\u0CF3le \U0001E4D0\U0001E4EC!",
       "14278 5240 114 302 86387 255 244 241 175 255 244 108 3"},
      {"ok\U00011F43\U00011F44 go\u1B4E.",
       "633 175 242 123888 175 242 124 229 807 160 258 239 16"},
      {"hi \U0001FA75\U0001FA76 \u2427\u2428 end",
       "6366 7351 105 116 3574 105 117 1327 241 103 161 241 104 1522"},
      {"Kirat \U00016D40\U00016D41\U00016D6D \U00016D70\U00016D71\U00016D72\U00016D73",
       "45 95260 86387 247 116 225 175 247 116 226 175 247 116 258 223 175 247 116 111 175 247 116 112 175 247 116 113 175 247 116 114"},
  };
  for (auto& [text, ids] : cases) EXPECT_EQ(ids_str(tok.encode(text)), ids) << json(text).dump();
  EXPECT_NE(onig_to_pcre2("\\p{L}").find("\\x{31350}-\\x{323AF}"), std::string::npos);
  EXPECT_EQ(onig_to_pcre2("\\p{Lu}"), "\\p{Lu}");  // only the five top-level categories
}

TEST(TokenizerGolden, MetadataMatches) {
  GET_TOKENIZER(tok);
  json g = golden("tokenizer_cases.json");
  EXPECT_EQ(tok.vocab_size(), g["vocab_size"].get<int>());
  EXPECT_EQ(tok.bos_id(), g["bos_id"].get<int>());
  EXPECT_EQ(tok.eos_id(), g["eos_id"].get<int>());
  EXPECT_EQ(tok.bos_token(), "<｜begin▁of▁sentence｜>");
  EXPECT_EQ(tok.eos_token(), "<｜end▁of▁sentence｜>");
  EXPECT_TRUE(tok.is_special(0));
  EXPECT_TRUE(tok.is_special(128805));    // <|EOT|>: special and "normalized"
  EXPECT_FALSE(tok.is_special(128803));   // <｜User｜> is an added token but not special
  EXPECT_FALSE(tok.is_special(19923));
  EXPECT_FALSE(tok.is_special(-1));
  EXPECT_FALSE(tok.is_special(tok.vocab_size()));
  EXPECT_EQ(tok.token_id("<｜User｜>"), 128803);
  EXPECT_EQ(tok.token_id("Hello"), 19923);
  EXPECT_EQ(tok.token_id("Ġworld"), 2058);  // vocab strings are in the byte-level alphabet
  EXPECT_EQ(tok.token_id("no such token"), std::nullopt);
}

TEST(TokenizerStream, ConcatenatesToFullDecodeWithValidPieces) {
  GET_TOKENIZER(tok);
  for (const char* file : {"tokenizer_cases.json", "tokenizer_random_public.json"}) {
    json g = golden(file);
    size_t n = 0;
    for (auto& c : g["texts"]) {
      const auto ids = c["ids"].get<std::vector<int32_t>>();
      for (bool skip : {false, true}) {
        SCOPED_TRACE(str(file, " text #", n, " skip_special=", skip));
        StreamDecoder sd(tok, skip);
        std::string all;
        for (int32_t id : ids) {
          std::string piece = sd.push(id);
          EXPECT_TRUE(is_valid_utf8(piece)) << json(piece).dump(-1, ' ', true, json::error_handler_t::replace);
          all += piece;
        }
        std::string rest = sd.flush();
        EXPECT_TRUE(is_valid_utf8(rest));
        EXPECT_EQ(all + rest, tok.decode(ids, skip));
      }
      ++n;
    }
  }
}

TEST(TokenizerStream, HoldsBackCharactersSplitAcrossTokensAndRepairsTheRest) {
  GET_TOKENIZER(tok);
  // 𝓭 (U+1D4ED, 4 bytes) is not one token: some pushes must return nothing.
  std::vector<int32_t> ids = tok.encode("𝓭𝓭𝓭");
  ASSERT_GT(ids.size(), 3u);
  StreamDecoder sd(tok);
  int empty = 0;
  std::string all;
  for (int32_t id : ids) {
    std::string p = sd.push(id);
    empty += p.empty();
    all += p;
  }
  EXPECT_GT(empty, 0);
  EXPECT_EQ(all, "𝓭𝓭𝓭");
  EXPECT_EQ(sd.flush(), "");

  // A lone lead byte left at the end becomes U+FFFD on flush; a bad continuation right away.
  auto byte_id = [&](uint8_t b) { return *tok.token_id(byte_char(b)); };
  StreamDecoder s2(tok);
  EXPECT_EQ(s2.push(byte_id('a')), "a");
  EXPECT_EQ(s2.push(byte_id(0xF0)), "");
  EXPECT_EQ(s2.push(byte_id(0x9F)), "");
  EXPECT_EQ(s2.push(byte_id('b')), "\xEF\xBF\xBD" "b");
  EXPECT_EQ(s2.push(byte_id(0xE2)), "");
  EXPECT_EQ(s2.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(tok.decode({byte_id('a'), byte_id(0xF0), byte_id(0x9F), byte_id('b'), byte_id(0xE2)}),
            "a\xEF\xBF\xBD" "b\xEF\xBF\xBD");
  // Special tokens are skipped by default, kept on request.
  StreamDecoder s3(tok), s4(tok, false);
  EXPECT_EQ(s3.push(0), "");
  EXPECT_EQ(s4.push(0), "<｜begin▁of▁sentence｜>");
  EXPECT_THROW(s3.push(-5), Error);
}

TEST(TokenizerUtf8, EncodeRejectsInvalidUtf8NamingTheOffset) {
  GET_TOKENIZER(tok);
  struct Case {
    std::string text;
    size_t offset;
  };
  std::vector<Case> cases = {
      {"abc\xff", 3},                   // never a UTF-8 byte
      {"\x80" "abc", 0},                // stray continuation
      {"ok \xC0\xAF", 3},               // overlong '/'
      {"\xE0\x80\xAF", 0},              // overlong, 3 bytes
      {"x\xED\xA0\x80y", 1},            // UTF-16 surrogate
      {"\xF4\x90\x80\x80", 0},          // above U+10FFFF
      {"euro \xE2\x82", 5},             // truncated at the end
      {"caf\xC3(", 3},                  // bad continuation
      {std::string(1000, 'a') + "\xFE", 1000},
  };
  for (auto& c : cases) {
    std::string msg = error_of([&] { tok.encode(c.text); });
    EXPECT_NE(msg.find("not valid UTF-8"), std::string::npos) << msg;
    EXPECT_NE(msg.find(str("byte offset ", c.offset, " ")), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(tok.encode(std::string("nul\0inside", 10)));
  EXPECT_EQ(tok.decode(tok.encode(std::string("nul\0inside", 10))), std::string("nul\0inside", 10));
}

TEST(TokenizerUtf8, RepairMatchesFromUtf8Lossy) {
  // Unicode 15 section 3.9, "U+FFFD substitution of maximal subparts" example.
  EXPECT_EQ(utf8::repair("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
            "a\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD" "b\xEF\xBF\xBD" "c\xEF\xBF\xBD\xEF\xBF\xBD" "d");
  EXPECT_EQ(utf8::repair("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate: 3
  EXPECT_EQ(utf8::repair("\xF0\x9F\x98"), "\xEF\xBF\xBD");  // truncated: one
  EXPECT_EQ(utf8::repair("héllo"), "héllo");
  EXPECT_EQ(utf8::unfinished_tail("ab\xF0\x9F\x98"), 3u);
  EXPECT_EQ(utf8::unfinished_tail("ab\xE2"), 1u);
  EXPECT_EQ(utf8::unfinished_tail("ab\xE0\x80"), 0u);  // can never be finished
  EXPECT_EQ(utf8::unfinished_tail("ab\xF0\x9F\x98\x80"), 0u);
  EXPECT_EQ(utf8::unfinished_tail(""), 0u);
}

TEST(TokenizerDecode, RejectsIdsOutOfRange) {
  GET_TOKENIZER(tok);
  for (int32_t bad : {-1, tok.vocab_size(), tok.vocab_size() + 1000, INT32_MAX, INT32_MIN}) {
    std::string msg = error_of([&] { tok.decode({19923, bad}); });
    EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
    EXPECT_NE(msg.find("position 1"), std::string::npos) << msg;
  }
}

TEST(TokenizerDecode, EveryIdDecodesToValidUtf8) {
  GET_TOKENIZER(tok);
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    std::string s = tok.decode({id});
    ASSERT_TRUE(is_valid_utf8(s)) << id;
    if (tok.is_special(id)) {
      ASSERT_EQ(tok.decode({id}, true), "") << id;
    }
  }
}

TEST(TokenizerEncode, LongRunsAndEdgeInputs) {
  GET_TOKENIZER(tok);
  EXPECT_TRUE(tok.encode("").empty());
  for (std::string s : {std::string(100000, 'a'), std::string(100000, ' '), std::string(30000, '7'),
                        std::string(50000, '\n'), std::string(20000, '!') + "x",
                        [] {
                          std::string r;
                          for (int i = 0; i < 5000; ++i) r += "深度 \xC2\xA0\t" + std::to_string(i) + "Zz😀";
                          return r;
                        }()}) {
    std::vector<int32_t> ids = tok.encode(s);
    EXPECT_FALSE(ids.empty());
    EXPECT_EQ(tok.decode(ids), s);
  }
  // Same text twice (the second time from the word cache) gives the same ids.
  std::string t = "The same sentence, twice: 12345 tokens.";
  EXPECT_EQ(tok.encode(t), tok.encode(t));
}

// Byte-level BPE loses nothing: any valid UTF-8 comes back from decode(encode(x)).
TEST(TokenizerEncode, RandomTextRoundTrips) {
  GET_TOKENIZER(tok);
  std::mt19937 rng(1234);
  auto put = [](std::string& s, uint32_t cp) {
    if (cp < 0x80) {
      s += char(cp);
    } else if (cp < 0x800) {
      s += char(0xC0 | (cp >> 6)), s += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += char(0xE0 | (cp >> 12)), s += char(0x80 | ((cp >> 6) & 0x3F)), s += char(0x80 | (cp & 0x3F));
    } else {
      s += char(0xF0 | (cp >> 18)), s += char(0x80 | ((cp >> 12) & 0x3F));
      s += char(0x80 | ((cp >> 6) & 0x3F)), s += char(0x80 | (cp & 0x3F));
    }
  };
  const uint32_t ranges[][2] = {{0, 0x7F}, {0x80, 0x7FF}, {0x800, 0xD7FF}, {0xE000, 0xFFFF}, {0x10000, 0x10FFFF},
                                {0x4E00, 0x9FA5}, {0x3040, 0x30FF}, {0x1F300, 0x1FAFF}, {0x2000, 0x206F}};
  for (int iter = 0; iter < 300; ++iter) {
    std::string text;
    size_t n = rng() % 200;
    for (size_t i = 0; i < n; ++i) {
      if (rng() % 50 == 0) {
        text += rng() % 2 ? "<｜User｜>" : "<｜end▁of▁sentence｜>";
        continue;
      }
      auto& r = ranges[rng() % 9];
      uint32_t cp = r[0] + rng() % (r[1] - r[0] + 1);
      if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'x';
      put(text, cp);
    }
    std::vector<int32_t> ids = tok.encode(text);
    ASSERT_EQ(tok.decode(ids), text) << json(text).dump();
  }
}

TEST(TokenizerEncode, ThreadsAgree) {
  GET_TOKENIZER(tok);
  json g = golden("tokenizer_random_public.json");
  std::vector<std::string> texts;
  for (auto& c : g["texts"]) texts.push_back(c["text"]);
  std::vector<std::vector<int32_t>> want;
  for (auto& t : texts) want.push_back(tok.encode(t));
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([&, k] {
      for (int rep = 0; rep < 3; ++rep)
        for (size_t i = (k * 37) % texts.size(), n = 0; n < texts.size(); ++n, i = (i + 1) % texts.size())
          if (tok.encode(texts[i]) != want[i]) ++mismatches;
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// The queue-based merge loop (long pieces) and the quadratic one (short pieces) agree.
TEST(TokenizerBpe, BothMergeLoopsAgree) {
  std::string why;
  std::string dir = tokenizer_dir(&why);
  ASSERT_FALSE(dir.empty()) << why;
  json j = json::parse(read_text_file(dir + "/tokenizer.json"));
  std::vector<std::pair<std::string, int32_t>> vocab;
  for (auto& [k, v] : j["model"]["vocab"].items()) vocab.emplace_back(k, v.get<int32_t>());
  std::vector<std::pair<std::string, std::string>> merges;
  for (auto& m : j["model"]["merges"]) {
    std::string s = m;
    merges.emplace_back(s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1));
  }
  BpeModel bpe(vocab, merges, -1, "tokenizer.json");
  std::map<uint8_t, int32_t> byte_ids;
  for (auto& [k, v] : vocab)
    for (int b = 0; b < 256; ++b)
      if (k == byte_char(uint8_t(b))) byte_ids[uint8_t(b)] = v;
  ASSERT_EQ(byte_ids.size(), 256u);
  std::mt19937 rng(7);
  const std::string alphabet = "etaoinshrdlu  ETAOIN0123.,-_'";
  for (int iter = 0; iter < 2000; ++iter) {
    size_t len = 2 + rng() % (BpeModel::kSmallPiece - 2);
    std::vector<int32_t> syms;
    std::string word;
    for (size_t i = 0; i < len; ++i) word += alphabet[rng() % alphabet.size()];
    for (char c : word) syms.push_back(byte_ids[uint8_t(c)]);
    std::vector<int32_t> small = syms, large = syms;
    bpe.merge_symbols(small);
    // Pad past the small-loop limit with a separator that no merge joins, then strip it.
    large.push_back(-7);
    large.insert(large.end(), syms.begin(), syms.end());
    while (large.size() <= BpeModel::kSmallPiece) large.push_back(-7);
    bpe.merge_symbols(large);
    std::vector<int32_t> first(large.begin(), std::find(large.begin(), large.end(), -7));
    ASSERT_EQ(ids_str(first), ids_str(small)) << word;
  }
}

TEST(TokenizerPreTokenizer, TranslatesOnigurumaEscapes) {
  std::string t = onig_to_pcre2("\\s+(?!\\S)|[\\s\\p{L}]\\h\\\\s\\[\\s]");
  EXPECT_EQ(t.find("\\s"), t.find("\\\\s") + 1);  // only the escaped backslash's 's' is left
  EXPECT_NE(t.find("[^\\t\\n"), std::string::npos);
  EXPECT_NE(t.find("[0-9a-fA-F]"), std::string::npos);
}

// ---- load errors, on small tokenizer.json files written to a temp folder ----

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    char tmpl[] = "/tmp/dsv3_tok_test_XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { fs::remove_all(path); }
  void write(const std::string& name, const std::string& bytes) const {
    std::ofstream(path / name, std::ios::binary) << bytes;
  }
  std::string str() const { return path.string(); }
};

// A tiny byte-level BPE: the 256 byte characters, a few merges, added tokens.
json tiny_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(uint8_t(b))] = b;
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  vocab["Ġab"] = 258;
  json j;
  j["version"] = "1.0";
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"}, {"pattern", {{"Regex", " ?\\S+|\\s+"}}}, {"behavior", "Isolated"}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  j["decoder"] = {{"type", "ByteLevel"}};
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"a b", "ab c", "Ġ ab"}}};
  j["added_tokens"] = json::array(
      {{{"id", 300}, {"content", "<S>"}, {"special", true}, {"normalized", false}, {"lstrip", false}, {"rstrip", false}, {"single_word", false}},
       {{"id", 301}, {"content", "<L>"}, {"special", false}, {"normalized", true}, {"lstrip", true}, {"rstrip", true}, {"single_word", false}}});
  return j;
}

}  // namespace

TEST(TokenizerLoad, TinyTokenizerWithStripFlags) {
  TempDir d;
  d.write("tokenizer.json", tiny_tokenizer().dump());
  d.write("tokenizer_config.json", R"({"bos_token": "<S>", "eos_token": {"content": "<missing>"}})");
  auto tok = Tokenizer::load(d.str());
  EXPECT_EQ(tok->vocab_size(), 302);
  EXPECT_EQ(tok->bos_id(), 300);
  EXPECT_EQ(tok->eos_id(), -1);  // named but not in the vocabulary
  EXPECT_EQ(tok->eos_token(), "<missing>");
  EXPECT_EQ(ids_str(tok->encode("abc ab")), "257 258");
  EXPECT_EQ(ids_str(tok->encode("x<S>abc")), "120 300 257");
  // <L> takes the whitespace around it (lstrip/rstrip), but not text another token took.
  EXPECT_EQ(ids_str(tok->encode("a  <L>  b")), "97 301 98");
  EXPECT_EQ(ids_str(tok->encode("<S> <L>")), "300 301");
  EXPECT_EQ(tok->decode({300, 257, 301}, true), "abc<L>");
  EXPECT_THROW(tok->decode({299}), Error);  // an id between the vocab and the added tokens
}

// The per-thread piece cache must keep tokenizers apart.
TEST(TokenizerLoad, TwoTokenizersDoNotShareCachedPieces) {
  TempDir d1, d2;
  json j = tiny_tokenizer();
  d1.write("tokenizer.json", j.dump());
  j["model"]["merges"] = json::array();
  d2.write("tokenizer.json", j.dump());
  auto with_merges = Tokenizer::load(d1.str()), without = Tokenizer::load(d2.str());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(ids_str(with_merges->encode("abc")), "257");
    EXPECT_EQ(ids_str(without->encode("abc")), "97 98 99");
  }
}

TEST(TokenizerLoad, ErrorsNameTheFileAndProblem) {
  auto expect_error = [](const std::string& dir, const std::string& needle) {
    std::string msg = error_of([&] { Tokenizer::load(dir); });
    EXPECT_NE(msg.find(needle), std::string::npos) << "message: " << msg;
  };
  expect_error("/nonexistent/dsv3/tokenizer", "does not exist");
  {
    TempDir d;
    expect_error(d.str(), "has no tokenizer.json");
  }
  {
    TempDir d;
    d.write("tokenizer.json", "this is not json");
    expect_error(d.str(), "tokenizer.json: not valid JSON");
  }
  {
    TempDir d;
    d.write("tokenizer.json", tiny_tokenizer().dump().substr(0, 500));  // truncated
    expect_error(d.str(), "tokenizer.json: not valid JSON");
  }
  {
    TempDir d;
    json j = tiny_tokenizer();
    j["model"]["type"] = "WordPiece";
    d.write("tokenizer.json", j.dump());
    expect_error(d.str(), "model type 'WordPiece' is not supported");
  }
  {
    TempDir d;
    json j = tiny_tokenizer();
    j["model"]["merges"].push_back("ab zz");
    d.write("tokenizer.json", j.dump());
    expect_error(d.str(), "uses a token missing from model.vocab ('zz')");
  }
  {
    TempDir d;
    json j = tiny_tokenizer();
    j["model"]["vocab"] = json::array();
    d.write("tokenizer.json", j.dump());
    expect_error(d.str(), "model.vocab must be an object");
  }
  {
    TempDir d;
    json j = tiny_tokenizer();
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "([unclosed";
    d.write("tokenizer.json", j.dump());
    expect_error(d.str(), "does not compile");
  }
  {
    TempDir d;
    json j = tiny_tokenizer();
    j["pre_tokenizer"] = {{"type", "Whitespace"}};
    d.write("tokenizer.json", j.dump());
    expect_error(d.str(), "unsupported pre_tokenizer type 'Whitespace'");
  }
  {
    TempDir d;
    json j = tiny_tokenizer();
    j["added_tokens"][0]["id"] = "seven";
    d.write("tokenizer.json", j.dump());
    expect_error(d.str(), "needs an integer 'id'");
  }
  {
    TempDir d;
    json j = tiny_tokenizer();
    j["added_tokens"][1]["single_word"] = true;
    d.write("tokenizer.json", j.dump());
    expect_error(d.str(), "single_word");
  }
  {
    TempDir d;
    d.write("tokenizer.json", tiny_tokenizer().dump());
    d.write("tokenizer_config.json", "{\"bos_token\": ");
    expect_error(d.str(), "tokenizer_config.json: not valid JSON");
  }
}

TEST(TokenizerLoad, FindTokenizerDirSearchOrder) {
  TempDir model, cache, empty;
  model.write("tokenizer.json", "{}");
  cache.write("tokenizer.json", "{}");
  const char* old = std::getenv("DSV3_TOKENIZER_DIR");
  std::string saved = old ? old : "";
  EXPECT_EQ(find_tokenizer_dir(model.str()), model.str());
  setenv("DSV3_TOKENIZER_DIR", cache.str().c_str(), 1);
  EXPECT_EQ(find_tokenizer_dir(empty.str()), cache.str());
  EXPECT_EQ(find_tokenizer_dir(""), cache.str());
  setenv("DSV3_TOKENIZER_DIR", empty.str().c_str(), 1);
  std::string msg = error_of([&] { find_tokenizer_dir(model.str() + "/nope"); });
  EXPECT_NE(msg.find("no tokenizer.json found"), std::string::npos) << msg;
  EXPECT_NE(msg.find(empty.str()), std::string::npos) << msg;
  if (old) setenv("DSV3_TOKENIZER_DIR", saved.c_str(), 1);
  else unsetenv("DSV3_TOKENIZER_DIR");
}

// ---- the dsv3 tokenize / detokenize commands ----

namespace {

struct RunResult {
  int status;
  std::string out, err;
};

// Runs `dsv3 <args>` with `input` on stdin through the shell; captures stdout and stderr.
RunResult run_dsv3(const std::string& args, const std::string& input) {
  TempDir d;
  d.write("in", input);
  std::string cmd = str("'", DSV3_BINARY, "' ", args, " < '", d.str(), "/in' > '", d.str(), "/out' 2> '", d.str(), "/err'");
  int rc = std::system(cmd.c_str());
  RunResult r;
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  r.out = read_text_file(d.str() + "/out");
  r.err = read_text_file(d.str() + "/err");
  return r;
}

}  // namespace

TEST(TokenizerCli, TokenizeAndDetokenize) {
  std::string why, dir = tokenizer_dir(&why);
  ASSERT_FALSE(dir.empty()) << why;
  RunResult r = run_dsv3("tokenize --tokenizer '" + dir + "'", "Hello, world!");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "19923 14 2058 3\n");
  GET_TOKENIZER(tok);
  r = run_dsv3("tokenize --tokenizer '" + dir + "'", " line\r\n\n");  // exact bytes: nothing trimmed
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, ids_str(tok.encode(" line\r\n\n")) + "\n");
  r = run_dsv3("tokenize --tokenizer '" + dir + "'", "");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "\n");
  r = run_dsv3("detokenize --tokenizer '" + dir + "'", "0 19923 14\n2058\t3 \n");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "<｜begin▁of▁sentence｜>Hello, world!");
  r = run_dsv3("detokenize --skip-special --tokenizer '" + dir + "'", "0 19923 14 2058 3");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "Hello, world!");
}

TEST(TokenizerCli, BadInputFailsWithAClearMessage) {
  std::string why, dir = tokenizer_dir(&why);
  ASSERT_FALSE(dir.empty()) << why;
  RunResult r = run_dsv3("detokenize --tokenizer '" + dir + "'", "19923 12x 3");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("'12x' is not a token id"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "");
  r = run_dsv3("detokenize --tokenizer '" + dir + "'", "19923 999999999");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("'999999999' is not a token id"), std::string::npos) << r.err;
  r = run_dsv3("detokenize --tokenizer '" + dir + "'", "-1");
  EXPECT_NE(r.status, 0);
  r = run_dsv3("tokenize --tokenizer '" + dir + "'", "good \xC3\x28 bad");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("not valid UTF-8 at byte offset 5"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "");
  TempDir d;
  d.write("tokenizer.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {");
  r = run_dsv3("tokenize --tokenizer '" + d.str() + "'", "hi");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("tokenizer.json: not valid JSON"), std::string::npos) << r.err;
  r = run_dsv3("tokenize --tokenizer '" + d.str() + "/missing'", "hi");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;
}
