// The sampling options `dsv3 generate` and `dsv3 chat` share (--temperature, --top-p, --top-k,
// --min-p, --repetition-penalty, --presence-penalty, --frequency-penalty, --seed) and the one way
// to turn them into SamplingParams.
#pragma once
#include <string>
#include <vector>

#include "runtime/sampler.h"
#include "tools/command.h"

// For a command's usage line (a literal: usage strings are registered during static init).
#define DSV3_SAMPLING_USAGE                                                         \
  "[--temperature T] [--top-p P] [--top-k K] [--min-p P] [--repetition-penalty R] " \
  "[--presence-penalty P] [--frequency-penalty F] [--seed S]"

namespace dsv3 {

// `opts` plus the sampling option names.
std::vector<std::string> with_sampling_options(std::vector<std::string> opts);

// The sampling options of `args` over the defaults (SamplingParams' own, but temperature 0.2, as
// the reference's generate.py). Each option is range-checked by SamplingParams::validate on its
// own, so a bad value gets an Error naming the option: "--top-p must be in (0, 1], got 2".
SamplingParams parse_sampling_options(const Args& args);

}  // namespace dsv3
