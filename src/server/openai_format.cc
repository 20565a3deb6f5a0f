#include "server/openai_format.h"

#include <chrono>
#include <random>

#include "text/utf8.h"

namespace dsv3::server {

namespace {

std::string random_hex(int n) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) s += digits[rng() & 15];
  return s;
}

// Characters (code points) of valid UTF-8 text.
int64_t code_points(const std::string& s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

}  // namespace

ResponseMeta new_response_meta(Endpoint endpoint, const std::string& model, bool logprobs) {
  ResponseMeta m;
  m.endpoint = endpoint;
  m.id = (endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-") + random_hex(24);
  m.created = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  m.model = model;
  m.logprobs = logprobs;
  return m;
}

json usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

ResponseWriter::ResponseWriter(const Tokenizer& tok, ResponseMeta meta, int choices)
    : tok_(tok), meta_(std::move(meta)), collected_(size_t(choices)), text_offset_(size_t(choices), 0) {}

std::string ResponseWriter::token_text(int32_t id) const { return utf8::repair(tok_.decode_bytes({id}, false)); }

json ResponseWriter::token_entry(const SampledToken& t) const {
  auto entry = [&](int32_t id, float logprob) {
    const std::string raw = tok_.decode_bytes({id}, false);
    json bytes = json::array();
    for (unsigned char c : raw) bytes.push_back(int(c));
    return json{{"token", utf8::repair(raw)}, {"logprob", logprob}, {"bytes", bytes}};
  };
  json e = entry(t.id, t.logprob);
  json top = json::array();
  for (const TokenLogprob& x : t.top) top.push_back(entry(x.id, x.logprob));
  e["top_logprobs"] = top;
  return e;
}

json ResponseWriter::logprobs_json(int choice, const std::vector<SampledToken>& tokens) {
  if (meta_.endpoint == Endpoint::kChat) {
    json content = json::array();
    for (const SampledToken& t : tokens) content.push_back(token_entry(t));
    return {{"content", content}};
  }
  json toks = json::array(), lps = json::array(), tops = json::array(), offs = json::array();
  for (const SampledToken& t : tokens) {
    const std::string text = token_text(t.id);
    toks.push_back(text);
    lps.push_back(t.logprob);
    json top = json::object();
    for (const TokenLogprob& x : t.top) top[token_text(x.id)] = x.logprob;
    tops.push_back(top);
    offs.push_back(text_offset_[size_t(choice)]);
    // The offset moves by what the token adds to "text" (special tokens add nothing there).
    text_offset_[size_t(choice)] += code_points(utf8::repair(tok_.decode_bytes({t.id}, true)));
  }
  return {{"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
}

json ResponseWriter::chunk(json choice, bool usage_null) const {
  json c = {{"id", meta_.id},
            {"object", meta_.endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
            {"created", meta_.created},
            {"model", meta_.model},
            {"choices", json::array({std::move(choice)})}};
  if (usage_null) c["usage"] = nullptr;
  return c;
}

json ResponseWriter::role_chunk(int choice, bool usage_null) const {
  return chunk({{"index", choice},
                {"delta", {{"role", "assistant"}, {"content", ""}}},
                {"logprobs", nullptr},
                {"finish_reason", nullptr}},
               usage_null);
}

json ResponseWriter::usage_chunk(const Usage& u) const {
  json c = chunk(json(), false);
  c["choices"] = json::array();
  c["usage"] = usage_json(u);
  return c;
}

std::vector<json> ResponseWriter::chunks(const ChoiceUpdate& u, bool usage_null) {
  const bool chat = meta_.endpoint == Endpoint::kChat;
  std::vector<json> out;
  if (!u.delta.empty() || !u.tokens.empty()) {
    json choice = {{"index", u.choice}};
    if (chat) {
      json delta = json::object();
      if (!u.delta.reasoning.empty()) delta["reasoning_content"] = u.delta.reasoning;
      if (!u.delta.content.empty() || u.delta.reasoning.empty()) delta["content"] = u.delta.content;
      choice["delta"] = delta;
    } else {
      choice["text"] = u.delta.content;
    }
    choice["logprobs"] = meta_.logprobs ? logprobs_json(u.choice, u.tokens) : json(nullptr);
    choice["finish_reason"] = nullptr;
    out.push_back(chunk(std::move(choice), usage_null));
  }
  if (!u.finish_reason.empty()) {
    json choice = {{"index", u.choice}};
    if (chat) choice["delta"] = json::object();
    else choice["text"] = "";
    choice["logprobs"] = nullptr;
    choice["finish_reason"] = u.finish_reason;
    out.push_back(chunk(std::move(choice), usage_null));
  }
  return out;
}

void ResponseWriter::collect(const ChoiceUpdate& u) {
  Collected& c = collected_[size_t(u.choice)];
  c.content += u.delta.content;
  c.reasoning += u.delta.reasoning;
  if (!u.finish_reason.empty()) c.finish_reason = u.finish_reason;
  if (!meta_.logprobs || u.tokens.empty()) return;
  json lp = logprobs_json(u.choice, u.tokens);
  if (c.logprobs.is_null()) {
    c.logprobs = std::move(lp);
    return;
  }
  for (auto& [key, values] : lp.items())
    for (auto& v : values) c.logprobs[key].push_back(std::move(v));
}

json ResponseWriter::response(const Usage& usage) const {
  const bool chat = meta_.endpoint == Endpoint::kChat;
  json choices = json::array();
  for (size_t i = 0; i < collected_.size(); ++i) {
    const Collected& c = collected_[i];
    json choice = {{"index", i}};
    if (chat) {
      json message = {{"role", "assistant"}, {"content", c.content}};
      if (!c.reasoning.empty()) message["reasoning_content"] = c.reasoning;
      choice["message"] = message;
    } else {
      choice["text"] = c.content;
    }
    json lp = c.logprobs;
    if (meta_.logprobs && lp.is_null())  // no tokens at all: empty lists
      lp = chat ? json{{"content", json::array()}}
                : json{{"tokens", json::array()}, {"token_logprobs", json::array()},
                       {"top_logprobs", json::array()}, {"text_offset", json::array()}};
    choice["logprobs"] = lp;
    choice["finish_reason"] = c.finish_reason;
    choices.push_back(choice);
  }
  return {{"id", meta_.id},
          {"object", chat ? "chat.completion" : "text_completion"},
          {"created", meta_.created},
          {"model", meta_.model},
          {"choices", choices},
          {"usage", usage_json(usage)}};
}

}  // namespace dsv3::server
