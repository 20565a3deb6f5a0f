#include "server/api_request.h"

#include <cmath>
#include <limits>

#include "core/error.h"
#include "text/chat_template.h"

namespace dsv3::server {

using ojson = nlohmann::ordered_json;

ApiError::ApiError(int status_, const std::string& message, std::string param_, std::string code_)
    : std::runtime_error(message), status(status_), type(error_type_for(status_)), param(std::move(param_)),
      code(std::move(code_)) {}

const char* error_type_for(int status) {
  if (status == 401) return "authentication_error";
  if (status == 429) return "rate_limit_error";
  return status >= 500 ? "server_error" : "invalid_request_error";
}

nlohmann::ordered_json error_body(const ApiError& e) {
  nlohmann::ordered_json err = {{"message", e.what()}, {"type", e.type}, {"param", nullptr}, {"code", nullptr}};
  if (!e.param.empty()) err["param"] = e.param;
  if (!e.code.empty()) err["code"] = e.code;
  return {{"error", err}};
}

namespace {

[[noreturn]] void bad(const std::string& param, const std::string& message) { throw ApiError(400, message, param); }

[[noreturn]] void wrong_type(const std::string& param, const char* want, const ojson& got) {
  bad(param, str("'", param, "' must be ", want, ", got ", json_type_name(got)));
}

// A present, non-null field, or nullptr (null counts as absent, as OpenAI treats it).
const ojson* field(const ojson& body, const char* key) {
  auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

bool get_bool(const ojson& body, const char* key, bool dflt) {
  const ojson* v = field(body, key);
  if (!v) return dflt;
  if (!v->is_boolean()) wrong_type(key, "a boolean", *v);
  return v->get<bool>();
}

// A finite number; out of [lo, hi] is an error naming the range.
std::optional<double> get_number(const ojson& body, const char* key, double lo, double hi) {
  const ojson* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(key, "a number", *v);
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi)) bad(key, str("'", key, "' must be in [", lo, ", ", hi, "], got ", v->dump()));
  return x;
}

// An integer (a number with an integral value) in [lo, hi].
std::optional<int64_t> get_integer(const ojson& body, const char* key, int64_t lo, int64_t hi) {
  const ojson* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(key, "an integer", *v);
  int64_t x = 0;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) bad(key, str("'", key, "' is too large: ", v->dump()));
    x = int64_t(u);
  } else if (v->is_number_integer()) {
    x = v->get<int64_t>();
  } else {
    const double d = v->get<double>();
    if (!(std::floor(d) == d && std::fabs(d) < 9e18)) wrong_type(key, "an integer", *v);
    x = int64_t(d);
  }
  if (x < lo || x > hi) bad(key, str("'", key, "' must be in [", lo, ", ", hi, "], got ", v->dump()));
  return x;
}

