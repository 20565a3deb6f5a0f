// `dsv3 serve` as its own process on the tiny model, driven over sockets: every endpoint, the
// fields of both completion APIs streamed and not (the shapes OpenAI sends), stop strings,
// n and seeds, logprobs in both formats, usage, token-id prompts, stop_token_ids, the
// reasoning split with a V3.1-style thinking template, and the step budget (--max-step-tokens).
#include <gtest/gtest.h>

#include <set>

#include "cli_util.h"
#include "server_util.h"
#include "text/utf8.h"

using namespace server_test;

namespace {

class ServerHttp : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = new ServerProcess({"--served-model-name", "tiny"}); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static std::string url() { return server_->url(); }
  static ServerProcess* server_;
};
ServerProcess* ServerHttp::server_ = nullptr;

const json kHello = json::array({{{"role", "user"}, {"content", "Hello! Who are you?"}}});

// The text of a streamed chat or completion, choice by choice, checking each chunk's shape.
std::vector<std::string> stream_text(const Stream& s, bool chat, std::vector<std::string>* finish = nullptr) {
  std::vector<std::string> text;
  for (const json& ev : s.events) {
    EXPECT_EQ(ev["object"], chat ? "chat.completion.chunk" : "text_completion") << ev;
    EXPECT_TRUE(ev["id"].get<std::string>().rfind(chat ? "chatcmpl-" : "cmpl-", 0) == 0) << ev;
    EXPECT_EQ(ev["model"], "tiny");
    EXPECT_TRUE(ev["created"].is_number_integer());
    for (const json& c : ev["choices"]) {
      const size_t i = c["index"].get<size_t>();
      if (text.size() <= i) text.resize(i + 1);
      if (finish && finish->size() <= i) finish->resize(i + 1);
      const json piece = chat ? c["delta"].value("content", json()) : c["text"];
      if (piece.is_string()) text[i] += piece.get<std::string>();
      if (!c["finish_reason"].is_null() && finish) (*finish)[i] = c["finish_reason"];
    }
  }
  return text;
}

TEST_F(ServerHttp, HealthModelsMetricsAndThePage) {
  Reply h = get(url(), "/health");
  EXPECT_EQ(h.status, 200);
  EXPECT_EQ(h.body["status"], "ok");
  Reply m = get(url(), "/v1/models");
  ASSERT_EQ(m.status, 200) << m.raw;
  EXPECT_EQ(m.body["object"], "list");
  EXPECT_EQ(m.body["data"][0]["id"], "tiny");
  EXPECT_EQ(m.body["data"][0]["object"], "model");
  EXPECT_EQ(m.body["data"][0]["max_model_len"], 16384);
  EXPECT_EQ(get(url(), "/v1/models/tiny").body["id"], "tiny");
  Reply none = get(url(), "/v1/models/other");
  EXPECT_EQ(none.status, 404);
  EXPECT_EQ(none.body["error"]["code"], "model_not_found");
  Reply metrics = get(url(), "/metrics");
  EXPECT_EQ(metrics.status, 200);
  for (const char* name : {"dsv3:time_to_first_token_seconds_bucket", "dsv3:inter_token_latency_seconds_sum",
                           "dsv3:e2e_request_latency_seconds_count", "dsv3:num_requests_running",
                           "dsv3:num_requests_waiting", "dsv3:kv_blocks_used", "dsv3:kv_blocks_total",
                           "dsv3:prefix_cache_hit_rate", "dsv3:prompt_tokens_total", "dsv3:generation_tokens_total",
                           "dsv3:request_errors_total", "process_resident_memory_bytes"})
    EXPECT_GE(metric(metrics.raw, name), 0) << name;
  // The paged cache sized for --max-seqs (8) sequences of the tiny model's 16384 positions, 64 a block.
  EXPECT_EQ(metric(metrics.raw, "dsv3:kv_blocks_total"), 8 * 16384 / 64);
  Reply page = get(url(), "/");
  EXPECT_EQ(page.status, 200);
  EXPECT_NE(page.raw.find("<title>dsv3 chat</title>"), std::string::npos);
  EXPECT_EQ(page.raw.find("http://"), std::string::npos);  // nothing fetched from elsewhere
  EXPECT_EQ(page.raw.find("https://"), std::string::npos);
}

