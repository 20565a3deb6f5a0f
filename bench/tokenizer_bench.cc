// Encode/decode throughput of the tokenizer on one core, in MB/s of UTF-8 input.
// Not built by CMake; build against a build dir's library, e.g.
//   g++ -O2 -std=c++20 -Isrc bench/tokenizer_bench.cc build/libdsv3lib.a -lpcre2-8 -pthread -o tokenizer_bench
//   ./tokenizer_bench [TOKENIZER_DIR] [TEXT_FILE]
// TEXT_FILE defaults to the GPL-3 text (English prose); it is repeated up to 8 MB. "cold" is the
// first pass of a freshly loaded tokenizer (empty word cache); "warm" the best of later passes.
// Times are the thread's CPU time, so a busy machine does not count against the tokenizer.
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/mmap_file.h"
#include "text/tokenizer.h"

using namespace dsv3;

// CPU time of this thread: the machine may be shared, and the claim is about one core.
struct Clock {
  using time_point = double;
  static double now() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
  }
};
static double seconds_since(double t) { return Clock::now() - t; }

int main(int argc, char** argv) try {
  std::string dir = find_tokenizer_dir(argc > 1 ? argv[1] : "");
  std::string path = argc > 2 ? argv[2] : "/usr/share/common-licenses/GPL-3";
  std::string unit = read_text_file(path);
  std::string text;
  while (text.size() < (8u << 20)) text += unit;

  auto t0 = Clock::now();
  auto tok = Tokenizer::load(dir);
  std::printf("load: %.3f s\n", seconds_since(t0));
  const double mb_unit = unit.size() / 1e6, mb = text.size() / 1e6;

  t0 = Clock::now();
  size_t n_unit = tok->encode(unit).size();
  double cold = seconds_since(t0);
  std::printf("encode cold: %.2f MB in %.3f s = %.1f MB/s (%zu tokens, %.2f bytes/token)\n", mb_unit, cold,
              mb_unit / cold, n_unit, double(unit.size()) / n_unit);

  double best = 1e9;
  std::vector<int32_t> ids;
  for (int rep = 0; rep < 3; ++rep) {
    t0 = Clock::now();
    ids = tok->encode(text);
    best = std::min(best, seconds_since(t0));
  }
  std::printf("encode warm: %.2f MB in %.3f s = %.1f MB/s (%zu tokens)\n", mb, best, mb / best, ids.size());

  t0 = Clock::now();
  std::string back = tok->decode(ids);
  double dt = seconds_since(t0);
  std::printf("decode: %.1f MB/s, round trip %s\n", mb / dt, back == text ? "exact" : "DIFFERS");
  return back == text ? 0 : 1;
} catch (const Error& e) {
  std::fprintf(stderr, "tokenizer_bench: %s\n", e.what());
  return 1;
}
