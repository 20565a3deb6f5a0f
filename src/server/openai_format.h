// OpenAI's response shapes: chat.completion and its stream chunks, text_completion (streamed and
// not), usage, and log-probabilities in the chat format ({"content": [{token, logprob, bytes,
// top_logprobs}]}) and the legacy completions format ({tokens, token_logprobs, top_logprobs,
// text_offset}).
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/api_request.h"
#include "server/generation.h"
#include "text/tokenizer.h"

namespace dsv3::server {

using json = nlohmann::ordered_json;  // keys in OpenAI's order

struct ResponseMeta {
  Endpoint endpoint = Endpoint::kChat;
  std::string id;       // chatcmpl-... / cmpl-...
  int64_t created = 0;  // Unix seconds
  std::string model;
  bool logprobs = false;
};
ResponseMeta new_response_meta(Endpoint endpoint, const std::string& model, bool logprobs);

json usage_json(const Usage& u);

// Builds the JSON of one API response from the choices' updates.
class ResponseWriter {
 public:
  ResponseWriter(const Tokenizer& tok, ResponseMeta meta, int choices);

  // Streaming: the chunks of one update (text, then the finish in a chunk of its own), and the
  // opening chunk of a chat choice (its role). `usage_null`: each chunk carries "usage": null
  // (stream_options.include_usage).
  std::vector<json> chunks(const ChoiceUpdate& u, bool usage_null);
  json role_chunk(int choice, bool usage_null) const;
  json usage_chunk(const Usage& u) const;  // the last chunk with include_usage: no choices

  // Not streaming: updates are collected, then the whole response is built.
  void collect(const ChoiceUpdate& u);
  json response(const Usage& u) const;

 private:
  json chunk(json choice, bool usage_null) const;
  json logprobs_json(int choice, const std::vector<SampledToken>& tokens);  // chat or legacy by endpoint
  json token_entry(const SampledToken& t) const;  // chat format, one token
  std::string token_text(int32_t id) const;       // a token's text (valid UTF-8)

  struct Collected {
    std::string content, reasoning, finish_reason;
    json logprobs;  // chat: array of entries; legacy: the four arrays
  };
  const Tokenizer& tok_;
  ResponseMeta meta_;
  std::vector<Collected> collected_;
  std::vector<int64_t> text_offset_;  // legacy logprobs: characters of text so far, per choice
};

}  // namespace dsv3::server
