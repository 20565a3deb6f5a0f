// The server's pieces without a server: request parsing and its refusals, planning (every field
// reaching the engine request), the choice text (incremental UTF-8, stop strings held back and
// cut, the reasoning split) and the metrics text.
#include <gtest/gtest.h>

#include "server/api_request.h"
#include "server/metrics.h"
#include "server/plan.h"
#include "server/text_stream.h"
#include "text/utf8.h"

using namespace dsv3;
using namespace dsv3::server;

namespace {

ApiError refusal(const std::string& body, Endpoint ep = Endpoint::kChat) {
  try {
    parse_api_request(body, ep);
  } catch (const ApiError& e) {
    return e;
  }
  return ApiError(0, "accepted");
}

const std::string kMsgs = R"("messages": [{"role": "user", "content": "hi"}])";

TEST(ServerRequest, ParsesEveryField) {
  ApiRequest r = parse_api_request(R"({"model": "m", )" + kMsgs + R"(, "max_completion_tokens": 7,
      "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": -1, "stop": "END", "n": 3,
      "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "logprobs": true,
      "top_logprobs": 4, "stream": true, "stream_options": {"include_usage": true},
      "chat_template_kwargs": {"thinking": true}, "ignore_eos": true, "stop_token_ids": [5, 6],
      "user": "u", "tools": [], "unknown_field": {"is": "ignored"}})",
                                   Endpoint::kChat);
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.05f);
  EXPECT_TRUE(r.has_seed);
  EXPECT_EQ(r.sampling.seed, ~uint64_t(0));
  EXPECT_EQ(r.stop, std::vector<std::string>{"END"});
  EXPECT_EQ(r.n, 3);
  EXPECT_FLOAT_EQ(r.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, -0.5f);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.1f);
  EXPECT_EQ(r.logprobs, 4);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.template_kwargs["thinking"], true);
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{5, 6}));

  r = parse_api_request(R"({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
      {"type": "text", "text": "b"}]}, {"role": "user", "content": "q"}]})", Endpoint::kChat);
  EXPECT_EQ(r.messages[0]["role"], "system");
  EXPECT_EQ(r.messages[0]["content"], "a\nb");
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.f);  // OpenAI's default
  EXPECT_FALSE(r.max_tokens.has_value());
  EXPECT_EQ(r.logprobs, -1);

  r = parse_api_request(R"({"prompt": ["a", [1, 2, 3]], "logprobs": 2, "stop": ["x", "yz"], "max_tokens": 4.0})",
                        Endpoint::kCompletion);
  ASSERT_EQ(r.prompts.size(), 2u);
  EXPECT_FALSE(r.prompts[0].is_ids);
  EXPECT_EQ(r.prompts[0].text, "a");
  EXPECT_TRUE(r.prompts[1].is_ids);
  EXPECT_EQ(r.prompts[1].ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(r.logprobs, 2);
  EXPECT_EQ(r.stop.size(), 2u);
  EXPECT_EQ(r.max_tokens, 4);
  r = parse_api_request(R"({"prompt": [7, 8]})", Endpoint::kCompletion);
  EXPECT_EQ(r.prompts.at(0).ids, (std::vector<int32_t>{7, 8}));
}

