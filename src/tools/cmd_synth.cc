// dsv3 synth: writes a random-weight checkpoint of a real model's shape in Hugging Face layout
// (the demo model, and the benchmark models without a download). See tools/synth.h.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "core/thread_pool.h"
#include "tools/synth.h"
#include "tools/command.h"

namespace dsv3 {
namespace {

std::atomic<bool> g_cancel{false};
extern "C" void on_signal(int) { g_cancel.store(true); }

std::string fmt_bytes(uint64_t b) {
  char buf[32];
  if (b >= 1000000000ull) std::snprintf(buf, sizeof buf, "%.2f GB", double(b) / 1e9);
  else std::snprintf(buf, sizeof buf, "%.1f MB", double(b) / 1e6);
  return buf;
}

std::string fmt_secs(double s) {
  char buf[32];
  if (s >= 60) std::snprintf(buf, sizeof buf, "%dm%02ds", int(s) / 60, int(s) % 60);
  else std::snprintf(buf, sizeof buf, "%.0fs", s);
  return buf;
}

// Bytes written / total with the rate: a redrawn bar on a terminal, else a line every 5%.
class Progress {
 public:
  Progress() : tty_(::isatty(STDERR_FILENO) == 1), t0_(std::chrono::steady_clock::now()) {}
  void operator()(uint64_t done, uint64_t total) {
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    const double frac = total ? double(done) / double(total) : 1.0;
    const double rate = secs > 0 ? double(done) / secs : 0;
    const std::string eta = rate > 0 && done < total ? " ETA " + fmt_secs(double(total - done) / rate) : "";
    char line[256];
    if (tty_) {
      const int width = 30, fill = int(frac * width);
      std::string bar(size_t(fill), '#');
      bar += std::string(size_t(width - fill), '-');
      std::snprintf(line, sizeof line, "\r[%s] %3.0f%% %s / %s  %.0f MB/s%s   ", bar.c_str(), frac * 100,
                    fmt_bytes(done).c_str(), fmt_bytes(total).c_str(), rate / 1e6, eta.c_str());
      std::fputs(line, stderr);
      if (done >= total) std::fputc('\n', stderr);
    } else {
      const int pct = int(frac * 100);
      if (done != 0 && pct < next_pct_ && done < total) return;
      while (next_pct_ <= pct) next_pct_ += 5;
      std::snprintf(line, sizeof line, "synth: %3d%% %s / %s  %.0f MB/s%s\n", pct, fmt_bytes(done).c_str(),
                    fmt_bytes(total).c_str(), rate / 1e6, eta.c_str());
      std::fputs(line, stderr);
    }
    std::fflush(stderr);
  }

 private:
  bool tty_;
  std::chrono::steady_clock::time_point t0_;
  int next_pct_ = 0;
};

int run_synth(int argc, char** argv) {
  Args args(argc, argv, {"shape", "layers", "dtype", "out", "seed", "shard-gb", "threads", "tokenizer"},
            {"force", "no-tokenizer", "quiet"});
  if (!args.positional().empty()) fail("unexpected argument '", args.positional()[0], "'");
  SynthOptions opt;
  opt.shape = args.require("shape");
  opt.out_dir = args.require("out");
  opt.dtype = args.get("dtype");
  if (args.has("dtype") && opt.dtype != "bf16" && opt.dtype != "fp8")
    fail("--dtype must be bf16 or fp8, got '", opt.dtype, "'");
  if (args.has("layers")) {
    long n = args.get_int("layers", 0);
    if (n < 1) fail("--layers must be at least 1, got ", n);
    if (n > 4096) fail("--layers must be at most 4096, got ", n);
    opt.layers = int(n);
  }
  if (args.has("seed")) {
    std::string s = args.get("seed");
    char* end = nullptr;
    errno = 0;
    unsigned long long v = std::strtoull(s.c_str(), &end, 10);
    if (s.empty() || *end || s[0] == '-' || errno == ERANGE)
      fail("--seed expects a non-negative integer, got '", s, "'");
    opt.seed = v;
  }
  opt.shard_gb = args.get_float("shard-gb", 4.0);
  if (!(opt.shard_gb > 0)) fail("--shard-gb must be positive, got ", args.get("shard-gb"));
  if (args.has("threads")) {
    long t = args.get_int("threads", 0);
    if (t < 1) fail("--threads must be at least 1, got ", t);
    opt.threads = int(t);
  }
  opt.force = args.has("force");
  opt.tokenizer = !args.has("no-tokenizer");
  opt.tokenizer_dir = args.get("tokenizer");
  const bool quiet = args.has("quiet");

  // Validates shape/dtype/layers before anything is written.
  ModelArgs a = shape_args(opt.shape, opt.dtype, opt.layers);
  Progress progress;
  bool announced = false;
  opt.progress = [&](uint64_t done, uint64_t total) {
    if (quiet) return;
    if (!announced) {
      std::fprintf(stderr, "dsv3 synth: %s %s, %d layers, %s of weights -> %s\n", opt.shape.c_str(),
                   a.dtype.c_str(), a.n_layers, fmt_bytes(total).c_str(), opt.out_dir.c_str());
      announced = true;
    }
    progress(done, total);
  };
  opt.cancel = &g_cancel;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  SynthResult r = synthesize(opt);
  std::fprintf(stderr, "dsv3 synth: wrote %s (%s, %d tensors in %d shard%s) in %.1f s\n", r.out_dir.c_str(),
               fmt_bytes(r.data_bytes).c_str(), r.n_tensors, r.n_shards, r.n_shards == 1 ? "" : "s", r.seconds);
  return 0;
}

}  // namespace

DSV3_COMMAND(synth,
             "--shape tiny|16B|236B|671B|v3.1 --out DIR [--dtype bf16|fp8] [--layers N] [--seed S] "
             "[--shard-gb G] [--threads N] [--force] [--no-tokenizer] [--tokenizer DIR] [--quiet]: "
             "write a random-weight checkpoint of that shape (HF layout; dtype defaults to the shape's own)",
             run_synth);

}  // namespace dsv3
