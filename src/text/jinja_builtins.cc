// Builtins of the Jinja interpreter: Jinja2's filters and tests, the str/dict methods templates
// call, and the globals (range, namespace, dict, raise_exception, strftime_now). Case mapping is done
// only where it matches Python exactly (ASCII; letters of other scripts are refused, not guessed).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <functional>
#include <optional>
#include <set>

#include "text/jinja_internal.h"

namespace dsv3::jinja {

namespace {

using Str = std::u32string;

// str.strip/lstrip/rstrip: `chars` null strips whitespace.
Str py_strip(const Str& s, const Str* chars, bool left, bool right) {
  auto drop = [&](char32_t c) { return chars ? chars->find(c) != Str::npos : is_py_space(c); };
  size_t b = 0, e = s.size();
  if (left)
    while (b < e && drop(s[b])) ++b;
  if (right)
    while (e > b && drop(s[e - 1])) --e;
  return s.substr(b, e - b);
}

// Letters whose case Python would change outside ASCII; we refuse them rather than guess.
bool has_case_outside_ascii(char32_t c) {
  static const std::pair<char32_t, char32_t> ranges[] = {
      {0xB5, 0xB5},       {0xC0, 0x2AF},      {0x345, 0x345},     {0x370, 0x52F},     {0x531, 0x58F},
      {0x10A0, 0x10FF},   {0x13A0, 0x13FF},   {0x1C80, 0x1CBF},   {0x1D00, 0x1FFF},   {0x2100, 0x218F},
      {0x24B6, 0x24E9},   {0x2C00, 0x2D2F},   {0xA640, 0xA69F},   {0xA720, 0xA7FF},   {0xAB30, 0xABBF},
      {0xFB00, 0xFB17},   {0xFF21, 0xFF5A},   {0x10400, 0x104FF}, {0x10570, 0x105BF}, {0x10C80, 0x10CFF},
      {0x118A0, 0x118FF}, {0x16E40, 0x16E9F}, {0x1E900, 0x1E95F}};
  for (auto [lo, hi] : ranges)
    if (c >= lo && c <= hi) return true;
  return false;
}
char32_t change_case(char32_t c, bool upper, const char* what) {
  if (c < 0x80) {
    if (upper && c >= 'a' && c <= 'z') return c - 32;
    if (!upper && c >= 'A' && c <= 'Z') return c + 32;
    return c;
  }
  if (has_case_outside_ascii(c)) eval_fail(what, " of non-ASCII letters is not supported");
  return c;
}
bool is_cased_ascii(char32_t c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}
Str to_case(Str s, bool upper, const char* what) {
  for (auto& c : s) c = change_case(c, upper, what);
  return s;
}
Str capitalize(const Str& s, const char* what) {
  if (s.empty()) return s;
  return to_case(s.substr(0, 1), true, what) + to_case(s.substr(1), false, what);
}
// Python's str.title(): a cased letter after an uncased character starts a word.
Str py_title(Str s) {
  bool prev_cased = false;
  for (auto& c : s) {
    c = change_case(c, !prev_cased, "title()");
    prev_cased = is_cased_ascii(c);
  }
  return s;
}

// str.split(sep, maxsplit) / str.splitlines().
std::vector<Str> py_split(const Str& s, const Str* sep, int64_t maxsplit) {
  std::vector<Str> out;
  if (!sep) {
    size_t i = 0;
    while (true) {
      while (i < s.size() && is_py_space(s[i])) ++i;
      if (i >= s.size()) break;
      if (maxsplit >= 0 && int64_t(out.size()) == maxsplit) {
        out.push_back(s.substr(i));  // the remainder keeps its trailing whitespace
        break;
      }
      size_t j = i;
      while (j < s.size() && !is_py_space(s[j])) ++j;
      out.push_back(s.substr(i, j - i));
      i = j;
    }
    return out;
  }
  if (sep->empty()) eval_fail("split(): empty separator");
  size_t i = 0;
  for (size_t j; (maxsplit < 0 || int64_t(out.size()) < maxsplit) && (j = s.find(*sep, i)) != Str::npos;
       i = j + sep->size())
    out.push_back(s.substr(i, j - i));
  out.push_back(s.substr(i));
  return out;
}
bool is_line_break(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || (c >= 0x1C && c <= 0x1E) || c == 0x85 ||
         c == 0x2028 || c == 0x2029;
}
std::vector<Str> py_splitlines(const Str& s, bool keepends) {
  std::vector<Str> out;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i;
    while (j < s.size() && !is_line_break(s[j])) ++j;
    size_t e = j;
    if (j < s.size()) e = (s[j] == '\r' && j + 1 < s.size() && s[j + 1] == '\n') ? j + 2 : j + 1;
    out.push_back(s.substr(i, (keepends ? e : j) - i));
    i = e;
  }
  return out;
}
Str py_replace(const Str& s, const Str& old, const Str& rep, int64_t count) {
  Str out;
  if (old.empty()) {  // Python inserts `rep` around every character
    for (size_t i = 0; i <= s.size(); ++i) {
      if (count < 0 || int64_t(i) < count) out += rep;
      if (i < s.size()) out += s[i];
    }
    return out;
  }
  size_t i = 0;
  for (size_t j; count != 0 && (j = s.find(old, i)) != Str::npos; i = j + old.size(), --count)
    out += s.substr(i, j - i) + rep;
  return out + s.substr(i);
}

}  // namespace

