// Internals of the Jinja interpreter shared by its parser (jinja_parse.cc), evaluator (jinja.cc)
// and builtins (jinja_builtins.cc): the syntax tree, runtime values and Python-style helpers.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.h"
#include "text/jinja.h"

namespace dsv3::jinja {

struct Expr;
using ExprP = std::unique_ptr<Expr>;
using KwArgs = std::vector<std::pair<std::string, ExprP>>;

struct Expr {
  enum class Kind {
    Const,   // value
    Name,    // name
    List,    // args = elements
    Tuple,   // args = elements
    Dict,    // args = k0, v0, k1, v1, ...
    Attr,    // args[0].name
    Item,    // args[0][args[1]]
    Slice,   // args[0][args[1]:args[2]:args[3]], absent parts are null
    Call,    // args[0](args[1..], kwargs)
    Filter,  // args[0] | name(args[1..], kwargs)
    Test,    // args[0] is [not] name(args[1..], kwargs); negated
    Unary,   // name in {"-", "+", "not"}, args[0]
    Binary,  // args[0] name args[1]; name is an operator, "in", "not in", "and", "or"
    Cond,    // args[0] if args[1] else args[2] (args[2] null: undefined)
  };
  Kind kind;
  int line;
  Json value;
  std::string name;
  std::vector<ExprP> args;
  KwArgs kwargs;
  bool negated = false;
};

struct Node;
using NodeP = std::unique_ptr<Node>;
using Body = std::vector<NodeP>;

struct Node {
  enum class Kind {
    Root,      // body
    Text,      // text
    Output,    // {{ expr }}
    If,        // branches (a null condition is the else branch)
    For,       // targets in expr [if cond]: body, else_body
    Set,       // targets = expr; attr non-empty: targets[0].attr = expr
    SetBlock,  // {% set targets[0] %}body{% endset %}
    Macro,     // name(params): body
    Break,
    Continue,
    Generation,  // HF's {% generation %}: renders its body
  };
  Kind kind;
  int line;
  std::string text;  // Text, Macro name
  std::string attr;  // Set with attribute target
  std::vector<std::string> targets;
  ExprP expr;
  ExprP cond;
  std::vector<std::pair<ExprP, Body>> branches;
  Body body, else_body;
  std::vector<std::pair<std::string, ExprP>> params;  // Macro: name, default (or null)
};

// A runtime value: JSON data, or what JSON cannot hold (undefined, namespace(), callables).
struct Value {
  enum class Kind { Undefined, Data, Namespace, Callable };
  Kind kind = Kind::Undefined;
  std::shared_ptr<std::map<std::string, Value>> ns;  // Namespace (shared: set ns.x mutates it)
  const Node* macro = nullptr;                       // Callable: a macro, or
  std::string builtin;                               // Callable: a global function's name
  std::string what;                                  // Undefined: what was looked up, for errors
  // Data standing for a Python object JSON has no type for, so that what Jinja2 would do with
  // it differently from a list is done the same or refused: "generator" and
  // "list_reverseiterator" (map/select/... results: always true, no len(), no [i]),
  // "dict_items"/"dict_keys"/"dict_values" (no [i]), "range", "LoopContext" (`loop`: attributes
  // only). Empty for plain JSON.
  std::string opaque;
  // Data that is, or may hold, a tuple (a tuple literal, dict items, dictsort pairs). JSON keeps
  // it as a list, so printing its Python repr is refused when it holds any list.
  bool tuples = false;

  // Data: a node of an immutable JSON tree that values share (templates cannot mutate data), so
  // `messages[i]`, attribute access and iteration cost O(1), not a copy of the subtree.
  const Json& data() const { return node_ ? *node_ : null_json(); }

