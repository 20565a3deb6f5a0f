// The Jinja interpreter (text/jinja.h), feature by feature. The expected strings of kCases were
// produced by Jinja2 3.1.6 configured as transformers' apply_chat_template configures it
// (ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True), loopcontrols, its tojson
// and raise_exception), rendering each template with kContext.
#include "text/jinja.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "core/error.h"

using dsv3::jinja::Json;
using dsv3::jinja::Template;

namespace {

const char* kContext =
    R"JSON({"name": "World", "b": "b", "x": 1, "xs": [1, 2, 3], "d": {"z": 1, "a": 2}, "m": {"role": "user", "content": "hi"}, "msgs": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": null}], "s": "  Hello, World  ", "u": "héllo🙂"})JSON";

struct Case {
  const char* name;
  const char* source;
  const char* expected;
};

const Case kCases[] = {
    // clang-format off
    {"text",
     "Hello world",
     "Hello world"},
    {"variable",
     "Hello {{ name }}!",
     "Hello World!"},
    {"undefined_prints_empty",
     "[{{ nope }}]",
     "[]"},
    {"concat",
     "{{ 'a' + b ~ 1 ~ nope }}",
     "ab1"},
    {"arithmetic",
     "{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 10 / 4 }} {{ 1.5 + 1 }} {{ 3 - 5 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }}",
     "7 3 -4 1 2 1024 2.5 2.5 -2 3.0 0.5"},
    {"comparisons",
     "{{ 1 < 2 }} {{ 'a' == 'a' }} {{ 1 == 1.0 }} {{ [1,2] != [1,2] }} {{ 'b' >= 'a' }} {{ x > 0.5 }} {{ none == none }} {{ m == {'content': 'hi', 'role': 'user'} }}",
     "True True True False True True True True"},
    {"in_operator",
     "{{ 'a' in 'cat' }} {{ 2 in xs }} {{ 'z' in d }} {{ 3 not in [1] }} {{ 'q' in nope }}",
     "True True True True False"},
    {"boolean_operators",
     "{{ 0 or 'x' }} {{ 1 and 'y' }} {{ not none }} {{ '' or [] }} {{ not x is defined }} {{ not nope is defined }}",
     "x y True [] False True"},
    {"conditional_expression",
     "{{ 'y' if x else 'n' }}[{{ 'z' if false }}]{{ 'a' if false else 'b' if true else 'c' }}",
     "y[]b"},
    {"if_elif_else",
     "{% for v in [1, 2, 3] %}{% if v == 1 %}one{% elif v == 2 %}two{% else %}many{% endif %},{% endfor %}",
     "one,two,many,"},
    {"loop_variables",
     "{% for v in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}[{{ loop.previtem }}|{{ loop.nextitem }}] {% endfor %}",
     "1032TrueFalse3[|2] 2121FalseFalse3[1|3] 3210FalseTrue3[2|] "},
    {"loop_over_dict_and_items",
     "{% for k in d %}{{ k }}{% endfor %};{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k, v in d|items %}{{ k }}{{ v }}{% endfor %}",
     "za;z=1;a=2;z1a2"},
    {"loop_over_string",
     "{% for c in u %}[{{ c }}]{% endfor %}",
     "[h][é][l][l][o][🙂]"},
    {"loop_filter_and_else",
     "{% for v in xs if v > 1 %}{{ v }}{{ loop.length }}{% else %}none{% endfor %}|{% for v in [] %}x{% else %}empty{% endfor %}",
     "2232|empty"},
    {"break_continue",
     "{% for v in range(10) %}{% if v == 1 %}{% continue %}{% endif %}{% if v > 3 %}{% break %}{% endif %}{{ v }}{% endfor %}",
     "023"},
    {"nested_loops",
     "{% for a in [1, 2] %}{% for b in 'xy' %}{{ a }}{{ b }}{{ loop.index }}{% endfor %}{{ loop.index }};{% endfor %}",
     "1x11y21;2x12y22;"},
    {"scoping",
     "{% set v = 0 %}{% for i in xs %}{% set v = v + i %}{{ v }}{% endfor %}|{{ v }}|{% if true %}{% set w = 5 %}{% endif %}{{ w }}",
     "123|0|5"},
    {"namespace",
     "{% set ns = namespace(total=0, names='', flag=false) %}{% for i in xs %}{% set ns.total = ns.total + i %}{% set ns.flag = true %}{% endfor %}{{ ns.total }} {{ ns.flag }} [{{ ns.names }}] {{ ns.missing is defined }}",
     "6 True [] False"},
    {"set_forms",
     "{% set a, b = 1, 'two' %}{{ a }}{{ b }}{% set t = (1, 2) %}{{ t|length }}{% set blk %}x{{ a }}y{% endset %}[{{ blk }}]",
     "1two2[x1y]"},
    {"macro",
     "{% macro greet(who, punct='!') %}Hi {{ who }}{{ punct }}{{ name }}{% endmacro %}{{ greet('A') }} {{ greet('B', '?') }} {{ greet(punct='.', who='C') }}",
     "Hi A!World Hi B?World Hi C.World"},
    {"whitespace_control",
     "a  {%- if true -%}  b  {%- endif -%}  c {{- ' d ' -}} e {#- comment -#} f",
     "abc d ef"},
    {"trim_and_lstrip_blocks",
     "  {% if true %}\n  x\n  {% endif %}\n  {{ 'y' }}\n  {# c #}\nz",
     "  x\n  y\nz"},
    {"lstrip_disabled_by_plus",
     "  {%+ if true %}x{% endif +%}\n|",
     "  x\n|"},
    {"comments",
     "a{# comment {{ x }} #}b\n{# c #}\nd",
     "ab\nd"},
    {"raw",
     "{% raw %}{{ x }}{% if %}{% endraw %}!",
     "{{ x }}{% if %}!"},
    {"subscripts_and_attributes",
     "{{ m['role'] }} {{ m.role }} {{ xs[0] }} {{ xs[-1] }} {{ xs.1 }} {{ m.missing is defined }} {{ msgs[0]['content'] }} [{{ xs[10] }}] {{ {'a': [1, {'b': 'c'}]}['a'][1]['b'] }}",
     "user user 1 3 2 False S [] c"},
    {"slices",
     "{{ xs[1:] }} {{ xs[:-1] }} {{ xs[::-1] }} {{ xs[::2] }} {{ u[1:3] }} {{ msgs[1:]|length }} {{ u[-2:] }} {{ xs[5:] }}",
     "[2, 3] [1, 2] [3, 2, 1] [1, 3] él 2 o🙂 []"},
    {"tests",
     "{{ x is defined }} {{ nope is undefined }} {{ msgs[2].content is none }} {{ msgs[0].content is not none }} {{ 'a' is string }} {{ 1 is number }} {{ 1.5 is float }} {{ 1 is integer }} {{ d is mapping }} {{ xs is iterable }} {{ xs is sequence }} {{ true is boolean }} {{ 4 is even }} {{ 3 is odd }} {{ 9 is divisibleby 3 }} {{ 2 is eq 2 }} {{ 'a' is in 'cat' }} {{ 'abc' is lower }} {{ true is true }} {{ none is sameas none }}",
     "True True True True True True True True True True True True True True True True True True True True"},
    {"python_str_of_values",
     "{{ [1, 'a', none, true, {'k': 1.5}] }} {{ 1e16 }} {{ 0.1 }} {{ 1.0 }} {{ 1e-5 }} {{ 123456.789 }} {{ \"it's\" }} {{ ['it\\'s', 'a\"b'] }} {{ -0.0 }} {{ 2.5e-7 }}",
     "[1, 'a', None, True, {'k': 1.5}] 1e+16 0.1 1.0 1e-05 123456.789 it's [\"it's\", 'a\"b'] -0.0 2.5e-07"},
    {"tojson",
     "{{ m|tojson }} {{ msgs|tojson }} {{ u|tojson }} {{ 'a\"b\\\\c\\n\\t'|tojson }} {{ [1.0, 0.5, 1e20, true, none]|tojson }} {{ d|tojson(sort_keys=true) }} {{ u|tojson(ensure_ascii=true) }} {{ {}|tojson }} {{ []|tojson }}",
     "{\"role\": \"user\", \"content\": \"hi\"} [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"U\"}, {\"role\": \"assistant\", \"content\": null}] \"héllo🙂\" \"a\\\"b\\\\c\\n\\t\" [1.0, 0.5, 1e+20, true, null] {\"a\": 2, \"z\": 1} \"h\\u00e9llo\\ud83d\\ude42\" {} []"},
    {"tojson_indent",
     "{{ {'a': [1, {'b': 2}], 'c': {}}|tojson(indent=2) }}\n{{ xs|tojson(indent='\\t') }}\n{{ d|tojson(separators=(',', ':')) }}",
     "{\n  \"a\": [\n    1,\n    {\n      \"b\": 2\n    }\n  ],\n  \"c\": {}\n}\n[\n\t1,\n\t2,\n\t3\n]\n{\"z\":1,\"a\":2}"},
    {"string_filters",
     "[{{ s|trim }}] [{{ 'xxaxx'|trim('x') }}] {{ 'ab'|upper }} {{ 'AB'|lower }} {{ 'hello wORLD'|capitalize }} {{ 'hello world-foo(bar'|title }} {{ 'aaa'|replace('a', 'b', 2) }} {{ 'abc'|reverse }} {{ 42|string ~ '!' }} {{ '<a&b>'|e }} {{ 'x'|safe }}",
     "[Hello, World] [a] AB ab Hello world Hello World-Foo(Bar bba cba 42! &lt;a&amp;b&gt; x"},
    {"sequence_filters",
     "{{ xs|length }} {{ u|length }} {{ d|count }} {{ xs|first }} {{ xs|last }} {{ xs|join('-') }} {{ 'ab'|list }} {{ xs|reverse|list }} {{ [3, 1, 2]|sort }} {{ [3, 1, 2]|sort(reverse=true) }} {{ ['b', 'A', 'c']|sort }} {{ [1, 2, 1, 3]|unique|list }} {{ xs|sum }} {{ xs|min }} {{ xs|max }} {{ nope|length }}",
     "3 6 2 1 3 1-2-3 ['a', 'b'] [3, 2, 1] [1, 2, 3] [3, 2, 1] ['A', 'b', 'c'] [1, 2, 3] 6 1 3 0"},
    {"dict_filters_and_lazy_results",
     "{{ d|items|list|length }} {% for k, v in d|items %}{{ k }}{{ v }}{% endfor %} {% for k, v in d|dictsort %}{{ k }}{{ v }}{% endfor %} {% for p in d|dictsort(by='value', reverse=true) %}{{ p|join('=') }};{% endfor %} {{ d|dictsort|map('first')|join(',') }} {{ (xs|select)[0] is defined }} {{ (xs|select) is sequence }} {{ [] |select and 'gen-true' }} {{ nope is sequence }} {{ range(3)[1] }} {{ d.items()|list|length }} {{ (xs|reverse)[0] is defined }} {{ 1 in range(3) }} {{ xs|select|first }}",
     "2 z1a2 a2z1 a=2;z=1; a,z False False gen-true True 1 2 False True 1"},
    {"attribute_filters",
     "{{ msgs|map(attribute='role')|join(',') }} {{ msgs|selectattr('role', 'equalto', 'user')|list|length }} {{ msgs|rejectattr('content', 'none')|map(attribute='content')|list }} {{ [0, 1, 2]|select|list }} {{ [0, 1, 2]|reject('odd')|list }} {{ ['a', 'b']|map('upper')|list }} {{ msgs|sort(attribute='role')|map(attribute='role')|list }}",
     "system,user,assistant 1 ['S', 'U'] [1, 2] [0, 2] ['A', 'B'] ['assistant', 'system', 'user']"},
    {"number_filters",
     "{{ '42'|int + 1 }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ 3.9|int }} {{ '2.5'|float }} {{ -3|abs }} {{ 2.5|round }} {{ 3.5|round }} {{ 2.675|round(2) }} {{ 2.1|round(0, 'ceil') }} {{ 3|round }}",
     "43 0 7 3 2.5 3 2.0 4.0 2.67 3.0 3"},
    {"default_filter",
     "{{ nope|default('dflt') }} {{ x|default('dflt') }} {{ ''|default('e', true) }} {{ nope|d('d') }} {{ none|default('n') }}",
     "dflt 1 e d None"},
    {"indent_filter",
     "{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(first=true) }}|{{ 'a\\n\\nb'|indent('> ', blank=true) }}",
     "a\n  b\n\n  c|    a\n    b|a\n> \n> b"},
    {"string_methods",
     "{{ s.strip() }}|{{ 'xxaxx'.lstrip('x') }}|{{ 'a b  c '.split() }}|{{ 'a,b,,c'.split(',') }}|{{ 'a,b,c'.split(',', 1) }}|{{ ' a b c '.split(none, 1) }}|{{ 'hello'.startswith('he') }}|{{ 'hello'.endswith(('x', 'lo')) }}|{{ 'Hi'.upper() }}{{ 'Hi'.lower() }}|{{ 'hello world'.title() }}|{{ 'aXbX'.replace('X', '-') }}|{{ u.find('l') }}|{{ 'aaa'.count('a') }}|{{ ', '.join(['a', 'b']) }}|{{ 'a\\nb\\r\\nc'.splitlines() }}|{{ s.rstrip() }}|",
     "Hello, World|axx|['a', 'b', 'c']|['a', 'b', '', 'c']|['a', 'b,c']|['a', 'b c ']|True|True|HIhi|Hello World|a-b-|2|3|a, b|['a', 'b', 'c']|  Hello, World|"},
    {"dict_methods",
     "{{ d.keys()|list }} {{ d.values()|list }} {{ d.get('z') }} {{ d.get('q', 'none') }} {{ d.get('q') }} {% for k, v in d.items() %}{{ k }}{{ v }}{% endfor %}",
     "['z', 'a'] [1, 2] 1 none None z1a2"},
    {"range_and_dict",
     "{% for i in range(3) %}{{ i }}{% endfor %} {{ range(1, 7, 2)|list }} {{ range(3, 0, -1)|list }} {{ dict(a=1, b='x') }}",
     "012 [1, 3, 5] [3, 2, 1] {'a': 1, 'b': 'x'}"},
    {"unicode",
     "{{ u|length }} {{ u[1] }} {{ u|upper if false else u }} {{ '你好'|length }}",
     "6 é héllo🙂 2"},
    {"newline_normalisation",
     "a\r\nb\rc {{ 'x\r\ny' }}\n",
     "a\nb\nc x\ny"},
    {"string_escapes",
     "{{ 'a\\nb\\t\\u00e9\\x41\\U0001F642\\\\' }}{{ \"q\\\"q\" }}{{ 'adj' \"acent\" }}",
     "a\nb\téA🙂\\q\"qadjacent"},
    {"unary_and_filter_precedence",
     "{{ -3|abs }} {{ -x }} {{ not 0 }} {{ 2 * -1 }} {{ (1 + 2)|string ~ 'x' }} {{ 'a' ~ 1 * 2 }}",
     "3 -1 True -2 3x a2"},
    {"message_loop",
     "{{ bos }}{% for message in msgs %}{% if message['role'] == 'system' %}<<{{ message['content'] }}>>{% elif message.content is not none %}[{{ message.role|upper }}] {{ message.content|trim }}\n{% else %}(tool call)\n{% endif %}{% endfor %}",
     "<<S>>[USER] U\n(tool call)\n"},
    {"loop_cycle_and_item_access",
     "{% for i in xs %}{{ loop.cycle('odd', 'even') }}{{ loop['index'] }}{% if loop.previtem is defined %}<{{ loop.previtem }}{% endif %} {% endfor %}",
     "odd1 even2<1 odd3<2 "},
    {"python_float_division",
     "{{ 0 % -1.25 }} {{ -7.5 // 2 }} {{ 7.5 // -2 }} {{ -0.0 // 1 }} {{ 1e308 * 10 }} {{ 5.5 % -2 }} {{ 2 ** -1 }} {{ (-8) ** 2 }} {{ 2 ** 62 }} {{ true + 1 }}",
     "-0.0 -4.0 -4.0 -0.0 inf -0.5 0.5 64 4611686018427387904 2"},
    {"set_top_level_in_if",
     "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{{ add_generation_prompt }}",
     "False"},
    // clang-format on
};

