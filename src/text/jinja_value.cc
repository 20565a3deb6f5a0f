// Python value semantics for the Jinja interpreter over JSON: UTF-8 as Python str (code points,
// str.isspace), str()/repr() (float repr, quoting), json.dumps as transformers' tojson calls it,
// truthiness, ==, ordering, len() and iteration.
#include <charconv>
#include <cmath>
#include <functional>

#include "text/jinja_internal.h"

namespace dsv3::jinja {

// ---------------------------------------------------------------- UTF-8 and Python str helpers

char32_t utf8_next(std::string_view s, size_t& i) {
  unsigned char c = s[i];
  int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > s.size()) {
    ++i;
    return 0xFFFD;
  }
  char32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
  for (int k = 1; k < n; ++k) {
    unsigned char d = s[i + k];
    if ((d & 0xC0) != 0x80) {
      ++i;
      return 0xFFFD;
    }
    cp = (cp << 6) | (d & 0x3F);
  }
  i += n;
  return cp;
}

std::u32string utf8_decode(std::string_view s) {
  std::u32string out;
  for (size_t i = 0; i < s.size();) out += utf8_next(s, i);
  return out;
}

std::string utf8_encode(std::u32string_view s) {
  std::string out;
  for (char32_t c : s) {
    if (c < 0x80) {
      out += char(c);
    } else if (c < 0x800) {
      out += char(0xC0 | (c >> 6));
      out += char(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      out += char(0xE0 | (c >> 12));
      out += char(0x80 | ((c >> 6) & 0x3F));
      out += char(0x80 | (c & 0x3F));
    } else {
      out += char(0xF0 | (c >> 18));
      out += char(0x80 | ((c >> 12) & 0x3F));
      out += char(0x80 | ((c >> 6) & 0x3F));
      out += char(0x80 | (c & 0x3F));
    }
  }
  return out;
}

bool is_py_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

namespace {

using Str = std::u32string;

// Python's repr() of a str; non-printable characters (as far as we know them) are escaped.
bool py_printable(char32_t c) {
  if (c < 0x20 || c == 0x7F || (c >= 0x80 && c <= 0xA0) || c == 0xAD) return false;
  static const std::pair<char32_t, char32_t> np[] = {
      // format, separator, private-use chars
      {0x600, 0x605},     {0x61C, 0x61C},     {0x6DD, 0x6DD},     {0x70F, 0x70F},     {0x890, 0x891},
      {0x8E2, 0x8E2},     {0x1680, 0x1680},   {0x180E, 0x180E},   {0x2000, 0x200F},   {0x2028, 0x202F},
      {0x205F, 0x2064},   {0x2066, 0x206F},   {0x3000, 0x3000},   {0xD800, 0xF8FF},   {0xFDD0, 0xFDEF},
      {0xFEFF, 0xFEFF},   {0xFFF0, 0xFFFB},   {0xFFFE, 0xFFFF},   {0x110BD, 0x110BD}, {0x110CD, 0x110CD},
      {0x13430, 0x1343F}, {0x1BCA0, 0x1BCA3}, {0x1D173, 0x1D17A}, {0xE0001, 0xE0001}, {0xE0020, 0xE007F},
      {0xF0000, 0x10FFFF}};
  for (auto [lo, hi] : np)
    if (c >= lo && c <= hi) return false;
  return true;
}
std::string py_str_repr(const std::string& s) {
  Str u = utf8_decode(s);
  char32_t q = (u.find(U'\'') != Str::npos && u.find(U'"') == Str::npos) ? U'"' : U'\'';
  std::string out(1, char(q));
  char buf[16];
  for (char32_t c : u) {
    if (c == q || c == U'\\')
      out += '\\', out += char(c);
    else if (c == U'\n')
      out += "\\n";
    else if (c == U'\r')
      out += "\\r";
    else if (c == U'\t')
      out += "\\t";
    else if (py_printable(c))
      out += utf8_encode(Str(1, c));
    else {
      std::snprintf(buf, sizeof buf,
                    c < 0x100     ? "\\x%02x"
                    : c < 0x10000 ? "\\u%04x"
                                  : "\\U%08x",
                    unsigned(c));
      out += buf;
    }
  }
  return out + char(q);
}

std::string json_quote(const std::string& s, bool ensure_ascii) {
  std::string out = "\"";
  char buf[16];
  for (char32_t c : utf8_decode(s)) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || (ensure_ascii && c >= 0x7F)) {
          if (c >= 0x10000) {
            char32_t v = c - 0x10000;
            std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", unsigned(0xD800 | (v >> 10)),
                          unsigned(0xDC00 | (v & 0x3FF)));
          } else {
            std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(c));
          }
          out += buf;
        } else {
          out += utf8_encode(Str(1, c));
        }
    }
  }
  return out + "\"";
}

