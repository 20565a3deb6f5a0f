// The model a benchmark runs: a checkpoint (--model DIR [--config F]) or random weights of a named
// shape made in the GPU's memory (--synthetic SHAPE [--dtype] [--layers] [--vocab], --device cuda).
#pragma once
#include <memory>
#include <string>

#include "dist/comm.h"
#include "io/checkpoint.h"
#include "runtime/model.h"
#include "tools/command.h"

namespace dsv3 {

struct BenchSource {
  std::unique_ptr<Checkpoint> ck;  // null: synthetic
  ModelArgs args;
  std::string what;                // for the report: the folder, or "synthetic SHAPE"
  // --tp-shard N: rank 0's share of the model spread over N ranks (its heads, vocabulary rows,
  // dense and shared-expert slices, experts [0, E / N)), the other ranks stood in for: the
  // collectives move nothing (dist/comm.h make_stand_in_comm), so times leave out the interconnect.
  int tp_shard = 1;
  std::unique_ptr<Comm> comm;  // the stand-in world (tp_shard > 1)
};
// The options' model, checked: exactly one of --model and --synthetic, the synthetic options only
// with --synthetic, --synthetic only on the GPU (gpu).
BenchSource bench_source(const Args& args, bool gpu);
// The Model of `src` on `backend` (a checkpoint's weights loaded; synthetic ones made on the GPU
// from `seed`). Takes src.ck.
std::unique_ptr<Model> bench_model(BenchSource& src, const std::string& backend, const ModelOptions& opt,
                                   uint64_t seed);

// dsv3 bench --concurrency ...: serving measured offline (bench_serving.cc); its exit code.
int run_serving_bench(const Args& args);

}  // namespace dsv3