  static Value of(Json j) {
    Value v;
    v.kind = Kind::Data;
    v.root_ = std::make_shared<const Json>(std::move(j));
    v.node_ = v.root_.get();
    return v;
  }
  // `part` (a node inside `parent`'s data), sharing its storage; keeps the tuples mark.
  static Value part_of(const Value& parent, const Json& part) {
    Value v;
    v.kind = Kind::Data;
    v.root_ = parent.root_;
    v.node_ = &part;
    v.tuples = parent.tuples;
    return v;
  }
  static Value undefined(std::string what) {
    Value v;
    v.what = std::move(what);
    return v;
  }
  static Value typed(Json j, std::string opaque, bool tuples = false) {
    Value v = of(std::move(j));
    v.opaque = std::move(opaque);
    v.tuples = tuples;
    return v;
  }
  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_iterator() const { return opaque == "generator" || opaque == "list_reverseiterator"; }
  bool indexable() const { return opaque.empty() || opaque == "range"; }
  bool is_data() const { return kind == Kind::Data; }

 private:
  static const Json& null_json() {
    static const Json null;
    return null;
  }
  std::shared_ptr<const Json> root_;
  const Json* node_ = nullptr;
};

// Thrown by the builtins without knowing the line; the evaluator adds template name and line.
struct EvalError : Error {
  using Error::Error;
};
template <class... A>
[[noreturn]] void eval_fail(const A&... a) {
  throw EvalError(str(a...));
}

// Python numbers over JSON: bool is an int (True + 1 == 2).
inline bool is_num(const Json& j) {
  return j.is_number() || j.is_boolean();
}
inline bool is_int(const Json& j) {
  return j.is_number_integer() || j.is_boolean();
}
inline int64_t as_int(const Json& j) {
  if (j.is_boolean()) return j.get<bool>() ? 1 : 0;
  if (j.is_number_unsigned() && j.get<uint64_t>() > uint64_t(INT64_MAX))
    eval_fail("integer ", j.dump(), " is too large");
  return j.get<int64_t>();
}
inline double as_double(const Json& j) {
  return j.is_boolean() ? (j.get<bool>() ? 1.0 : 0.0) : j.get<double>();
}

// ---- jinja_parse.cc ----
// The syntax tree of `source` (a Node of kind Root). Errors are "<name> line N: ...".
NodeP parse_template(std::string_view source, const std::string& name, const Options& opts);

// ---- jinja_builtins.cc ----
struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};
class Evaluator;  // jinja.cc; filters like map() and select() call back into it

bool has_filter(const std::string& name);
bool has_test(const std::string& name);
Value apply_filter(Evaluator& ev, const std::string& name, const Value& v, const CallArgs& a);
bool apply_test(Evaluator& ev, const std::string& name, const Value& v, const CallArgs& a);
Value call_method(const Value& obj, const std::string& name, const CallArgs& a);
Value call_global(const std::string& name, const CallArgs& a);
bool is_global(const std::string& name);

// Python semantics over values.
bool truthy(const Value& v);
std::string type_name(const Value& v);  // "string", "undefined (messages[0]['x'])", ...
bool py_equal(const Json& a, const Json& b);
int py_compare(const Json& a, const Json& b);  // <0, 0, >0; Error when not orderable
std::string py_str(const Value& v);            // str(v); undefined -> ""
std::string py_repr(const Json& j);            // repr(j)
std::string py_float_repr(double d);
// json.dumps(j, ensure_ascii, indent (null, int or string), separators, sort_keys)
std::string py_json(const Json& j, bool ensure_ascii, const Json& indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys);
std::vector<Value> iterate(const Value& v);  // for-loop items (dict: keys; string: characters)
size_t py_len(const Value& v);

// UTF-8 as Python str: code points.
std::u32string utf8_decode(std::string_view s);
char32_t utf8_next(std::string_view s, size_t& i);  // code point at i (invalid byte: U+FFFD), advances
std::string utf8_encode(std::u32string_view s);
bool is_py_space(char32_t c);  // str.isspace()
std::string rstrip_space(std::string_view s);

}  // namespace dsv3::jinja
