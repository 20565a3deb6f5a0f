// The DeepSeek-V3 chat template (text/chat_template.h) against Hugging Face: every chat of the
// golden tokenizer files (prompt string from transformers 5.17 apply_chat_template, ids from HF
// tokenizers' encoding of it), tool call chats rendered by Jinja2 3.1.6 with transformers'
// settings (kToolChats), bad input, and the `dsv3 template` command.
#include "text/chat_template.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "cli_util.h"
#include "core/error.h"
#include "text/tokenizer.h"

using dsv3::ChatTemplate;
using dsv3::testing_util::CliRun;
using dsv3::testing_util::run_dsv3;
using ojson = nlohmann::ordered_json;
namespace fs = std::filesystem;

namespace {

// The DeepSeek-V3 tokenizer directory (text/tokenizer.h's find_tokenizer_dir). Fails the test
// (not skips) when there is none, with the reason.
#define REQUIRE_TOKENIZER(dir) \
  std::string dir;             \
  ASSERT_NO_THROW(dir = dsv3::find_tokenizer_dir(""))

ojson load_json(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot open " + path);
  return ojson::parse(f);
}

struct Chat {
  std::string where;
  ojson messages;
  bool add_generation_prompt;
  ojson tools;
  std::string prompt;
  std::vector<int32_t> ids;  // empty when the case has none
};

std::vector<Chat> golden_chats(const std::string& file) {
  ojson doc = load_json(std::string(DSV3_TEST_DATA) + "/golden/" + file);
  std::vector<Chat> out;
  for (size_t i = 0; i < doc.at("chats").size(); ++i) {
    const ojson& c = doc["chats"][i];
    out.push_back({file + " chats[" + std::to_string(i) + "]", c.at("messages"),
                   c.at("add_generation_prompt").get<bool>(), nullptr, c.at("prompt").get<std::string>(),
                   c.at("ids").get<std::vector<int32_t>>()});
  }
  return out;
}

// Tool-call chats: prompts rendered by Jinja2 3.1.6 from the same chat_template with
// transformers' environment (trim_blocks, lstrip_blocks) and context (bos/eos/pad tokens, tools,
// documents=None). The template's own quirks (a second call appends <｜tool▁calls▁end｜> after
// each call; is_first is never reset) are part of what HF renders.
const char* kToolChats = R"JSON([
 {
  "name": "single_tool_call",
  "messages": [
   {
    "role": "system",
    "content": "You can call tools."
   },
   {
    "role": "user",
    "content": "Weather in Paris?"
   },
   {
    "role": "assistant",
    "content": null,
    "tool_calls": [
     {
      "id": "call_1",
      "type": "function",
      "function": {
       "name": "get_weather",
       "arguments": "{\"city\": \"Paris\"}"
      }
     }
    ]
   },
   {
    "role": "tool",
    "tool_call_id": "call_1",
    "content": "{\"temp\": 21}"
   },
   {
    "role": "assistant",
    "content": "It is 21°C in Paris."
   },
   {
    "role": "user",
    "content": "Thanks!"
   }
  ],
  "add_generation_prompt": true,
  "tools": null,
  "prompt": "<｜begin▁of▁sentence｜>You can call tools.<｜User｜>Weather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{\"temp\": 21}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>It is 21°C in Paris.<｜end▁of▁sentence｜><｜User｜>Thanks!<｜Assistant｜>"
 },
 {
  "name": "two_tool_calls_then_answer",
  "messages": [
   {
    "role": "user",
    "content": "Compare Paris and 東京."
   },
   {
    "role": "assistant",
    "content": null,
    "tool_calls": [
     {
      "id": "call_1",
      "type": "function",
      "function": {
       "name": "get_weather",
       "arguments": "{\"city\": \"Paris\"}"
      }
     },
     {
      "id": "call_2",
      "type": "function",
      "function": {
       "name": "get_weather",
       "arguments": "{\"city\": \"\\u6771\\u4eac\"}"
      }
     }
    ]
   },
   {
    "role": "tool",
    "content": "21"
   },
   {
    "role": "tool",
    "content": "18"
   },
   {
    "role": "assistant",
    "content": "Paris is warmer."
   }
  ],
  "add_generation_prompt": true,
  "tools": null,
  "prompt": "<｜begin▁of▁sentence｜><｜User｜>Compare Paris and 東京.<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"\\u6771\\u4eac\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>21<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>18<｜tool▁output▁end｜><｜tool▁outputs▁end｜>Paris is warmer.<｜end▁of▁sentence｜><｜Assistant｜>"
 },
 {
  "name": "ends_with_tool_output",
  "messages": [
   {
    "role": "user",
    "content": "Weather?"
   },
   {
    "role": "assistant",
    "content": null,
    "tool_calls": [
     {
      "id": "call_1",
      "type": "function",
      "function": {
       "name": "get_weather",
       "arguments": "{\"city\": \"Rome\"}"
      }
     }
    ]
   },
   {
    "role": "tool",
    "content": "sunny\nwarm"
   }
  ],
  "add_generation_prompt": true,
  "tools": [
   {
    "type": "function",
    "function": {
     "name": "get_weather",
     "description": "Weather",
     "parameters": {
      "type": "object",
      "properties": {
       "city": {
        "type": "string"
       }
      }
     }
    }
   }
  ],
  "prompt": "<｜begin▁of▁sentence｜><｜User｜>Weather?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Rome\"}\n```<｜tool▁call▁end｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny\nwarm<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
 },
 {
  "name": "tool_calls_in_two_turns",
  "messages": [
   {
    "role": "system",
    "content": "A"
   },
   {
    "role": "system",
    "content": "B"
   },
   {
    "role": "user",
    "content": "q1"
   },
   {
    "role": "assistant",
    "content": null,
    "tool_calls": [
     {
      "id": "call_1",
      "type": "function",
      "function": {
       "name": "f",
       "arguments": "{}"
      }
     }
    ]
   },
   {
    "role": "tool",
    "content": "r1"
   },
   {
    "role": "assistant",
    "content": "a1"
   },
   {
    "role": "user",
    "content": "q2"
   },
   {
    "role": "assistant",
    "content": null,
    "tool_calls": [
     {
      "id": "call_1",
      "type": "function",
      "function": {
       "name": "g",
       "arguments": "{\"x\": [1, 2]}"
      }
     }
    ]
   },
   {
    "role": "tool",
    "content": "r2"
   }
  ],
  "add_generation_prompt": true,
  "tools": null,
  "prompt": "<｜begin▁of▁sentence｜>A\n\nB<｜User｜>q1<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>r1<｜tool▁output▁end｜><｜tool▁outputs▁end｜>a1<｜end▁of▁sentence｜><｜User｜>q2\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n```json\n{\"x\": [1, 2]}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>\n<｜tool▁output▁begin｜>r2<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
 },
 {
  "name": "no_generation_prompt",
  "messages": [
   {
    "role": "user",
    "content": "Hi"
   },
   {
    "role": "assistant",
    "content": "Hello"
   }
  ],
  "add_generation_prompt": false,
  "tools": null,
  "prompt": "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>Hello<｜end▁of▁sentence｜>"
 },
 {
  "name": "empty_messages",
  "messages": [],
  "add_generation_prompt": true,
  "tools": null,
  "prompt": "<｜begin▁of▁sentence｜><｜Assistant｜>"
 },
 {
  "name": "unknown_role_is_skipped",
  "messages": [
   {
    "role": "developer",
    "content": "ignored"
   },
   {
    "role": "user",
    "content": "x"
   }
  ],
  "add_generation_prompt": true,
  "tools": null,
  "prompt": "<｜begin▁of▁sentence｜><｜User｜>x<｜Assistant｜>"
 }
])JSON";

