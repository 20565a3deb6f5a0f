// The sampling options `dsv3 chat` and `dsv3 generate` share (tools/sampling_options.h), through
// the built binary on a tiny synthetic model: chat takes every one of them as generate does, the
// penalties included, and both refuse a bad value with a message naming the option.
#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_util.h"
#include "golden_util.h"
#include "text/tokenizer.h"
#include "tools/synth.h"

using dsv3::testing_util::CliRun;
using dsv3::testing_util::run_dsv3;
using dsv3::testing_util::tmp_path;

namespace {

class SamplingOptions : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(tmp_path("sampling_model"));
    std::system(("rm -rf '" + *dir_ + "'").c_str());
    dsv3::SynthOptions o;
    o.shape = "tiny";
    o.dtype = "fp8";
    o.out_dir = *dir_;
    o.seed = 5;
    o.fsync = false;
    o.tokenizer_dir = dsv3::find_tokenizer_dir("");
    dsv3::synthesize(o);
  }
  static void TearDownTestSuite() {
    std::system(("rm -rf '" + *dir_ + "'").c_str());
    delete dir_;
  }

  // The one answer of a chat asked "Hello" with `options`.
  static std::string chat_answer(const std::string& options) {
    CliRun r = run_dsv3("chat --model '" + *dir_ + "' --backend ref --max-new-tokens 24 " + options,
                        "Hello\n/exit\n");
    EXPECT_EQ(r.rc, 0) << r.err;
    const size_t start = r.out.find("\n> "), end = r.out.find("\n[prompt ");
    if (start == std::string::npos || end == std::string::npos || end < start + 3) {
      ADD_FAILURE() << "no answer in chat's output:\n" << r.out;
      return "";
    }
    return r.out.substr(start + 3, end - start - 3);
  }
  // generate's completion of the same prompt (the chat template around "Hello") with `options`.
  static std::string generate_completion(const std::string& options) {
    CliRun r = run_dsv3("generate --model '" + *dir_ +
                        "' --backend ref --max-new-tokens 24 --prompt Hello --json " + options);
    EXPECT_EQ(r.rc, 0) << r.err;
    try {
      return nlohmann::json::parse(r.out).at(0).at("completion").get<std::string>();
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what() << "\n" << r.out;
      return "";
    }
  }

  static std::string* dir_;
};
std::string* SamplingOptions::dir_ = nullptr;

TEST_F(SamplingOptions, ChatTakesThePenaltiesAsGenerateDoes) {
  const std::string greedy = chat_answer("--temperature 0");
  ASSERT_FALSE(greedy.empty());
  // Each penalty, turned round to reward the tokens of the context, makes greedy decoding repeat
  // them, which the unpenalised greedy answer does not: the option reaches the sampler.
  for (const char* penalty :
       {"--frequency-penalty -1000", "--presence-penalty -1000", "--repetition-penalty 0.001"}) {
    SCOPED_TRACE(penalty);
    const std::string opts = std::string("--temperature 0 ") + penalty;
    const std::string answer = chat_answer(opts);
    EXPECT_NE(answer, greedy);
    EXPECT_EQ(answer, generate_completion(opts));
  }
  // Every option at once, sampled: the first chat turn draws with --seed as generate's first prompt.
  const std::string all =
      "--temperature 0.9 --top-p 0.95 --top-k 1000 --min-p 0.001 --repetition-penalty 1.3 "
      "--presence-penalty 0.5 --frequency-penalty 0.25 --seed 7";
  EXPECT_EQ(chat_answer(all), generate_completion(all));
}

TEST_F(SamplingOptions, BadValuesAreRefusedNamingTheOption) {
  struct Bad {
    const char* options;
    const char* message;
  };
  const Bad bad[] = {
      {"--temperature -1", "--temperature must be a finite number >= 0 (0 = greedy), got -1"},
      {"--temperature nan", "--temperature must be a finite number >= 0"},
      {"--top-p 0", "--top-p must be in (0, 1], got 0"},
      {"--top-p 1.5", "--top-p must be in (0, 1], got 1.5"},
      {"--top-p x", "option --top-p expects a number, got 'x'"},
      {"--top-k -3", "--top-k must be >= 0 (0 = off), got -3"},
      {"--top-k 99999999999", "--top-k must be in [0, 2147483647] (0 = off), got 99999999999"},
      {"--min-p 2", "--min-p must be in [0, 1], got 2"},
      {"--repetition-penalty 0", "--repetition-penalty must be a finite number > 0 (1 = off), got 0"},
      {"--repetition-penalty -2", "--repetition-penalty must be a finite number > 0"},
      {"--presence-penalty inf", "--presence-penalty must be finite, got inf"},
      {"--frequency-penalty nan", "--frequency-penalty must be finite, got nan"},
      {"--frequency-penalty 1e39", "--frequency-penalty must be finite, got inf"},
      {"--seed -1", "--seed must be >= 0, got -1"},
  };
  for (const char* command : {"chat", "generate --prompt Hello"}) {
    for (const Bad& b : bad) {
      SCOPED_TRACE(std::string(command) + " " + b.options);
      CliRun r =
          run_dsv3(std::string(command) + " --model '" + *dir_ + "' --backend ref " + b.options, "Hello\n");
      EXPECT_EQ(r.rc, 1);
      EXPECT_EQ(r.out, "");  // refused before the model loads
      EXPECT_NE(r.err.find(b.message), std::string::npos) << "stderr: " << r.err;
    }
  }
}

}  // namespace
