#include "server/metrics.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "core/error.h"

namespace dsv3::server {

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {
  DSV3_CHECK(std::is_sorted(bounds_.begin(), bounds_.end()));
}

void Histogram::observe(double v) {
  const size_t b = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());  // le
  std::lock_guard<std::mutex> lk(mu_);
  counts_[b]++;
  sum_ += v;
}

uint64_t Histogram::count() const {
  std::lock_guard<std::mutex> lk(mu_);
  uint64_t n = 0;
  for (uint64_t c : counts_) n += c;
  return n;
}

namespace {

std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

void line(std::string& out, const std::string& name, const std::string& labels, const std::string& value) {
  out += name;
  if (!labels.empty()) out += "{" + labels + "}";
  out += " " + value + "\n";
}

void header(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

// A label value with \, " and newlines escaped (the exposition format's rule).
std::string label_value(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out += '\\', out += c;
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

}  // namespace

void Histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  std::lock_guard<std::mutex> lk(mu_);
  const std::string sep = labels.empty() ? "" : labels + ",";
  uint64_t cum = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    cum += counts_[i];
    const std::string le = i < bounds_.size() ? number(bounds_[i]) : "+Inf";
    line(out, name + "_bucket", sep + "le=\"" + le + "\"", std::to_string(cum));
  }
  line(out, name + "_sum", labels, number(sum_));
  line(out, name + "_count", labels, std::to_string(cum));
}

const char* error_kind_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::kInvalidRequest:
      return "invalid_request";
    case ErrorKind::kContextLength:
      return "context_length";
    case ErrorKind::kAuthentication:
      return "authentication";
    case ErrorKind::kNotFound:
      return "not_found";
    case ErrorKind::kPayloadTooLarge:
      return "payload_too_large";
    case ErrorKind::kQueueFull:
      return "queue_full";
    case ErrorKind::kShuttingDown:
      return "shutting_down";
    case ErrorKind::kEngine:
      return "engine";
    case ErrorKind::kClientDisconnect:
      return "client_disconnect";
    case ErrorKind::kCount:
      break;
  }
  return "other";
}

// Bucket bounds in seconds: vLLM's ranges, with finer steps at the low end where a small model
// on a CPU lands.
ServerMetrics::ServerMetrics()
    : ttft({0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40,
            80, 160, 640, 2560}),
      itl({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10,
           20, 40, 80}),
      e2e({0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960,
           1920, 7680}) {}

void ServerMetrics::count_finish(Finish f) {
  if (f == Finish::kStop) stopped_++;
  if (f == Finish::kLength) length_++;
}

std::string ServerMetrics::render(const EngineStats& s, const std::string& model_name) const {
  const std::string model = "model_name=\"" + label_value(model_name) + "\"";
  std::string out;
  auto gauge = [&](const char* name, const char* help, double v) {
    header(out, name, "gauge", help);
    line(out, name, model, number(v));
  };
  auto counter = [&](const char* name, const char* help, double v) {
    header(out, name, "counter", help);
    line(out, name, model, number(v));
  };
  gauge("dsv3:num_requests_running", "Requests in the engine's current step.", s.running);
  gauge("dsv3:num_requests_waiting", "Requests queued or preempted in the engine.", s.waiting);
  gauge("dsv3:kv_blocks_used", "KV cache blocks in use.", double(s.kv_blocks_used));
  gauge("dsv3:kv_blocks_total", "KV cache blocks in all.", double(s.kv_blocks_total));
  gauge("dsv3:kv_cache_usage_perc", "Fraction of the KV cache blocks in use (0 to 1).",
        s.kv_blocks_total > 0 ? double(s.kv_blocks_used) / double(s.kv_blocks_total) : 0.0);
  counter("dsv3:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
          double(s.prefix_query_tokens));
  counter("dsv3:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", double(s.prefix_hit_tokens));
  gauge("dsv3:prefix_cache_hit_rate", "Prefix cache hits over queries, in tokens, since start.",
        s.prefix_query_tokens > 0 ? double(s.prefix_hit_tokens) / double(s.prefix_query_tokens) : 0.0);
  counter("dsv3:prompt_tokens_total", "Prompt tokens processed.", double(s.prompt_tokens));
  counter("dsv3:generation_tokens_total", "Tokens generated.", double(s.generation_tokens));
  counter("dsv3:num_preemptions_total", "Requests preempted by the engine.", double(s.preemptions));
  counter("dsv3:model_steps_total", "Model steps run (forward and draw).", double(s.steps));
  counter("dsv3:model_step_tokens_total", "Tokens computed in model steps.", double(s.step_tokens));
  counter("dsv3:model_step_seconds_total", "Seconds spent in model steps.", s.step_s);
  counter("dsv3:decode_steps_total", "Model steps in which every sequence computed only its next token.",
          double(s.decode_steps));
  counter("dsv3:decode_step_seconds_total", "Seconds spent in those decode-only steps.", s.decode_step_s);

  header(out, "dsv3:request_success_total", "counter", "Choices finished, by reason.");
  line(out, "dsv3:request_success_total", model + ",finished_reason=\"stop\"", std::to_string(stopped_.load()));
  line(out, "dsv3:request_success_total", model + ",finished_reason=\"length\"", std::to_string(length_.load()));
  header(out, "dsv3:request_errors_total", "counter", "Requests refused or ended by an error, by kind.");
  for (size_t k = 0; k < errors_.size(); ++k)
    line(out, "dsv3:request_errors_total", model + ",kind=\"" + error_kind_name(ErrorKind(k)) + "\"",
         std::to_string(errors_[k].load()));

  header(out, "dsv3:time_to_first_token_seconds", "histogram", "Time from a request's arrival to its first token.");
  ttft.render(out, "dsv3:time_to_first_token_seconds", model);
  header(out, "dsv3:inter_token_latency_seconds", "histogram", "Time between two tokens of a request.");
  itl.render(out, "dsv3:inter_token_latency_seconds", model);
  header(out, "dsv3:e2e_request_latency_seconds", "histogram", "Time from a request's arrival to its end.");
  e2e.render(out, "dsv3:e2e_request_latency_seconds", model);

  header(out, "process_resident_memory_bytes", "gauge", "Resident memory of the server process.");
  line(out, "process_resident_memory_bytes", "", number(double(resident_memory_bytes())));
  return out;
}

int64_t resident_memory_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(f >> size >> resident)) return 0;
  return resident * int64_t(::sysconf(_SC_PAGESIZE));
}

}  // namespace dsv3::server
