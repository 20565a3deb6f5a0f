// Chat template loading and rendering with transformers' context: messages, tools (None unless
// given), documents (None), add_generation_prompt and the tokenizer's special tokens
// (transformers/utils/chat_template_utils.py render_jinja_template + special_tokens_map).
#include "text/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace dsv3 {

using ojson = nlohmann::ordered_json;

namespace {

bool read_file(const std::string& path, std::string& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::ostringstream ss;
  ss << f.rdbuf();
  out = ss.str();
  return true;
}

// The special tokens transformers puts in the template context (its special_tokens_map).
ojson special_tokens_of(const ojson& config, const std::string& path) {
  ojson out = ojson::object();
  for (const char* key :
       {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    auto it = config.find(key);
    if (it == config.end() || it->is_null()) continue;
    if (it->is_string()) {
      out[key] = *it;
    } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
      out[key] = (*it)["content"];
    } else {
      fail(path, ": \"", key, "\" must be a string or an object with a string \"content\", got ",
           json_type_name(*it));
    }
  }
  return out;
}

}  // namespace

ChatTemplate::ChatTemplate(std::string_view source, const ojson& special_tokens, std::string name)
    : source_(source),
      template_(source, std::move(name), jinja::hf_chat_options()),
      special_tokens_(special_tokens) {
  if (!special_tokens_.is_object()) fail("chat template special tokens must be a JSON object");
}

ChatTemplate ChatTemplate::load(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string config_path = (fs::path(dir) / "tokenizer_config.json").string();
  std::string text;
  if (!read_file(config_path, text))
    fail("cannot read ", config_path, " (is ", dir, " a Hugging Face tokenizer directory?)");
  ojson config = ojson::parse(text, nullptr, false);
  if (config.is_discarded()) fail(config_path, " is not valid JSON");
  if (!config.is_object()) fail(config_path, " must hold a JSON object, got ", json_type_name(config));
  ojson special = special_tokens_of(config, config_path);

  const std::string jinja_path = (fs::path(dir) / "chat_template.jinja").string();
  std::string source;
  if (fs::exists(jinja_path)) {
    if (!read_file(jinja_path, source)) fail("cannot read ", jinja_path);
    return ChatTemplate(source, special, jinja_path);
  }
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null())
    fail(config_path, " has no \"chat_template\" (and there is no chat_template.jinja beside it)");
  const std::string name = config_path + " chat_template";
  if (it->is_string()) return ChatTemplate(it->get<std::string>(), special, name);
  if (!it->is_array())
    fail(config_path, ": \"chat_template\" must be a string or a list of {\"name\", \"template\"}, got ",
         json_type_name(*it));
  std::optional<ChatTemplate> result;
  std::optional<jinja::Template> tool_use;
  for (const auto& t : *it) {
    if (!t.is_object() || !t.contains("name") || !t["name"].is_string() || !t.contains("template") ||
        !t["template"].is_string())
      fail(config_path, ": each entry of \"chat_template\" must be {\"name\": string, \"template\": string}");
    std::string tname = t["name"].get<std::string>();
    if (tname == "default") result.emplace(t["template"].get<std::string>(), special, name + " 'default'");
    if (tname == "tool_use")
      tool_use.emplace(t["template"].get<std::string>(), name + " 'tool_use'", jinja::hf_chat_options());
  }
  if (!result) fail(config_path, ": \"chat_template\" has no template named \"default\"");
  result->tool_use_ = std::move(tool_use);
  return std::move(*result);
}

const char* json_type_name(const ojson& j) {
  switch (j.type()) {
    case ojson::value_t::null:
      return "null";
    case ojson::value_t::boolean:
      return "a boolean";
    case ojson::value_t::string:
      return "a string";
    case ojson::value_t::array:
      return "an array";
    case ojson::value_t::object:
      return "an object";
    default:
      return "a number";
  }
}

void validate_chat_messages(const ojson& messages) {
  if (!messages.is_array())
    fail("messages must be a JSON array of message objects, got ", json_type_name(messages));
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    const std::string at = str("messages[", i, "]");
    if (!m.is_object()) fail(at, " must be an object with \"role\" and \"content\", got ", json_type_name(m));
    auto role = m.find("role");
    if (role == m.end()) fail(at, " has no \"role\"");
    if (!role->is_string()) fail(at, ".role must be a string, got ", json_type_name(*role));
    auto calls = m.find("tool_calls");
    bool has_calls = calls != m.end() && !calls->is_null();
    if (has_calls && !calls->is_array()) fail(at, ".tool_calls must be an array, got ", json_type_name(*calls));
    auto content = m.find("content");
    if (content == m.end()) fail(at, " (role \"", role->get<std::string>(), "\") has no \"content\"");
    if (content->is_null()) {
      if (!has_calls) fail(at, ".content is null, which is allowed only for a message with \"tool_calls\"");
    } else if (!content->is_string()) {
      fail(at, ".content must be a string", has_calls ? " or null" : "", ", got ", json_type_name(*content));
    }
  }
}

std::string ChatTemplate::render(const ojson& messages, bool add_generation_prompt,
                                 const ojson& tools, const ojson& kwargs) const {
  validate_chat_messages(messages);
  if (!tools.is_null() && !tools.is_array())
    fail("tools must be a JSON array (or null), got ", json_type_name(tools));
  if (!kwargs.is_null() && !kwargs.is_object())
    fail("chat template kwargs must be a JSON object (or null), got ", json_type_name(kwargs));
  ojson ctx = special_tokens_;
  if (kwargs.is_object()) {
    for (const char* reserved : {"messages", "tools", "documents", "add_generation_prompt"})
      if (kwargs.contains(reserved)) fail("chat template kwargs may not set \"", reserved, "\"");
    for (auto it = kwargs.begin(); it != kwargs.end(); ++it) ctx[it.key()] = it.value();
  }
  ctx["messages"] = messages;
  ctx["tools"] = tools;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = add_generation_prompt;
  const jinja::Template& t = (!tools.is_null() && tool_use_) ? *tool_use_ : template_;
  return t.render(ctx);
}

std::string ChatTemplate::render(const nlohmann::json& messages, bool add_generation_prompt,
                                 const nlohmann::json& tools) const {
  return render(ojson(messages), add_generation_prompt, ojson(tools));
}

}  // namespace dsv3