// ---------------------------------------------------------------- argument binding

namespace {

// Binds positional and keyword arguments to `params` like a Python signature; unset: nullopt.
using Params = std::vector<std::optional<Value>>;
Params bind(const CallArgs& a, std::initializer_list<const char*> params, const std::string& fn) {
  Params out(params.size());
  if (a.pos.size() > params.size())
    eval_fail(fn, " takes at most ", params.size(), " arguments, got ", a.pos.size());
  for (size_t i = 0; i < a.pos.size(); ++i) out[i] = a.pos[i];
  for (const auto& [k, v] : a.kw) {
    size_t i = 0;
    for (const char* p : params) {
      if (k == p) break;
      ++i;
    }
    if (i == params.size()) eval_fail(fn, " has no argument '", k, "'");
    out[i] = v;
  }
  return out;
}
const Json& data(const Value& v, const std::string& what) {
  if (!v.is_data() || !v.opaque.empty()) eval_fail(what, ": expected a value, got ", type_name(v));
  return v.data();
}
std::string arg_str(const std::optional<Value>& v, const std::string& what, std::string dflt = "") {
  if (!v || (v->is_data() && v->data().is_null())) return dflt;
  if (!v->is_data() || !v->data().is_string()) eval_fail(what, ": expected a string, got ", type_name(*v));
  return v->data().get<std::string>();
}
int64_t arg_int(const std::optional<Value>& v, const std::string& what, int64_t dflt) {
  if (!v || (v->is_data() && v->data().is_null())) return dflt;
  if (!v->is_data() || !is_int(v->data())) eval_fail(what, ": expected an integer, got ", type_name(*v));
  return as_int(v->data());
}
bool arg_bool(const std::optional<Value>& v, bool dflt) {
  return v ? truthy(*v) : dflt;
}
Str self_str(const Value& v, const std::string& what) {
  if (!v.is_data() || !v.data().is_string()) eval_fail(what, ": expected a string, got ", type_name(v));
  return utf8_decode(v.data().get_ref<const std::string&>());
}
Value str_value(const Str& s) {
  return Value::of(utf8_encode(s));
}
Value list_value(const std::vector<Str>& parts) {
  Json out = Json::array();
  for (const auto& p : parts) out.push_back(utf8_encode(p));
  return Value::of(std::move(out));
}
Json items_of(const Json& d) {
  Json out = Json::array();
  for (const auto& [k, v] : d.items()) out.push_back(Json::array({k, v}));
  return out;
}
Json to_list(const Value& v) {
  Json out = Json::array();
  for (auto& x : iterate(v)) out.push_back(x.data());
  return out;
}

// "a.b.0" lookups of selectattr/map/sort(attribute=...).
Value get_path(const Value& v, const std::string& path) {
  Value cur = v;
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('.', i);
    if (j == std::string::npos) j = path.size();
    std::string key = path.substr(i, j - i);
    if (!cur.is_data()) return Value::undefined("attribute '" + path + "'");
    const Json& d = cur.data();
    Value next = Value::undefined("attribute '" + path + "'");
    if (d.is_object() && d.contains(key))
      next = Value::part_of(cur, d[key]);
    else if (d.is_array() && !key.empty() && std::all_of(key.begin(), key.end(), ::isdigit) &&
             std::stoul(key) < d.size())
      next = Value::part_of(cur, d[std::stoul(key)]);
    cur = std::move(next);
    i = j + 1;
  }
  return cur;
}

// Sort key of sort/unique/dictsort/min/max: strings folded to lower case unless case_sensitive.
Json sort_key(const Json& j, bool case_sensitive) {
  if (case_sensitive || !j.is_string()) return j;
  return utf8_encode(
      to_case(utf8_decode(j.get_ref<const std::string&>()), false, "case-insensitive sorting"));
}

CallArgs rest_args(const CallArgs& a, size_t skip) {
  CallArgs r;
  r.pos.assign(a.pos.begin() + std::min(skip, a.pos.size()), a.pos.end());
  r.kw = a.kw;
  return r;
}

// select/reject/selectattr/rejectattr: keep items whose test (or truthiness) == want.
Value select_items(Evaluator& ev, const Value& v, const CallArgs& a, bool by_attr, bool want,
                   const std::string& fn) {
  std::string attr;
  size_t skip = 0;
  if (by_attr) {
    if (a.pos.empty()) eval_fail(fn, "() needs an attribute name");
    attr = arg_str(a.pos[0], fn);
    skip = 1;
  }
  std::string test = a.pos.size() > skip ? arg_str(a.pos[skip], fn) : "";
  if (!test.empty() && !has_test(test)) eval_fail(fn, "(): unknown test '", test, "'");
  CallArgs targs = rest_args(a, skip + 1);
  Json out = Json::array();
  for (const auto& item : iterate(v)) {
    Value x = by_attr ? get_path(item, attr) : item;
    bool ok = test.empty() ? truthy(x) : apply_test(ev, test, x, targs);
    if (ok == want) out.push_back(item.data());
  }
  return Value::typed(std::move(out), "generator");
}

