// Jinja evaluator: walks the syntax tree of jinja_parse.cc with Jinja2's scoping (a for-loop
// iteration and a macro call get their own scope; `if` does not; namespace() objects are shared)
// and Python's operator semantics. Builtin filters, tests and methods live in jinja_builtins.cc.
#include <algorithm>
#include <climits>
#include <cmath>

#include "text/jinja_internal.h"

namespace dsv3::jinja {

namespace {

// a // b and a % b with Python's sign rules (the result of % has the sign of b).
int64_t floor_div(int64_t a, int64_t b) {
  if (a == INT64_MIN && b == -1) eval_fail("integer overflow in //");
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

Value arith(const std::string& op, const Json& a, const Json& b) {
  if (op == "**" && (!is_int(a) || !is_int(b) || as_int(b) < 0)) {
    double x = as_double(a), y = as_double(b);
    if (x == 0 && y < 0) eval_fail("0.0 cannot be raised to a negative power");
    if (x < 0 && y != std::floor(y)) eval_fail("a negative number to a fractional power is complex");
    return Value::of(std::pow(x, y));
  }
  if (op == "/") {
    if (as_double(b) == 0) eval_fail("division by zero");
    return Value::of(as_double(a) / as_double(b));
  }
  if (is_int(a) && is_int(b)) {
    int64_t x = as_int(a), y = as_int(b), r = 0;
    bool overflow = false;
    if (op == "+")
      overflow = __builtin_add_overflow(x, y, &r);
    else if (op == "-")
      overflow = __builtin_sub_overflow(x, y, &r);
    else if (op == "*")
      overflow = __builtin_mul_overflow(x, y, &r);
    else if (op == "//" || op == "%") {
      if (y == 0) eval_fail(op == "//" ? "integer division by zero" : "integer modulo by zero");
      r = floor_div(x, y);
      if (op == "%") r = x - r * y;
    } else if (op == "**") {
      if (x == 0 || x == 1) return Value::of(y == 0 ? int64_t(1) : x);
      if (x == -1) return Value::of(y % 2 ? int64_t(-1) : int64_t(1));
      r = 1;  // |x| >= 2 overflows within 63 steps
      for (int64_t i = 0; i < y && !overflow; ++i) overflow = __builtin_mul_overflow(r, x, &r);
    }
    if (overflow) eval_fail("integer overflow in ", x, " ", op, " ", y);
    return Value::of(r);
  }
  double x = as_double(a), y = as_double(b);
  if (op == "+") return Value::of(x + y);
  if (op == "-") return Value::of(x - y);
  if (op == "*") return Value::of(x * y);
  if (y == 0) eval_fail("float division by zero");
  double mod = std::fmod(x, y), div = (x - mod) / y;  // CPython's float_divmod
  if (mod != 0) {
    if ((y < 0) != (mod < 0)) mod += y, div -= 1.0;
  } else {
    mod = std::copysign(0.0, y);
  }
  double floordiv = std::copysign(0.0, x / y);
  if (div != 0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  }
  return Value::of(op == "//" ? floordiv : mod);
}

bool values_equal(const Value& a, const Value& b) {
  if (a.is_iterator() || b.is_iterator()) return false;  // Python compares iterators by identity
  if (a.opaque != b.opaque) return false;
  if (a.is_data() && b.is_data()) return py_equal(a.data(), b.data());
  if (a.kind != b.kind) return false;
  if (a.kind == Value::Kind::Namespace) return a.ns == b.ns;
  if (a.kind == Value::Kind::Callable) return a.macro == b.macro && a.builtin == b.builtin;
  return true;  // undefined == undefined
}

bool contains(const Value& container, const Value& item) {
  if (container.is_undefined()) return false;  // Undefined iterates as empty
  if (!container.is_data())
    eval_fail("'in' needs a string, list or dict on the right, got ", type_name(container));
  const Json& c = container.data();
  if (c.is_string()) {
    if (!item.is_data() || !item.data().is_string())
      eval_fail("'in <string>' requires a string on the left, got ", type_name(item));
    return c.get_ref<const std::string&>().find(item.data().get_ref<const std::string&>()) !=
           std::string::npos;
  }
  if (c.is_array()) {
    if (!item.is_data()) return false;
    for (const auto& x : c)
      if (py_equal(x, item.data())) return true;
    return false;
  }
  if (c.is_object() && item.is_data() && (item.data().is_array() || item.data().is_object()))
    eval_fail("'in <dict>' needs a hashable key, got ", type_name(item));
  if (c.is_object())
    return item.is_data() && item.data().is_string() && c.contains(item.data().get<std::string>());
  eval_fail("'in' needs a string, list or dict on the right, got ", type_name(container));
}

Value binary(const std::string& op, const Value& l, const Value& r) {
  if (op == "~") return Value::of(py_str(l) + py_str(r));
  if (op == "==") return Value::of(values_equal(l, r));
  if (op == "!=") return Value::of(!values_equal(l, r));
  if (op == "in") return Value::of(contains(r, l));
  if (op == "not in") return Value::of(!contains(r, l));
  for (const Value* v : {&l, &r})
    if (!v->is_data() || !v->opaque.empty()) eval_fail("cannot apply '", op, "' to ", type_name(*v));
  const Json &a = l.data(), &b = r.data();
  if (op == "<") return Value::of(py_compare(a, b) < 0);
  if (op == "<=") return Value::of(py_compare(a, b) <= 0);
  if (op == ">") return Value::of(py_compare(a, b) > 0);
  if (op == ">=") return Value::of(py_compare(a, b) >= 0);
  if (is_num(a) && is_num(b)) return arith(op, a, b);
  if (op == "+" && a.is_string() && b.is_string())
    return Value::of(a.get_ref<const std::string&>() + b.get_ref<const std::string&>());
  if (op == "+" && a.is_array() && b.is_array()) {
    Json out = a;
    for (const auto& x : b) out.push_back(x);
    return Value::typed(std::move(out), "", l.tuples || r.tuples);
  }
  if (op == "*" && (a.is_string() || a.is_array()) && is_int(b)) {
    int64_t n = as_int(b);
    size_t unit = std::max<size_t>(1, a.is_string() ? a.get_ref<const std::string&>().size() : a.size());
    if (n > 0 && uint64_t(n) > (64u << 20) / unit) eval_fail("repetition result too large");
    Json out = a.is_string() ? Json("") : Json::array();
    for (int64_t i = 0; i < n; ++i) {
      if (a.is_string())
        out.get_ref<std::string&>() += a.get_ref<const std::string&>();
      else
        for (const auto& x : a) out.push_back(x);
    }
    return Value::typed(std::move(out), "", l.tuples);
  }
  if (op == "*" && is_int(a) && (b.is_string() || b.is_array())) return binary(op, r, l);
  if (op == "%" && a.is_string()) eval_fail("printf-style string formatting ('...' % x) is not supported");
  eval_fail("unsupported operand types for ", op, ": ", type_name(l), " and ", type_name(r));
}

// Python index into a sequence of length n; false when out of range.
bool py_index(int64_t i, size_t n, size_t& out) {
  if (i < 0) i += int64_t(n);
  if (i < 0 || i >= int64_t(n)) return false;
  out = size_t(i);
  return true;
}

}  // namespace

class Evaluator {
 public:
  Evaluator(const std::string& name, const Json& context) : name_(name) {
    Value ctx = Value::of(context);  // the one copy of the caller's data
    for (const auto& [k, v] : ctx.data().items()) top_[k] = Value::part_of(ctx, v);
    scopes_.push_back(&top_);
  }

