// The OpenAI request bodies the server takes (POST /v1/chat/completions and /v1/completions),
// parsed and checked into one ApiRequest before anything runs, and the OpenAI error object every
// refusal is sent as. Pure: no tokenizer, no engine, no HTTP (the fuzz target drives it directly).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/sampler.h"

namespace dsv3::server {

// A refusal with its HTTP status, sent as {"error": {"message", "type", "param", "code"}}.
struct ApiError : std::runtime_error {
  int status;
  std::string type;   // "invalid_request_error", "authentication_error", "rate_limit_error", "server_error"
  std::string param;  // the request field at fault ("" = none: null in the body)
  std::string code;   // a short machine-readable reason ("" = null)
  ApiError(int status, const std::string& message, std::string param = "", std::string code = "");
};
// The body of an error response.
nlohmann::ordered_json error_body(const ApiError& e);
// The error type for a status: 401 authentication_error, 429 rate_limit_error, other 4xx
// invalid_request_error, 5xx server_error.
const char* error_type_for(int status);

enum class Endpoint { kChat, kCompletion };

// One /v1/completions prompt: text (tokenized with BOS first) or token ids (used as given).
struct PromptInput {
  bool is_ids = false;
  std::string text;
  std::vector<int32_t> ids;
};

// Limits of the fields below, also in the README's Serving section.
constexpr int kMaxChoices = 128;      // n
constexpr int kMaxTopLogprobs = 20;   // top_logprobs (chat), logprobs (completions)
constexpr int kMaxStopStrings = 16;   // stop
constexpr int kMaxPrompts = 256;      // /v1/completions prompt lists
constexpr int kMaxJsonDepth = 64;     // nesting of the request body

struct ApiRequest {
  Endpoint endpoint = Endpoint::kChat;
  std::string model;                         // "" when the body has none
  nlohmann::ordered_json messages;           // chat: checked; text content parts joined into strings
  nlohmann::ordered_json template_kwargs;    // chat_template_kwargs: null or an object
  std::vector<PromptInput> prompts;          // completions: one or more
  SamplingParams sampling;                   // temperature 1 unless given (OpenAI's default)
  bool has_seed = false;                     // seed given: choice i samples with seed + i
  std::optional<int> max_tokens;             // max_tokens / max_completion_tokens (>= 1); none: the context's rest
  int n = 1;                                 // choices per prompt
  std::vector<std::string> stop;             // stop strings (non-empty)
  std::vector<int32_t> stop_token_ids;       // extension (vLLM): ids that end a choice
  bool ignore_eos = false;                   // extension (vLLM): EOS does not end a choice
  bool stream = false;
  bool include_usage = false;                // stream_options.include_usage
  int logprobs = -1;                         // -1: none; k >= 0: the sampled token's and k more per token
};

// Parses and checks a request body. Throws ApiError (400) naming the field: malformed JSON or
// invalid UTF-8 in it, wrong types, values out of range, features this server does not have.
ApiRequest parse_api_request(std::string_view body, Endpoint endpoint);

}  // namespace dsv3::server