std::vector<Chat> tool_chats() {
  std::vector<Chat> out;
  for (const auto& c : ojson::parse(kToolChats))
    out.push_back({"tool chat " + c.at("name").get<std::string>(),
                   c.at("messages"),
                   c.at("add_generation_prompt").get<bool>(),
                   c.at("tools"),
                   c.at("prompt").get<std::string>(),
                   {}});
  return out;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const dsv3::Error& e) {
    return e.what();
  }
  return "";
}

// A file name in this process's scratch folder, which is removed when the tests end.
std::string temp_path(const std::string& name) {
  struct Scratch {
    fs::path dir = fs::temp_directory_path() / ("dsv3_chat_template_test_" + std::to_string(getpid()));
    ~Scratch() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  };
  static Scratch scratch;
  static int counter = 0;
  fs::create_directories(scratch.dir);
  return (scratch.dir / (std::to_string(counter++) + "_" + name)).string();
}
void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

std::string ids_line(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
  return s + "\n";
}

}  // namespace

TEST(ChatTemplate, LoadsTheDeepSeekV3Template) {
  REQUIRE_TOKENIZER(dir);
  ChatTemplate t = ChatTemplate::load(dir);
  EXPECT_NE(t.source().find("<｜Assistant｜>"), std::string::npos);
}