std::string render_hf(const std::string& src, const Json& ctx = Json::object()) {
  return Template(src, "test", dsv3::jinja::hf_chat_options()).render(ctx);
}

// The message of the Error that rendering (or parsing) `src` throws; "" when none is thrown.
std::string error_of(const std::string& src, const Json& ctx = Json::parse(kContext)) {
  try {
    render_hf(src, ctx);
  } catch (const dsv3::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Jinja, MatchesJinja2OnEveryFeatureCase) {
  const Json ctx = Json::parse(kContext);
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    std::string got;
    try {
      got = render_hf(c.source, ctx);
    } catch (const dsv3::Error& e) {
      ADD_FAILURE() << c.name << " threw: " << e.what();
      continue;
    }
    EXPECT_EQ(got, c.expected) << "template: " << c.source;
  }
}

TEST(Jinja, GenerationTagRendersItsBody) {
  // transformers' AssistantTracker extension: {% generation %} only marks the span.
  EXPECT_EQ(render_hf("a{% generation %}b{{ x }}{% endgeneration %}c", {{"x", 1}}), "ab1c");
}

TEST(Jinja, DefaultOptionsKeepNewlinesAfterTags) {
  Template t("{% if true %}\n  x\n{% endif %}\n", "plain");  // no trim_blocks / lstrip_blocks
  EXPECT_EQ(t.render(Json::object()), "\n  x\n");
  Template keep("a\n", "keep", {false, false, true});
  EXPECT_EQ(keep.render(Json::object()), "a\n");
}

