#include "server/plan.h"

#include <random>

#include "core/error.h"

namespace dsv3::server {

namespace {

struct Prompt {
  std::vector<int32_t> ids;
  bool opens_reasoning = false;
};

Prompt chat_prompt(const ApiRequest& r, const PlanInputs& in) {
  if (!in.tmpl)
    throw ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages");
  std::string text;
  try {
    text = in.tmpl->render(r.messages, true, nullptr, r.template_kwargs);
  } catch (const Error& e) {
    throw ApiError(400, str("the chat template cannot render these messages: ", e.what()), "messages");
  }
  Prompt p;
  p.ids = in.encoder.encode(text);
  p.opens_reasoning = prompt_opens_reasoning(text);
  return p;
}

Prompt completion_prompt(const PromptInput& input, const PlanInputs& in) {
  Prompt p;
  if (input.is_ids) {
    p.ids = input.ids;
    for (size_t i = 0; i < p.ids.size(); ++i)
      if (p.ids[i] >= in.vocab_size)
        throw ApiError(400, str("prompt token ", i, " is id ", p.ids[i], ", outside the vocabulary [0, ", in.vocab_size, ")"),
                       "prompt");
    return p;
  }
  if (in.tok.bos_id() >= 0) p.ids.push_back(in.tok.bos_id());  // as Hugging Face tokenizers add it
  const std::vector<int32_t> text = in.encoder.encode(input.text);
  p.ids.insert(p.ids.end(), text.begin(), text.end());
  return p;
}

// max_tokens for a prompt of P tokens: as asked, or what the context leaves.
int budget(const ApiRequest& r, int P, const PlanInputs& in) {
  const char* prompt_field = r.endpoint == Endpoint::kChat ? "messages" : "prompt";
  const int C = in.max_context;
  if (P == 0) throw ApiError(400, "the prompt is empty", prompt_field);
  if (P >= C)
    throw ApiError(400,
                   str("this model's context is ", C, " tokens, but the prompt has ", P,
                       " tokens (it must leave room for at least one generated token)"),
                   prompt_field, "context_length_exceeded");
  if (!r.max_tokens) return C - P;
  const int64_t M = *r.max_tokens;
  if (P + M > C)
    throw ApiError(400,
                   str("this model's context is ", C, " tokens, but the prompt has ", P, " tokens and max_tokens asks for ",
                       M, " more (", P + M, " in all)"),
                   "max_tokens", "context_length_exceeded");
  return int(M);
}

}  // namespace

std::vector<ChoiceSpec> plan_choices(const ApiRequest& r, const PlanInputs& in) {
  std::vector<Prompt> prompts;
  if (r.endpoint == Endpoint::kChat) {
    prompts.push_back(chat_prompt(r, in));
  } else {
    for (const PromptInput& p : r.prompts) prompts.push_back(completion_prompt(p, in));
  }
  uint64_t seed = r.sampling.seed;
  if (!r.has_seed) seed = std::random_device{}() * 0x100000000ull + std::random_device{}();
  std::vector<ChoiceSpec> out;
  for (size_t k = 0; k < prompts.size(); ++k) {
    const int max_tokens = budget(r, int(prompts[k].ids.size()), in);
    for (int i = 0; i < r.n; ++i) {
      ChoiceSpec s;
      s.prompt = int(k);
      s.request.prompt = prompts[k].ids;
      s.request.sampling = r.sampling;
      s.request.sampling.seed = seed + uint64_t(i);
      s.request.max_tokens = max_tokens;
      s.request.stop_ids = r.stop_token_ids;
      s.request.top_logprobs = r.logprobs;
      s.request.ignore_eos = r.ignore_eos;
      s.text.stop = r.stop;
      s.text.split_reasoning = r.endpoint == Endpoint::kChat;
      s.text.prompt_opens_reasoning = prompts[k].opens_reasoning;
      out.push_back(std::move(s));
    }
  }
  return out;
}

}  // namespace dsv3::server
