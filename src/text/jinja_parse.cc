// Jinja lexer and parser: template source -> syntax tree (jinja_internal.h). Follows Jinja2 3.1's
// lexer for whitespace control (trim_blocks, lstrip_blocks, {%- -%}, {%+, newline normalisation)
// and its parser for operator precedence (jinja2/parser.py: parse_or ... parse_unary).
#include <cstdlib>
#include <initializer_list>

#include "text/jinja_internal.h"

namespace dsv3::jinja {
namespace {

struct Tok {
  enum Type { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, Str, Int, Float, Op, Eof };
  Type type;
  std::string s;  // text, name, decoded string, operator
  Json num;       // Int, Float
  int line;
};

bool is_ident_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool is_digit(char c) {
  return c >= '0' && c <= '9';
}
bool is_ident(char c) {
  return is_ident_start(c) || is_digit(c);
}
bool is_ascii_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

class Lexer {
 public:
  Lexer(std::string_view source, const std::string& name, const Options& o) : name_(name), o_(o) {
    // Jinja2 normalises \r\n and \r to \n everywhere, then drops one trailing newline.
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!o_.keep_trailing_newline && !src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Tok> run() {
    while (pos_ < src_.size()) {
      size_t p = find_tag(pos_);
      std::string text = src_.substr(pos_, (p == std::string::npos ? src_.size() : p) - pos_);
      if (p == std::string::npos) {
        emit_text(std::move(text), line_);
        break;
      }
      char kind = src_[p + 1];
      char sign = p + 2 < src_.size() && (src_[p + 2] == '-' || src_[p + 2] == '+') ? src_[p + 2] : 0;
      if (sign == '-') {
        text = rstrip_space(text);
      } else if (sign != '+' && o_.lstrip_blocks && kind != '{') {
        size_t l = text.rfind('\n');
        l = l == std::string::npos ? 0 : l + 1;
        if ((l > 0 || line_start_) && all_space(std::string_view(text).substr(l))) text.resize(l);
      }
      int text_line = line_;
      advance_to(p);
      emit_text(std::move(text), text_line);
      int tag_line = line_;
      advance_to(p + 2 + (sign ? 1 : 0));
      if (kind == '#') {
        lex_comment(tag_line);
      } else if (kind == '%' && try_raw(tag_line)) {
      } else {
        toks_.push_back({kind == '{' ? Tok::VarBegin : Tok::BlockBegin, "", nullptr, tag_line});
        lex_tag(kind, tag_line);
      }
    }
    toks_.push_back({Tok::Eof, "", nullptr, line_});
    return std::move(toks_);
  }

 private:
  [[noreturn]] void error(int line, const std::string& msg) { fail(name_, " line ", line, ": ", msg); }

  size_t find_tag(size_t from) const {
    for (size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1))
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) return p;
    return std::string::npos;
  }
  void advance_to(size_t p) {
    for (; pos_ < p; ++pos_)
      if (src_[pos_] == '\n') ++line_;
  }
  bool starts(std::string_view s) const { return std::string_view(src_).substr(pos_).starts_with(s); }
  static bool all_space(std::string_view s) {
    for (size_t i = 0; i < s.size();)
      if (!is_py_space(utf8_next(s, i))) return false;
    return true;
  }
  void skip_space() {  // Python's \s: any Unicode whitespace
    while (pos_ < src_.size()) {
      size_t i = pos_;
      if (!is_py_space(utf8_next(src_, i))) break;
      advance_to(i);
    }
  }
  void emit_text(std::string text, int line) {
    if (!text.empty()) toks_.push_back({Tok::Text, std::move(text), nullptr, line});
  }
  // After a closing `%}` / `#}` / `}}`: `-` strips the whitespace that follows; a plain block or
  // comment end eats one newline under trim_blocks. Notes whether the next text starts a line.
  void close_tag(bool minus, bool block) {
    size_t start = pos_;
    if (minus)
      skip_space();
    else if (block && o_.trim_blocks && pos_ < src_.size() && src_[pos_] == '\n')
      advance_to(pos_ + 1);
    line_start_ = pos_ > start && src_[pos_ - 1] == '\n';
  }

