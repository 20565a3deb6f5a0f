// The server's metrics in Prometheus text format (GET /metrics), named as vLLM names them with
// a dsv3: prefix: latency histograms the server measures, the engine's state (EngineStats) and
// counters of finished requests and of errors by kind. Thread-safe.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/engine.h"

namespace dsv3::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);  // ascending; +Inf is implicit
  void observe(double v);
  // Appends the _bucket, _sum and _count lines of `name` with `labels` ("a=\"b\"").
  void render(std::string& out, const std::string& name, const std::string& labels) const;
  uint64_t count() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative), the last one is +Inf
  double sum_ = 0;
};

// Why a request was refused or ended badly; each a label of dsv3:request_errors_total.
enum class ErrorKind {
  kInvalidRequest,    // 400: malformed JSON, wrong types, values out of range
  kContextLength,     // 400: prompt + max_tokens past the context
  kAuthentication,    // 401
  kNotFound,          // 404: unknown model or route
  kPayloadTooLarge,   // 413
  kQueueFull,         // 429
  kShuttingDown,      // 503
  kEngine,            // the engine failed a request
  kClientDisconnect,  // the client left before the answer ended (its requests are cancelled)
  kCount
};
const char* error_kind_name(ErrorKind k);

class ServerMetrics {
 public:
  ServerMetrics();
  Histogram ttft, itl, e2e;  // seconds: time to first token, between tokens, request start to end
  void count_error(ErrorKind k) { errors_[size_t(k)]++; }
  void count_finish(Finish f);  // an engine request ended with a result (stop or length)
  int64_t errors(ErrorKind k) const { return errors_[size_t(k)]; }
  // The whole exposition: these metrics, the engine's `stats`, the process's resident memory.
  std::string render(const EngineStats& stats, const std::string& model_name) const;

 private:
  std::array<std::atomic<int64_t>, size_t(ErrorKind::kCount)> errors_{};
  std::atomic<int64_t> stopped_{0}, length_{0};
};

// Bytes of resident memory of this process (from /proc/self/statm); 0 where unknown.
int64_t resident_memory_bytes();

}  // namespace dsv3::server