TEST(Jinja, KeepsKeyOrderOfTheContext) {
  Json ctx = Json::parse(R"({"d": {"zeta": 1, "alpha": {"y": 2, "b": 3}}})");
  EXPECT_EQ(render_hf("{{ d|tojson }}|{% for k in d %}{{ k }}{% endfor %}", ctx),
            R"({"zeta": 1, "alpha": {"y": 2, "b": 3}}|zetaalpha)");
}

TEST(Jinja, MacrosCanRecurseAndSeeGlobals) {
  EXPECT_EQ(
      render_hf("{% macro f(n) %}{{ n }}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}"),
      "3210");
  EXPECT_NE(error_of("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}").find("nested too deeply"),
            std::string::npos);
}

TEST(Jinja, SyntaxErrorsNameTheLineAndTheProblem) {
  struct Bad {
    const char* src;
    const char* message;
  };
  const Bad bad[] = {
      {"{% frobnicate %}", "unknown or unsupported tag '{% frobnicate %}'"},
      {"{% include 'x.j2' %}", "unknown or unsupported tag '{% include %}'"},
      {"a\n{{ x|frobnicate }}", "test line 2: unknown or unsupported filter 'frobnicate'"},
      {"{{ x is frobnicated }}", "unknown or unsupported test 'frobnicated'"},
      {"{% if x %}abc", "test line 1: '{% if %}' is never closed (missing '{% endif %}')"},
      {"x\n\n{% for a in b %}", "test line 3: '{% for %}' is never closed"},
      {"{% endfor %}", "unexpected '{% endfor %}'"},
      {"{% if x %}{% endfor %}", "unexpected '{% endfor %}'"},
      {"{{ x", "unclosed '{{'"},
      {"{% if x", "unclosed '{%'"},
      {"{# note", "unclosed comment"},
      {"{{ 'abc }}", "unterminated string literal"},
      {"{{ x ]] }}", "unbalanced ']'"},
      {"{{ x $ y }}", "unexpected character '$'"},
      {"{{ }}", "expected an expression, got '}}'"},
      {"{{ a b }}", "expected '}}', got 'b'"},
      {"{% break %}", "'break' outside of a for loop"},
      {"{% for x in y recursive %}{% endfor %}", "recursive for loops are not supported"},
      {"{{ 1 < 2 < 3 }}", "chained comparisons"},
      {"{{ f(*args) }}", "*args / **kwargs"},
      {"{% raw %}abc", "missing {% endraw %}"},
      {"{{ '\\N{DASH}' }}", "\\N{...} escapes are not supported"},
  };
  for (const Bad& b : bad) {
    std::string msg;
    try {
      Template t(b.src, "test", dsv3::jinja::hf_chat_options());
    } catch (const dsv3::Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find(b.message), std::string::npos) << "template: " << b.src << "\nerror: " << msg;
  }
}