TEST(ServerRequest, RefusesBadInputNamingTheField) {
  struct Case {
    std::string body;
    std::string param, needle;
    Endpoint ep = Endpoint::kChat;
  };
  const std::vector<Case> cases = {
      {"{", "", "not valid JSON"},
      {"[1]", "", "must be a JSON object"},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\"}]}", "", "UTF-8"},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"\\ud800\"}]}", "", "surrogate"},
      {"{}", "messages", "required"},
      {R"({"messages": "hi"})", "messages", "must be an array"},
      {R"({"messages": []})", "messages", "at least one"},
      {R"({"messages": [{"role": "wizard", "content": "x"}]})", "messages[0].role", "must be system"},
      {R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content", "content parts"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", "messages[0].content[0]", "text"},
      {R"({"messages": [{"role": "user", "content": [{"type": 2, "text": "a"}]}]})", "messages[0].content[0]", "text"},
      {R"({"messages": [{"role": "user", "content": [{"text": "a"}]}]})", "messages[0].content[0]", "text"},
      {R"({"model": 3, )" + kMsgs + "}", "model", "must be a string"},
      {R"({"temperature": "hot", )" + kMsgs + "}", "temperature", "must be a number, got a string"},
      {R"({"temperature": -1, )" + kMsgs + "}", "temperature", "must be in"},
      {R"({"top_p": 0, )" + kMsgs + "}", "top_p", "(0, 1]"},
      {R"({"top_k": 2.5, )" + kMsgs + "}", "top_k", "must be an integer"},
      {R"({"presence_penalty": 3, )" + kMsgs + "}", "presence_penalty", "[-2, 2]"},
      {R"({"max_tokens": 0, )" + kMsgs + "}", "max_tokens", "must be in [1,"},
      {R"({"max_tokens": 5, "max_completion_tokens": 6, )" + kMsgs + "}", "max_completion_tokens", "disagree"},
      {R"({"n": 0, )" + kMsgs + "}", "n", "must be in [1, 128]"},
      {R"({"n": true, )" + kMsgs + "}", "n", "must be an integer, got a boolean"},
      {R"({"stop": 5, )" + kMsgs + "}", "stop", "a string or an array"},
      {R"({"stop": [""], )" + kMsgs + "}", "stop", "empty"},
      {R"({"stream": "yes", )" + kMsgs + "}", "stream", "boolean"},
      {R"({"stream_options": {"include_usage": true}, )" + kMsgs + "}", "stream_options", "only allowed"},
      {R"({"top_logprobs": 2, )" + kMsgs + "}", "top_logprobs", "needs 'logprobs'"},
      {R"({"logprobs": true, "top_logprobs": 21, )" + kMsgs + "}", "top_logprobs", "[0, 20]"},
      {R"({"tools": [{"type": "function"}], )" + kMsgs + "}", "tools", "not supported"},
      {R"({"response_format": {"type": "json_object"}, )" + kMsgs + "}", "response_format", "not supported"},
      {R"({"logit_bias": {"5": 1}, )" + kMsgs + "}", "logit_bias", "not supported"},
      {R"({"chat_template_kwargs": [1], )" + kMsgs + "}", "chat_template_kwargs", "an object"},
      {R"({"seed": "x", )" + kMsgs + "}", "seed", "integer"},
      {R"({"stop_token_ids": [-1], )" + kMsgs + "}", "stop_token_ids", "token id"},
      {std::string(100, '[') + std::string(100, ']'), "", "nests deeper than 64"},
      {"{}", "prompt", "required", Endpoint::kCompletion},
      {R"({"prompt": []})", "prompt", "empty array", Endpoint::kCompletion},
      {R"({"prompt": [[]]})", "prompt", "no token ids", Endpoint::kCompletion},
      {R"({"prompt": [1, "a"]})", "prompt", "token id", Endpoint::kCompletion},
      {R"({"prompt": {"a": 1}})", "prompt", "must be a string", Endpoint::kCompletion},
      {R"({"prompt": "a", "logprobs": 30})", "logprobs", "[0, 20]", Endpoint::kCompletion},
      {R"({"prompt": "a", "echo": true})", "echo", "not supported", Endpoint::kCompletion},
      {R"({"prompt": "a", "best_of": 2})", "best_of", "not supported", Endpoint::kCompletion},
  };
  for (const Case& c : cases) {
    ApiError e = refusal(c.body, c.ep);
    EXPECT_EQ(e.status, 400) << c.body << " -> " << e.what();
    EXPECT_EQ(e.param, c.param) << c.body << " -> " << e.what();
    EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos) << c.body << " -> " << e.what();
    EXPECT_EQ(e.type, "invalid_request_error");
  }
  const auto body = error_body(ApiError(429, "full", "", "queue_full"));
  EXPECT_EQ(body.dump(), R"({"error":{"message":"full","type":"rate_limit_error","param":null,"code":"queue_full"}})");
}