  void run(const Node& root, std::string& out) { exec(root.body, out); }

 private:
  using Frame = std::map<std::string, Value>;
  enum class Flow { Normal, Break, Continue };

  [[noreturn]] void error(int line, const std::string& msg) const { fail(name_, " line ", line, ": ", msg); }

  Flow exec(const Body& body, std::string& out) {
    for (const auto& n : body) {
      Flow f = exec(*n, out);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  Flow exec(const Node& n, std::string& out) {
    switch (n.kind) {
      case Node::Kind::Root:
      case Node::Kind::Generation:
        return exec(n.body, out);
      case Node::Kind::Text:
        out += n.text;
        return Flow::Normal;
      case Node::Kind::Output: {
        Value v = eval(*n.expr);
        if (v.kind == Value::Kind::Namespace || v.kind == Value::Kind::Callable)
          error(n.line, "cannot print " + type_name(v));
        out += py_str(v);
        return Flow::Normal;
      }
      case Node::Kind::If:
        for (const auto& [cond, body] : n.branches)
          if (!cond || truthy(eval(*cond))) return exec(body, out);
        return Flow::Normal;
      case Node::Kind::For:
        return exec_for(n, out);
      case Node::Kind::Set: {
        Value v = eval(*n.expr);
        if (n.attr.empty()) {
          assign(n.targets, v, n.line);
        } else {
          Value target = lookup(n.targets[0]);
          if (target.kind != Value::Kind::Namespace)
            error(n.line, "cannot set attribute '" + n.attr + "' of " + type_name(target) +
                              ": only namespace() objects can be assigned to");
          (*target.ns)[n.attr] = std::move(v);
        }
        return Flow::Normal;
      }
      case Node::Kind::SetBlock: {
        std::string s;
        exec(n.body, s);
        assign(n.targets, Value::of(std::move(s)), n.line);
        return Flow::Normal;
      }
      case Node::Kind::Macro: {
        Value m;
        m.kind = Value::Kind::Callable;
        m.macro = &n;
        (*scopes_.back())[n.text] = std::move(m);
        return Flow::Normal;
      }
      case Node::Kind::Break:
        return Flow::Break;
      case Node::Kind::Continue:
        return Flow::Continue;
    }
    error(n.line, "internal: unknown node");
  }

  Flow exec_for(const Node& n, std::string& out) {
    Value seq = eval(*n.expr);
    std::vector<Value> items;
    try {
      items = iterate(seq);
    } catch (const EvalError& e) {
      error(n.line, e.what());
    }
    if (n.cond) {
      std::vector<Value> kept;
      for (auto& it : items) {
        Frame f;
        scopes_.push_back(&f);
        assign(n.targets, it, n.line);
        bool keep = truthy(eval(*n.cond));
        scopes_.pop_back();
        if (keep) kept.push_back(std::move(it));
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec(n.else_body, out);
    const size_t len = items.size();
    for (size_t i = 0; i < len; ++i) {
      Frame f;
      scopes_.push_back(&f);
      assign(n.targets, items[i], n.line);
      Json loop = {
          {"index", i + 1},  {"index0", i},          {"revindex", len - i}, {"revindex0", len - i - 1},
          {"first", i == 0}, {"last", i + 1 == len}, {"length", len},       {"depth", 1},
          {"depth0", 0}};
      if (i > 0 && items[i - 1].is_data()) loop["previtem"] = items[i - 1].data();
      if (i + 1 < len && items[i + 1].is_data()) loop["nextitem"] = items[i + 1].data();
      f["loop"] = Value::typed(std::move(loop), "LoopContext", items[i].tuples);  // previtem/nextitem
      Flow flow = exec(n.body, out);
      scopes_.pop_back();
      if (flow == Flow::Break) break;
    }
    return Flow::Normal;
  }

  void assign(const std::vector<std::string>& targets, const Value& v, int line) {
    Frame& f = *scopes_.back();
    if (targets.size() == 1) {
      f[targets[0]] = v;
      return;
    }
    if (!v.is_data() || !v.data().is_array() || v.data().size() != targets.size())
      error(line, str("cannot unpack ", type_name(v), " into ", targets.size(), " variables"));
    for (size_t i = 0; i < targets.size(); ++i) f[targets[i]] = Value::part_of(v, v.data()[i]);
  }

  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto hit = (*it)->find(name);
      if (hit != (*it)->end()) return hit->second;
    }
    if (is_global(name)) {
      Value v;
      v.kind = Value::Kind::Callable;
      v.builtin = name;
      return v;
    }
    return Value::undefined("'" + name + "'");
  }

 public:
  // Evaluates `e`; errors from builtins get this expression's line.
  Value eval(const Expr& e) {
    try {
      return eval_inner(e);
    } catch (const EvalError& err) {
      error(e.line, err.what());
    }
  }

 private:
  Value data_of(const Expr& e, const char* what, bool& tuples) {
    Value v = eval(e);
    if (!v.is_data() || !v.opaque.empty()) error(e.line, str(what, " cannot hold ", type_name(v)));
    tuples |= v.tuples;
    return v;
  }

  Value eval_inner(const Expr& e) {
    switch (e.kind) {
      case Expr::Kind::Const:
        return Value::of(e.value);
      case Expr::Kind::Name:
        return lookup(e.name);
      case Expr::Kind::List:
      case Expr::Kind::Tuple: {
        Json out = Json::array();
        bool tuples = e.kind == Expr::Kind::Tuple;
        for (const auto& a : e.args) out.push_back(data_of(*a, "a list", tuples).data());
        return Value::typed(std::move(out), "", tuples);
      }
      case Expr::Kind::Dict: {
        Json out = Json::object();
        bool tuples = false;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          Value k = eval(*e.args[i]);
          if (!k.is_data() || !k.data().is_string())
            error(e.line, "dict keys must be strings, got " + type_name(k));
          out[k.data().get<std::string>()] = data_of(*e.args[i + 1], "a dict", tuples).data();
        }
        return Value::typed(std::move(out), "", tuples);
      }
      case Expr::Kind::Attr:
        return get_attr(eval(*e.args[0]), e.name, *e.args[0]);
      case Expr::Kind::Item:
        return get_item(eval(*e.args[0]), eval(*e.args[1]), *e.args[0]);
      case Expr::Kind::Slice:
        return slice(e);
      case Expr::Kind::Call:
        return call(e);
      case Expr::Kind::Filter: {
        Value v = eval(*e.args[0]);
        Value out = apply_filter(*this, e.name, v, eval_args(e));
        if (out.is_data() && !out.data().is_primitive()) out.tuples |= v.tuples;
        return out;
      }
      case Expr::Kind::Test:
        return Value::of(apply_test(*this, e.name, eval(*e.args[0]), eval_args(e)) != e.negated);
      case Expr::Kind::Unary: {
        Value v = eval(*e.args[0]);
        if (e.name == "not") return Value::of(!truthy(v));
        if (!v.is_data() || !is_num(v.data()))
          eval_fail("bad operand for unary ", e.name, ": ", type_name(v));
        if (e.name == "+") return v.data().is_boolean() ? Value::of(as_int(v.data())) : v;
        if (is_int(v.data())) return arith("-", Json(0), v.data());
        return Value::of(-v.data().get<double>());
      }
      case Expr::Kind::Binary: {
        Value l = eval(*e.args[0]);
        if (e.name == "and") return truthy(l) ? eval(*e.args[1]) : l;
        if (e.name == "or") return truthy(l) ? l : eval(*e.args[1]);
        return binary(e.name, l, eval(*e.args[1]));
      }
      case Expr::Kind::Cond:
        if (truthy(eval(*e.args[1]))) return eval(*e.args[0]);
        if (e.args[2]) return eval(*e.args[2]);
        return Value::undefined("the conditional expression without 'else'");
    }
    error(e.line, "internal: unknown expression");
  }

  static std::string describe(const Expr& e) {
    if (e.kind == Expr::Kind::Name) return "'" + e.name + "'";
    if (e.kind == Expr::Kind::Attr) return describe(*e.args[0]) + "." + e.name;
    if (e.kind == Expr::Kind::Item && e.args[1]->kind == Expr::Kind::Const)
      return describe(*e.args[0]) + "[" + e.args[1]->value.dump() + "]";
    return "the value";
  }
  [[noreturn]] void undefined_use(const Value& v, const Expr& from) {
    eval_fail(describe(from), " is undefined",
              v.what.empty() || v.what == describe(from) ? "" : " (" + v.what + ")");
  }

  Value get_attr(const Value& obj, const std::string& name, const Expr& from) {
    if (obj.is_undefined()) undefined_use(obj, from);
    std::string what = describe(from) + "." + name;
    if (obj.kind == Value::Kind::Namespace) {
      auto it = obj.ns->find(name);
      return it == obj.ns->end() ? Value::undefined(what) : it->second;
    }
    if (obj.is_data() && (obj.opaque.empty() || obj.opaque == "LoopContext") && obj.data().is_object()) {
      auto it = obj.data().find(name);
      if (it != obj.data().end()) return Value::part_of(obj, *it);
    }
    return Value::undefined(what);
  }

  Value get_item(const Value& obj, const Value& key, const Expr& from) {
    if (obj.is_undefined()) undefined_use(obj, from);
    std::string what = describe(from) + "[" + (key.is_data() ? key.data().dump() : type_name(key)) + "]";
    if ((obj.kind == Value::Kind::Namespace || obj.opaque == "LoopContext") && key.is_data() &&
        key.data().is_string())
      return get_attr(obj, key.data().get<std::string>(), from);
    if (!obj.is_data() || !key.is_data() || !obj.indexable()) return Value::undefined(what);
    const Json &o = obj.data(), &k = key.data();
    size_t idx;
    if (o.is_object() && k.is_string()) {
      auto it = o.find(k.get<std::string>());
      if (it != o.end()) return Value::part_of(obj, *it);
    } else if (o.is_array() && is_int(k)) {
      if (py_index(as_int(k), o.size(), idx)) return Value::part_of(obj, o[idx]);
    } else if (o.is_string() && is_int(k)) {
      std::u32string s = utf8_decode(o.get_ref<const std::string&>());
      if (py_index(as_int(k), s.size(), idx)) return Value::of(utf8_encode(s.substr(idx, 1)));
    }
    return Value::undefined(what);
  }

  // Python slicing of a list or string: obj[start:stop:step].
  Value slice(const Expr& e) {
    Value obj = eval(*e.args[0]);
    if (obj.is_undefined()) undefined_use(obj, *e.args[0]);
    if (!obj.indexable()) eval_fail("cannot slice ", type_name(obj));
    int64_t p[3];
    bool given[3];
    for (int i = 0; i < 3; ++i) {
      given[i] = e.args[i + 1] != nullptr;
      if (!given[i]) continue;
      Value v = eval(*e.args[i + 1]);
      if (v.is_data() && v.data().is_null()) {
        given[i] = false;
        continue;
      }
      if (!v.is_data() || !is_int(v.data())) eval_fail("slice indices must be integers, got ", type_name(v));
      p[i] = as_int(v.data());
    }
    int64_t step = given[2] ? p[2] : 1;
    if (step == 0) eval_fail("slice step cannot be zero");
    bool is_str = obj.is_data() && obj.data().is_string();
    if (!obj.is_data() || !(is_str || obj.data().is_array())) eval_fail("cannot slice ", type_name(obj));
    std::u32string s = is_str ? utf8_decode(obj.data().get_ref<const std::string&>()) : std::u32string();
    int64_t n = is_str ? int64_t(s.size()) : int64_t(obj.data().size());
    auto clamp = [&](int64_t v) {  // CPython's PySlice_AdjustIndices
      if (v < 0) v += n;
      return step > 0 ? std::clamp<int64_t>(v, 0, n) : std::clamp<int64_t>(v, -1, n - 1);
    };
    int64_t start = given[0] ? clamp(p[0]) : (step > 0 ? 0 : n - 1);
    int64_t stop = given[1] ? clamp(p[1]) : (step > 0 ? n : -1);
    std::u32string out_s;
    Json out_a = Json::array();
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (is_str)
        out_s += s[size_t(i)];
      else
        out_a.push_back(obj.data()[size_t(i)]);
    }
    return is_str ? Value::of(utf8_encode(out_s)) : Value::typed(std::move(out_a), obj.opaque, obj.tuples);
  }