TEST(Jinja, RenderErrorsNameTheLineAndTheProblem) {
  struct Bad {
    const char* src;
    const char* message;
  };
  const Bad bad[] = {
      {"{{ raise_exception('Conversation roles must alternate') }}",
       "test line 1: raise_exception: Conversation roles must alternate"},
      {"a\nb\n{{ 'x' + nope }}", "test line 3: cannot apply '+' to undefined 'nope'"},
      {"{{ nope.x }}", "'nope' is undefined"},
      {"{{ m.missing.deeper }}", "'m'.missing is undefined"},
      {"{{ msgs[5]['content'] }}", "'msgs'[5] is undefined"},
      {"{{ 'a' + 1 }}", "unsupported operand types for +: a string and an integer"},
      {"{{ msgs[2].content + 'x' }}", "unsupported operand types for +: none and a string"},
      {"{% for c in 3 %}{% endfor %}", "cannot iterate over an integer"},
      {"{% for c in none %}{% endfor %}", "cannot iterate over none"},
      {"{% set x = 1 %}{% set x.a = 2 %}", "only namespace() objects can be assigned to"},
      {"{{ xs.append(4) }}", "a list has no method 'append'"},
      {"{{ name.format(1) }}", "strings have no method 'format'"},
      {"{{ d.update({}) }}", "dicts have no method 'update'"},
      {"{{ 'é'|upper }}", "upper of non-ASCII letters is not supported"},
      {"{{ 1 / 0 }}", "division by zero"},
      {"{{ 1 // 0 }}", "integer division by zero"},
      {"{{ '%s' % name }}", "printf-style string formatting"},
      {"{{ nope() }}", "'nope' is undefined"},
      {"{{ name() }}", "'name' is not callable"},
      {"{{ 1 < 'a' }}", "cannot order an integer and a string"},
      {"{{ 'a' in 1 }}", "'in' needs a string, list or dict on the right"},
      {"{{ 1 in 'abc' }}", "'in <string>' requires a string on the left"},
      {"{{ namespace(a=1) }}", "cannot print a namespace"},
      {"{{ nope|tojson }}", "tojson: expected a value, got undefined 'nope'"},
      {"{{ xs|join(1) }}", "join: expected a string"},
      {"{{ xs|trim(foo=1) }}", "trim has no argument 'foo'"},
      {"{{ msgs|map(attribute='name')|list }}", "map(attribute='name'): an item has no 'name'"},
      {"{% set a, b = xs %}", "cannot unpack a list into 2 variables"},
      {"{% macro f(a) %}{% endmacro %}{{ f(1, 2) }}", "macro 'f' takes 1 arguments, got 2"},
      {"{{ range(1000000)|length }}", "range() too large"},
      {"{{ 9223372036854775807 + 1 }}", "integer overflow"},
      {"{{ {1: 2} }}", "dict keys must be strings"},
      {"{{ xs[1:2:0] }}", "slice step cannot be zero"},
      {"{{ 0.0 ** -1 }}", "0.0 cannot be raised to a negative power"},
      {"{{ (-8) ** 0.5 }}", "complex"},
      // Python objects JSON has no type for: refused where Jinja2 would print their repr.
      {"{{ d.items() }}", "cannot print a dict_items"},
      {"{% for i in xs %}{{ loop }}{% endfor %}", "cannot print a LoopContext"},
      {"{{ xs|select }}", "cannot print a generator"},
      {"{{ xs|select|length }}", "a generator has no length"},
      {"{{ xs|map('string')|tojson }}", "tojson: expected a value, got a generator"},
      {"{{ xs|reverse|last }}", "cannot be reversed"},
      {"{{ (1, 'a') }}", "Python's tuple repr is not supported"},
      {"{% for p in d|dictsort %}{{ p }}{% endfor %}", "Python's tuple repr is not supported"},
  };
  for (const Bad& b : bad) {
    std::string msg = error_of(b.src);
    EXPECT_NE(msg.find(b.message), std::string::npos) << "template: " << b.src << "\nerror: " << msg;
  }
}

