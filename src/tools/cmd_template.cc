// dsv3 template: renders a chat through the tokenizer's chat template, as transformers'
// apply_chat_template(messages, add_generation_prompt=True) does, and prints the token ids
// (space separated) or, with --text, the prompt string itself (exactly, no newline added).
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "tools/command.h"

namespace dsv3 {
namespace {

int run_template(int argc, char** argv) {
  Args args(argc, argv, {"tokenizer", "messages"}, {"text", "no-generation-prompt"});
  const std::string path = args.require("messages");
  const std::string dir = args.has("tokenizer") ? args.get("tokenizer") : find_tokenizer_dir("");

  // The chat file: a JSON array of messages, or {"messages": [...], "tools": [...]}.
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot read ", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  nlohmann::ordered_json doc;
  try {
    doc = nlohmann::ordered_json::parse(ss.str());
  } catch (const nlohmann::json::parse_error& e) {
    fail(path, " is not valid JSON: ", e.what());
  }
  nlohmann::ordered_json messages, tools = nullptr;
  if (doc.is_array()) {
    messages = doc;
  } else if (doc.is_object() && doc.contains("messages")) {
    messages = doc["messages"];
    if (doc.contains("tools")) tools = doc["tools"];
  } else {
    fail(path, " must hold a JSON array of messages or an object with \"messages\"");
  }
  try {
    validate_chat_messages(messages);
  } catch (const Error& e) {
    fail(path, ": ", e.what());
  }

  ChatTemplate tmpl = ChatTemplate::load(dir);
  std::string prompt = tmpl.render(messages, !args.has("no-generation-prompt"), tools);
  std::string out;
  if (args.has("text")) {
    out = prompt;
  } else {
    // The template writes the special tokens itself (bos included): encode adds none, as HF
    // tokenizers' encode(prompt, add_special_tokens=False) (the golden chat ids).
    auto tok = Tokenizer::load(dir);
    for (int32_t id : tok->encode(prompt)) out += (out.empty() ? "" : " ") + std::to_string(id);
    out += '\n';
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  return std::fflush(stdout) == 0 ? 0 : 1;
}

}  // namespace
}  // namespace dsv3

DSV3_COMMAND(template,
             "--messages FILE.json [--tokenizer DIR] [--text] [--no-generation-prompt]: "
             "the chat's prompt token ids (or --text: the prompt) via the chat template",
             dsv3::run_template);
