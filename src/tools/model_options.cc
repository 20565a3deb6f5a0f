#include "tools/model_options.h"

#include <algorithm>

#include "backend/backend.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "dist/comm.h"
#include "io/checkpoint.h"
#include "runtime/scheduler.h"

namespace dsv3 {

std::vector<std::string> with_model_options(std::vector<std::string> opts) {
  for (const char* o : {"model", "config", "backend", "attn", "threads", "kv-cache-gb", "weight-memory"}) opts.push_back(o);
  return opts;
}

AttnImpl parse_attn(const std::string& s) {
  if (s == "absorb") return AttnImpl::kAbsorb;
  if (s == "naive") return AttnImpl::kNaive;
  fail("--attn must be absorb or naive, got '", s, "'");
}

WeightMemory parse_weight_memory(const Args& args) {
  WeightMemory m;
  const std::string s = args.get("weight-memory", "auto");
  if (s == "auto") m.mode = WeightMemory::kAuto;
  else if (s == "map") m.mode = WeightMemory::kMap;
  else if (s == "copy") m.mode = WeightMemory::kCopy;
  else fail("--weight-memory must be auto, map or copy, got '", s, "'");
  return m;
}

std::string default_backend() {
  auto names = backend_names();
  return std::find(names.begin(), names.end(), "cpu") != names.end() ? "cpu" : "ref";
}

std::string chosen_backend(const Args& args, const std::string& dflt) {
  return args.get("backend", dflt.empty() ? default_backend() : dflt);
}

int parse_max_step_tokens(const Args& args, const std::string& backend) {
  const long dflt = backend == "cuda" ? 8192 : SchedulerOptions().max_step_tokens;
  const long n = args.get_int("max-step-tokens", dflt);
  if (n < 1 || n > 65536) fail("--max-step-tokens must be in [1, 65536], got ", n);
  return int(n);
}

LoadedModel load_model(const Args& args, int slots, int max_len, const std::string& backend) {
  if (args.has("threads")) {
    long t = args.get_int("threads", 0);
    if (t < 1 || t > 1024) fail("--threads must be in [1, 1024], got ", t);
    ThreadPool::set_global_threads(int(t));
  }
  // Under mpirun: every rank opens the checkpoint (its own file in the reference's layout for that
  // many ranks); a rank that cannot makes them all stop, each saying which rank failed.
  Comm& world = world_comm();
  const std::string be = chosen_backend(args, backend);
  std::unique_ptr<Checkpoint> ck;
  std::string err;
  try {
#if defined(DSV3_HAVE_CUDA) && !defined(DSV3_HAVE_NCCL)
    if (world.size() > 1 && be == "cuda")
      fail("several ranks on the GPU need NCCL, which this build lacks (the CUDA toolkit's nccl.h and libnccl were not "
           "found at configure time); use --backend cpu, or rebuild where NCCL is installed");
#endif
    ck = Checkpoint::open(args.require("model"), args.get("config"), world.rank(), world.size());
    check_shardable(load_model_args(*ck), world.size());
  } catch (const Error& e) {
    err = e.what();
  }
  if (world.size() > 1 && !world.all_ok(err.empty()))
    fail("rank ", world.rank(), " of ", world.size(), ": ",
         err.empty() ? "another rank could not open the model (its message says why)" : err);
  if (!err.empty()) throw Error(err);
  ModelOptions opt;
  opt.attn = parse_attn(args.get("attn", "absorb"));
  opt.max_seqs = std::max(1, slots);
  opt.max_len = std::min(max_len, load_model_args(*ck).max_seq_len);
  opt.kv_cache_gb = args.get_float("kv-cache-gb", 0);  // 0: sized for slots x max_len
  opt.weights = parse_weight_memory(args);
  opt.comm = world.size() > 1 ? &world : nullptr;
  LoadedModel lm;
  lm.model = std::make_unique<Model>(std::move(ck), make_backend(be), opt);
  return lm;
}

bool follow_leader(const Args& args, const std::string& backend) {
  if (world_comm().rank() == 0) return false;
  LoadedModel lm = load_model(args, 1, INT32_MAX, backend);  // (the leader's cache geometry replaces these)
  lm.model->follow();
  return true;
}

}  // namespace dsv3