TEST(ServerPlan, EveryFieldReachesTheEngineRequest) {
  auto tok = Tokenizer::load(find_tokenizer_dir(""));
  Encoder enc(*tok);
  const PlanInputs in{*tok, enc, nullptr, 100, 1000};
  ApiRequest r = parse_api_request(R"({"prompt": ["a b", [5, 6]], "n": 2, "seed": 10, "temperature": 0.5,
      "top_k": 3, "top_p": 0.8, "min_p": 0.1, "presence_penalty": 0.2, "frequency_penalty": 0.3,
      "repetition_penalty": 1.4, "stop_token_ids": [7], "ignore_eos": true, "logprobs": 2, "max_tokens": 9,
      "stop": ["x"]})",
                                   Endpoint::kCompletion);
  std::vector<ChoiceSpec> specs = plan_choices(r, in);
  ASSERT_EQ(specs.size(), 4u);
  std::vector<int32_t> text_ids = {tok->bos_id()};
  for (int32_t id : tok->encode("a b")) text_ids.push_back(id);
  for (size_t i = 0; i < 4; ++i) {
    const EngineRequest& e = specs[i].request;
    EXPECT_EQ(specs[i].prompt, int(i / 2));
    EXPECT_EQ(e.prompt, i < 2 ? text_ids : (std::vector<int32_t>{5, 6}));
    EXPECT_EQ(e.sampling.seed, 10 + i % 2);  // choice i of each prompt: seed + i
    EXPECT_FLOAT_EQ(e.sampling.temperature, 0.5f);
    EXPECT_EQ(e.sampling.top_k, 3);
    EXPECT_FLOAT_EQ(e.sampling.top_p, 0.8f);
    EXPECT_FLOAT_EQ(e.sampling.min_p, 0.1f);
    EXPECT_FLOAT_EQ(e.sampling.presence_penalty, 0.2f);
    EXPECT_FLOAT_EQ(e.sampling.frequency_penalty, 0.3f);
    EXPECT_FLOAT_EQ(e.sampling.repetition_penalty, 1.4f);
    EXPECT_EQ(e.max_tokens, 9);
    EXPECT_EQ(e.stop_ids, std::vector<int32_t>{7});
    EXPECT_TRUE(e.ignore_eos);
    EXPECT_EQ(e.top_logprobs, 2);
    EXPECT_EQ(specs[i].text.stop, std::vector<std::string>{"x"});
    EXPECT_FALSE(specs[i].text.split_reasoning);
  }
  // No max_tokens: the rest of the context. No seed: the choices still differ.
  r = parse_api_request(R"({"prompt": [[5, 6, 7]], "n": 2})", Endpoint::kCompletion);
  specs = plan_choices(r, in);
  EXPECT_EQ(specs[0].request.max_tokens, 97);
  EXPECT_EQ(specs[1].request.sampling.seed, specs[0].request.sampling.seed + 1);
  EXPECT_EQ(specs[0].request.top_logprobs, -1);
  // Refusals name the numbers.
  auto refused = [&](const std::string& body, const std::string& needle) {
    try {
      plan_choices(parse_api_request(body, Endpoint::kCompletion), in);
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "accepted: " << body;
  };
  refused(R"({"prompt": [1, 1000]})", "prompt token 1 is id 1000, outside the vocabulary [0, 1000)");
  refused(R"({"prompt": [1, 2], "max_tokens": 99})", "context is 100 tokens, but the prompt has 2 tokens and max_tokens asks for 99 more (101 in all)");
}