TEST_F(ServerHttp, ChatStreamedAndNotGiveTheSameAnswer) {
  const json req = {{"model", "tiny"}, {"messages", kHello}, {"max_tokens", 24}, {"temperature", 0}};
  Reply r = post(url(), "/v1/chat/completions", req);
  ASSERT_EQ(r.status, 200) << r.raw;
  const json& b = r.body;
  EXPECT_EQ(b["object"], "chat.completion");
  EXPECT_TRUE(b["id"].get<std::string>().rfind("chatcmpl-", 0) == 0);
  EXPECT_EQ(b["model"], "tiny");
  ASSERT_EQ(b["choices"].size(), 1u);
  const json& c = b["choices"][0];
  EXPECT_EQ(c["index"], 0);
  EXPECT_EQ(c["message"]["role"], "assistant");
  EXPECT_FALSE(c["message"].contains("reasoning_content"));
  EXPECT_TRUE(c["logprobs"].is_null());
  EXPECT_EQ(c["finish_reason"], "length");
  const std::string answer = c["message"]["content"];
  EXPECT_EQ(dsv3::utf8::first_invalid(answer), answer.size());
  EXPECT_EQ(b["usage"]["completion_tokens"], 24);
  EXPECT_GT(b["usage"]["prompt_tokens"].get<int>(), 5);
  EXPECT_EQ(b["usage"]["total_tokens"], b["usage"]["prompt_tokens"].get<int>() + 24);

  json sreq = req;
  sreq["stream_options"] = {{"include_usage", true}};
  Stream s = stream(url(), "/v1/chat/completions", sreq);
  ASSERT_EQ(s.status, 200) << s.raw;
  EXPECT_TRUE(s.done);
  ASSERT_GE(s.events.size(), 4u);
  // OpenAI's order: the role first, the text, a finish chunk with an empty delta, the usage.
  EXPECT_EQ(s.events[0]["choices"][0]["delta"], json({{"role", "assistant"}, {"content", ""}}));
  const json& fin = s.events[s.events.size() - 2];
  EXPECT_EQ(fin["choices"][0]["delta"], json::object());
  EXPECT_EQ(fin["choices"][0]["finish_reason"], "length");
  const json& last = s.events.back();
  EXPECT_EQ(last["choices"], json::array());
  EXPECT_EQ(last["usage"], b["usage"]);
  for (size_t i = 0; i + 1 < s.events.size(); ++i) {
    EXPECT_TRUE(s.events[i].contains("usage") && s.events[i]["usage"].is_null());
    EXPECT_EQ(s.events[i]["id"], s.events[0]["id"]);
  }
  EXPECT_EQ(stream_text(s, true), std::vector<std::string>{answer});

  // Without include_usage no chunk carries usage.
  Stream plain = stream(url(), "/v1/chat/completions", req);
  for (const json& ev : plain.events) EXPECT_FALSE(ev.contains("usage")) << ev;
  EXPECT_EQ(stream_text(plain, true), std::vector<std::string>{answer});
  // max_completion_tokens is max_tokens' newer name.
  json newer = req;
  newer.erase("max_tokens");
  newer["max_completion_tokens"] = 24;
  EXPECT_EQ(post(url(), "/v1/chat/completions", newer).body["choices"][0]["message"]["content"], answer);
}

TEST_F(ServerHttp, CompletionsTakeEveryPromptForm) {
  auto complete = [&](const json& prompt, int n = 1) {
    Reply r = post(url(), "/v1/completions",
                   {{"prompt", prompt}, {"max_tokens", 6}, {"temperature", 0}, {"n", n}, {"model", "tiny"}});
    EXPECT_EQ(r.status, 200) << r.raw;
    EXPECT_EQ(r.body["object"], "text_completion");
    std::vector<std::string> out;
    for (const json& c : r.body["choices"]) {
      EXPECT_EQ(c["index"], out.size());
      EXPECT_EQ(c["finish_reason"], "length");
      out.push_back(c["text"]);
    }
    return out;
  };
  const std::string a = complete("The capital of France is").at(0);
  const std::string b = complete("1, 2, 3,").at(0);
  EXPECT_EQ(complete(json::array({"The capital of France is", "1, 2, 3,"})), (std::vector<std::string>{a, b}));
  // Ids: BOS + the text's ids is what a string prompt becomes.
  auto tok = dsv3::Tokenizer::load(dsv3::find_tokenizer_dir(""));
  std::vector<int32_t> ids = {tok->bos_id()};
  for (int32_t id : tok->encode("1, 2, 3,")) ids.push_back(id);
  EXPECT_EQ(complete(ids).at(0), b);
  EXPECT_EQ(complete(json::array({ids, ids}), 2), (std::vector<std::string>{b, b, b, b}));
  Reply usage = post(url(), "/v1/completions", {{"prompt", json::array({ids, ids})}, {"max_tokens", 3}, {"n", 2}});
  EXPECT_EQ(usage.body["usage"]["prompt_tokens"], 2 * ids.size());
  EXPECT_EQ(usage.body["usage"]["completion_tokens"], 12);

  std::vector<std::string> finish;
  Stream s = stream(url(), "/v1/completions", {{"prompt", json::array({"The capital of France is", "1, 2, 3,"})},
                                               {"max_tokens", 6}, {"temperature", 0}});
  EXPECT_TRUE(s.done);
  EXPECT_EQ(stream_text(s, false, &finish), (std::vector<std::string>{a, b}));
  EXPECT_EQ(finish, (std::vector<std::string>{"length", "length"}));
}