using FilterFn = std::function<Value(Evaluator&, const Value&, const CallArgs&)>;

const std::map<std::string, FilterFn>& filters() {
  static const std::map<std::string, FilterFn> table = [] {
    std::map<std::string, FilterFn> f;
    f["abs"] = [](Evaluator&, const Value& v, const CallArgs&) {
      const Json& j = data(v, "abs");
      if (is_int(j)) return Value::of(std::abs(as_int(j)));
      if (j.is_number()) return Value::of(std::fabs(j.get<double>()));
      eval_fail("abs: expected a number, got ", type_name(v));
    };
    f["capitalize"] = [](Evaluator&, const Value& v, const CallArgs&) {
      return str_value(capitalize(utf8_decode(py_str(v)), "capitalize"));
    };
    f["default"] = [](Evaluator&, const Value& v, const CallArgs& a) {
      auto p = bind(a, {"default_value", "boolean"}, "default");
      bool use = v.is_undefined() || (arg_bool(p[1], false) && !truthy(v));
      return use ? (p[0] ? *p[0] : Value::of("")) : v;
    };
    f["d"] = f["default"];
    f["dictsort"] = [](Evaluator&, const Value& v, const CallArgs& a) {
      auto p = bind(a, {"case_sensitive", "by", "reverse"}, "dictsort");
      const Json& d = data(v, "dictsort");
      if (!d.is_object()) eval_fail("dictsort: expected a dict, got ", type_name(v));
      std::string by = arg_str(p[1], "dictsort", "key");
      if (by != "key" && by != "value") eval_fail("dictsort: 'by' must be 'key' or 'value'");
      bool cs = arg_bool(p[0], false), rev = arg_bool(p[2], false);
      Json items = items_of(d);
      std::vector<Json> v2(items.begin(), items.end());
      std::stable_sort(v2.begin(), v2.end(), [&](const Json& x, const Json& y) {
        int i = by == "key" ? 0 : 1;
        int c = py_compare(sort_key(x[i], cs), sort_key(y[i], cs));
        return rev ? c > 0 : c < 0;
      });
      return Value::typed(Json(v2), "", true);
    };
    f["escape"] = [](Evaluator&, const Value& v, const CallArgs&) {
      std::string out;
      for (char c : py_str(v)) {
        switch (c) {
          case '&':
            out += "&amp;";
            break;
          case '<':
            out += "&lt;";
            break;
          case '>':
            out += "&gt;";
            break;
          case '"':
            out += "&#34;";
            break;
          case '\'':
            out += "&#39;";
            break;
          default:
            out += c;
        }
      }
      return Value::of(out);
    };
    f["e"] = f["escape"];
    f["first"] = [](Evaluator&, const Value& v, const CallArgs&) {
      auto items = iterate(v);
      return items.empty() ? Value::undefined("first item of an empty sequence") : items.front();
    };
    f["last"] = [](Evaluator&, const Value& v, const CallArgs&) {
      if (v.is_iterator()) eval_fail("last: ", type_name(v), " cannot be reversed; use |list|last");
      auto items = iterate(v);
      return items.empty() ? Value::undefined("last item of an empty sequence") : items.back();
    };
    f["float"] = [](Evaluator&, const Value& v, const CallArgs& a) {
      auto p = bind(a, {"default"}, "float");
      Value dflt = p[0] ? *p[0] : Value::of(0.0);
      if (v.is_undefined()) eval_fail("float: ", type_name(v));  // float(Undefined) raises in Jinja2
      if (!v.is_data()) return dflt;
      if (is_num(v.data())) return Value::of(as_double(v.data()));
      if (!v.data().is_string()) return dflt;
      std::string s = utf8_encode(py_strip(utf8_decode(v.data().get<std::string>()), nullptr, true, true));
      char* end = nullptr;
      double d = std::strtod(s.c_str(), &end);
      return (!s.empty() && *end == 0) ? Value::of(d) : dflt;
    };
    f["int"] = [](Evaluator&, const Value& v, const CallArgs& a) {
      auto p = bind(a, {"default", "base"}, "int");
      Value dflt = p[0] ? *p[0] : Value::of(0);
      int base = int(arg_int(p[1], "int", 10));
      if (v.is_undefined()) eval_fail("int: ", type_name(v));  // int(Undefined) raises in Jinja2
      if (!v.is_data()) return dflt;
      if (is_int(v.data())) return Value::of(as_int(v.data()));
      if (v.data().is_number()) return Value::of(int64_t(std::trunc(v.data().get<double>())));
      if (!v.data().is_string()) return dflt;
      std::string s = utf8_encode(py_strip(utf8_decode(v.data().get<std::string>()), nullptr, true, true));
      s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
      char* end = nullptr;
      errno = 0;
      long long n = std::strtoll(s.c_str(), &end, base);
      if (!s.empty() && *end == 0 && errno == 0) return Value::of(int64_t(n));
      double d = std::strtod(s.c_str(), &end);
      return (!s.empty() && *end == 0 && std::isfinite(d)) ? Value::of(int64_t(std::trunc(d))) : dflt;
    };
    f["indent"] = [](Evaluator&, const Value& v, const CallArgs& a) {
      auto p = bind(a, {"width", "first", "blank"}, "indent");
      Str ind = p[0] && p[0]->is_data() && p[0]->data().is_string()
                    ? self_str(*p[0], "indent")
                    : Str(size_t(std::max<int64_t>(0, arg_int(p[0], "indent", 4))), U' ');
      if (!v.is_data() || !v.data().is_string()) eval_fail("indent: expected a string, got ", type_name(v));
      Str s = utf8_decode(v.data().get<std::string>()) + U"\n";  // as jinja2's do_indent
      auto lines = py_splitlines(s, false);
      Str out;
      for (size_t i = 0; i < lines.size(); ++i) {
        if (i) out += U"\n";
        bool pad = i > 0 && (arg_bool(p[2], false) || !lines[i].empty());
        out += (pad ? ind : Str()) + lines[i];
      }
      if (arg_bool(p[1], false)) out = ind + out;
      return str_value(out);
    };
    f["items"] = [](Evaluator&, const Value& v, const CallArgs&) {
      if (v.is_undefined()) return Value::typed(Json::array(), "generator", true);
      const Json& d = data(v, "items");
      if (!d.is_object()) eval_fail("items: expected a dict, got ", type_name(v));
      return Value::typed(items_of(d), "generator", true);
    };
    f["join"] = [](Evaluator&, const Value& v, const CallArgs& a) {
      auto p = bind(a, {"d", "attribute"}, "join");
      std::string sep = arg_str(p[0], "join"), attr = arg_str(p[1], "join"), out;
      bool first = true;
      for (const auto& x : iterate(v)) {
        out += (first ? "" : sep) + py_str(attr.empty() ? x : get_path(x, attr));
        first = false;
      }
      return Value::of(out);
    };
    f["length"] = [](Evaluator&, const Value& v, const CallArgs&) { return Value::of(py_len(v)); };
    f["count"] = f["length"];
    f["list"] = [](Evaluator&, const Value& v, const CallArgs&) { return Value::of(to_list(v)); };
    f["lower"] = [](Evaluator&, const Value& v, const CallArgs&) {
      return str_value(to_case(utf8_decode(py_str(v)), false, "lower"));
    };
    f["upper"] = [](Evaluator&, const Value& v, const CallArgs&) {
      return str_value(to_case(utf8_decode(py_str(v)), true, "upper"));
    };
    f["map"] = [](Evaluator& ev, const Value& v, const CallArgs& a) {
      Json out = Json::array();
      bool by_attr = false;
      for (const auto& [k, x] : a.kw) by_attr |= k == "attribute";
      if (by_attr) {
        auto p = bind(a, {"attribute", "default"}, "map");
        std::string attr = arg_str(p[0], "map");
        for (const auto& item : iterate(v)) {
          Value x = get_path(item, attr);
          if (x.is_undefined() && p[1]) x = *p[1];
          if (!x.is_data()) eval_fail("map(attribute='", attr, "'): an item has no '", attr, "'");
          out.push_back(x.data());
        }
      } else {
        if (a.pos.empty()) eval_fail("map() needs a filter name or attribute=");
        std::string name = arg_str(a.pos[0], "map");
        if (!has_filter(name)) eval_fail("map(): unknown filter '", name, "'");
        CallArgs rest = rest_args(a, 1);
        for (const auto& item : iterate(v)) out.push_back(data(apply_filter(ev, name, item, rest), "map"));
      }
      return Value::typed(std::move(out), "generator");
    };
    auto minmax = [](bool is_max) {
      return [is_max](Evaluator&, const Value& v, const CallArgs& a) {
        auto p = bind(a, {"case_sensitive", "attribute"}, is_max ? "max" : "min");
        std::string attr = arg_str(p[1], "min/max");
        bool cs = arg_bool(p[0], false);
        auto items = iterate(v);
        if (items.empty()) return Value::undefined("min/max of an empty sequence");
        size_t best = 0;
        auto key = [&](size_t i) {
          return sort_key(data(attr.empty() ? items[i] : get_path(items[i], attr), "min/max"), cs);
        };
        for (size_t i = 1; i < items.size(); ++i) {
          int c = py_compare(key(i), key(best));
          if (is_max ? c > 0 : c < 0) best = i;
        }
        return items[best];
      };
    };
    f["max"] = minmax(true);
    f["min"] = minmax(false);
    f["reject"] = [](Evaluator& ev, const Value& v, const CallArgs& a) {
      return select_items(ev, v, a, false, false, "reject");
    };
    f["rejectattr"] = [](Evaluator& ev, const Value& v, const CallArgs& a) {
      return select_items(ev, v, a, true, false, "rejectattr");
    };
    f["select"] = [](Evaluator& ev, const Value& v, const CallArgs& a) {
      return select_items(ev, v, a, false, true, "select");
    };
    f["selectattr"] = [](Evaluator& ev, const Value& v, const CallArgs& a) {
      return select_items(ev, v, a, true, true, "selectattr");
    };
    f["replace"] = [](Evaluator&, const Value& v, const CallArgs& a) {
      auto p = bind(a, {"old", "new", "count"}, "replace");
      if (!p[0] || !p[1]) eval_fail("replace() needs old and new strings");
      return str_value(py_replace(utf8_decode(py_str(v)), utf8_decode(arg_str(p[0], "replace")),
                                  utf8_decode(arg_str(p[1], "replace")), arg_int(p[2], "replace", -1)));
    };
    f["reverse"] = [](Evaluator&, const Value& v, const CallArgs&) {
      if (v.is_data() && v.data().is_string()) {
        Str s = utf8_decode(v.data().get<std::string>());
        return str_value(Str(s.rbegin(), s.rend()));
      }
      Json l = to_list(v);
      std::reverse(l.begin(), l.end());
      return Value::typed(std::move(l), "list_reverseiterator");
    };
    f["round"] = [](Evaluator&, const Value& v, const CallArgs& a) {
      auto p = bind(a, {"precision", "method"}, "round");
      const Json& j = data(v, "round");
      if (!is_num(j)) eval_fail("round: expected a number, got ", type_name(v));
      int64_t prec = arg_int(p[0], "round", 0);
      std::string method = arg_str(p[1], "round", "common");
      if (method == "common") {
        if (is_int(j) && prec >= 0) return Value::of(as_int(j));
        char buf[512];  // printf rounds the exact binary value half-to-even, as Python's round()
        std::snprintf(buf, sizeof buf, "%.*f", int(std::clamp<int64_t>(prec, 0, 300)), as_double(j));
        if (prec < 0) eval_fail("round: negative precision is not supported");
        return Value::of(std::strtod(buf, nullptr));
      }
      if (method != "ceil" && method != "floor") eval_fail("round: method must be common, ceil or floor");
      double m = std::pow(10.0, double(prec));
      double x = as_double(j) * m;
      return Value::of((method == "ceil" ? std::ceil(x) : std::floor(x)) / m);
    };
    f["safe"] = [](Evaluator&, const Value& v, const CallArgs&) { return v; };
    f["sort"] = [](Evaluator&, const Value& v, const CallArgs& a) {
      auto p = bind(a, {"reverse", "case_sensitive", "attribute"}, "sort");
      bool rev = arg_bool(p[0], false), cs = arg_bool(p[1], false);
      std::string attr = arg_str(p[2], "sort");
      std::vector<Value> items = iterate(v);
      std::vector<std::pair<Json, Json>> keyed;
      for (const auto& x : items)
        keyed.emplace_back(sort_key(data(attr.empty() ? x : get_path(x, attr), "sort"), cs), x.data());
      std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
        int c = py_compare(x.first, y.first);
        return rev ? c > 0 : c < 0;
      });
      Json out = Json::array();
      for (auto& [k, x] : keyed) out.push_back(std::move(x));
      return Value::of(std::move(out));
    };
    f["string"] = [](Evaluator&, const Value& v, const CallArgs&) { return Value::of(py_str(v)); };
    f["sum"] = [](Evaluator&, const Value& v, const CallArgs& a) {
      auto p = bind(a, {"attribute", "start"}, "sum");
      std::string attr = arg_str(p[0], "sum");
      Json total = p[1] ? data(*p[1], "sum") : Json(0);
      for (const auto& x : iterate(v)) {
        const Json& y = data(attr.empty() ? x : get_path(x, attr), "sum");
        if (!is_num(total) || !is_num(y)) eval_fail("sum: items must be numbers");
        total = (is_int(total) && is_int(y)) ? Json(as_int(total) + as_int(y))
                                             : Json(as_double(total) + as_double(y));
      }
      return Value::of(total);
    };
    f["title"] = [](Evaluator&, const Value& v, const CallArgs&) {  // jinja2's do_title, not str.title
      Str s = utf8_decode(py_str(v)), out;
      auto boundary = [](char32_t c) {
        return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_py_space(c);
      };
      bool start = true;
      for (char32_t c : s) {
        if (boundary(c)) {
          out += c;
          start = true;
        } else {
          out += change_case(c, start, "title");
          start = false;
        }
      }
      return str_value(out);
    };
    f["tojson"] = [](Evaluator&, const Value& v, const CallArgs& a) {
      auto p = bind(a, {"ensure_ascii", "indent", "separators", "sort_keys"}, "tojson");
      Json indent = p[1] ? data(*p[1], "tojson") : Json(nullptr);
      std::string item_sep = indent.is_null() ? ", " : ",", key_sep = ": ";
      if (p[2] && !(p[2]->is_data() && p[2]->data().is_null())) {
        const Json& s = data(*p[2], "tojson");
        if (!s.is_array() || s.size() != 2 || !s[0].is_string() || !s[1].is_string())
          eval_fail("tojson: separators must be a pair of strings");
        item_sep = s[0].get<std::string>(), key_sep = s[1].get<std::string>();
      }
      return Value::of(py_json(data(v, "tojson"), arg_bool(p[0], false), indent, item_sep, key_sep,
                               arg_bool(p[3], false)));
    };
    f["trim"] = [](Evaluator&, const Value& v, const CallArgs& a) {
      auto p = bind(a, {"chars"}, "trim");
      Str chars = utf8_decode(arg_str(p[0], "trim"));
      return str_value(
          py_strip(utf8_decode(py_str(v)), p[0] && !chars.empty() ? &chars : nullptr, true, true));
    };
    f["unique"] = [](Evaluator&, const Value& v, const CallArgs& a) {
      auto p = bind(a, {"case_sensitive", "attribute"}, "unique");
      bool cs = arg_bool(p[0], false);
      std::string attr = arg_str(p[1], "unique");
      Json out = Json::array(), seen = Json::array();
      for (const auto& x : iterate(v)) {
        Json k = sort_key(data(attr.empty() ? x : get_path(x, attr), "unique"), cs);
        if (std::none_of(seen.begin(), seen.end(), [&](const Json& s) { return py_equal(s, k); })) {
          seen.push_back(k);
          out.push_back(x.data());
        }
      }
      return Value::typed(std::move(out), "generator");
    };
    return f;
  }();
  return table;
}

