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
  const long tp = args.get_int("tp-shard", 1);
  if (tp < 1 || tp > 1024) fail("--tp-shard must be in [1, 1024], got ", tp);
  src.tp_shard = int(tp);
  auto shard_note = [&] {
    if (tp == 1) return;
    check_shardable(src.args, src.tp_shard);
    src.what += str(" (rank 0 of ", tp, ", the others stood in for)");
  };
  if (args.has("model")) {
    src.ck = Checkpoint::open(args.get("model"), args.get("config"), 0, src.tp_shard);
    src.args = load_model_args(*src.ck);
    src.what = args.get("model");
    shard_note();
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
  shard_note();
  return src;
}

std::unique_ptr<Model> bench_model(BenchSource& src, const std::string& backend, const ModelOptions& opt,
                                   uint64_t seed) {
  ModelOptions o = opt;
  if (src.tp_shard > 1) {
    src.comm = make_stand_in_comm(src.tp_shard);
    o.comm = src.comm.get();
  }
  if (src.ck) return std::make_unique<Model>(std::move(src.ck), make_backend(backend), o);
#ifdef DSV3_HAVE_CUDA
  auto be = make_backend("cuda");
  ModelWeights w = cuda::random_weights(*be, src.args, seed, {0, src.tp_shard});
  return std::make_unique<Model>(src.args, std::move(w), std::move(be), o);
#else
  fail("--synthetic needs the CUDA backend, which this build does not have");
#endif
}

}  // namespace dsv3