TEST(ChatTemplate, RendersEveryGoldenChatLikeTransformers) {
  REQUIRE_TOKENIZER(dir);
  ChatTemplate t = ChatTemplate::load(dir);
  size_t n = 0;
  for (const char* file : {"tokenizer_cases.json", "tokenizer_random_public.json"}) {
    for (const Chat& c : golden_chats(file)) {
      SCOPED_TRACE(c.where);
      EXPECT_EQ(t.render(c.messages, c.add_generation_prompt), c.prompt);
      ++n;
    }
  }
  EXPECT_EQ(n, 24u);  // 4 + 20 chats
}

// The golden ids are HF tokenizers' encoding of the rendered prompt; dsv3's must be exactly those.
TEST(ChatTemplate, GoldenChatIdsAreTheRenderedPromptEncoded) {
  REQUIRE_TOKENIZER(dir);
  ChatTemplate t = ChatTemplate::load(dir);
  auto tok = dsv3::Tokenizer::load(dir);
  size_t n = 0;
  for (const char* file : {"tokenizer_cases.json", "tokenizer_random_public.json"}) {
    for (const Chat& c : golden_chats(file)) {
      SCOPED_TRACE(c.where);
      ASSERT_FALSE(c.ids.empty());
      EXPECT_EQ(tok->encode(t.render(c.messages, c.add_generation_prompt)), c.ids);
      ++n;
    }
  }
  EXPECT_EQ(n, 24u);  // 4 + 20 chats
}

TEST(ChatTemplate, RendersToolCallsAndToolOutputsLikeJinja2) {
  REQUIRE_TOKENIZER(dir);
  ChatTemplate t = ChatTemplate::load(dir);
  for (const Chat& c : tool_chats()) {
    SCOPED_TRACE(c.where);
    EXPECT_EQ(t.render(c.messages, c.add_generation_prompt, c.tools), c.prompt);
  }
}

TEST(ChatTemplate, SortedJsonOverloadRendersTheSame) {
  REQUIRE_TOKENIZER(dir);
  ChatTemplate t = ChatTemplate::load(dir);
  nlohmann::json msgs =
      nlohmann::json::parse(R"([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])");
  EXPECT_EQ(t.render(msgs), "<｜begin▁of▁sentence｜>S<｜User｜>U<｜Assistant｜>");
  EXPECT_EQ(t.render(msgs, false), "<｜begin▁of▁sentence｜>S<｜User｜>U");
}