// The seed: any 64-bit integer (negative ones wrap, as a uint64).
std::optional<uint64_t> get_seed(const ojson& body) {
  const ojson* v = field(body, "seed");
  if (!v) return std::nullopt;
  if (v->is_number_unsigned()) return v->get<uint64_t>();
  if (v->is_number_integer()) return uint64_t(v->get<int64_t>());
  return uint64_t(*get_integer(body, "seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()));
}

void parse_stop(const ojson& body, ApiRequest& r) {
  const ojson* v = field(body, "stop");
  if (!v) return;
  if (v->is_string()) {
    r.stop.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    if (v->size() > size_t(kMaxStopStrings))
      bad("stop", str("'stop' holds at most ", kMaxStopStrings, " strings, got ", v->size()));
    for (size_t i = 0; i < v->size(); ++i) {
      if (!(*v)[i].is_string()) wrong_type(str("stop[", i, "]"), "a string", (*v)[i]);
      r.stop.push_back((*v)[i].get<std::string>());
    }
  } else {
    wrong_type("stop", "a string or an array of strings", *v);
  }
  for (const std::string& s : r.stop)
    if (s.empty()) bad("stop", "'stop' strings must not be empty");
}

void parse_stop_ids(const ojson& body, ApiRequest& r) {
  const ojson* v = field(body, "stop_token_ids");
  if (!v) return;
  if (!v->is_array()) wrong_type("stop_token_ids", "an array of integers", *v);
  for (size_t i = 0; i < v->size(); ++i) {
    const ojson& x = (*v)[i];
    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > std::numeric_limits<int32_t>::max())
      bad("stop_token_ids", str("'stop_token_ids[", i, "]' must be a token id (an integer >= 0), got ", x.dump()));
    r.stop_token_ids.push_back(int32_t(x.get<int64_t>()));
  }
}

void parse_sampling(const ojson& body, ApiRequest& r) {
  SamplingParams& s = r.sampling;
  s.temperature = float(get_number(body, "temperature", 0, 1e6).value_or(1.0));
  s.top_p = float(get_number(body, "top_p", 0, 1).value_or(1.0));
  if (!(s.top_p > 0)) bad("top_p", "'top_p' must be in (0, 1], got 0");
  const int64_t k = get_integer(body, "top_k", -1, std::numeric_limits<int32_t>::max()).value_or(0);
  s.top_k = k < 0 ? 0 : int(k);  // -1 (vLLM) and 0: off
  s.min_p = float(get_number(body, "min_p", 0, 1).value_or(0.0));
  s.presence_penalty = float(get_number(body, "presence_penalty", -2, 2).value_or(0.0));
  s.frequency_penalty = float(get_number(body, "frequency_penalty", -2, 2).value_or(0.0));
  s.repetition_penalty = float(get_number(body, "repetition_penalty", 0, 1e6).value_or(1.0));
  if (!(s.repetition_penalty > 0)) bad("repetition_penalty", "'repetition_penalty' must be > 0 (1 = off), got 0");
  if (auto seed = get_seed(body)) {
    r.has_seed = true;
    s.seed = *seed;
  }
}

void parse_max_tokens(const ojson& body, ApiRequest& r) {
  const int64_t lim = std::numeric_limits<int32_t>::max();
  auto a = get_integer(body, "max_tokens", 1, lim), b = get_integer(body, "max_completion_tokens", 1, lim);
  if (a && b && *a != *b)
    bad("max_completion_tokens", str("'max_tokens' (", *a, ") and 'max_completion_tokens' (", *b, ") disagree"));
  if (a || b) r.max_tokens = int(a ? *a : *b);
}

void parse_stream(const ojson& body, ApiRequest& r) {
  r.stream = get_bool(body, "stream", false);
  const ojson* opts = field(body, "stream_options");
  if (!opts) return;
  if (!opts->is_object()) wrong_type("stream_options", "an object", *opts);
  if (!r.stream) bad("stream_options", "'stream_options' is only allowed when 'stream' is true");
  r.include_usage = get_bool(*opts, "include_usage", false);
}

// Fields of OpenAI's API that this server does not implement: refused unless at their default.
void refuse_unsupported(const ojson& body) {
  auto refuse = [](const char* key, const char* what) {
    bad(key, str("'", key, "' is not supported by this server (", what, ")"));
  };
  for (const char* key : {"tools", "functions"})
    if (const ojson* v = field(body, key); v && !(v->is_array() && v->empty())) refuse(key, "no tool calling");
  if (const ojson* v = field(body, "response_format"); v && !(v->is_object() && v->value("type", "") == "text"))
    refuse("response_format", "only {\"type\": \"text\"}");
  if (const ojson* v = field(body, "logit_bias"); v && !(v->is_object() && v->empty())) refuse("logit_bias", "no logit bias");
  if (get_bool(body, "echo", false)) refuse("echo", "the prompt is not echoed");
  if (const ojson* v = field(body, "suffix"); v && !(v->is_string() && v->get<std::string>().empty()))
    refuse("suffix", "no insertion");
  if (get_integer(body, "best_of", 1, 1000).value_or(1) > 1) refuse("best_of", "no best-of sampling; use n");
}

// A message's content as the template wants it: a string, or null with tool_calls. OpenAI's
// content parts ([{"type": "text", "text": ...}]) are joined with newlines.
ojson content_string(const ojson& content, const std::string& at) {
  if (content.is_string() || content.is_null()) return content;
  if (!content.is_array()) wrong_type(at, "a string or an array of content parts", content);
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const ojson& part = content[i];
    const std::string p = str(at, "[", i, "]");
    if (!part.is_object()) wrong_type(p, "an object {\"type\": \"text\", \"text\": ...}", part);
    auto ty = part.find("type");  // (a "type" that is not a string is refused as any other)
    if (ty == part.end() || !ty->is_string() || ty->get<std::string>() != "text")
      bad(p, str("'", p, "': only text content parts are supported"));
    auto t = part.find("text");
    if (t == part.end() || !t->is_string()) bad(p, str("'", p, ".text' must be a string"));
    if (i > 0) text += "\n";
    text += t->get<std::string>();
  }
  return text;
}

void parse_messages(const ojson& body, ApiRequest& r) {
  const ojson* v = field(body, "messages");
  if (!v) bad("messages", "'messages' is required");
  if (!v->is_array()) wrong_type("messages", "an array of messages", *v);
  if (v->empty()) bad("messages", "'messages' must hold at least one message");
  r.messages = ojson::array();
  for (size_t i = 0; i < v->size(); ++i) {
    const ojson& m = (*v)[i];
    const std::string at = str("messages[", i, "]");
    if (!m.is_object()) wrong_type(at, "an object with 'role' and 'content'", m);
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) bad(at + ".role", str("'", at, ".role' must be a string"));
    std::string rs = role->get<std::string>();
    if (rs == "developer") rs = "system";  // OpenAI's newer name for system instructions
    if (rs != "system" && rs != "user" && rs != "assistant" && rs != "tool")
      bad(at + ".role", str("'", at, ".role' must be system, developer, user, assistant or tool, got '", rs, "'"));
    ojson out = m;
    out["role"] = rs;
    auto content = m.find("content");
    out["content"] = content == m.end() ? ojson(nullptr) : content_string(*content, at + ".content");
    r.messages.push_back(std::move(out));
  }
  try {
    validate_chat_messages(r.messages);
  } catch (const Error& e) {
    bad("messages", e.what());
  }
  if (const ojson* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) wrong_type("chat_template_kwargs", "an object", *kw);
    r.template_kwargs = *kw;
  }
}

