#include "tools/model_options.h"

#include <algorithm>

#include "backend/backend.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "io/checkpoint.h"

namespace dsv3 {

std::vector<std::string> with_model_options(std::vector<std::string> opts) {
  for (const char* o : {"model", "config", "backend", "attn", "threads", "kv-cache-gb"}) opts.push_back(o);
  return opts;
}

AttnImpl parse_attn(const std::string& s) {
  if (s == "absorb") return AttnImpl::kAbsorb;
  if (s == "naive") return AttnImpl::kNaive;
  fail("--attn must be absorb or naive, got '", s, "'");
}

std::string default_backend() {
  auto names = backend_names();
  return std::find(names.begin(), names.end(), "cpu") != names.end() ? "cpu" : "ref";
}

LoadedModel load_model(const Args& args, int slots, int max_len, const std::string& backend) {
  if (args.has("threads")) {
    long t = args.get_int("threads", 0);
    if (t < 1 || t > 1024) fail("--threads must be in [1, 1024], got ", t);
    ThreadPool::set_global_threads(int(t));
  }
  auto ck = Checkpoint::open(args.require("model"), args.get("config"));
  ModelOptions opt;
  opt.attn = parse_attn(args.get("attn", "absorb"));
  opt.max_seqs = std::max(1, slots);
  opt.max_len = std::min(max_len, load_model_args(*ck).max_seq_len);
  opt.kv_cache_gb = args.get_float("kv-cache-gb", 0);  // 0: sized for slots x max_len
  LoadedModel lm;
  lm.model = std::make_unique<Model>(std::move(ck), make_backend(args.get("backend", backend.empty() ? default_backend() : backend)), opt);
  return lm;
}

}  // namespace dsv3
