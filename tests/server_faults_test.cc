// `dsv3 serve` against bad input and faults, over sockets: each refusal an OpenAI error object
// with the right status, the server unharmed (a normal request after every fault gives the
// answer it gave before). Malformed and ill-typed JSON, invalid UTF-8, an unknown model or
// route, prompt + max_tokens past the context, a body over the limit, API keys, a full queue
// (429 + Retry-After), clients that disconnect mid-stream and mid-wait (their requests
// cancelled), and SIGTERM (new requests refused, those in flight finished, exit 0).
#include <gtest/gtest.h>

#include "server_util.h"

using namespace server_test;

namespace {

const json kChat = {{"messages", {{{"role", "user"}, {"content", "Say something."}}}},
                    {"max_tokens", 8},
                    {"temperature", 0}};

std::string answer(const std::string& url, const std::string& key = "") {
  Reply r = post(url, "/v1/chat/completions", kChat, key);
  EXPECT_EQ(r.status, 200) << r.raw;
  return r.body["choices"][0]["message"]["content"].get<std::string>();
}

// An OpenAI error object with this status; returns it for more checks.
json expect_error(const Reply& r, int status) {
  EXPECT_EQ(r.status, status) << r.raw;
  if (!r.body.is_object() || !r.body.contains("error")) {
    ADD_FAILURE() << "not an error object: " << r.raw;
    return json::object();
  }
  json e = r.body["error"];
  for (const char* k : {"message", "type", "param", "code"}) EXPECT_TRUE(e.contains(k)) << k << " in " << r.raw;
  EXPECT_TRUE(e["message"].is_string());
  return e;
}

// Waits until the engine is idle: nothing running or waiting, no KV blocks in use.
std::string wait_idle(const std::string& url, double seconds = 30) {
  std::string m;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    m = get(url, "/metrics").raw;
    if (metric(m, "dsv3:num_requests_running") == 0 && metric(m, "dsv3:num_requests_waiting") == 0 &&
        metric(m, "dsv3:kv_blocks_used") == 0)
      return m;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ADD_FAILURE() << "the engine did not become idle:\n" << m;
  return m;
}

double errors(const std::string& metrics, const std::string& kind) {
  return metric(metrics, "dsv3:request_errors_total", "model_name=\"tiny\",kind=\"" + kind + "\"");
}

TEST(ServerFaults, BadRequestsAreRefusedAndHarmNothing) {
  ServerProcess server({"--served-model-name", "tiny", "--max-model-len", "256"});
  const std::string url = server.url();
  const std::string before = answer(url);
  const std::string path = "/v1/chat/completions";
  auto raw_post = [&](const std::string& body) {
    return raw_http(server.port(), "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                   "Connection: close\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
  };
  auto body_of = [](const std::string& http) { return json::parse(http.substr(http.find("\r\n\r\n") + 4), nullptr, false); };

  std::string r = raw_post("{\"messages\": [");
  EXPECT_EQ(r.rfind("HTTP/1.1 400", 0), 0u) << r;
  EXPECT_NE(body_of(r)["error"]["message"].get<std::string>().find("not valid JSON"), std::string::npos);
  r = raw_post("{\"messages\": [{\"role\": \"user\", \"content\": \"\xc3\x28 bad\"}]}");  // invalid UTF-8
  EXPECT_EQ(r.rfind("HTTP/1.1 400", 0), 0u) << r;
  EXPECT_NE(body_of(r)["error"]["message"].get<std::string>().find("UTF-8"), std::string::npos);
  r = raw_post("{\"messages\": [{\"role\": \"user\", \"content\": \"\\udc00\"}]}");  // a lone surrogate
  EXPECT_EQ(r.rfind("HTTP/1.1 400", 0), 0u) << r;
  r = raw_http(server.port(), "GARBAGE\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 400", 0), 0u) << r;
  EXPECT_TRUE(body_of(r).contains("error")) << r;

  json e = expect_error(post(url, path, {{"messages", "hi"}}), 400);
  EXPECT_EQ(e["param"], "messages");
  e = expect_error(post(url, path, {{"messages", kChat["messages"]}, {"temperature", "warm"}}), 400);
  EXPECT_EQ(e["param"], "temperature");
  EXPECT_EQ(e["type"], "invalid_request_error");
  e = expect_error(post(url, path, {{"messages", kChat["messages"]}, {"model", "gpt-4"}}), 404);
  EXPECT_EQ(e["code"], "model_not_found");
  e = expect_error(post(url, "/v1/completions", {{"prompt", {0, 999999}}}), 400);
  EXPECT_NE(e["message"].get<std::string>().find("999999"), std::string::npos);
  // Past the context of 256: the numbers named.
  json longer = kChat;
  longer["max_tokens"] = 255;
  e = expect_error(post(url, path, longer), 400);
  EXPECT_EQ(e["code"], "context_length_exceeded");
  EXPECT_EQ(e["param"], "max_tokens");
  EXPECT_NE(e["message"].get<std::string>().find("context is 256 tokens"), std::string::npos) << e;
  EXPECT_NE(e["message"].get<std::string>().find("max_tokens asks for 255"), std::string::npos) << e;
  std::string words;
  for (int i = 0; i < 300; ++i) words += "word ";
  e = expect_error(post(url, "/v1/completions", {{"prompt", words}}), 400);
  EXPECT_EQ(e["param"], "prompt");
  EXPECT_NE(e["message"].get<std::string>().find("the prompt has 30"), std::string::npos) << e;
  // Over the body limit (16 MiB): 413.
  e = expect_error(post(url, "/v1/completions", {{"prompt", std::string(17 << 20, 'a')}}), 413);
  EXPECT_NE(e["message"].get<std::string>().find("limit"), std::string::npos);
  e = expect_error(get(url, "/v1/nothing"), 404);
  e = expect_error(post(url, "/v1/models", json::object()), 404);
  EXPECT_EQ(post(url, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 1}}).status, 200);

  EXPECT_EQ(answer(url), before);
  const std::string m = wait_idle(url);
  EXPECT_GE(errors(m, "invalid_request"), 6);
  EXPECT_EQ(errors(m, "context_length"), 2);
  EXPECT_EQ(errors(m, "payload_too_large"), 1);
  EXPECT_GE(errors(m, "not_found"), 3);
}