  void lex_comment(int line) {
    size_t q = src_.find("#}", pos_);
    if (q == std::string::npos) error(line, "unclosed comment {# ... #}");
    bool minus = q > pos_ && src_[q - 1] == '-';
    advance_to(q + 2);
    close_tag(minus, true);
  }

  // {% raw %}...{% endraw %}: the text between is output as is.
  bool try_raw(int line) {
    size_t save = pos_;
    int save_line = line_;
    skip_space();
    if (!starts("raw") || (pos_ + 3 < src_.size() && is_ident(src_[pos_ + 3]))) {
      pos_ = save, line_ = save_line;
      return false;
    }
    advance_to(pos_ + 3);
    skip_space();
    bool minus = starts("-");
    if (minus) advance_to(pos_ + 1);
    if (!starts("%}")) error(line, "expected '%}' after 'raw'");
    advance_to(pos_ + 2);
    if (minus) skip_space();
    for (size_t p = src_.find("{%", pos_); p != std::string::npos; p = src_.find("{%", p + 1)) {
      size_t q = p + 2;
      char sign = q < src_.size() && (src_[q] == '-' || src_[q] == '+') ? src_[q++] : 0;
      while (q < src_.size() && is_ascii_space(src_[q])) ++q;
      if (src_.compare(q, 6, "endraw") != 0) continue;
      q += 6;
      while (q < src_.size() && is_ascii_space(src_[q])) ++q;
      bool end_minus = q < src_.size() && src_[q] == '-';
      bool end_plus = q < src_.size() && src_[q] == '+';
      if (end_minus || end_plus) ++q;
      if (src_.compare(q, 2, "%}") != 0) continue;
      std::string text = src_.substr(pos_, p - pos_);
      if (sign == '-') {
        text = rstrip_space(text);
      } else if (sign != '+' && o_.lstrip_blocks) {
        size_t l = text.rfind('\n');
        if (l != std::string::npos && all_space(std::string_view(text).substr(l + 1))) text.resize(l + 1);
      }
      int text_line = line_;
      advance_to(q + 2);
      emit_text(std::move(text), text_line);
      close_tag(end_minus, !end_plus);
      return true;
    }
    error(line, "missing {% endraw %}");
  }

  void lex_tag(char kind, int open_line) {
    int depth = 0;
    const char* close = kind == '{' ? "}}" : "%}";
    for (;;) {
      skip_space();
      if (pos_ >= src_.size())
        error(open_line, kind == '{' ? "unclosed '{{' (missing '}}')" : "unclosed '{%' (missing '%}')");
      if (depth == 0) {
        bool minus = starts("-") && std::string_view(src_).substr(pos_ + 1).starts_with(close);
        bool plus = kind == '%' && starts("+%}");
        if (minus || plus || starts(close)) {
          int line = line_;
          advance_to(pos_ + 2 + (minus || plus ? 1 : 0));
          toks_.push_back({kind == '{' ? Tok::VarEnd : Tok::BlockEnd, "", nullptr, line});
          close_tag(minus, kind == '%' && !plus);
          return;
        }
      }
      char c = src_[pos_];
      int line = line_;
      if (is_ident_start(c)) {
        size_t e = pos_;
        while (e < src_.size() && is_ident(src_[e])) ++e;
        toks_.push_back({Tok::Name, src_.substr(pos_, e - pos_), nullptr, line});
        advance_to(e);
      } else if (is_digit(c)) {
        lex_number();
      } else if (c == '\'' || c == '"') {
        lex_string(c);
      } else {
        static const char* ops[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "*", "/", "%", "~", "[",
                                    "]",  "(",  ")",  "{",  "}",  "<",  ">", "=", ".", ":", "|", ",", ";"};
        const char* op = nullptr;
        for (const char* o : ops)
          if (starts(o)) {
            op = o;
            break;
          }
        if (!op) error(line, str("unexpected character '", c, "' in tag"));
        if (*op == '(' || *op == '[' || *op == '{') ++depth;
        if (*op == ')' || *op == ']' || *op == '}') {
          if (depth == 0) error(line, str("unbalanced '", op, "'"));
          --depth;
        }
        toks_.push_back({Tok::Op, op, nullptr, line});
        advance_to(pos_ + std::string_view(op).size());
      }
    }
  }