TEST_F(ServerHttp, SeedsAndSamplingParameters) {
  const json base = {{"prompt", "Once upon a time"}, {"max_tokens", 12}, {"temperature", 1.0}, {"seed", 42}};
  auto texts = [&](json req) {
    Reply r = post(url(), "/v1/completions", req);
    EXPECT_EQ(r.status, 200) << r.raw;
    std::vector<std::string> out;
    for (const json& c : r.body["choices"]) out.push_back(c["text"]);
    return out;
  };
  json n3 = base;
  n3["n"] = 3;
  const std::vector<std::string> three = texts(n3);
  ASSERT_EQ(three.size(), 3u);
  EXPECT_EQ(texts(n3), three);  // reproducible
  EXPECT_NE(three[0], three[1]);
  json next = base;
  next["seed"] = 43;
  EXPECT_EQ(texts(next).at(0), three[1]);  // choice i samples with seed + i
  json greedy = base;
  greedy["temperature"] = 0;
  const std::string g = texts(greedy).at(0);
  for (const auto& [k, v] : std::vector<std::pair<std::string, json>>{{"top_k", 1}, {"top_p", 1e-6}, {"min_p", 1.0}}) {
    json r = base;
    r[k] = v;
    EXPECT_EQ(texts(r).at(0), g) << k << " keeps only the most likely token";
  }
  json pen = base;
  pen["presence_penalty"] = 1.5, pen["frequency_penalty"] = 1.0, pen["repetition_penalty"] = 1.2;
  EXPECT_EQ(texts(pen), texts(pen));
  // Chat streams n choices, each opening with its role.
  Stream s = stream(url(), "/v1/chat/completions", {{"messages", kHello}, {"max_tokens", 5}, {"n", 2}, {"seed", 1}});
  ASSERT_TRUE(s.done);
  std::vector<std::string> finish;
  EXPECT_EQ(stream_text(s, true, &finish).size(), 2u);
  EXPECT_EQ(finish, (std::vector<std::string>{"length", "length"}));
}

TEST_F(ServerHttp, StopStringsEndTheTextBeforeThem) {
  const json req = {{"prompt", "Tell me a story about"}, {"max_tokens", 24}, {"temperature", 0}};
  const std::string full = post(url(), "/v1/completions", req).body["choices"][0]["text"];
  ASSERT_GT(full.size(), 12u);
  // A stop string from the middle of the greedy text, starting at a character boundary.
  size_t at = full.size() / 2;
  while (at > 0 && (static_cast<unsigned char>(full[at]) & 0xC0) == 0x80) --at;
  size_t end = at + 1;
  while (end < full.size() && (static_cast<unsigned char>(full[end]) & 0xC0) == 0x80) ++end;
  const std::string stop = full.substr(at, std::min(full.size(), end + 2) - at);
  const std::string before = full.substr(0, full.find(stop));
  json r = req;
  r["stop"] = json::array({"never appears \x01", stop});
  Reply cut = post(url(), "/v1/completions", r);
  EXPECT_EQ(cut.body["choices"][0]["text"], before) << "stop " << json(stop);
  EXPECT_EQ(cut.body["choices"][0]["finish_reason"], "stop");
  EXPECT_LT(cut.body["usage"]["completion_tokens"].get<int>(), 24);
  std::vector<std::string> finish;
  Stream s = stream(url(), "/v1/completions", r);
  EXPECT_EQ(stream_text(s, false, &finish), std::vector<std::string>{before});
  EXPECT_EQ(finish, std::vector<std::string>{"stop"});
  // Chat too, with a single string.
  const json chat = {{"messages", kHello}, {"max_tokens", 24}, {"temperature", 0}};
  const std::string answer = post(url(), "/v1/chat/completions", chat).body["choices"][0]["message"]["content"];
  json cstop = chat;
  cstop["stop"] = answer.substr(0, dsv3::utf8::step(answer).len);  // the first character
  Reply c = post(url(), "/v1/chat/completions", cstop);
  EXPECT_EQ(c.body["choices"][0]["message"]["content"], "");
  EXPECT_EQ(c.body["choices"][0]["finish_reason"], "stop");
}