  CallArgs eval_args(const Expr& e) {
    CallArgs a;
    for (size_t i = 1; i < e.args.size(); ++i) a.pos.push_back(eval(*e.args[i]));
    for (const auto& [k, v] : e.kwargs) a.kw.emplace_back(k, eval(*v));
    return a;
  }

  Value call(const Expr& e) {
    const Expr& callee = *e.args[0];
    if (callee.kind == Expr::Kind::Attr) {  // obj.method(...)
      Value obj = eval(*callee.args[0]);
      if (obj.is_undefined()) undefined_use(obj, *callee.args[0]);
      if (obj.kind == Value::Kind::Namespace)
        return call_value(get_attr(obj, callee.name, *callee.args[0]), e);
      CallArgs a = eval_args(e);
      if (obj.opaque == "LoopContext" && callee.name == "cycle") {  // loop.cycle(a, b, ...)
        if (a.pos.empty() || !a.kw.empty()) eval_fail("loop.cycle() needs at least one positional argument");
        return a.pos[obj.data()["index0"].get<size_t>() % a.pos.size()];
      }
      return call_method(obj, callee.name, a);
    }
    return call_value(eval(callee), e);
  }

  Value call_value(const Value& f, const Expr& e) {
    if (f.kind != Value::Kind::Callable) {
      if (f.is_undefined()) undefined_use(f, *e.args[0]);
      eval_fail(describe(*e.args[0]), " is not callable (it is ", type_name(f), ")");
    }
    CallArgs a = eval_args(e);
    if (!f.macro) return call_global(f.builtin, a);
    const Node& m = *f.macro;
    if (a.pos.size() > m.params.size())
      eval_fail("macro '", m.text, "' takes ", m.params.size(), " arguments, got ", a.pos.size());
    if (++depth_ > 100) eval_fail("macro calls nested too deeply (recursion?)");
    Frame frame;
    std::vector<Frame*> saved = scopes_;
    scopes_ = {scopes_.front(), &frame};
    for (size_t i = 0; i < m.params.size(); ++i) {
      const auto& [pname, dflt] = m.params[i];
      const Value* given = i < a.pos.size() ? &a.pos[i] : nullptr;
      for (const auto& [k, v] : a.kw)
        if (k == pname) given = &v;
      frame[pname] = given ? *given : dflt ? eval(*dflt) : Value::undefined("'" + pname + "'");
    }
    for (const auto& [k, v] : a.kw) {
      bool known = false;
      for (const auto& p : m.params) known |= p.first == k;
      if (!known) eval_fail("macro '", m.text, "' has no parameter '", k, "'");
    }
    std::string out;
    exec(m.body, out);
    scopes_ = std::move(saved);
    --depth_;
    return Value::of(std::move(out));
  }

  const std::string& name_;
  Frame top_;
  std::vector<Frame*> scopes_;
  int depth_ = 0;
};

Template::Template(std::string_view source, std::string name, Options opts)
    : name_(std::move(name)), root_(parse_template(source, name_, opts)) {}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

std::string Template::render(const Json& context) const {
  if (!context.is_object())
    fail(name_, ": the render context must be a JSON object, got ", context.type_name());
  Evaluator ev(name_, context);
  std::string out;
  ev.run(*root_, out);
  return out;
}

}  // namespace dsv3::jinja