TEST(ServerPlan, ChatTemplateKwargsOpenReasoning) {
  auto tok = Tokenizer::load(find_tokenizer_dir(""));
  Encoder enc(*tok);
  const ChatTemplate tmpl(
      "{{ bos_token }}{% for m in messages %}<｜User｜>{{ m['content'] }}{% endfor %}<｜Assistant｜>"
      "{% if thinking is defined and thinking %}<think>\n{% else %}</think>{% endif %}",
      nlohmann::ordered_json{{"bos_token", "<｜begin▁of▁sentence｜>"}});
  const PlanInputs in{*tok, enc, &tmpl, 1000, tok->vocab_size()};
  const std::string msgs = R"("messages": [{"role": "user", "content": "q"}])";
  std::vector<ChoiceSpec> think =
      plan_choices(parse_api_request("{" + msgs + R"(, "chat_template_kwargs": {"thinking": true}})", Endpoint::kChat), in);
  std::vector<ChoiceSpec> plain = plan_choices(parse_api_request("{" + msgs + "}", Endpoint::kChat), in);
  EXPECT_TRUE(think[0].text.split_reasoning);
  EXPECT_TRUE(think[0].text.prompt_opens_reasoning);
  EXPECT_FALSE(plain[0].text.prompt_opens_reasoning);
  EXPECT_EQ(think[0].request.prompt, tok->encode("<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜><think>\n"));
  EXPECT_EQ(plain[0].request.prompt, tok->encode("<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜></think>"));
  try {
    plan_choices(parse_api_request("{" + msgs + R"(, "chat_template_kwargs": {"messages": 1}})", Endpoint::kChat), in);
    ADD_FAILURE() << "accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param, "messages");
    EXPECT_NE(std::string(e.what()).find("may not set"), std::string::npos) << e.what();
  }
}

TEST(ServerText, StopStringsAreHeldBackAndCut) {
  StopMatcher m({"STOP", "xyz"});
  EXPECT_EQ(m.push("hello S"), "hello ");  // "S" may begin "STOP"
  EXPECT_EQ(m.push("T"), "");
  EXPECT_EQ(m.push("ART x"), "START ");    // not a stop after all; "x" may begin "xyz"
  EXPECT_EQ(m.push("y"), "");
  EXPECT_EQ(m.push("zzz"), "");            // "xyz" matched: nothing from it on
  EXPECT_TRUE(m.matched());
  EXPECT_EQ(m.push("more"), "");
  EXPECT_EQ(m.flush(), "");

  StopMatcher first({"bc", "abcd"});        // the earliest match wins
  EXPECT_EQ(first.push("xxabcd"), "xx");
  StopMatcher tail({"STOP"});
  EXPECT_EQ(tail.push("end ST"), "end ");
  EXPECT_EQ(tail.flush(), "ST");            // the choice ended: the held text is real text
  StopMatcher utf({"é!"});
  EXPECT_EQ(utf.push("café"), "caf");       // held at a character boundary
  EXPECT_EQ(utf.push("?"), "é?");
}

TEST(ServerText, ReasoningSplitsAtThinkTags) {
  {  // the prompt opened the block (R1, V3.1 thinking)
    ReasoningSplitter s(true);
    TextDelta d = s.push("let me think</th");
    EXPECT_EQ(d.reasoning, "let me think");
    EXPECT_EQ(d.content, "");
    d = s.push("ink>\n\nThe answer");
    EXPECT_EQ(d.reasoning, "");
    EXPECT_EQ(d.content, "The answer");
    EXPECT_TRUE(s.saw_reasoning());
  }
  {  // the output opens it, after whitespace, split over pieces
    ReasoningSplitter s(false);
    EXPECT_TRUE(s.push(" \n<th").empty());
    TextDelta d = s.push("ink>hmm</think>ok");
    EXPECT_EQ(d.reasoning, "hmm");
    EXPECT_EQ(d.content, "ok");
  }
  {  // no tags: all content, "<think>" later in the text is text
    ReasoningSplitter s(false);
    TextDelta d = s.push("Hi <think>x</think>");
    EXPECT_EQ(d.content, "Hi <think>x</think>");
    EXPECT_FALSE(s.saw_reasoning());
  }
  {  // cut while thinking: the rest is reasoning
    ReasoningSplitter s(true);
    TextDelta d = s.push("abc</thi");
    d.append(s.flush());
    EXPECT_EQ(d.reasoning, "abc</thi");
  }
  EXPECT_TRUE(prompt_opens_reasoning("<｜User｜>q<｜Assistant｜><think>\n"));
  EXPECT_FALSE(prompt_opens_reasoning("<｜User｜>q<｜Assistant｜></think>"));
  EXPECT_FALSE(prompt_opens_reasoning("<think>x"));
}