TEST(ServerFaults, ApiKey) {
  ServerProcess server({"--api-key", "s3cret"});
  const std::string url = server.url();
  json e = expect_error(post(url, "/v1/chat/completions", kChat), 401);
  EXPECT_EQ(e["type"], "authentication_error");
  EXPECT_EQ(e["code"], "invalid_api_key");
  expect_error(post(url, "/v1/chat/completions", kChat, "wrong"), 401);
  expect_error(post(url, "/v1/chat/completions", kChat, "s3cret-and-more"), 401);
  expect_error(get(url, "/v1/models"), 401);
  EXPECT_EQ(get(url, "/v1/models", "s3cret").status, 200);
  EXPECT_FALSE(answer(url, "s3cret").empty());
  EXPECT_EQ(get(url, "/health").status, 200);  // health and metrics stay open to probes
  EXPECT_EQ(errors(get(url, "/metrics").raw, "authentication"), 4);
}

TEST(ServerFaults, FullQueueAnswers429) {
  ServerProcess server({"--served-model-name", "tiny", "--max-seqs", "1", "--max-queue", "1"});
  const std::string url = server.url();
  // Two long requests fill the server (one running, one waiting); the third is refused.
  const std::string long_one =
      http_post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 3000}, {"ignore_eos", true}, {"stream", true}});
  const int a = send_raw(server.port(), long_one), b = send_raw(server.port(), long_one);
  for (int i = 0; i < 200; ++i) {
    if (metric(get(url, "/metrics").raw, "dsv3:num_requests_waiting") == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  json e = expect_error(post(url, "/v1/completions", {{"prompt", "y"}, {"max_tokens", 2}}), 429);
  EXPECT_EQ(e["type"], "rate_limit_error");
  EXPECT_EQ(e["code"], "queue_full");
  const std::string r = raw_http(server.port(), "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                                "Content-Length: 14\r\n\r\n{\"prompt\":\"z\"}");
  EXPECT_EQ(r.rfind("HTTP/1.1 429", 0), 0u) << r;
  EXPECT_NE(r.find("Retry-After: 1\r\n"), std::string::npos) << r;
  // More choices than the server ever holds: 400, not a 429 to retry forever.
  e = expect_error(post(url, "/v1/completions", {{"prompt", "y"}, {"n", 3}}), 400);
  EXPECT_EQ(e["param"], "n");
  ::close(a);  // both leave: their requests end
  ::close(b);
  wait_idle(url);
  EXPECT_EQ(post(url, "/v1/completions", {{"prompt", "y"}, {"max_tokens", 2}}).status, 200);
  const std::string m = get(url, "/metrics").raw;
  EXPECT_EQ(errors(m, "queue_full"), 2);
  EXPECT_EQ(errors(m, "client_disconnect"), 2);
}

TEST(ServerFaults, DisconnectedClientsAreCancelled) {
  ServerProcess server({"--served-model-name", "tiny", "--max-seqs", "1"});  // one at a time: a second one queues
  const std::string url = server.url();
  const std::string before = answer(url);
  // Streamed: the client leaves after 3 events of a request for 5000 tokens.
  Stream s = stream(url, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 5000}, {"ignore_eos", true}}, 3);
  EXPECT_EQ(s.events.size(), 3u);
  std::string m = wait_idle(url, 20);
  EXPECT_EQ(errors(m, "client_disconnect"), 1);
  EXPECT_LT(metric(m, "dsv3:generation_tokens_total"), 1000);
  // Streamed, still waiting in the queue behind a long request when it leaves.
  const int first = send_raw(server.port(), http_post("/v1/completions", {{"prompt", "a"}, {"max_tokens", 3000},
                                                                         {"ignore_eos", true}, {"stream", true}}));
  const int queued = send_raw(server.port(), http_post("/v1/completions", {{"prompt", "b"}, {"max_tokens", 3000},
                                                                          {"ignore_eos", true}, {"stream", true}}));
  for (int i = 0; i < 200 && metric(get(url, "/metrics").raw, "dsv3:num_requests_waiting") != 1; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ::close(queued);
  for (int i = 0; i < 200 && metric(get(url, "/metrics").raw, "dsv3:num_requests_waiting") != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(metric(get(url, "/metrics").raw, "dsv3:num_requests_running"), 1);  // the first still runs
  ::close(first);
  // Not streamed: the client leaves while its answer is being generated.
  raw_http(server.port(), http_post("/v1/completions", {{"prompt", "c"}, {"max_tokens", 5000}, {"ignore_eos", true}}),
           0.5);
  m = wait_idle(url, 20);
  EXPECT_EQ(errors(m, "client_disconnect"), 4);
  EXPECT_LT(metric(m, "dsv3:generation_tokens_total"), 2500);
  EXPECT_EQ(answer(url), before);
}

// Streams a completion of `max_tokens` (EOS ignored) into `out` on its own thread, returned once
// the server counts the request running (or after ~2 s).
std::thread start_running(const std::string& url, int max_tokens, Stream& out) {
  std::thread t([&out, url, max_tokens] {
    out = stream(url, "/v1/completions", {{"prompt", "x"}, {"max_tokens", max_tokens}, {"ignore_eos", true}});
  });
  for (int i = 0; i < 200 && metric(get(url, "/metrics").raw, "dsv3:num_requests_running") != 1; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return t;
}

TEST(ServerFaults, SigtermDrainsAndExitsZero) {
  ServerProcess server({"--served-model-name", "tiny", "--drain-timeout", "30"});
  const std::string url = server.url();
  // A request in flight when SIGTERM comes finishes, whole.
  Stream in_flight;
  std::thread t = start_running(url, 150, in_flight);
  ::kill(server.pid(), SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // Meanwhile new work is refused (503) or, once the listener has stopped, not accepted at all.
  Reply late = post(url, "/v1/completions", {{"prompt", "y"}, {"max_tokens", 2}});
  if (late.status != 0) {
    json e = expect_error(late, 503);
    EXPECT_EQ(e["code"], "shutting_down");
  }
  t.join();
  EXPECT_EQ(in_flight.status, 200);
  EXPECT_TRUE(in_flight.done) << in_flight.raw.substr(in_flight.raw.size() > 500 ? in_flight.raw.size() - 500 : 0);
  int tokens = 0;
  for (const json& ev : in_flight.events)
    for (const json& c : ev["choices"])
      if (c["finish_reason"] == "length") ++tokens;
  EXPECT_EQ(tokens, 1);
  EXPECT_EQ(server.wait(30), 0) << server.log();
}

TEST(ServerFaults, SigtermCancelsWhatOutlastsTheDrainTimeout) {
  ServerProcess server({"--drain-timeout", "0.5"});
  const std::string url = server.url();
  Stream s;
  std::thread t = start_running(url, 10000, s);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(server.stop(SIGTERM, 20), 0) << server.log();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10);
  t.join();
  ASSERT_FALSE(s.events.empty());
  const json& last = s.events.back();
  ASSERT_TRUE(last.contains("error")) << last;
  EXPECT_EQ(last["error"]["type"], "server_error");
  EXPECT_TRUE(s.done);
}

}  // namespace
