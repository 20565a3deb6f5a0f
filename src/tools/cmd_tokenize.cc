// `dsv3 tokenize` (UTF-8 text on stdin -> ids) and `dsv3 detokenize` (ids on stdin -> text):
// the tokenizer from the shell, for checking prompts and comparing with other implementations.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"
#include "text/tokenizer.h"
#include "tools/command.h"

namespace dsv3 {
namespace {

std::string read_stdin() {
  std::string s;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, stdin)) > 0) s.append(buf, n);
  if (std::ferror(stdin)) fail("cannot read stdin");
  return s;
}

void write_stdout(const std::string& s) {
  if (std::fwrite(s.data(), 1, s.size(), stdout) != s.size() || std::fflush(stdout) != 0)
    fail("cannot write stdout");
}

int run_tokenize(int argc, char** argv) {
  Args args(argc, argv, {"tokenizer"});
  if (!args.positional().empty()) fail("unexpected argument '", args.positional()[0], "' (text comes on stdin)");
  auto tok = Tokenizer::load(args.has("tokenizer") ? args.get("tokenizer") : find_tokenizer_dir(""));
  std::string text = read_stdin();  // exact bytes: no trimming, no newline handling
  std::vector<int32_t> ids = tok->encode(text);
  std::string out;
  out.reserve(ids.size() * 7 + 1);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ' ';
    out += std::to_string(ids[i]);
  }
  out += '\n';
  write_stdout(out);
  return 0;
}

int run_detokenize(int argc, char** argv) {
  Args args(argc, argv, {"tokenizer"}, {"skip-special"});
  if (!args.positional().empty()) fail("unexpected argument '", args.positional()[0], "' (ids come on stdin)");
  auto tok = Tokenizer::load(args.has("tokenizer") ? args.get("tokenizer") : find_tokenizer_dir(""));
  std::string in = read_stdin();
  std::vector<int32_t> ids;
  size_t i = 0;
  auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; };
  while (i < in.size()) {
    while (i < in.size() && is_space(in[i])) ++i;
    if (i >= in.size()) break;
    size_t j = i;
    while (j < in.size() && !is_space(in[j])) ++j;
    std::string word = in.substr(i, j - i);
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(word.c_str(), &end, 10);
    bool digits_only = word.find_first_not_of("0123456789", word[0] == '-' ? 1 : 0) == std::string::npos &&
                       word != "-";
    if (!digits_only || *end || errno == ERANGE || v < 0 || v >= tok->vocab_size())
      fail("input word ", ids.size() + 1, " '", word.substr(0, 40), "' is not a token id (an integer in [0, ",
           tok->vocab_size(), "))");
    ids.push_back(int32_t(v));
    i = j;
  }
  write_stdout(tok->decode(ids, args.has("skip-special")));  // throws before writing on a bad id
  return 0;
}

}  // namespace
}  // namespace dsv3

DSV3_COMMAND(tokenize, "[--tokenizer DIR]: print the ids of the UTF-8 text on stdin", dsv3::run_tokenize);
DSV3_COMMAND(detokenize, "[--tokenizer DIR] [--skip-special]: print the text of the ids on stdin",
             dsv3::run_detokenize);