TEST(Jinja, LookupsShareDataInsteadOfCopyingIt) {
  // messages[loop.index0 - 1] inside the loop over messages (as Qwen's template does for tool
  // turns) must not copy the whole list per access: 3000 messages of 3 kB render in well under
  // a second (copying made this quadratic: tens of seconds).
  Json msgs = Json::array();
  for (int i = 0; i < 3000; ++i)
    msgs.push_back({{"role", "tool"}, {"content", std::string(3000, 'a' + i % 26)}});
  auto start = std::chrono::steady_clock::now();
  std::string out = render_hf(
      "{% for m in messages %}{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<u>"
      "{% endif %}{{ m.content|length }}{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}</u>"
      "{% endif %}{% endfor %}",
      {{"messages", msgs}});
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(out.size(), 3000u * 4 + 7);
  EXPECT_LT(seconds, 5.0);
}

TEST(Jinja, DeepNestingIsAnErrorNotACrash) {
  std::string deep = "{{ " + std::string(500, '(') + "1" + std::string(500, ')') + " }}";
  EXPECT_NE(error_of(deep).find("nested too deeply"), std::string::npos);
  std::string tags;
  for (int i = 0; i < 500; ++i) tags += "{% if true %}";
  EXPECT_NE(error_of(tags).find("nested too deeply"), std::string::npos);
}

TEST(Jinja, ContextMustBeAnObject) {
  Template t("x", "ctx");
  EXPECT_THROW(t.render(Json::array()), dsv3::Error);
}
