// Options every model-running command shares (--model, --config, --backend, --attn, --threads,
// --kv-cache-gb) and the one way to turn them into a Model.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "runtime/model.h"
#include "tools/command.h"

namespace dsv3 {

std::vector<std::string> with_model_options(std::vector<std::string> opts);
AttnImpl parse_attn(const std::string& s);
// --weight-memory auto|map|copy (default auto; backend/backend.h WeightMemory).
WeightMemory parse_weight_memory(const Args& args);
std::string default_backend();  // "cpu" when this build has it, else "ref"
// The backend a command's model runs on (load_model's): --backend, else `dflt` when given, else
// default_backend().
std::string chosen_backend(const Args& args, const std::string& dflt = "");
// --max-step-tokens N: the scheduler's token budget per step, in [1, 65536]. Its default depends on
// the backend the model runs on: 8192 for "cuda" (fewer, larger prefill chunks; SGLang's default
// chunk on cards of 35-160 GB), else SchedulerOptions' 2048.
int parse_max_step_tokens(const Args& args, const std::string& backend);

struct LoadedModel {
  std::unique_ptr<Model> model;
};
// Opens --model (with --config), sets threads, picks --backend, sizes the cache for `slots`
// sequences of up to `max_len` positions (capped by the config's maximum).
// --backend defaults to `backend` when given, else default_backend().
LoadedModel load_model(const Args& args, int slots, int max_len, const std::string& backend = "");

// Under mpirun, on every rank but 0: loads this rank's shard of --model and runs the steps rank 0
// sends until it is done; true. On rank 0 (and without mpirun): false, nothing done. A command
// that runs a model calls it first, so only rank 0 reads its input and writes its output.
bool follow_leader(const Args& args, const std::string& backend = "");

}  // namespace dsv3