TEST_F(ServerHttp, StopTokenIdsEndAChoice) {
  Reply r = post(url(), "/v1/completions", {{"prompt", "abc"}, {"max_tokens", 6}, {"temperature", 0}, {"logprobs", 0}});
  ASSERT_EQ(r.status, 200) << r.raw;
  auto tok = dsv3::Tokenizer::load(dsv3::find_tokenizer_dir(""));
  // A generated token (after the first) whose text encodes back to one id not generated before it.
  const json& tokens = r.body["choices"][0]["logprobs"]["tokens"];
  std::set<int32_t> before;
  for (size_t k = 0; k < tokens.size(); ++k) {
    const std::vector<int32_t> ids = tok->encode(tokens[k].get<std::string>());
    if (k > 0 && ids.size() == 1 && !before.count(ids[0])) {
      Reply s = post(url(), "/v1/completions",
                     {{"prompt", "abc"}, {"max_tokens", 6}, {"temperature", 0}, {"stop_token_ids", {ids[0]}}});
      EXPECT_EQ(s.body["choices"][0]["finish_reason"], "stop");
      EXPECT_EQ(s.body["usage"]["completion_tokens"], k);
      return;
    }
    before.insert(ids.begin(), ids.end());
  }
  FAIL() << "no generated token round-trips through the tokenizer: " << tokens;
}

TEST_F(ServerHttp, LogprobsInBothFormats) {
  Reply c = post(url(), "/v1/chat/completions",
                 {{"messages", kHello}, {"max_tokens", 5}, {"temperature", 0}, {"logprobs", true}, {"top_logprobs", 3}});
  ASSERT_EQ(c.status, 200) << c.raw;
  const json& content = c.body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 5u);
  for (const json& e : content) {
    EXPECT_TRUE(e["token"].is_string());
    EXPECT_LE(e["logprob"].get<double>(), 0.0);
    EXPECT_TRUE(e["bytes"].is_array());
    ASSERT_EQ(e["top_logprobs"].size(), 3u);
    // Greedy: the sampled token is the most likely one.
    EXPECT_EQ(e["top_logprobs"][0]["token"], e["token"]);
    EXPECT_DOUBLE_EQ(e["top_logprobs"][0]["logprob"].get<double>(), e["logprob"].get<double>());
    EXPECT_GE(e["top_logprobs"][0]["logprob"].get<double>(), e["top_logprobs"][1]["logprob"].get<double>());
  }
  Stream s = stream(url(), "/v1/chat/completions",
                    {{"messages", kHello}, {"max_tokens", 5}, {"temperature", 0}, {"logprobs", true}});
  size_t streamed = 0;
  for (const json& ev : s.events)
    for (const json& ch : ev["choices"])
      if (!ch["logprobs"].is_null()) {
        streamed += ch["logprobs"]["content"].size();
        for (const json& e : ch["logprobs"]["content"]) EXPECT_TRUE(e["top_logprobs"].empty());
      }
  EXPECT_EQ(streamed, 5u);

  Reply l = post(url(), "/v1/completions", {{"prompt", "x"}, {"max_tokens", 4}, {"temperature", 0}, {"logprobs", 2}});
  const json& lp = l.body["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 4u);
  EXPECT_EQ(lp["token_logprobs"].size(), 4u);
  EXPECT_EQ(lp["text_offset"][0], 0);
  ASSERT_EQ(lp["top_logprobs"].size(), 4u);
  for (const json& top : lp["top_logprobs"]) EXPECT_LE(top.size(), 2u);
  EXPECT_TRUE(l.body["choices"][0]["logprobs"].is_object());
}

