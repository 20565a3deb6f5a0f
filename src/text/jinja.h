// A small Jinja2 interpreter for chat templates: the subset of Jinja2 (3.1) that Hugging Face chat
// templates use, evaluated over JSON values with Python semantics (str(), json.dumps, slicing, ...).
// Anything outside the subset is a dsv3::Error naming the template line, never a silent guess.
//
// Statements: if/elif/else, for (tuple targets, `if` filter, else, loop.*), set (name, tuple,
// ns.attr, block form), macro, break/continue, raw, generation (HF's tag, renders its body),
// comments, whitespace control ({%- -%} {{- -}} {%+), trim_blocks, lstrip_blocks.
// Expressions: literals, lists, dicts, tuples, names, .attr, [item], [a:b:c], calls, |filters,
// `is` tests, not/and/or, + - * / // % ** ~, comparisons, in / not in, `a if c else b`.
// Globals: range, namespace, dict, raise_exception, strftime_now. Filters, tests and methods:
// see jinja_builtins.cc (filter_names(), test_names()).
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace dsv3::jinja {

// Insertion-ordered like a Python dict: tojson and dict iteration keep the caller's key order.
using Json = nlohmann::ordered_json;

struct Options {
  bool trim_blocks = false;            // drop the first newline after a block tag or comment
  bool lstrip_blocks = false;          // drop spaces before a block tag or comment on its line
  bool keep_trailing_newline = false;  // Jinja2 drops one trailing newline of the source
};

// The environment transformers' apply_chat_template compiles templates with.
inline Options hf_chat_options() {
  return Options{true, true, false};
}

struct Node;

class Template {
 public:
  // Parses `source`. `name` prefixes every error message ("<name> line 3: ..."). Throws Error on
  // syntax errors, unknown tags, unknown filters or tests.
  explicit Template(std::string_view source, std::string name = "template", Options opts = {});
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // Renders with the variables of `context` (a JSON object). Throws Error on what cannot be
  // rendered (undefined operands, type errors, raise_exception(...)).
  std::string render(const Json& context) const;

  const std::string& name() const { return name_; }

 private:
  std::string name_;
  std::unique_ptr<Node> root_;
};

}  // namespace dsv3::jinja