using TestFn = std::function<bool(const Value&, const Params&)>;
struct TestDef {
  std::vector<const char*> params;
  TestFn fn;
};

const std::map<std::string, TestDef>& tests() {
  static const std::map<std::string, TestDef> table = [] {
    std::map<std::string, TestDef> t;
    auto is = [](auto pred) {
      return TestDef{{}, [pred](const Value& v, const Params&) { return v.is_data() && pred(v.data()); }};
    };
    t["defined"] = {{}, [](const Value& v, const Params&) { return !v.is_undefined(); }};
    t["undefined"] = {{}, [](const Value& v, const Params&) { return v.is_undefined(); }};
    t["none"] = is([](const Json& j) { return j.is_null(); });
    t["boolean"] = is([](const Json& j) { return j.is_boolean(); });
    t["true"] = is([](const Json& j) { return j.is_boolean() && j.get<bool>(); });
    t["false"] = is([](const Json& j) { return j.is_boolean() && !j.get<bool>(); });
    t["integer"] = is([](const Json& j) { return j.is_number_integer(); });
    t["float"] = is([](const Json& j) { return j.is_number_float(); });
    t["number"] = is([](const Json& j) { return is_num(j); });
    t["string"] = is([](const Json& j) { return j.is_string(); });
    t["mapping"] = {{}, [](const Value& v, const Params&) {
                      return v.is_data() && v.opaque.empty() && v.data().is_object();
                    }};
    t["iterable"] = {
        {}, [](const Value& v, const Params&) {
          return v.is_undefined() ||
                 (v.is_data() && (v.data().is_string() || v.data().is_array() || v.data().is_object()));
        }};
    t["sequence"] = {{}, [](const Value& v, const Params&) {  // has len() and [i] (Undefined has both)
                       return v.is_undefined() ||
                              (v.is_data() && v.indexable() &&
                               (v.data().is_string() || v.data().is_array() || v.data().is_object()));
                     }};
    t["callable"] = {{}, [](const Value& v, const Params&) { return v.kind == Value::Kind::Callable; }};
    auto cmp = [](auto pred) {
      return TestDef{{"other"}, [pred](const Value& v, const Params& p) {
                       if (!p[0]) eval_fail("this test needs an argument");
                       return pred(v, *p[0]);
                     }};
    };
    auto eq = [](const Value& a, const Value& b) {
      return a.is_data() && b.is_data() ? py_equal(a.data(), b.data()) : a.kind == b.kind && a.ns == b.ns;
    };
    auto order = [](const Value& a, const Value& b) {
      return py_compare(data(a, "comparison"), data(b, "comparison"));
    };
    t["eq"] = t["equalto"] = cmp(eq);
    t["ne"] = cmp([eq](const Value& a, const Value& b) { return !eq(a, b); });
    t["sameas"] = cmp([](const Value& a, const Value& b) {  // identity: meaningful for none/true/false
      return a.is_data() && b.is_data() && a.data().is_primitive() && a.data().type() == b.data().type() &&
             a.data() == b.data();
    });
    t["lt"] = t["lessthan"] = cmp([order](const Value& a, const Value& b) { return order(a, b) < 0; });
    t["le"] = cmp([order](const Value& a, const Value& b) { return order(a, b) <= 0; });
    t["gt"] = t["greaterthan"] = cmp([order](const Value& a, const Value& b) { return order(a, b) > 0; });
    t["ge"] = cmp([order](const Value& a, const Value& b) { return order(a, b) >= 0; });
    t["in"] = {{"seq"}, [](const Value& v, const Params& p) {
                 if (!p[0]) eval_fail("'in' test needs an argument");
                 const Json& c = data(*p[0], "in");
                 if (c.is_string())
                   return v.is_data() && v.data().is_string() &&
                          c.get<std::string>().find(v.data().get<std::string>()) != std::string::npos;
                 if (c.is_object())
                   return v.is_data() && v.data().is_string() && c.contains(v.data().get<std::string>());
                 if (!c.is_array()) eval_fail("'in' test needs a string, list or dict");
                 return v.is_data() &&
                        std::any_of(c.begin(), c.end(), [&](const Json& x) { return py_equal(x, v.data()); });
               }};
    auto int_of = [](const Value& v) {
      if (!v.is_data() || !is_int(v.data())) eval_fail("expected an integer, got ", type_name(v));
      return as_int(v.data());
    };
    t["even"] = {{}, [int_of](const Value& v, const Params&) { return int_of(v) % 2 == 0; }};
    t["odd"] = {{}, [int_of](const Value& v, const Params&) { return int_of(v) % 2 != 0; }};
    t["divisibleby"] = cmp([int_of](const Value& a, const Value& b) {
      int64_t d = int_of(b);
      if (d == 0) eval_fail("divisibleby(0)");
      return int_of(a) % d == 0;
    });
    auto cased = [](bool upper) {  // str(value).islower() / .isupper()
      return TestDef{{}, [upper](const Value& v, const Params&) {
                       Str s = utf8_decode(py_str(v));
                       const char* what = upper ? "'upper' test" : "'lower' test";
                       return to_case(s, upper, what) == s && std::any_of(s.begin(), s.end(), is_cased_ascii);
                     }};
    };
    t["lower"] = cased(false);
    t["upper"] = cased(true);
    return t;
  }();
  return table;
}

}  // namespace