std::string int_str(const Json& j) {
  return j.is_number_unsigned() ? std::to_string(j.get<uint64_t>()) : std::to_string(as_int(j));
}

}  // namespace

std::string rstrip_space(std::string_view s) {
  Str u = utf8_decode(s);
  while (!u.empty() && is_py_space(u.back())) u.pop_back();
  return utf8_encode(u);
}

std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);  // shortest round-trip
  std::string sci(buf, r.ptr), digits, sign;
  size_t epos = sci.find('e');
  int exp10 = std::stoi(sci.substr(epos + 1));
  for (char c : sci.substr(0, epos))
    if (c == '-')
      sign = "-";
    else if (c != '.')
      digits += c;
  if (exp10 >= -4 && exp10 < 16) {
    if (exp10 < 0) return sign + "0." + std::string(-exp10 - 1, '0') + digits;
    if (digits.size() <= size_t(exp10) + 1)
      return sign + digits + std::string(exp10 + 1 - digits.size(), '0') + ".0";
    return sign + digits.substr(0, exp10 + 1) + "." + digits.substr(exp10 + 1);
  }
  std::snprintf(buf, sizeof buf, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
  return sign + digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "") + buf;
}

std::string py_repr(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null:
      return "None";
    case Json::value_t::boolean:
      return j.get<bool>() ? "True" : "False";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return int_str(j);
    case Json::value_t::number_float:
      return py_float_repr(j.get<double>());
    case Json::value_t::string:
      return py_str_repr(j.get_ref<const std::string&>());
    case Json::value_t::array: {
      std::string out = "[";
      for (size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + py_repr(j[i]);
      return out + "]";
    }
    case Json::value_t::object: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, v] : j.items()) {
        out += (first ? "" : ", ") + py_str_repr(k) + ": " + py_repr(v);
        first = false;
      }
      return out + "}";
    }
    default:
      eval_fail("cannot convert ", j.type_name(), " to a string");
  }
}

namespace {
bool holds_list(const Json& j) {
  if (j.is_array()) return true;
  if (j.is_object())
    for (const auto& [k, v] : j.items())
      if (holds_list(v)) return true;
  return false;
}
}  // namespace

std::string py_str(const Value& v) {
  if (v.is_undefined()) return "";
  if (!v.is_data()) eval_fail("cannot convert ", type_name(v), " to a string");
  if (!v.opaque.empty())
    eval_fail("cannot print ", type_name(v),
              " (Jinja2 would print a Python object here); convert it with |list");
  if (v.tuples && holds_list(v.data()))
    eval_fail(
        "cannot print a value holding tuples (from items(), dictsort or a tuple literal): Python's tuple "
        "repr is not supported");
  return v.data().is_string() ? v.data().get<std::string>() : py_repr(v.data());
}

std::string py_json(const Json& j, bool ensure_ascii, const Json& indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys) {
  std::string ind;
  bool pretty = !indent.is_null();
  if (indent.is_string())
    ind = indent.get<std::string>();
  else if (is_int(indent))
    ind = std::string(std::max<int64_t>(0, std::min<int64_t>(as_int(indent), 64)), ' ');
  else if (pretty)
    eval_fail("tojson(): indent must be an integer or a string");
  std::string out;
  std::function<void(const Json&, int)> dump = [&](const Json& x, int level) {
    auto newline = [&](int l) {
      if (!pretty) return;
      out += '\n';
      for (int i = 0; i < l; ++i) out += ind;
    };
    switch (x.type()) {
      case Json::value_t::null:
        out += "null";
        return;
      case Json::value_t::boolean:
        out += x.get<bool>() ? "true" : "false";
        return;
      case Json::value_t::number_integer:
      case Json::value_t::number_unsigned:
        out += int_str(x);
        return;
      case Json::value_t::number_float: {
        double d = x.get<double>();
        out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : py_float_repr(d);
        return;
      }
      case Json::value_t::string:
        out += json_quote(x.get_ref<const std::string&>(), ensure_ascii);
        return;
      case Json::value_t::array:
      case Json::value_t::object: {
        bool arr = x.is_array();
        if (x.empty()) {
          out += arr ? "[]" : "{}";
          return;
        }
        out += arr ? '[' : '{';
        std::vector<std::pair<std::string, const Json*>> kids;
        if (arr) {
          for (const auto& v : x) kids.emplace_back("", &v);
        } else {
          for (const auto& [k, v] : x.items()) kids.emplace_back(k, &v);
          if (sort_keys)
            std::stable_sort(kids.begin(), kids.end(), [](const auto& a, const auto& b) {
              return utf8_decode(a.first) < utf8_decode(b.first);
            });
        }
        for (size_t i = 0; i < kids.size(); ++i) {
          if (i) out += item_sep;
          newline(level + 1);
          if (!arr) out += json_quote(kids[i].first, ensure_ascii) + key_sep;
          dump(*kids[i].second, level + 1);
        }
        newline(level);
        out += arr ? ']' : '}';
        return;
      }
      default:
        eval_fail("tojson(): cannot serialise ", x.type_name());
    }
  };
  dump(j, 0);
  return out;
}

