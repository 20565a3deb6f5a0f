// dsv3 logits: replays a file of forward calls (stepNNN.start_pos [1], stepNNN.tokens [B, T])
// on one model, in order, and writes stepNNN.logits [B, vocab] float32 — how dsv3 is checked
// against another implementation.
#include <algorithm>
#include <cstdio>
#include <map>
#include <string>

#include "backend/backend.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "runtime/model.h"
#include "tools/command.h"
#include "tools/model_options.h"

namespace dsv3 {

namespace {

struct Call {
  std::string prefix;
  int start_pos = 0, B = 0, T = 0;
  std::vector<int32_t> tokens;
};

std::vector<Call> read_calls(const std::string& path) {
  SafetensorsFile f(path);
  std::map<int, Call> steps;
  for (auto& [name, e] : f.entries()) {
    if (name.rfind("step", 0) != 0) continue;
    auto dot = name.find('.');
    std::string num = name.substr(4, dot == std::string::npos ? std::string::npos : dot - 4);
    if (num.empty() || num.find_first_not_of("0123456789") != std::string::npos || dot == std::string::npos) continue;
    std::string field = name.substr(dot + 1);
    Call& c = steps[std::stoi(num)];
    c.prefix = name.substr(0, dot);
    TensorView t = f.get(name);
    if (field == "start_pos") {
      if (t.numel() != 1 || (t.dtype != DType::I32 && t.dtype != DType::I64))
        fail(path, ": '", name, "' must be one I32 value");
      c.start_pos = t.dtype == DType::I32 ? t.as<int32_t>()[0] : int(t.as<int64_t>()[0]);
    } else if (field == "tokens") {
      if (t.shape.size() != 2 || (t.dtype != DType::I32 && t.dtype != DType::I64))
        fail(path, ": '", name, "' must be I32 [B, T], is ", dtype_name(t.dtype), " ", shape_str(t.shape));
      c.B = int(t.shape[0]);
      c.T = int(t.shape[1]);
      c.tokens.resize(size_t(t.numel()));
      for (int64_t i = 0; i < t.numel(); ++i)
        c.tokens[size_t(i)] = t.dtype == DType::I32 ? t.as<int32_t>()[i] : int32_t(t.as<int64_t>()[i]);
    }
  }
  std::vector<Call> out;
  for (auto& [k, c] : steps) {
    if (c.B == 0 || c.T == 0) fail(path, ": ", c.prefix, ".tokens is missing or empty");
    out.push_back(std::move(c));
  }
  if (out.empty()) fail(path, ": no stepNNN.tokens entries");
  for (auto& c : out)
    if (!f.has(c.prefix + ".start_pos")) fail(path, ": ", c.prefix, ".start_pos is missing");
  return out;
}

int run_logits(int argc, char** argv) {
  Args args(argc, argv, with_model_options({"calls", "out", "dump-taps"}));
  if (follow_leader(args, "ref")) return 0;  // (under mpirun, ranks but 0)
  std::vector<Call> calls = read_calls(args.require("calls"));
  std::string out_path = args.require("out");
  int slots = 1, len = 1;
  for (auto& c : calls) {
    slots = std::max(slots, c.B);
    len = std::max(len, c.start_pos + c.T);
  }
  LoadedModel lm = load_model(args, slots, len, "ref");  // the exact path unless asked otherwise
  Model& model = *lm.model;
  if (len > model.max_len())
    fail("calls reach position ", len - 1, ", past the model's maximum sequence length ", model.args().max_seq_len);
  const int V = model.args().vocab_size;
  std::vector<std::vector<float>> results;
  std::vector<NamedTensor> tensors;
  std::vector<std::string> names;
  results.reserve(calls.size());
  names.reserve(calls.size());
  // --dump-taps FILE: every named intermediate of every call, as stepNNN.<tap> [B*T, dim].
  std::vector<std::vector<float>> tap_data;
  std::vector<std::string> tap_names;
  std::vector<std::vector<int64_t>> tap_shapes;
  std::string prefix;
  if (args.has("dump-taps"))
    model.set_tap([&](const std::string& name, const float* d, int64_t rows, int64_t cols) {
      tap_names.push_back(prefix + "." + name);
      tap_data.emplace_back(d, d + rows * cols);
      tap_shapes.push_back({rows, cols});
    });
  for (auto& c : calls) {
    prefix = c.prefix;
    results.emplace_back(size_t(c.B) * size_t(V));
    try {
      model.forward(c.tokens.data(), c.B, c.T, c.start_pos, results.back().data());
    } catch (const Error& e) {
      fail(c.prefix, ": ", e.what());
    }
    names.push_back(c.prefix + ".logits");
  }
  for (size_t i = 0; i < calls.size(); ++i)
    tensors.push_back({names[i], DType::F32, {calls[i].B, V}, results[i].data()});
  write_safetensors(out_path, tensors);
  if (args.has("dump-taps")) {
    std::vector<NamedTensor> taps;
    for (size_t i = 0; i < tap_names.size(); ++i)
      taps.push_back({tap_names[i], DType::F32, tap_shapes[i], tap_data[i].data()});
    write_safetensors(args.get("dump-taps"), taps);
  }
  std::fprintf(stderr, "dsv3 logits: %zu calls -> %s\n", calls.size(), out_path.c_str());
  return 0;
}

}  // namespace

DSV3_COMMAND(logits, "--model DIR --calls CALLS.safetensors --out OUT.safetensors [--attn absorb|naive] [--backend B] [--dump-taps F]: replay forward calls, write logits", run_logits);

}  // namespace dsv3
