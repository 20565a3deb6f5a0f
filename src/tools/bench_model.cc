#include "tools/bench_model.h"

#include "core/error.h"
#include "model/shapes.h"
#ifdef DSV3_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace dsv3 {

BenchSource bench_source(const Args& args, bool gpu) {
  if (args.has("model") == args.has("synthetic")) fail("give one of --model DIR or --synthetic SHAPE");
  if ((args.has("dtype") || args.has("layers") || args.has("vocab")) && !args.has("synthetic"))
    fail("--dtype, --layers and --vocab go with --synthetic (a checkpoint has its own)");
  BenchSource src;
  if (args.has("model")) {
    src.ck = Checkpoint::open(args.get("model"), args.get("config"));
    src.args = load_model_args(*src.ck);
    src.what = args.get("model");
    return src;
  }
  if (!gpu) fail("--synthetic makes its weights on the GPU: give --device cuda (or a checkpoint from dsv3 synth)");
  src.args = shape_args(args.get("synthetic"), args.get("dtype"), int(args.get_int("layers", 0)));
  if (args.has("vocab")) {  // e.g. 102400: the reference's configs/config_16B.json (its speed anchors)
    const long v = args.get_int("vocab", 0);
    if (v < 1 || v > (1 << 24)) fail("--vocab must be in [1, 16777216], got ", v);
    src.args.vocab_size = int(v);
  }
  src.what = "synthetic " + args.get("synthetic");
  return src;
}

std::unique_ptr<Model> bench_model(BenchSource& src, const std::string& backend, const ModelOptions& opt,
                                   uint64_t seed) {
  if (src.ck) return std::make_unique<Model>(std::move(src.ck), make_backend(backend), opt);
#ifdef DSV3_HAVE_CUDA
  auto be = make_backend("cuda");
  ModelWeights w = cuda::random_weights(*be, src.args, seed);
  return std::make_unique<Model>(src.args, std::move(w), std::move(be), opt);
#else
  fail("--synthetic needs the CUDA backend, which this build does not have");
#endif
}

}  // namespace dsv3