std::string type_name(const Value& v) {
  if (v.is_data() && !v.opaque.empty()) return "a " + v.opaque;
  switch (v.kind) {
    case Value::Kind::Undefined:
      return v.what.empty() ? "an undefined value" : "undefined " + v.what;
    case Value::Kind::Namespace:
      return "a namespace";
    case Value::Kind::Callable:
      return "a function";
    case Value::Kind::Data:
      break;
  }
  switch (v.data().type()) {
    case Json::value_t::null:
      return "none";
    case Json::value_t::boolean:
      return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return "an integer";
    case Json::value_t::number_float:
      return "a float";
    case Json::value_t::string:
      return "a string";
    case Json::value_t::array:
      return "a list";
    case Json::value_t::object:
      return "a dict";
    default:
      return v.data().type_name();
  }
}

bool truthy(const Value& v) {
  if (v.is_undefined()) return false;
  if (v.is_iterator()) return true;  // a Python generator is true even when it yields nothing
  if (!v.is_data()) return true;
  const Json& j = v.data();
  if (j.is_null()) return false;
  if (j.is_boolean()) return j.get<bool>();
  if (is_int(j)) return j.is_number_unsigned() ? j.get<uint64_t>() != 0 : as_int(j) != 0;
  if (j.is_number()) return j.get<double>() != 0;
  if (j.is_string()) return !j.get_ref<const std::string&>().empty();
  return !j.empty();
}

bool py_equal(const Json& a, const Json& b) {
  if (is_num(a) && is_num(b)) {
    if (is_int(a) && is_int(b) && !a.is_number_unsigned() && !b.is_number_unsigned())
      return as_int(a) == as_int(b);
    if (a.is_number_unsigned() && b.is_number_unsigned()) return a.get<uint64_t>() == b.get<uint64_t>();
    return as_double(a) == as_double(b);
  }
  if (a.type() != b.type()) return false;
  if (a.is_array()) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (!py_equal(a[i], b[i])) return false;
    return true;
  }
  if (a.is_object()) {
    if (a.size() != b.size()) return false;
    for (const auto& [k, v] : a.items()) {
      auto it = b.find(k);
      if (it == b.end() || !py_equal(v, *it)) return false;
    }
    return true;
  }
  return a == b;
}

int py_compare(const Json& a, const Json& b) {
  if (is_num(a) && is_num(b)) {
    if (is_int(a) && is_int(b) && !a.is_number_unsigned() && !b.is_number_unsigned())
      return as_int(a) < as_int(b) ? -1 : as_int(a) > as_int(b);
    double x = as_double(a), y = as_double(b);
    return x < y ? -1 : x > y;
  }
  if (a.is_string() && b.is_string()) {  // UTF-8 byte order is code point order
    int c = a.get_ref<const std::string&>().compare(b.get_ref<const std::string&>());
    return c < 0 ? -1 : c > 0;
  }
  if (a.is_array() && b.is_array()) {
    for (size_t i = 0; i < a.size() && i < b.size(); ++i)
      if (!py_equal(a[i], b[i])) return py_compare(a[i], b[i]);
    return a.size() < b.size() ? -1 : a.size() > b.size();
  }
  eval_fail("cannot order ", type_name(Value::of(a)), " and ", type_name(Value::of(b)));
}

std::vector<Value> iterate(const Value& v) {
  std::vector<Value> out;
  if (v.is_undefined()) return out;
  if (!v.is_data()) eval_fail("cannot iterate over ", type_name(v));
  const Json& j = v.data();
  if (j.is_array()) {
    for (const auto& x : j) out.push_back(Value::part_of(v, x));
  } else if (j.is_object()) {
    for (const auto& [k, x] : j.items()) out.push_back(Value::of(k));
  } else if (j.is_string()) {
    for (char32_t c : utf8_decode(j.get_ref<const std::string&>()))
      out.push_back(Value::of(utf8_encode(Str(1, c))));
  } else {
    eval_fail("cannot iterate over ", type_name(v));
  }
  return out;
}

size_t py_len(const Value& v) {
  if (v.is_undefined()) return 0;
  if (v.is_iterator()) eval_fail(type_name(v), " has no length (Jinja2 yields it lazily); use |list|length");
  if (v.is_data() && v.data().is_string()) return utf8_decode(v.data().get_ref<const std::string&>()).size();
  if (v.is_data() && (v.data().is_array() || v.data().is_object())) return v.data().size();
  eval_fail(type_name(v), " has no length");
}

}  // namespace dsv3::jinja
