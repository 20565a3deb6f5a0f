// dsv3 convert: a Hugging Face checkpoint to the reference's model-parallel layout, as its
// inference/convert.py does (see tools/convert.h).
#include <cstdio>
#include <string>

#include "core/error.h"
#include "tools/command.h"
#include "tools/convert.h"
#include "tools/progress.h"

namespace dsv3 {
namespace {

int run_convert(int argc, char** argv) {
  Args args(argc, argv, {"hf-ckpt-path", "save-path", "n-experts", "model-parallel"}, {"quiet"});
  if (!args.positional().empty()) fail("unexpected argument '", args.positional()[0], "'");
  ConvertOptions opt;
  opt.hf_dir = args.require("hf-ckpt-path");
  opt.save_dir = args.require("save-path");
  args.require("n-experts");
  args.require("model-parallel");
  const long e = args.get_int("n-experts", 0), n = args.get_int("model-parallel", 0);
  if (e < 1 || e > 1 << 20) fail("--n-experts must be in [1, 1048576], got ", e);
  if (n < 1 || n > 4096) fail("--model-parallel must be in [1, 4096], got ", n);
  opt.n_experts = int(e);
  opt.mp = int(n);
  Progress progress("convert", args.has("quiet"));
  opt.progress = [&](uint64_t done, uint64_t total) { progress(done, total); };
  opt.cancel = &interrupt_flag();
  const ConvertResult r = convert_checkpoint(opt);
  if (!args.has("quiet"))
    std::fprintf(stderr,
                 "dsv3 convert: %d tensors from %d file%s (%s) -> %d file%s model{0..%d}-mp%d.safetensors "
                 "(%s) in %s; %d multi-token-prediction tensor%s skipped, %d tokenizer file%s copied\n",
                 r.n_tensors, r.n_inputs, r.n_inputs == 1 ? "" : "s", fmt_bytes(r.bytes_in).c_str(), opt.mp,
                 opt.mp == 1 ? "" : "s", opt.mp - 1, opt.mp, fmt_bytes(r.bytes_out).c_str(), opt.save_dir.c_str(),
                 r.n_skipped, r.n_skipped == 1 ? "" : "s", r.n_copied, r.n_copied == 1 ? "" : "s");
  return 0;
}

}  // namespace

DSV3_COMMAND(convert,
             "--hf-ckpt-path DIR --save-path OUT --n-experts E --model-parallel N [--quiet]: "
             "a Hugging Face checkpoint to the reference's layout for N ranks (its convert.py): "
             "OUT/model{r}-mp{N}.safetensors",
             run_convert);

}  // namespace dsv3