// A tokenizer folder whose chat template ends the prompt as DeepSeek-V3.1's does: "<think>" when
// chat_template_kwargs.thinking is true, "</think>" otherwise.
std::string thinking_tokenizer() {
  const std::string dir = ::testing::TempDir() + "/dsv3_thinking_tok_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(dsv3::find_tokenizer_dir("") + "/tokenizer.json", dir + "/tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  const json config = {
      {"bos_token", "<｜begin▁of▁sentence｜>"},
      {"eos_token", "<｜end▁of▁sentence｜>"},
      {"chat_template",
       "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}{% endif %}"
       "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% if thinking is defined and thinking %}<think>\n"
       "{% else %}</think>{% endif %}{% endif %}"}};
  std::ofstream(dir + "/tokenizer_config.json") << config.dump();
  return dir;
}

// --max-step-tokens N: a prompt goes through steps of at most N tokens (the metrics count them),
// and the greedy answer is the one the default budget gives; a budget out of range is refused
// before the model loads.
TEST(ServerSteps, StepBudgetChunksThePromptAndKeepsTheAnswer) {
  const json req = {{"model", "tiny"}, {"messages", kHello}, {"max_tokens", 8}, {"temperature", 0}};
  std::string want;
  int prompt = 0;
  {
    ServerProcess server({"--served-model-name", "tiny"});
    const Reply r = post(server.url(), "/v1/chat/completions", req);
    ASSERT_EQ(r.status, 200) << r.raw;
    want = r.body["choices"][0]["message"]["content"];
    prompt = r.body["usage"]["prompt_tokens"];
    // one step for the prompt (and the first token), then one per token
    EXPECT_EQ(metric(get(server.url(), "/metrics").raw, "dsv3:model_steps_total"), 8);
  }
  ASSERT_GT(prompt, 6);
  ServerProcess server({"--served-model-name", "tiny", "--max-step-tokens", "3"});
  const Reply r = post(server.url(), "/v1/chat/completions", req);
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["choices"][0]["message"]["content"], want);
  const std::string m = get(server.url(), "/metrics").raw;
  const double steps = metric(m, "dsv3:model_steps_total"), tokens = metric(m, "dsv3:model_step_tokens_total");
  EXPECT_EQ(steps, (prompt + 2) / 3 + 7);  // the prompt in chunks of 3, the last one drawing the first token
  EXPECT_EQ(tokens, prompt + 7);

  const dsv3::testing_util::CliRun bad =
      dsv3::testing_util::run_dsv3("serve --model '" + tiny_model() + "' --port 0 --max-step-tokens 0");
  EXPECT_EQ(bad.rc, 1);
  EXPECT_NE(bad.err.find("--max-step-tokens must be in [1, 65536], got 0"), std::string::npos) << bad.err;
}

TEST(ServerReasoning, ThinkingOutputIsReasoningContent) {
  const std::string tdir = thinking_tokenizer();
  ServerProcess server({"--tokenizer", tdir});
  const json req = {{"messages", kHello}, {"max_tokens", 10}, {"temperature", 0}};
  json think = req;
  think["chat_template_kwargs"] = {{"thinking", true}};
  // Thinking: the prompt opened <think>; the random model never closes it, so all is reasoning.
  Reply r = post(server.url(), "/v1/chat/completions", think);
  ASSERT_EQ(r.status, 200) << r.raw;
  const json& m = r.body["choices"][0]["message"];
  ASSERT_TRUE(m.contains("reasoning_content")) << m;
  EXPECT_FALSE(m["reasoning_content"].get<std::string>().empty());
  EXPECT_EQ(m["content"], "");
  Stream s = stream(server.url(), "/v1/chat/completions", think);
  std::string reasoning;
  for (const json& ev : s.events) {
    for (const json& c : ev["choices"]) {
      if (c["delta"].contains("reasoning_content")) reasoning += c["delta"]["reasoning_content"].get<std::string>();
      if (c["delta"].contains("content")) {
        EXPECT_EQ(c["delta"]["content"], "");
      }
    }
  }
  EXPECT_EQ(reasoning, m["reasoning_content"]);
  // Not thinking: plain content.
  json plain = req;
  plain["chat_template_kwargs"] = {{"thinking", false}};
  Reply p = post(server.url(), "/v1/chat/completions", plain);
  EXPECT_FALSE(p.body["choices"][0]["message"].contains("reasoning_content"));
  EXPECT_FALSE(p.body["choices"][0]["message"]["content"].get<std::string>().empty());
  std::filesystem::remove_all(tdir);
}

}  // namespace
