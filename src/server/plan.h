// From a checked ApiRequest to the engine requests of its choices: chat messages rendered with
// the chat template (and chat_template_kwargs) and tokenized, completion prompts tokenized (BOS
// first) or taken as ids, max_tokens checked against the context, seeds spread over choices.
#pragma once
#include <vector>

#include "runtime/engine.h"
#include "server/api_request.h"
#include "server/encoder.h"
#include "server/generation.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace dsv3::server {

struct PlanInputs {
  const Tokenizer& tok;
  Encoder& encoder;          // tokenizes (tok's encode, on its own thread)
  const ChatTemplate* tmpl;  // null: chat requests are refused
  int max_context = 0;       // Engine::max_context()
  int vocab_size = 0;        // Engine::vocab_size()
};

// One ChoiceSpec per prompt and choice, prompt-major (index = prompt * n + choice). Choice i of
// a prompt samples with seed + i (a seed drawn at random when the request has none). Throws
// ApiError (400): no chat template, a template that refuses the messages, an id outside the
// vocabulary, an empty prompt, prompt + max_tokens past the context (code
// "context_length_exceeded", naming the numbers).
std::vector<ChoiceSpec> plan_choices(const ApiRequest& r, const PlanInputs& in);

}  // namespace dsv3::server
