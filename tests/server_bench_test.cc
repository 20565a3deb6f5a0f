// dsv3 bench-serve against dsv3 serve on the tiny model: every request completes with exactly
// --output-len tokens (ignore_eos), the report holds vLLM's metrics with sane values, and bad
// options or an unreachable server are clear errors.
#include <gtest/gtest.h>

#include <cstdio>

#include "server_util.h"

using namespace server_test;

namespace {

// Runs a command; its stdout, and its exit code in `rc`.
std::string run(const std::string& cmd, int& rc) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = ::pclose(p);
  rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}

TEST(ServerBench, ReportsVllmMetricsWithExactLengths) {
  ServerProcess server({"--served-model-name", "tiny"});
  int rc = 0;
  const std::string out = run(std::string(DSV3_BINARY) + " bench-serve --url " + server.url() +
                                  " --concurrency 4 --requests 12 --input-len 16 --output-len 6 --request-rate 40 --json",
                              rc);
  ASSERT_EQ(rc, 0) << out;
  const json r = json::parse(out);
  EXPECT_EQ(r["model"], "tiny");
  EXPECT_EQ(r["completed"], 12);
  EXPECT_EQ(r["failed"], 0);
  EXPECT_EQ(r["errors"], json::object());
  EXPECT_EQ(r["total_input_tokens"], 12 * 16);
  EXPECT_EQ(r["total_output_tokens"], 12 * 6);
  EXPECT_GT(r["request_throughput"].get<double>(), 0);
  EXPECT_NEAR(r["output_throughput"].get<double>(), 6 * r["request_throughput"].get<double>(), 1e-6);
  for (const char* k : {"ttft", "tpot", "itl", "e2el"}) {
    const json& s = r[k];
    EXPECT_GT(s["mean_ms"].get<double>(), 0) << k;
    EXPECT_LE(s["p50_ms"].get<double>(), s["p90_ms"].get<double>()) << k;
    EXPECT_LE(s["p90_ms"].get<double>(), s["p99_ms"].get<double>()) << k;
  }
  EXPECT_LT(r["ttft"]["p50_ms"].get<double>(), r["e2el"]["p50_ms"].get<double>());
  // The server counted exactly these tokens.
  const std::string m = get(server.url(), "/metrics").raw;
  EXPECT_EQ(metric(m, "dsv3:generation_tokens_total"), 12 * 6);
  EXPECT_EQ(metric(m, "dsv3:prompt_tokens_total"), 12 * 16);
  // Its steps computed every prompt token and every generated one but each request's last (never
  // fed back), in some decode-only steps and some with prompt tokens.
  EXPECT_EQ(metric(m, "dsv3:model_step_tokens_total"), 12 * (16 + 6 - 1));
  EXPECT_GT(metric(m, "dsv3:decode_steps_total"), 0);
  EXPECT_LT(metric(m, "dsv3:decode_steps_total"), metric(m, "dsv3:model_steps_total"));
  EXPECT_GT(metric(m, "dsv3:decode_step_seconds_total"), 0);
  EXPECT_LT(metric(m, "dsv3:decode_step_seconds_total"), metric(m, "dsv3:model_step_seconds_total"));

  const std::string text = run(std::string(DSV3_BINARY) + " bench-serve --url " + server.url() +
                                   " --concurrency 2 --requests 2 --input-len 4 --output-len 2",
                               rc);
  EXPECT_EQ(rc, 0);
  for (const char* line : {"Successful requests:", "Output token throughput (tok/s):", "p99 ttft (ms):",
                           "mean tpot (ms):", "p90 itl (ms):", "p50 e2el (ms):"})
    EXPECT_NE(text.find(line), std::string::npos) << line << " in\n" << text;
}

TEST(ServerBench, ClearErrors) {
  int rc = 0;
  std::string err = run(std::string(DSV3_BINARY) + " bench-serve --url http://127.0.0.1:1 --requests 1 2>&1", rc);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find("cannot reach http://127.0.0.1:1"), std::string::npos) << err;
  err = run(std::string(DSV3_BINARY) + " bench-serve --url ftp://x 2>&1", rc);
  EXPECT_NE(err.find("--url must start with http://"), std::string::npos) << err;
  err = run(std::string(DSV3_BINARY) + " bench-serve --concurrency 0 2>&1", rc);
  EXPECT_NE(err.find("--concurrency must be in"), std::string::npos) << err;
  ServerProcess server({"--max-model-len", "64"});
  err = run(std::string(DSV3_BINARY) + " bench-serve --url " + server.url() + " --input-len 60 --output-len 8 2>&1", rc);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find("exceed the model's context of 64 tokens"), std::string::npos) << err;
}

}  // namespace
