#include "tools/progress.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>

namespace dsv3 {

std::string fmt_bytes(uint64_t b) {
  char buf[32];
  if (b >= 1000000000ull) std::snprintf(buf, sizeof buf, "%.2f GB", double(b) / 1e9);
  else std::snprintf(buf, sizeof buf, "%.1f MB", double(b) / 1e6);
  return buf;
}

Progress::Progress(std::string label, bool quiet)
    : label_(std::move(label)),
      quiet_(quiet),
      tty_(::isatty(STDERR_FILENO) == 1),
      t0_(std::chrono::steady_clock::now()),
      last_(t0_) {}

void Progress::operator()(uint64_t done, uint64_t total) {
  if (quiet_) return;
  const auto now = std::chrono::steady_clock::now();
  const double secs = std::chrono::duration<double>(now - t0_).count();
  const double frac = total ? double(done) / double(total) : 1.0;
  const double rate = secs > 0 ? double(done) / secs : 0;
  const int pct = int(frac * 100);
  if (tty_) {
    // Redraw at most 10 times a second, and always at the end.
    if (done < total && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    const int width = 30, fill = int(frac * width);
    const std::string bar = std::string(size_t(fill), '#') + std::string(size_t(width - fill), '-');
    std::fprintf(stderr, "\r%s [%s] %3d%% %s / %s  %.0f MB/s   ", label_.c_str(), bar.c_str(), pct,
                 fmt_bytes(done).c_str(), fmt_bytes(total).c_str(), rate / 1e6);
    if (done >= total) std::fputc('\n', stderr);
  } else {
    if (pct < next_pct_ && done < total) return;
    while (next_pct_ <= pct) next_pct_ += 10;
    std::fprintf(stderr, "%s: %3d%% %s / %s  %.0f MB/s\n", label_.c_str(), pct, fmt_bytes(done).c_str(),
                 fmt_bytes(total).c_str(), rate / 1e6);
  }
  std::fflush(stderr);
}

namespace {
std::atomic<bool> g_interrupted{false};
extern "C" void on_interrupt(int) { g_interrupted.store(true); }
}  // namespace

const std::atomic<bool>& interrupt_flag() {
  static const bool installed = [] {
    struct sigaction sa {};
    sa.sa_handler = on_interrupt;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    return true;
  }();
  (void)installed;
  return g_interrupted;
}

}  // namespace dsv3
