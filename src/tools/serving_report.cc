#include "tools/serving_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>

namespace dsv3 {

using json = nlohmann::json;

std::vector<std::vector<int32_t>> random_prompts(const ServingLoad& l, int32_t first, int32_t last) {
  std::mt19937_64 rng(l.seed);
  std::uniform_int_distribution<int32_t> id(first, last - 1);
  std::vector<std::vector<int32_t>> prompts(size_t(l.requests));
  for (auto& p : prompts)
    for (int i = 0; i < l.input_len; ++i) p.push_back(id(rng));
  return prompts;
}

std::vector<double> arrival_times(const ServingLoad& l) {
  std::mt19937_64 rng(l.seed + 1);
  std::vector<double> at(size_t(l.requests), 0.0);
  if (!std::isfinite(l.rate)) return at;
  std::exponential_distribution<double> gap(l.rate);
  for (size_t i = 1; i < at.size(); ++i) at[i] = at[i - 1] + gap(rng);
  return at;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = p / 100 * double(v.size() - 1);
  const size_t lo = size_t(std::floor(rank)), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - double(lo));
}

namespace {

json summary(const std::vector<double>& v) {  // milliseconds
  double mean = 0;
  for (double x : v) mean += x;
  if (!v.empty()) mean /= double(v.size());
  return {{"mean_ms", mean * 1e3},
          {"p50_ms", percentile(v, 50) * 1e3},
          {"p90_ms", percentile(v, 90) * 1e3},
          {"p99_ms", percentile(v, 99) * 1e3}};
}

}  // namespace

json serving_report(const ServingLoad& l, const std::vector<RequestTiming>& out, double duration) {
  std::vector<double> ttft, tpot, itl, e2e;
  std::map<std::string, int> errors;
  int ok = 0;
  int64_t output_tokens = 0;
  for (const RequestTiming& o : out) {
    if (!o.ok) {
      errors[o.error]++;
      continue;
    }
    ++ok;
    output_tokens += o.output_tokens;
    ttft.push_back(o.ttft);
    e2e.push_back(o.e2e);
    if (o.output_tokens > 1) tpot.push_back((o.e2e - o.ttft) / double(o.output_tokens - 1));
    itl.insert(itl.end(), o.itl.begin(), o.itl.end());
  }
  const int64_t input_tokens = int64_t(ok) * l.input_len;
  return {{"concurrency", l.concurrency},
          {"request_rate", std::isfinite(l.rate) ? json(l.rate) : json("inf")},
          {"input_len", l.input_len},
          {"output_len", l.output_len},
          {"completed", ok},
          {"failed", int(out.size()) - ok},
          {"errors", errors},
          {"duration_s", duration},
          {"total_input_tokens", input_tokens},
          {"total_output_tokens", output_tokens},
          {"request_throughput", double(ok) / duration},
          {"output_throughput", double(output_tokens) / duration},
          {"total_token_throughput", double(input_tokens + output_tokens) / duration},
          {"ttft", summary(ttft)},
          {"tpot", summary(tpot)},
          {"itl", summary(itl)},
          {"e2el", summary(e2e)}};
}

void print_serving_report(const json& r) {
  auto row = [](const std::string& name, const std::string& v) { std::printf("%-40s %s\n", name.c_str(), v.c_str()); };
  auto num = [](double v, int digits) {
    char b[64];
    std::snprintf(b, sizeof b, "%.*f", digits, v);
    return std::string(b);
  };
  std::printf("============ Serving Benchmark Result ============\n");
  row("Successful requests:", std::to_string(r["completed"].get<int>()));
  row("Failed requests:", std::to_string(r["failed"].get<int>()));
  for (auto& [kind, n] : r["errors"].items()) row("  " + kind + ":", std::to_string(n.get<int>()));
  row("Benchmark duration (s):", num(r["duration_s"], 2));
  row("Total input tokens:", std::to_string(r["total_input_tokens"].get<int64_t>()));
  row("Total generated tokens:", std::to_string(r["total_output_tokens"].get<int64_t>()));
  row("Request throughput (req/s):", num(r["request_throughput"], 2));
  row("Output token throughput (tok/s):", num(r["output_throughput"], 2));
  row("Total token throughput (tok/s):", num(r["total_token_throughput"], 2));
  for (const char* extra : {"kv_blocks_peak", "kv_blocks_total", "prefix_cache_hit_rate", "preemptions"})
    if (r.contains(extra)) row(std::string(extra) + ":", r[extra].dump());
  if (r.contains("steps")) {  // (the offline bench: the scheduler's model steps)
    const int64_t n = r["steps"], d = r["decode_steps"], tok = r["step_tokens"];
    const double t = r["step_time_s"], td = r["decode_step_time_s"];
    auto per = [&](double s, int64_t k) { return k > 0 ? num(1e3 * s / double(k), 2) : std::string("-"); };
    row("Model steps:", std::to_string(n) + " in " + num(t, 2) + " s, " + num(n > 0 ? double(tok) / double(n) : 0, 1) +
                            " tokens each on average" +
                            (r.contains("max_step_tokens") ? " (at most " + r["max_step_tokens"].dump() + ")" : ""));
    row("  decode-only steps:", std::to_string(d) + " in " + num(td, 2) + " s (" + per(td, d) + " ms each)");
    row("  steps with prompt tokens:", std::to_string(n - d) + " in " + num(t - td, 2) + " s (" + per(t - td, n - d) +
                                           " ms each)");
  }
  const std::pair<const char*, const char*> parts[] = {
      {"ttft", "Time to First Token"}, {"tpot", "Time per Output Token (excl. 1st token)"},
      {"itl", "Inter-token Latency"}, {"e2el", "End-to-end Latency"}};
  for (auto& [key, title] : parts) {
    std::printf("%s\n", (std::string("---- ") + title + " ").append(std::max<int>(0, 46 - int(std::string(title).size())), '-').c_str());
    for (const char* stat : {"mean", "p50", "p90", "p99"})
      row(std::string(stat) + " " + key + " (ms):", num(r[key][std::string(stat) + "_ms"], 2));
  }
  if (r.contains("generate_tpot_ms"))  // (one request: beside `dsv3 generate` on the same request)
    std::printf("one request vs generate: %.2f ms per output token served, %.2f ms as generate runs it: %.0f%% of "
                "generate's speed\n",
                r["tpot"]["mean_ms"].get<double>(), r["generate_tpot_ms"].get<double>(), 100 * r["vs_generate"].get<double>());
  std::printf("==================================================\n");
}

}  // namespace dsv3
