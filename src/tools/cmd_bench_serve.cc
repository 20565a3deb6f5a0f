// dsv3 bench-serve: a load generator for an OpenAI-compatible server, measured as vLLM's
// `bench serve` measures: R streamed /v1/completions requests of I random prompt tokens and
// exactly O output tokens (ignore_eos), at most N in flight, arriving as a Poisson process of
// rate λ (or all at once). Reports request and token throughput, TTFT, TPOT, ITL and end-to-end
// latency (mean, p50, p90, p99) and errors by kind.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "core/error.h"
#include "server/api_client.h"
#include "tools/command.h"
#include "tools/serving_report.h"

namespace dsv3 {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// Random prompt ids come from this range: ordinary tokens in every DeepSeek vocabulary.
constexpr int32_t kFirstId = 1000, kLastId = 32000;

struct Config : ServingLoad {
  std::string url, api_key, model;
};

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// One streamed request; times are taken as each event arrives.
RequestTiming run_one(server::ApiClient& cli, const Config& c, const std::vector<int32_t>& prompt) {
  const json body = {{"model", c.model},   {"prompt", prompt},      {"max_tokens", c.output_len},
                     {"ignore_eos", true}, {"temperature", 0},      {"stream", true},
                     {"stream_options", {{"include_usage", true}}}};
  RequestTiming o;
  const Clock::time_point start = Clock::now();
  Clock::time_point last = start;
  bool first = true;
  std::string stream_error;
  int usage_tokens = -1;
  auto res = cli.post("/v1/completions", body.dump(), [&](const std::string& data) {
    if (data == "[DONE]") return true;
    json ev = json::parse(data, nullptr, false);
    if (ev.is_discarded()) {
      stream_error = "bad_event";
      return false;
    }
    if (ev.contains("error")) {
      stream_error = "stream_error";
      return true;
    }
    if (ev.contains("usage") && ev["usage"].is_object()) usage_tokens = ev["usage"].value("completion_tokens", -1);
    const json& choices = ev.value("choices", json::array());
    if (choices.empty() || choices[0].value("text", "").empty()) return true;
    const Clock::time_point now = Clock::now();
    if (first) o.ttft = seconds(now - start), first = false;
    else o.itl.push_back(seconds(now - last));
    last = now;
    return true;
  });
  o.e2e = seconds(Clock::now() - start);
  o.output_tokens = std::max(usage_tokens, 0);
  if (!res.error.empty()) o.error = "connection (" + res.error + ")";
  else if (res.status != 200) o.error = "http_" + std::to_string(res.status);
  else if (!stream_error.empty()) o.error = stream_error;
  else if (usage_tokens != c.output_len) o.error = "short_output";
  o.ok = o.error.empty();
  return o;
}

// The served model's name and context, from GET /v1/models.
void probe(Config& c) {
  server::ApiClient cli(c.url, c.api_key, 30);
  auto r = cli.get("/v1/models");
  if (!r.error.empty()) fail("cannot reach ", c.url, ": ", r.error);
  json body = json::parse(r.body, nullptr, false);
  if (r.status != 200 || body.is_discarded() || !body.contains("data") || body["data"].empty())
    fail(c.url, "/v1/models answered ", r.status, ": ", r.body.substr(0, 300));
  const json& card = body["data"][0];
  if (c.model.empty()) c.model = card.value("id", "");
  const int ctx = card.value("max_model_len", 0);
  if (ctx > 0 && c.input_len + c.output_len > ctx)
    fail("--input-len ", c.input_len, " + --output-len ", c.output_len, " exceed the model's context of ", ctx, " tokens");
}

json run_bench(const Config& c) {
  const std::vector<std::vector<int32_t>> prompts = random_prompts(c, kFirstId, kLastId);
  const std::vector<double> arrival = arrival_times(c);  // seconds after the start
  std::vector<RequestTiming> out(size_t(c.requests));
  std::atomic<int> next{0};
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> workers;
  for (int w = 0; w < std::min(c.concurrency, c.requests); ++w) {
    workers.emplace_back([&] {
      server::ApiClient cli(c.url, c.api_key);
      for (int i; (i = next++) < c.requests;) {
        std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(arrival[size_t(i)])));
        out[size_t(i)] = run_one(cli, c, prompts[size_t(i)]);
      }
    });
  }
  for (auto& t : workers) t.join();
  json r = serving_report(c, out, seconds(Clock::now() - start));
  r["url"] = c.url, r["model"] = c.model;
  return r;
}

int run_bench_serve(int argc, char** argv) {
  Args args(argc, argv,
            {"url", "concurrency", "requests", "input-len", "output-len", "request-rate", "seed", "model", "api-key"},
            {"json"});
  ::signal(SIGPIPE, SIG_IGN);  // a server that goes away is an error to count, not the end of us
  Config c;
  c.url = args.get("url", "http://127.0.0.1:8000");
  while (!c.url.empty() && c.url.back() == '/') c.url.pop_back();
  if (c.url.rfind("http://", 0) != 0) fail("--url must start with http:// (e.g. http://127.0.0.1:8000), got '", c.url, "'");
  c.api_key = args.get("api-key");
  c.model = args.get("model");
  c.concurrency = int(args.get_int("concurrency", 1));
  c.requests = int(args.get_int("requests", 100));
  c.input_len = int(args.get_int("input-len", 128));
  c.output_len = int(args.get_int("output-len", 128));
  c.rate = args.get_float("request-rate", INFINITY);
  c.seed = uint64_t(args.get_int("seed", 0));
  if (c.concurrency < 1 || c.concurrency > 4096) fail("--concurrency must be in [1, 4096], got ", c.concurrency);
  if (c.requests < 1) fail("--requests must be >= 1, got ", c.requests);
  if (c.input_len < 1 || c.output_len < 1) fail("--input-len and --output-len must be >= 1");
  if (!(c.rate > 0)) fail("--request-rate must be > 0 requests per second (default: all at once)");
  probe(c);
  json report = run_bench(c);
  if (args.has("json")) std::printf("%s\n", report.dump(2).c_str());
  else print_serving_report(report);
  return report["failed"].get<int>() == 0 ? 0 : 1;
}

}  // namespace

// Registered by hand: the command's name has a hyphen, which DSV3_COMMAND's identifier cannot.
static const bool dsv3_registered_bench_serve = register_command(
    {"bench-serve",
     "--url URL --concurrency N --requests R --input-len I --output-len O [--request-rate λ] [--seed S] "
     "[--model NAME] [--api-key K] [--json]: load generator for an OpenAI-compatible server (vLLM's bench serve metrics)",
     run_bench_serve});

}  // namespace dsv3