TEST(ChatTemplate, RejectsMalformedMessagesWithClearErrors) {
  REQUIRE_TOKENIZER(dir);
  ChatTemplate t = ChatTemplate::load(dir);
  struct Bad {
    const char* messages;
    const char* message;
  };
  const Bad bad[] = {
      {R"({"role": "user", "content": "hi"})",
       "messages must be a JSON array of message objects, got an object"},
      {R"("hi")", "messages must be a JSON array of message objects, got a string"},
      {R"([{"role": "user", "content": "a"}, "b"])", "messages[1] must be an object"},
      {R"([{"content": "hi"}])", "messages[0] has no \"role\""},
      {R"([{"role": 3, "content": "hi"}])", "messages[0].role must be a string, got a number"},
      {R"([{"role": null, "content": "hi"}])", "messages[0].role must be a string, got null"},
      {R"([{"role": "user"}])", "messages[0] (role \"user\") has no \"content\""},
      {R"([{"role": "user", "content": null}])",
       "messages[0].content is null, which is allowed only for a message with \"tool_calls\""},
      {R"([{"role": "user", "content": 5}])", "messages[0].content must be a string, got a number"},
      {R"([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])",
       "messages[0].content must be a string, got an array"},
      {R"([{"role": "assistant", "content": null, "tool_calls": {}}])",
       "messages[0].tool_calls must be an array, got an object"},
  };
  for (const Bad& b : bad) {
    std::string msg = error_of([&] { t.render(ojson::parse(b.messages)); });
    EXPECT_NE(msg.find(b.message), std::string::npos) << b.messages << "\nerror: " << msg;
  }
  std::string msg = error_of([&] { t.render(ojson::array(), true, ojson::object()); });
  EXPECT_NE(msg.find("tools must be a JSON array"), std::string::npos) << msg;
  // What the validation lets through but the template cannot render is still an Error, not a guess.
  msg = error_of([&] {
    t.render(ojson::parse(
        R"([{"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}])"));
  });
  EXPECT_NE(msg.find("chat_template line 5: unsupported operand types for +: a string and a dict"),
            std::string::npos)
      << msg;
}

TEST(ChatTemplate, LoadErrorsNameTheFile) {
  std::string missing = temp_path("no_such_dir");
  std::string msg = error_of([&] { ChatTemplate::load(missing); });
  EXPECT_NE(msg.find("cannot read " + missing + "/tokenizer_config.json"), std::string::npos) << msg;

  std::string dir = temp_path("tok");
  fs::create_directories(dir);
  write_file(dir + "/tokenizer_config.json", "{\"bos_token\": \"<s>\",");
  msg = error_of([&] { ChatTemplate::load(dir); });
  EXPECT_NE(msg.find(dir + "/tokenizer_config.json is not valid JSON"), std::string::npos) << msg;

  write_file(dir + "/tokenizer_config.json", R"({"bos_token": "<s>"})");
  msg = error_of([&] { ChatTemplate::load(dir); });
  EXPECT_NE(msg.find("has no \"chat_template\""), std::string::npos) << msg;

  write_file(dir + "/tokenizer_config.json", R"({"bos_token": 5, "chat_template": "x"})");
  msg = error_of([&] { ChatTemplate::load(dir); });
  EXPECT_NE(msg.find("\"bos_token\" must be a string or an object"), std::string::npos) << msg;

  write_file(dir + "/tokenizer_config.json",
             R"({"chat_template": "{% for m in messages %}{{ m.content|shout }}{% endfor %}"})");
  msg = error_of([&] { ChatTemplate::load(dir); });
  EXPECT_NE(msg.find("tokenizer_config.json chat_template line 1: unknown or unsupported filter 'shout'"),
            std::string::npos)
      << msg;
}