bool has_filter(const std::string& name) {
  return filters().count(name) > 0;
}
bool has_test(const std::string& name) {
  return tests().count(name) > 0;
}

Value apply_filter(Evaluator& ev, const std::string& name, const Value& v, const CallArgs& a) {
  auto it = filters().find(name);
  if (it == filters().end()) eval_fail("unknown filter '", name, "'");
  return it->second(ev, v, a);
}

bool apply_test(Evaluator&, const std::string& name, const Value& v, const CallArgs& a) {
  auto it = tests().find(name);
  if (it == tests().end()) eval_fail("unknown test '", name, "'");
  const TestDef& t = it->second;
  Params p(t.params.size());
  if (a.pos.size() > t.params.size() || !a.kw.empty())
    eval_fail("test '", name, "' takes ", t.params.size(), " argument(s)");
  for (size_t i = 0; i < a.pos.size(); ++i) p[i] = a.pos[i];
  return t.fn(v, p);
}

// ---------------------------------------------------------------- methods and globals

Value call_method(const Value& obj, const std::string& name, const CallArgs& a) {
  const std::string fn = name + "()";
  if (obj.is_data() && obj.opaque.empty() && obj.data().is_object()) {
    const Json& d = obj.data();
    if (name == "items" || name == "keys" || name == "values") {
      bind(a, {}, fn);
      if (name == "items") return Value::typed(items_of(d), "dict_items", true);
      Json out = Json::array();
      for (const auto& [k, v] : d.items()) out.push_back(name == "keys" ? Json(k) : v);
      return Value::typed(std::move(out), "dict_" + name);
    }
    if (name == "get") {
      auto p = bind(a, {"key", "default"}, fn);
      if (!p[0]) eval_fail("get() needs a key");
      const Json& k = data(*p[0], fn);
      if (k.is_string() && d.contains(k.get<std::string>()))
        return Value::part_of(obj, d[k.get<std::string>()]);
      return p[1] ? *p[1] : Value::of(nullptr);
    }
    eval_fail("dicts have no method '", name, "' here (supported: items, keys, values, get)");
  }
  if (!obj.is_data() || !obj.data().is_string())
    eval_fail(type_name(obj), " has no method '", name, "'",
              obj.is_data() && obj.data().is_array() ? " (lists are immutable in templates)" : "");
  Str s = utf8_decode(obj.data().get_ref<const std::string&>());
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    auto p = bind(a, {"chars"}, fn);
    Str chars = utf8_decode(arg_str(p[0], fn));
    bool has = p[0] && !(p[0]->is_data() && p[0]->data().is_null());
    return str_value(py_strip(s, has ? &chars : nullptr, name != "rstrip", name != "lstrip"));
  }
  if (name == "split") {
    auto p = bind(a, {"sep", "maxsplit"}, fn);
    bool has = p[0] && !(p[0]->is_data() && p[0]->data().is_null());
    Str sep = utf8_decode(arg_str(p[0], fn));
    return list_value(py_split(s, has ? &sep : nullptr, arg_int(p[1], fn, -1)));
  }
  if (name == "splitlines")
    return list_value(py_splitlines(s, arg_bool(bind(a, {"keepends"}, fn)[0], false)));
  if (name == "startswith" || name == "endswith") {
    auto p = bind(a, {"prefix"}, fn);
    if (!p[0]) eval_fail(fn, " needs an argument");
    const Json& x = data(*p[0], fn);
    Json options = x.is_array() ? x : Json::array({x});
    for (const auto& o : options) {
      if (!o.is_string()) eval_fail(fn, ": expected a string or a list of strings");
      Str q = utf8_decode(o.get<std::string>());
      bool hit =
          q.size() <= s.size() && (name == "startswith" ? s.compare(0, q.size(), q) == 0
                                                        : s.compare(s.size() - q.size(), q.size(), q) == 0);
      if (hit) return Value::of(true);
    }
    return Value::of(false);
  }
  if (name == "upper" || name == "lower") return str_value(to_case(s, name == "upper", fn.c_str()));
  if (name == "capitalize") return str_value(capitalize(s, "capitalize()"));
  if (name == "title") return str_value(py_title(s));
  if (name == "replace") {
    auto p = bind(a, {"old", "new", "count"}, fn);
    if (!p[0] || !p[1]) eval_fail("replace() needs old and new strings");
    return str_value(
        py_replace(s, utf8_decode(arg_str(p[0], fn)), utf8_decode(arg_str(p[1], fn)), arg_int(p[2], fn, -1)));
  }
  if (name == "find" || name == "rfind" || name == "count") {
    auto p = bind(a, {"sub"}, fn);
    Str sub = utf8_decode(arg_str(p[0], fn));
    if (name == "count") {
      if (sub.empty()) return Value::of(s.size() + 1);
      int64_t n = 0;
      for (size_t i = s.find(sub); i != Str::npos; i = s.find(sub, i + sub.size())) ++n;
      return Value::of(n);
    }
    size_t i = name == "find" ? s.find(sub) : s.rfind(sub);
    return Value::of(i == Str::npos ? int64_t(-1) : int64_t(i));
  }
  if (name == "join") {
    auto p = bind(a, {"iterable"}, fn);
    if (!p[0]) eval_fail("join() needs an argument");
    std::string out, sep = utf8_encode(s);
    bool first = true;
    for (const auto& x : iterate(*p[0])) {
      if (!x.is_data() || !x.data().is_string())
        eval_fail("join(): items must be strings, got ", type_name(x));
      out += (first ? "" : sep) + x.data().get<std::string>();
      first = false;
    }
    return Value::of(out);
  }
  eval_fail("strings have no method '", name,
            "' here (supported: strip, lstrip, rstrip, split, splitlines, "
            "startswith, endswith, upper, lower, capitalize, title, replace, find, rfind, count, join)");
}

