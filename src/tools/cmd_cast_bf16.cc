// dsv3 cast-bf16: an FP8 Hugging Face checkpoint to bf16, as the reference's
// inference/fp8_cast_bf16.py does (see tools/cast_bf16.h).
#include <cstdio>
#include <string>

#include "core/error.h"
#include "core/thread_pool.h"
#include "tools/cast_bf16.h"
#include "tools/command.h"
#include "tools/progress.h"

namespace dsv3 {
namespace {

int run_cast_bf16(int argc, char** argv) {
  Args args(argc, argv, {"input-fp8-hf-path", "output-bf16-hf-path", "threads"}, {"quiet"});
  if (!args.positional().empty()) fail("unexpected argument '", args.positional()[0], "'");
  CastOptions opt;
  opt.in_dir = args.require("input-fp8-hf-path");
  opt.out_dir = args.require("output-bf16-hf-path");
  if (args.has("threads")) {
    const long t = args.get_int("threads", 0);
    if (t < 1 || t > 1024) fail("--threads must be in [1, 1024], got ", t);
    ThreadPool::set_global_threads(int(t));
  }
  Progress progress("cast-bf16", args.has("quiet"));
  opt.progress = [&](uint64_t done, uint64_t total) { progress(done, total); };
  opt.cancel = &interrupt_flag();
  const CastResult r = cast_fp8_to_bf16(opt);
  if (!args.has("quiet"))
    std::fprintf(stderr,
                 "dsv3 cast-bf16: %d F8_E4M3 weights cast to bf16, %d tensors copied, %d scales dropped, "
                 "%d shard%s (%s) -> %s (%s); %d other file%s copied\n",
                 r.n_cast, r.n_copied, r.n_scales, r.n_files, r.n_files == 1 ? "" : "s",
                 fmt_bytes(r.bytes_in).c_str(), opt.out_dir.c_str(), fmt_bytes(r.bytes_out).c_str(),
                 r.n_other_files, r.n_other_files == 1 ? "" : "s");
  return 0;
}

}  // namespace

// Registered by hand: DSV3_COMMAND makes the name from an identifier, which cannot hold '-'.
static const bool dsv3_registered_cast_bf16 = register_command(
    {"cast-bf16",
     "--input-fp8-hf-path DIR --output-bf16-hf-path OUT [--threads N] [--quiet]: an FP8 Hugging Face "
     "checkpoint to bf16 (the reference's fp8_cast_bf16.py): weights dequantised, scales dropped",
     run_cast_bf16});

}  // namespace dsv3
