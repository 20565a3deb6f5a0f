// The serving metrics of vLLM's `bench serve`, shared by `dsv3 bench-serve` (over HTTP) and
// `dsv3 bench --concurrency` (the scheduler in-process): per-request times in, throughput and
// TTFT / TPOT / ITL / end-to-end latency (mean, p50, p90, p99) out, as JSON and as a table.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dsv3 {

struct RequestTiming {
  bool ok = false;
  std::string error;          // the kind, when !ok
  double ttft = 0, e2e = 0;   // seconds from the request's start
  int output_tokens = 0;
  std::vector<double> itl;    // seconds between successive outputs
};

struct ServingLoad {
  int concurrency = 1, requests = 1, input_len = 0, output_len = 0;
  double rate = 0;            // requests per second; infinity: all at once
  uint64_t seed = 0;
};

// `requests` prompts of `input_len` ids drawn from [first, last), seeded.
std::vector<std::vector<int32_t>> random_prompts(const ServingLoad& l, int32_t first, int32_t last);
// Arrival times (seconds after the start) of a Poisson process of `rate` (all 0 when infinite).
std::vector<double> arrival_times(const ServingLoad& l);

// numpy.percentile's default (linear between the closest ranks).
double percentile(std::vector<double> v, double p);

// The report: counts, errors by kind, throughputs over `duration_s`, the latency summaries.
nlohmann::json serving_report(const ServingLoad& l, const std::vector<RequestTiming>& t, double duration_s);
void print_serving_report(const nlohmann::json& r);

}  // namespace dsv3
