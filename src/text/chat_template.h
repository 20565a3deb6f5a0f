// The chat template of a Hugging Face tokenizer: renders a list of chat messages into the prompt
// string exactly as transformers' apply_chat_template(messages, add_generation_prompt=...) does,
// by interpreting the template's Jinja (text/jinja.h) with the context transformers gives it.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "text/jinja.h"

namespace dsv3 {

class ChatTemplate {
 public:
  // Reads a Hugging Face tokenizer directory: the template from `dir/chat_template.jinja` when it
  // exists, else from tokenizer_config.json's "chat_template" (a string, or a list of
  // {"name", "template"} of which "default" and "tool_use" are used); the special tokens
  // (bos_token, eos_token, ...: strings or {"content": ...} objects) from tokenizer_config.json.
  // Throws Error naming the file and what is missing or malformed.
  static ChatTemplate load(const std::string& tokenizer_dir);

  // From template source; `special_tokens` is an object like {"bos_token": "<s>", ...} whose
  // entries become template variables. `name` prefixes error messages.
  ChatTemplate(std::string_view source, const nlohmann::ordered_json& special_tokens,
               std::string name = "chat_template");

  // The prompt for `messages` (validated with validate_chat_messages). `tools` (null or a list)
  // is passed to the template as `tools`. `kwargs` (null or an object) are further template
  // variables, as transformers' apply_chat_template(**kwargs) passes them (e.g. DeepSeek-V3.1's
  // `thinking`); they may replace a special token but not messages, tools, documents or
  // add_generation_prompt. Throws Error for invalid messages and for anything the template
  // cannot render (raise_exception, undefined values, unsupported Jinja).
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt = true,
                     const nlohmann::ordered_json& tools = nullptr,
                     const nlohmann::ordered_json& kwargs = nullptr) const;
  // The same for an nlohmann::json (key order of its objects is already sorted there).
  std::string render(const nlohmann::json& messages, bool add_generation_prompt = true,
                     const nlohmann::json& tools = nullptr) const;

  const std::string& source() const { return source_; }

 private:
  std::string source_;
  jinja::Template template_;
  std::optional<jinja::Template> tool_use_;  // a named "tool_use" template, used when tools are given
  nlohmann::ordered_json special_tokens_;
};

// "null", "a boolean", "a string", "an array", "an object" or "a number": for error messages.
const char* json_type_name(const nlohmann::ordered_json& j);

// Checks that `messages` is a list of objects, each with a string "role" and a "content" that is a
// string, or null when the message has "tool_calls" (a list). Throws Error naming the message
// index and the field that is wrong.
void validate_chat_messages(const nlohmann::ordered_json& messages);

}  // namespace dsv3
