#include "tools/sampling_options.h"

#include <climits>

#include "core/error.h"

namespace dsv3 {
namespace {

// The float options; each is the SamplingParams field of the same name with '_' for '-'.
struct FloatOption {
  const char* name;
  float SamplingParams::*field;
};
constexpr FloatOption kFloatOptions[] = {
    {"temperature", &SamplingParams::temperature},
    {"top-p", &SamplingParams::top_p},
    {"min-p", &SamplingParams::min_p},
    {"repetition-penalty", &SamplingParams::repetition_penalty},
    {"presence-penalty", &SamplingParams::presence_penalty},
    {"frequency-penalty", &SamplingParams::frequency_penalty},
};

// Validates `one` (default SamplingParams but the field `option` sets) and rethrows its Error
// under the option's name: "sampling: top_p must be ..." becomes "--top-p must be ...".
void check_option(const char* option, const SamplingParams& one) {
  try {
    one.validate();
  } catch (const Error& e) {
    std::string field = option;
    for (char& c : field)
      if (c == '-') c = '_';
    const std::string msg = e.what(), prefix = "sampling: " + field + " ";
    if (msg.rfind(prefix, 0) == 0) fail("--", option, " ", msg.substr(prefix.size()));
    fail("--", option, ": ", msg);
  }
}

}  // namespace

std::vector<std::string> with_sampling_options(std::vector<std::string> opts) {
  for (const FloatOption& o : kFloatOptions) opts.push_back(o.name);
  opts.push_back("top-k");
  opts.push_back("seed");
  return opts;
}

SamplingParams parse_sampling_options(const Args& args) {
  SamplingParams sp;
  sp.temperature = 0.2f;  // the reference's generate.py default
  for (const FloatOption& o : kFloatOptions) {
    if (!args.has(o.name)) continue;
    SamplingParams one;
    one.*o.field = float(args.get_float(o.name, 0));
    check_option(o.name, one);
    sp.*o.field = one.*o.field;
  }
  if (args.has("top-k")) {
    const long k = args.get_int("top-k", 0);
    if (k < INT_MIN || k > INT_MAX) fail("--top-k must be in [0, ", INT_MAX, "] (0 = off), got ", k);
    SamplingParams one;
    one.top_k = int(k);
    check_option("top-k", one);
    sp.top_k = one.top_k;
  }
  if (args.has("seed")) {
    const long seed = args.get_int("seed", 0);
    if (seed < 0) fail("--seed must be >= 0, got ", seed);
    sp.seed = uint64_t(seed);
  }
  sp.validate();
  return sp;
}

}  // namespace dsv3
