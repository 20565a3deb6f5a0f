// What a long-running command that writes files shows and obeys: a progress line on stderr and
// Ctrl-C / SIGTERM turned into a flag the work polls (so it stops and cleans up after itself).
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

namespace dsv3 {

// "1.23 GB" / "45.6 MB".
std::string fmt_bytes(uint64_t b);

// Bytes done / total with the rate: a redrawn bar when stderr is a terminal, else a line every
// 10%. `label` starts each line ("convert").
class Progress {
 public:
  explicit Progress(std::string label, bool quiet = false);
  void operator()(uint64_t done, uint64_t total);

 private:
  std::string label_;
  bool quiet_, tty_;
  std::chrono::steady_clock::time_point t0_, last_;
  int next_pct_ = 0;
};

// Installs SIGINT and SIGTERM handlers that set the returned flag (once per process).
const std::atomic<bool>& interrupt_flag();

}  // namespace dsv3