TEST(ServerText, ChoiceTextNeverSplitsACharacter) {
  auto tok = Tokenizer::load(find_tokenizer_dir(""));
  const std::string text = "naïve 😀 emoji, 中文字符 and ünïcödé ✓";
  const std::vector<int32_t> ids = tok->encode(text);
  // Some ids of this text stand for part of a character: their bytes alone are not valid UTF-8.
  int partial = 0;
  for (int32_t id : ids) partial += utf8::first_invalid(tok->decode_bytes({id})) != tok->decode_bytes({id}).size();
  ASSERT_GT(partial, 0);
  ChoiceTextOptions opt;
  ChoiceText ct(*tok, opt);
  std::string out;
  for (int32_t id : ids) {
    TextDelta d = ct.push(id);
    EXPECT_EQ(utf8::first_invalid(d.content), d.content.size()) << "invalid UTF-8 after id " << id;
    out += d.content;
  }
  out += ct.finish().content;
  EXPECT_EQ(out, text);

  opt.stop = {"中文"};
  ChoiceText stopped(*tok, opt);
  out.clear();
  for (int32_t id : ids) out += stopped.push(id).content;
  out += stopped.finish().content;
  EXPECT_TRUE(stopped.stopped());
  EXPECT_EQ(out, "naïve 😀 emoji, ");
}

TEST(ServerMetrics, PrometheusText) {
  ServerMetrics m;
  m.ttft.observe(0.003);
  m.ttft.observe(100);
  m.count_error(ErrorKind::kQueueFull);
  m.count_finish(Finish::kStop);
  EngineStats s;
  s.running = 1, s.waiting = 2, s.kv_blocks_used = 3, s.kv_blocks_total = 10;
  s.prefix_hit_tokens = 1, s.prefix_query_tokens = 4;
  const std::string t = m.render(s, "m\"x");
  const std::string l = "{model_name=\"m\\\"x\"";
  EXPECT_NE(t.find("# TYPE dsv3:time_to_first_token_seconds histogram"), std::string::npos);
  EXPECT_NE(t.find("dsv3:time_to_first_token_seconds_bucket" + l + ",le=\"0.0025\"} 0\n"), std::string::npos);
  EXPECT_NE(t.find("dsv3:time_to_first_token_seconds_bucket" + l + ",le=\"0.005\"} 1\n"), std::string::npos);
  EXPECT_NE(t.find("dsv3:time_to_first_token_seconds_bucket" + l + ",le=\"+Inf\"} 2\n"), std::string::npos);
  EXPECT_NE(t.find("dsv3:time_to_first_token_seconds_count" + l + "} 2\n"), std::string::npos);
  EXPECT_NE(t.find("dsv3:num_requests_waiting" + l + "} 2\n"), std::string::npos);
  EXPECT_NE(t.find("dsv3:kv_blocks_used" + l + "} 3\n"), std::string::npos);
  EXPECT_NE(t.find("dsv3:prefix_cache_hit_rate" + l + "} 0.25\n"), std::string::npos);
  EXPECT_NE(t.find("dsv3:request_errors_total" + l + ",kind=\"queue_full\"} 1\n"), std::string::npos);
  EXPECT_NE(t.find("dsv3:request_errors_total" + l + ",kind=\"client_disconnect\"} 0\n"), std::string::npos);
  EXPECT_NE(t.find("dsv3:request_success_total" + l + ",finished_reason=\"stop\"} 1\n"), std::string::npos);
  EXPECT_NE(t.find("\nprocess_resident_memory_bytes "), std::string::npos);
}

}  // namespace
