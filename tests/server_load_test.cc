// A bounded load on loopback: 64 concurrent clients x 8 requests each, streamed and not, some of
// them disconnecting at random. Every answer that is read to its end equals the same request's
// answer alone (greedy: no token lost, duplicated or mixed up between requests), nothing else
// fails, the engine ends idle with no KV blocks in use, and the server's memory stays steady.
#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <random>

#include "server_util.h"

using namespace server_test;

namespace {

constexpr int kClients = 64, kRequestsEach = 8, kPrompts = 16, kTokens = 4;

json request(int prompt) {
  return {{"prompt", "Request number " + std::to_string(prompt) + " says:"},
          {"max_tokens", kTokens},
          {"temperature", 0},
          {"logprobs", 0}};
}

// The answer's tokens (their text, from the logprobs) and its text.
struct Answer {
  std::vector<std::string> tokens;
  std::string text;
  bool operator==(const Answer& o) const { return tokens == o.tokens && text == o.text; }
};

Answer from_response(const json& body) {
  Answer a;
  const json& c = body["choices"][0];
  a.text = c["text"];
  for (const json& t : c["logprobs"]["tokens"]) a.tokens.push_back(t);
  return a;
}

Answer from_stream(const Stream& s) {
  Answer a;
  for (const json& ev : s.events)
    for (const json& c : ev["choices"]) {
      a.text += c["text"].get<std::string>();
      if (c["logprobs"].is_object())
        for (const json& t : c["logprobs"]["tokens"]) a.tokens.push_back(t);
    }
  return a;
}

int64_t rss_bytes(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  return -1;
}

struct Tally {
  std::atomic<int> ok{0}, wrong{0}, failed{0}, left{0};
  std::mutex mu;
  std::vector<std::string> problems;
  void problem(const std::string& p) {
    std::lock_guard<std::mutex> lk(mu);
    if (problems.size() < 10) problems.push_back(p);
  }
};

// One client: `n` requests, each streamed or not at random; one in eight leaves early.
void client(const ServerProcess& server, const std::vector<Answer>& solo, int id, int n, Tally& t) {
  std::mt19937 rng(uint32_t(1000 + id));
  for (int k = 0; k < n; ++k) {
    const int p = int(rng() % kPrompts);
    const bool streamed = rng() % 2, leave = rng() % 8 == 0;
    if (leave) {  // sends the request and closes the connection a moment later
      json body = request(p);
      body["max_tokens"] = 200;
      body["stream"] = streamed;
      ::close(send_raw(server.port(), http_post("/v1/completions", body)));
      t.left++;
      continue;
    }
    Answer got;
    int status = 0;
    std::string raw;
    if (streamed) {
      Stream s = stream(server.url(), "/v1/completions", request(p));
      status = s.status, raw = s.raw;
      if (!s.done) status = -1;
      got = from_stream(s);
    } else {
      Reply r = post(server.url(), "/v1/completions", request(p));
      status = r.status, raw = r.raw;
      if (status == 200) got = from_response(r.body);
    }
    if (status != 200) {
      t.failed++;
      t.problem("status " + std::to_string(status) + ": " + raw.substr(0, 300));
    } else if (!(got == solo[size_t(p)])) {
      t.wrong++;
      t.problem("prompt " + std::to_string(p) + (streamed ? " streamed" : "") + ": got '" + got.text + "', alone '" +
                solo[size_t(p)].text + "'");
    } else {
      t.ok++;
    }
  }
}

void load(const ServerProcess& server, const std::vector<Answer>& solo, int clients, int each, Tally& t) {
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) threads.emplace_back(client, std::cref(server), std::cref(solo), c, each, std::ref(t));
  for (auto& th : threads) th.join();
}

std::string idle_metrics(const std::string& url) {
  std::string m;
  for (int i = 0; i < 600; ++i) {
    m = get(url, "/metrics").raw;
    if (metric(m, "dsv3:num_requests_running") == 0 && metric(m, "dsv3:num_requests_waiting") == 0 &&
        metric(m, "dsv3:kv_blocks_used") == 0)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return m;
}

TEST(ServerLoad, ConcurrentClientsWithDisconnects) {
  ServerProcess server({"--served-model-name", "tiny", "--max-seqs", "8", "--max-queue", "120"});
  std::vector<Answer> solo;
  for (int p = 0; p < kPrompts; ++p) {
    Reply r = post(server.url(), "/v1/completions", request(p));
    ASSERT_EQ(r.status, 200) << r.raw;
    solo.push_back(from_response(r.body));
    ASSERT_EQ(solo.back().tokens.size(), size_t(kTokens));
  }
  Tally warm;
  load(server, solo, 16, 2, warm);  // every code path once before memory is measured
  idle_metrics(server.url());
  const int64_t rss0 = rss_bytes(server.pid());

  Tally t;
  const auto t0 = std::chrono::steady_clock::now();
  load(server, solo, kClients, kRequestsEach, t);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string m = idle_metrics(server.url());
  const int64_t rss1 = rss_bytes(server.pid());
  std::printf("load: %d ok, %d left early, %.1f s; RSS %.1f MB -> %.1f MB\n", t.ok.load(), t.left.load(), seconds,
              double(rss0) / 1e6, double(rss1) / 1e6);
  EXPECT_EQ(t.failed.load(), 0);
  EXPECT_EQ(t.wrong.load(), 0);
  for (const auto& p : t.problems) ADD_FAILURE() << p;
  EXPECT_EQ(t.ok + t.left, kClients * kRequestsEach);
  EXPECT_GT(t.left.load(), 0);
  EXPECT_EQ(metric(m, "dsv3:kv_blocks_used"), 0);
  EXPECT_EQ(metric(m, "dsv3:num_requests_running"), 0);
  EXPECT_EQ(metric(m, "dsv3:num_requests_waiting"), 0);
  for (const char* kind : {"invalid_request", "queue_full", "engine", "shutting_down"})
    EXPECT_EQ(metric(m, "dsv3:request_errors_total", std::string("model_name=\"tiny\",kind=\"") + kind + "\""), 0)
        << kind;
  EXPECT_LE(metric(m, "dsv3:request_errors_total", "model_name=\"tiny\",kind=\"client_disconnect\""),
            t.left + warm.left);

  // A second round: memory does not grow with the requests served.
  Tally again;
  load(server, solo, kClients, 2, again);
  EXPECT_EQ(again.failed + again.wrong, 0);
  for (const auto& p : again.problems) ADD_FAILURE() << p;
  idle_metrics(server.url());
  const int64_t rss2 = rss_bytes(server.pid());
  std::printf("second round: RSS %.1f MB\n", double(rss2) / 1e6);
#ifndef __SANITIZE_ADDRESS__  // AddressSanitizer holds freed memory in quarantine: RSS grows by design
  EXPECT_LT(rss2 - rss1, int64_t(8) << 20) << "RSS " << rss0 << " -> " << rss1 << " -> " << rss2;
  EXPECT_LT(rss1 - rss0, int64_t(32) << 20) << "RSS " << rss0 << " -> " << rss1;
#endif
}

}  // namespace