  void lex_number() {
    size_t e = pos_;
    auto digits = [&] {
      while (e < src_.size() &&
             (is_digit(src_[e]) || (src_[e] == '_' && e + 1 < src_.size() && is_digit(src_[e + 1]))))
        ++e;
    };
    digits();
    bool is_float = false;
    if (e + 1 < src_.size() && src_[e] == '.' && is_digit(src_[e + 1])) {
      ++e;
      digits();
      is_float = true;
    }
    if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t f = e + 1;
      if (f < src_.size() && (src_[f] == '+' || src_[f] == '-')) ++f;
      if (f < src_.size() && is_digit(src_[f])) {
        e = f;
        digits();
        is_float = true;
      }
    }
    std::string text;
    for (size_t i = pos_; i < e; ++i)
      if (src_[i] != '_') text += src_[i];
    Tok t{is_float ? Tok::Float : Tok::Int, text, nullptr, line_};
    if (is_float) {
      t.num = std::strtod(text.c_str(), nullptr);
    } else {
      errno = 0;
      long long v = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) error(line_, "integer literal " + text + " is too large");
      t.num = static_cast<int64_t>(v);
    }
    toks_.push_back(std::move(t));
    advance_to(e);
  }

  // A Python string literal: the escapes of Python's unicode-escape codec.
  void lex_string(char quote) {
    int line = line_;
    size_t i = pos_ + 1;
    std::string out;
    auto hex = [&](int n) -> char32_t {
      if (i + n > src_.size()) error(line, "truncated \\x/\\u escape in string literal");
      char32_t v = 0;
      for (int k = 0; k < n; ++k) {
        char h = src_[i + k];
        int d = is_digit(h)              ? h - '0'
                : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                : (h >= 'A' && h <= 'F') ? h - 'A' + 10
                                         : -1;
        if (d < 0) error(line, "bad hex digit in \\x/\\u escape of a string literal");
        v = v * 16 + d;
      }
      i += n;
      return v;
    };
    for (;;) {
      if (i >= src_.size()) error(line, "unterminated string literal");
      char c = src_[i];
      if (c == quote) break;
      if (c != '\\') {
        out += c;
        ++i;
        continue;
      }
      if (++i >= src_.size()) error(line, "unterminated string literal");
      char e = src_[i++];
      switch (e) {
        case '\n':
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x':
          out += utf8_encode(std::u32string(1, hex(2)));
          break;
        case 'u':
          out += utf8_encode(std::u32string(1, hex(4)));
          break;
        case 'U': {
          char32_t v = hex(8);
          if (v > 0x10FFFF) error(line, "\\U escape out of range");
          out += utf8_encode(std::u32string(1, v));
          break;
        }
        case 'N':
          error(line, "\\N{...} escapes are not supported");
        default:
          if (e >= '0' && e <= '7') {
            char32_t v = e - '0';
            for (int k = 0; k < 2 && i < src_.size() && src_[i] >= '0' && src_[i] <= '7'; ++k)
              v = v * 8 + (src_[i++] - '0');
            out += utf8_encode(std::u32string(1, v));
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    toks_.push_back({Tok::Str, std::move(out), nullptr, line});
    advance_to(i + 1);
  }

  std::string src_;
  const std::string& name_;
  const Options& o_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_start_ = true;
  std::vector<Tok> toks_;
};

ExprP make(Expr::Kind k, int line, std::string name = {}) {
  auto e = std::make_unique<Expr>();
  e->kind = k;
  e->line = line;
  e->name = std::move(name);
  return e;
}
ExprP make(Expr::Kind k, int line, std::string name, ExprP a, ExprP b = nullptr) {
  auto e = make(k, line, std::move(name));
  e->args.push_back(std::move(a));
  if (b) e->args.push_back(std::move(b));
  return e;
}
NodeP make_node(Node::Kind k, int line) {
  auto n = std::make_unique<Node>();
  n->kind = k;
  n->line = line;
  return n;
}

class Parser {
 public:
  Parser(std::vector<Tok> toks, const std::string& name) : t_(std::move(toks)), name_(name) {}

  NodeP parse_root() {
    auto root = make_node(Node::Kind::Root, 1);
    std::string which;
    root->body = parse_body({}, which, 1, "");
    return root;
  }

 private:
  [[noreturn]] void error(int line, const std::string& msg) { fail(name_, " line ", line, ": ", msg); }
  const Tok& peek(size_t k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Tok& next() { return t_[i_ < t_.size() - 1 ? i_++ : i_]; }
  bool is_op(const char* s, size_t k = 0) const { return peek(k).type == Tok::Op && peek(k).s == s; }
  bool is_name(const char* s, size_t k = 0) const { return peek(k).type == Tok::Name && peek(k).s == s; }
  static std::string describe(const Tok& t) {
    switch (t.type) {
      case Tok::Text:
        return "template text";
      case Tok::VarBegin:
        return "'{{'";
      case Tok::VarEnd:
        return "'}}'";
      case Tok::BlockBegin:
        return "'{%'";
      case Tok::BlockEnd:
        return "'%}'";
      case Tok::Eof:
        return "end of template";
      case Tok::Str:
        return "string '" + t.s + "'";
      default:
        return "'" + t.s + "'";
    }
  }
  [[noreturn]] void unexpected(const std::string& wanted) {
    error(peek().line, "expected " + wanted + ", got " + describe(peek()));
  }
  void expect_op(const char* s) {
    if (!is_op(s)) unexpected(str("'", s, "'"));
    next();
  }
  void expect_block_end() {
    if (peek().type != Tok::BlockEnd) unexpected("'%}'");
    next();
  }
  std::string expect_name(const char* what) {
    if (peek().type != Tok::Name) unexpected(what);
    return next().s;
  }

  // Statements up to one of the tags `ends` (whose name is consumed and stored in `which`).
  Body parse_body(std::initializer_list<const char*> ends, std::string& which, int open_line,
                  const char* open_tag) {
    Body body;
    for (;;) {
      const Tok& t = peek();
      if (t.type == Tok::Eof) {
        if (ends.size() == 0) return body;
        error(open_line, str("'{% ", open_tag, " %}' is never closed (missing '{% ", *ends.begin(), " %}')"));
      }
      if (t.type == Tok::Text) {
        auto n = make_node(Node::Kind::Text, t.line);
        n->text = next().s;
        body.push_back(std::move(n));
      } else if (t.type == Tok::VarBegin) {
        next();
        auto n = make_node(Node::Kind::Output, t.line);
        n->expr = parse_tuple();
        if (peek().type != Tok::VarEnd) unexpected("'}}'");
        next();
        body.push_back(std::move(n));
      } else if (t.type == Tok::BlockBegin) {
        if (peek(1).type == Tok::Name)
          for (const char* e : ends)
            if (peek(1).s == e) {
              next();
              which = next().s;
              return body;
            }
        next();
        body.push_back(parse_statement());
      } else {
        unexpected("template text or a tag");
      }
    }
  }

  // Bounds the recursion of deeply nested tags or expressions (a stack overflow is no error message).
  struct DepthGuard {
    Parser& p;
    DepthGuard(Parser& parser, int line) : p(parser) {
      if (++p.depth_ > 200) p.error(line, "tags or expressions nested too deeply");
    }
    ~DepthGuard() { --p.depth_; }
  };

  NodeP parse_statement() {
    int line = peek().line;
    DepthGuard guard(*this, line);
    std::string tag = expect_name("a tag name");
    std::string which;
    if (tag == "if") {
      auto n = make_node(Node::Kind::If, line);
      ExprP cond = parse_expression(false);
      for (;;) {
        expect_block_end();
        Body b = parse_body({"endif", "elif", "else"}, which, line, "if");
        n->branches.emplace_back(std::move(cond), std::move(b));
        if (which == "elif") {
          cond = parse_expression(false);
        } else if (which == "else") {
          expect_block_end();
          n->branches.emplace_back(nullptr, parse_body({"endif"}, which, line, "if"));
          break;
        } else {
          break;
        }
      }
      expect_block_end();
      return n;
    }
    if (tag == "for") {
      auto n = make_node(Node::Kind::For, line);
      bool paren = is_op("(");
      if (paren) next();
      do n->targets.push_back(expect_name("a loop variable"));
      while (is_op(",") && (next(), true));
      if (paren) expect_op(")");
      if (!is_name("in")) unexpected("'in'");
      next();
      n->expr = parse_tuple(false);
      if (is_name("if")) {
        next();
        n->cond = parse_expression(true);
      }
      if (is_name("recursive")) error(line, "recursive for loops are not supported");
      expect_block_end();
      ++loop_depth_;
      n->body = parse_body({"endfor", "else"}, which, line, "for");
      --loop_depth_;
      if (which == "else") {
        expect_block_end();
        n->else_body = parse_body({"endfor"}, which, line, "for");
      }
      expect_block_end();
      return n;
    }
    if (tag == "set") {
      auto n = make_node(Node::Kind::Set, line);
      n->targets.push_back(expect_name("a variable name"));
      if (is_op(".")) {
        next();
        n->attr = expect_name("an attribute name");
      } else {
        while (is_op(",")) {
          next();
          n->targets.push_back(expect_name("a variable name"));
        }
      }
      if (is_op("=")) {
        next();
        n->expr = parse_tuple();
        expect_block_end();
        return n;
      }
      if (!n->attr.empty() || n->targets.size() != 1) unexpected("'='");
      expect_block_end();
      n->kind = Node::Kind::SetBlock;
      n->body = parse_body({"endset"}, which, line, "set");
      expect_block_end();
      return n;
    }
    if (tag == "macro") {
      auto n = make_node(Node::Kind::Macro, line);
      n->text = expect_name("a macro name");
      expect_op("(");
      while (!is_op(")")) {
        std::string p = expect_name("a parameter name");
        ExprP dflt;
        if (is_op("=")) {
          next();
          dflt = parse_expression(true);
        }
        n->params.emplace_back(p, std::move(dflt));
        if (!is_op(",")) break;
        next();
      }
      expect_op(")");
      expect_block_end();
      int saved = loop_depth_;
      loop_depth_ = 0;
      n->body = parse_body({"endmacro"}, which, line, "macro");
      loop_depth_ = saved;
      if (peek().type == Tok::Name) next();
      expect_block_end();
      return n;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) error(line, "'" + tag + "' outside of a for loop");
      expect_block_end();
      return make_node(tag == "break" ? Node::Kind::Break : Node::Kind::Continue, line);
    }
    if (tag == "generation") {
      expect_block_end();
      auto n = make_node(Node::Kind::Generation, line);
      n->body = parse_body({"endgeneration"}, which, line, "generation");
      expect_block_end();
      return n;
    }
    static const char* closers[] = {"endif", "elif", "else", "endfor", "endset", "endmacro", "endgeneration"};
    for (const char* c : closers)
      if (tag == c) error(line, "unexpected '{% " + tag + " %}': no block it could close is open");
    error(line, "unknown or unsupported tag '{% " + tag + " %}'");
  }

  // ---- expressions, by increasing binding strength as in jinja2/parser.py ----
  bool at_tuple_end() const {
    auto ty = peek().type;
    return ty == Tok::VarEnd || ty == Tok::BlockEnd || is_op(")");
  }
  ExprP parse_tuple(bool with_condexpr = true) {
    int line = peek().line;
    ExprP first = parse_expression(with_condexpr);
    if (!is_op(",")) return first;
    auto t = make(Expr::Kind::Tuple, line);
    t->args.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (at_tuple_end() || is_name("if")) break;
      t->args.push_back(parse_expression(with_condexpr));
    }
    return t;
  }
  ExprP parse_expression(bool with_condexpr) {
    DepthGuard guard(*this, peek().line);
    if (!with_condexpr) return parse_or();
    ExprP e = parse_or();
    while (is_name("if")) {
      int line = next().line;
      ExprP cond = parse_or();
      ExprP other;
      if (is_name("else")) {
        next();
        other = parse_expression(true);
      }
      auto c = make(Expr::Kind::Cond, line, "", std::move(e), std::move(cond));
      c->args.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }
  ExprP parse_or() {
    ExprP e = parse_and();
    while (is_name("or")) {
      int line = next().line;
      e = make(Expr::Kind::Binary, line, "or", std::move(e), parse_and());
    }
    return e;
  }
  ExprP parse_and() {
    ExprP e = parse_not();
    while (is_name("and")) {
      int line = next().line;
      e = make(Expr::Kind::Binary, line, "and", std::move(e), parse_not());
    }
    return e;
  }
  ExprP parse_not() {
    if (is_name("not")) {
      int line = next().line;
      return make(Expr::Kind::Unary, line, "not", parse_not());
    }
    return parse_compare();
  }
  ExprP parse_compare() {
    ExprP e = parse_math1();
    int n = 0;
    for (;; ++n) {
      int line = peek().line;
      std::string op;
      if (peek().type == Tok::Op && (peek().s == "==" || peek().s == "!=" || peek().s == "<" ||
                                     peek().s == "<=" || peek().s == ">" || peek().s == ">=")) {
        op = next().s;
      } else if (is_name("in")) {
        op = next().s;
      } else if (is_name("not") && is_name("in", 1)) {
        next(), next();
        op = "not in";
      } else {
        break;
      }
      if (n > 0) error(line, "chained comparisons (a < b < c) are not supported");
      e = make(Expr::Kind::Binary, line, op, std::move(e), parse_math1());
    }
    return e;
  }
  template <class F>
  ExprP binary_loop(F operand, std::initializer_list<const char*> ops) {
    ExprP e = operand();
    for (;;) {
      const char* hit = nullptr;
      for (const char* o : ops)
        if (is_op(o)) hit = o;
      if (!hit) return e;
      int line = next().line;
      e = make(Expr::Kind::Binary, line, hit, std::move(e), operand());
    }
  }
  ExprP parse_math1() {
    return binary_loop([&] { return parse_concat(); }, {"+", "-"});
  }
  ExprP parse_concat() {
    return binary_loop([&] { return parse_math2(); }, {"~"});
  }
  ExprP parse_math2() {
    return binary_loop([&] { return parse_pow(); }, {"*", "/", "//", "%"});
  }
  ExprP parse_pow() {
    return binary_loop([&] { return parse_unary(true); }, {"**"});
  }
  ExprP parse_unary(bool with_filter) {
    DepthGuard guard(*this, peek().line);
    ExprP e;
    if (is_op("-") || is_op("+")) {
      const Tok& t = next();
      e = make(Expr::Kind::Unary, t.line, t.s, parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }
  ExprP parse_primary() {
    const Tok& t = peek();
    int line = t.line;
    if (t.type == Tok::Name) {
      next();
      auto c = make(Expr::Kind::Const, line);
      if (t.s == "true" || t.s == "True")
        c->value = true;
      else if (t.s == "false" || t.s == "False")
        c->value = false;
      else if (t.s == "none" || t.s == "None")
        c->value = nullptr;
      else
        return make(Expr::Kind::Name, line, t.s);
      return c;
    }
    if (t.type == Tok::Str) {
      auto c = make(Expr::Kind::Const, line);
      std::string s;
      while (peek().type == Tok::Str) s += next().s;  // adjacent literals concatenate
      c->value = s;
      return c;
    }
    if (t.type == Tok::Int || t.type == Tok::Float) {
      auto c = make(Expr::Kind::Const, line);
      c->value = next().num;
      return c;
    }
    if (is_op("(")) {
      next();
      if (is_op(")")) {
        next();
        return make(Expr::Kind::Tuple, line);
      }
      ExprP e = parse_tuple();
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto l = make(Expr::Kind::List, line);
      while (!is_op("]")) {
        l->args.push_back(parse_expression(true));
        if (!is_op(",")) break;
        next();
      }
      expect_op("]");
      return l;
    }
    if (is_op("{")) {
      next();
      auto d = make(Expr::Kind::Dict, line);
      while (!is_op("}")) {
        d->args.push_back(parse_expression(true));
        expect_op(":");
        d->args.push_back(parse_expression(true));
        if (!is_op(",")) break;
        next();
      }
      expect_op("}");
      return d;
    }
    unexpected("an expression");
  }
  ExprP parse_postfix(ExprP e) {
    for (;;) {
      int line = peek().line;
      if (is_op(".")) {
        next();
        if (peek().type == Tok::Int) {
          auto idx = make(Expr::Kind::Const, line);
          idx->value = next().num;
          e = make(Expr::Kind::Item, line, "", std::move(e), std::move(idx));
        } else {
          e = make(Expr::Kind::Attr, line, expect_name("an attribute name"), std::move(e));
        }
      } else if (is_op("[")) {
        next();
        ExprP parts[3];
        int n = 0;
        bool slice = false;
        for (;;) {
          if (!is_op(":") && !is_op("]")) parts[n] = parse_expression(true);
          if (!is_op(":")) break;
          next();
          slice = true;
          if (++n > 2) error(line, "too many ':' in slice");
        }
        expect_op("]");
        if (!slice) {
          if (!parts[0]) error(line, "empty subscript []");
          e = make(Expr::Kind::Item, line, "", std::move(e), std::move(parts[0]));
        } else {
          auto s = make(Expr::Kind::Slice, line, "", std::move(e));
          for (auto& p : parts) s->args.push_back(std::move(p));
          e = std::move(s);
        }
      } else if (is_op("(")) {
        e = parse_call(std::move(e), Expr::Kind::Call, "");
      } else {
        return e;
      }
    }
  }
  ExprP parse_call(ExprP callee, Expr::Kind kind, std::string name) {
    auto c = make(kind, peek().line, std::move(name), std::move(callee));
    expect_op("(");
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) error(peek().line, "*args / **kwargs in calls are not supported");
      if (peek().type == Tok::Name && is_op("=", 1)) {
        std::string k = next().s;
        next();
        c->kwargs.emplace_back(k, parse_expression(true));
      } else {
        if (!c->kwargs.empty()) error(peek().line, "positional argument after keyword argument");
        c->args.push_back(parse_expression(true));
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
    return c;
  }
  ExprP parse_filter_expr(ExprP e) {
    for (;;) {
      if (is_op("|")) {
        int line = next().line;
        std::string f = expect_name("a filter name");
        if (!has_filter(f)) error(line, "unknown or unsupported filter '" + f + "'");
        if (is_op("(")) {
          e = parse_call(std::move(e), Expr::Kind::Filter, f);
        } else {
          e = make(Expr::Kind::Filter, line, f, std::move(e));
        }
      } else if (is_name("is")) {
        int line = next().line;
        bool negated = is_name("not") && (next(), true);
        std::string t = expect_name("a test name");
        if (!has_test(t)) error(line, "unknown or unsupported test '" + t + "'");
        if (is_op("(")) {
          e = parse_call(std::move(e), Expr::Kind::Test, t);
        } else {
          auto ty = peek().type;
          bool arg = (ty == Tok::Name || ty == Tok::Str || ty == Tok::Int || ty == Tok::Float || is_op("[") ||
                      is_op("{")) &&
                     !is_name("else") && !is_name("or") && !is_name("and");
          if (is_name("is")) error(peek().line, "tests cannot be chained with 'is'");
          e = make(Expr::Kind::Test, line, t, std::move(e));
          if (arg) e->args.push_back(parse_postfix(parse_primary()));
        }
        e->negated = negated;
      } else if (is_op("(")) {
        e = parse_call(std::move(e), Expr::Kind::Call, "");
      } else {
        return e;
      }
    }
  }

  std::vector<Tok> t_;
  size_t i_ = 0;
  const std::string& name_;
  int loop_depth_ = 0;
  int depth_ = 0;
};

}  // namespace

NodeP parse_template(std::string_view source, const std::string& name, const Options& opts) {
  Parser p(Lexer(source, name, opts).run(), name);
  return p.parse_root();
}

}  // namespace dsv3::jinja