PromptInput ids_prompt(const ojson& a, const std::string& at) {
  PromptInput p;
  p.is_ids = true;
  for (size_t i = 0; i < a.size(); ++i) {
    const ojson& x = a[i];
    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > std::numeric_limits<int32_t>::max())
      bad("prompt", str("'", at, "[", i, "]' must be a token id (an integer >= 0), got ", x.dump()));
    p.ids.push_back(int32_t(x.get<int64_t>()));
  }
  if (p.ids.empty()) bad("prompt", str("'", at, "' holds no token ids"));
  return p;
}

// OpenAI's four prompt forms: a string, strings, token ids, lists of token ids.
void parse_prompt(const ojson& body, ApiRequest& r) {
  const ojson* v = field(body, "prompt");
  if (!v) bad("prompt", "'prompt' is required");
  const char* want = "a string, an array of strings, an array of token ids or an array of such arrays";
  if (v->is_string()) {
    r.prompts.push_back({false, v->get<std::string>(), {}});
    return;
  }
  if (!v->is_array()) wrong_type("prompt", want, *v);
  if (v->empty()) bad("prompt", "'prompt' must not be an empty array");
  if ((*v)[0].is_number()) {
    r.prompts.push_back(ids_prompt(*v, "prompt"));
    return;
  }
  if (v->size() > size_t(kMaxPrompts)) bad("prompt", str("'prompt' holds at most ", kMaxPrompts, " prompts, got ", v->size()));
  for (size_t i = 0; i < v->size(); ++i) {
    const ojson& p = (*v)[i];
    const std::string at = str("prompt[", i, "]");
    if (p.is_string()) r.prompts.push_back({false, p.get<std::string>(), {}});
    else if (p.is_array()) r.prompts.push_back(ids_prompt(p, at));
    else bad("prompt", str("'", at, "' must be a string or an array of token ids, got ", json_type_name(p)));
  }
}

void parse_logprobs(const ojson& body, ApiRequest& r) {
  if (r.endpoint == Endpoint::kCompletion) {  // legacy: logprobs is the number of top tokens
    if (auto k = get_integer(body, "logprobs", 0, kMaxTopLogprobs)) r.logprobs = int(*k);
    return;
  }
  const bool on = get_bool(body, "logprobs", false);
  auto k = get_integer(body, "top_logprobs", 0, kMaxTopLogprobs);
  if (k && !on) bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  if (on) r.logprobs = int(k.value_or(0));
}

}  // namespace

ApiRequest parse_api_request(std::string_view text, Endpoint endpoint) {
  ojson body;
  // Nesting is bounded: copying or destroying a deeper value recurses once per level.
  auto depth_check = [](int depth, ojson::parse_event_t, ojson&) {
    if (depth > kMaxJsonDepth) bad("", str("the request body nests deeper than ", kMaxJsonDepth, " levels"));
    return true;
  };
  try {
    body = ojson::parse(text.begin(), text.end(), depth_check);
  } catch (const nlohmann::json::exception& e) {
    // nlohmann names the byte and the reason (a syntax error, or ill-formed UTF-8 in a string).
    bad("", str("the request body is not valid JSON: ", e.what()));
  }
  if (!body.is_object()) bad("", str("the request body must be a JSON object, got ", json_type_name(body)));
  ApiRequest r;
  r.endpoint = endpoint;
  if (const ojson* m = field(body, "model")) {
    if (!m->is_string()) wrong_type("model", "a string", *m);
    r.model = m->get<std::string>();
  }
  if (endpoint == Endpoint::kChat) parse_messages(body, r);
  else parse_prompt(body, r);
  refuse_unsupported(body);
  parse_sampling(body, r);
  parse_max_tokens(body, r);
  r.n = int(get_integer(body, "n", 1, kMaxChoices).value_or(1));
  parse_stop(body, r);
  parse_stop_ids(body, r);
  r.ignore_eos = get_bool(body, "ignore_eos", false);
  parse_stream(body, r);
  parse_logprobs(body, r);
  if (const ojson* u = field(body, "user"); u && !u->is_string()) wrong_type("user", "a string", *u);
  return r;
}

}  // namespace dsv3::server