bool is_global(const std::string& name) {
  return name == "range" || name == "namespace" || name == "dict" || name == "raise_exception" ||
         name == "strftime_now";
}

Value call_global(const std::string& name, const CallArgs& a) {
  if (name == "raise_exception") {
    auto p = bind(a, {"message"}, name);
    eval_fail("raise_exception: ", p[0] ? py_str(*p[0]) : "");
  }
  if (name == "range") {
    if (!a.kw.empty() || a.pos.empty() || a.pos.size() > 3)
      eval_fail("range() takes 1 to 3 integer arguments");
    int64_t v[3] = {0, 0, 1};
    for (size_t i = 0; i < a.pos.size(); ++i) v[a.pos.size() == 1 ? 1 : i] = arg_int(a.pos[i], "range", 0);
    if (v[2] == 0) eval_fail("range() step must not be zero");
    Json out = Json::array();
    for (int64_t i = v[0]; v[2] > 0 ? i < v[1] : i > v[1]; i += v[2]) {
      if (out.size() >= 100000) eval_fail("range() too large");  // jinja2's sandbox limit
      out.push_back(i);
    }
    return Value::typed(std::move(out), "range");
  }
  if (name == "namespace" || name == "dict") {
    if (a.pos.size() > 1) eval_fail(name, "() takes at most one positional argument (a dict)");
    std::map<std::string, Value> m;
    Json d = Json::object();
    if (!a.pos.empty()) {
      const Json& init = data(a.pos[0], name);
      if (!init.is_object()) eval_fail(name, "(): the positional argument must be a dict");
      for (const auto& [k, v] : init.items()) m[k] = Value::of(v), d[k] = v;
    }
    for (const auto& [k, v] : a.kw) {
      m[k] = v;
      if (name == "dict") d[k] = data(v, "dict()");
    }
    if (name == "dict") return Value::of(std::move(d));
    Value ns;
    ns.kind = Value::Kind::Namespace;
    ns.ns = std::make_shared<std::map<std::string, Value>>(std::move(m));
    return ns;
  }
  if (name == "strftime_now") {
    auto p = bind(a, {"format"}, name);
    std::string f = arg_str(p[0], name);
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[512];
    size_t n = std::strftime(buf, sizeof buf, f.c_str(), &tm);
    return Value::of(std::string(buf, n));
  }
  eval_fail("unknown function '", name, "'");
}

}  // namespace dsv3::jinja