TEST(ChatTemplate, SpecialTokensAndNamedTemplates) {
  std::string dir = temp_path("tok");
  fs::create_directories(dir);
  // Named templates: "default", and "tool_use" when tools are given; special tokens as objects.
  write_file(dir + "/tokenizer_config.json", R"({
    "bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>", "unk_token": null,
    "chat_template": [
      {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}{{ eos_token }}{% endfor %}{{ unk_token is defined }}{{ tools is none }}"},
      {"name": "tool_use", "template": "{{ tools|tojson }}|{{ messages|length }}{% if add_generation_prompt %}>{% endif %}"}]})");
  ChatTemplate t = ChatTemplate::load(dir);
  ojson msgs = ojson::parse(R"([{"role": "user", "content": "hi"}])");
  EXPECT_EQ(t.render(msgs), "<s>user:hi</s>FalseTrue");
  ojson tools =
      ojson::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": 2}}}])");
  EXPECT_EQ(t.render(msgs, true, tools),
            R"([{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": 2}}}]|1>)");
  // chat_template.jinja beside tokenizer_config.json takes precedence.
  write_file(dir + "/chat_template.jinja", "J{{ messages[0].content }}\n");
  EXPECT_EQ(ChatTemplate::load(dir).render(msgs), "Jhi");
}

TEST(ChatTemplate, CommandPrintsTextAndIds) {
  REQUIRE_TOKENIZER(dir);
  ojson doc = load_json(std::string(DSV3_TEST_DATA) + "/golden/tokenizer_cases.json");
  const ojson& chat = doc.at("chats").at(1);
  std::string file = temp_path("messages.json");
  write_file(file, chat.at("messages").dump());
  CliRun text = run_dsv3("template --tokenizer '" + dir + "' --messages '" + file + "' --text");
  EXPECT_EQ(text.rc, 0) << text.err;
  EXPECT_EQ(text.out, chat.at("prompt").get<std::string>());
  CliRun ids = run_dsv3("template --tokenizer '" + dir + "' --messages '" + file + "'");
  EXPECT_EQ(ids.rc, 0) << ids.err;
  EXPECT_EQ(ids.out, ids_line(chat.at("ids").get<std::vector<int32_t>>()));
  // An object with "messages" and "tools" is accepted too.
  file = temp_path("messages.json");
  write_file(file, ojson{{"messages", chat.at("messages")}, {"tools", ojson::array()}}.dump());
  CliRun obj = run_dsv3("template --tokenizer '" + dir + "' --messages '" + file + "' --text");
  EXPECT_EQ(obj.rc, 0) << obj.err;
  EXPECT_EQ(obj.out, chat.at("prompt").get<std::string>());
}

TEST(ChatTemplate, CommandRejectsBadMessagesFiles) {
  REQUIRE_TOKENIZER(dir);
  struct Bad {
    const char* content;  // null: the file does not exist
    const char* message;
  };
  const Bad bad[] = {
      {"[{\"role\": \"user\", \"content\": \"hi\"", "is not valid JSON"},
      {"", "is not valid JSON"},
      {"[{\"content\": \"hi\"}]", "messages[0] has no \"role\""},
      {"[{\"role\": 1, \"content\": \"hi\"}]", "messages[0].role must be a string"},
      {"{\"role\": \"user\", \"content\": \"hi\"}",
       "must hold a JSON array of messages or an object with \"messages\""},
      {nullptr, "cannot read"},
  };
  for (const Bad& b : bad) {
    std::string file = temp_path("bad.json");
    if (b.content) write_file(file, b.content);
    CliRun r = run_dsv3("template --tokenizer '" + dir + "' --messages '" + file + "' --text");
    EXPECT_NE(r.rc, 0) << (b.content ? b.content : "(missing file)");
    EXPECT_EQ(r.out, "");
    EXPECT_NE(r.err.find(b.message), std::string::npos) << "stderr: " << r.err;
    EXPECT_NE(r.err.find(file), std::string::npos) << "stderr should name the file: " << r.err;
  }
  CliRun r = run_dsv3("template --messages x.json");
  EXPECT_NE(r.rc, 0);
}
