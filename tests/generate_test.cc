// dsv3 generate, greedy, on the golden checkpoints with the golden prompts as ids: the tokens
// follow the argmax of logits_fp32 at every step up to the first step where the reference's own
// recorded token departs from that argmax (golden/README.md).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "golden_util.h"
#include "io/safetensors.h"

using namespace dsv3;
using namespace dsv3::testing_util;

namespace {

std::string slurp(const std::string& p) {
  std::ifstream f(p);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

class GoldenGenerate : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenGenerate, GreedyFollowsFp32Argmax) {
  const std::string c = GetParam();
  SafetensorsFile g(case_dir(c) + "/golden.safetensors");
  TensorView lens = g.get("prompt_lens"), flat = g.get("prompt_tokens_flat");
  const int B = int(lens.dim(0));
  std::vector<std::vector<int32_t>> prompts;
  std::string ids_path = tmp_path("gen_" + c + ".txt");
  {
    std::ofstream f(ids_path);
    int off = 0;
    for (int b = 0; b < B; ++b) {
      int n = lens.as<int32_t>()[b];
      prompts.emplace_back(flat.as<int32_t>() + off, flat.as<int32_t>() + off + n);
      off += n;
      for (int i = 0; i < n; ++i) f << (i ? " " : "") << prompts.back()[size_t(i)];
      f << "\n";
    }
  }
  // How many tokens the reference generated per row: up to the last step's end position.
  int steps = std::atoi(g.metadata().at("steps").c_str());
  char key[32];
  std::snprintf(key, sizeof key, "step%03d", steps - 1);
  int end_pos = g.get(std::string(key) + ".start_pos").as<int32_t>()[0] + int(g.get(std::string(key) + ".tokens").dim(1)) + 1;
  int max_new = 0;
  for (auto& p : prompts) max_new = std::max(max_new, end_pos - int(p.size()));
  std::string out = tmp_path("gen_" + c + ".json");
  std::string cmd = std::string(DSV3_BINARY) + " generate --model " + case_dir(c) + "/hf --input-ids " + ids_path +
                    " --json --temperature 0 --ignore-eos --backend ref --max-new-tokens " +
                    std::to_string(max_new) + " >" + out + " 2>/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto res = nlohmann::json::parse(slurp(out));
  ASSERT_EQ(int(res.size()), B);
  const int V = int(g.get("step000.logits_fp32").dim(1));
  int checked = 0;
  for (int b = 0; b < B; ++b) {
    auto ours = res[size_t(b)]["completion_ids"].get<std::vector<int32_t>>();
    const int L = int(prompts[size_t(b)].size());
    for (int s = 0; s < steps; ++s) {
      std::snprintf(key, sizeof key, "step%03d", s);
      TensorView tok = g.get(std::string(key) + ".tokens");
      int next = g.get(std::string(key) + ".start_pos").as<int32_t>()[0] + int(tok.dim(1));  // position predicted
      if (next < L) continue;  // still inside the prompt
      int expected = argmax(g.get(std::string(key) + ".logits_fp32").as<float>() + size_t(b) * V, V);
      size_t j = size_t(next - L);
      ASSERT_LT(j, ours.size()) << c << " row " << b;
      EXPECT_EQ(ours[j], expected) << c << " row " << b << " generated token " << j;
      ++checked;
      if (s + 1 >= steps) break;
      std::snprintf(key, sizeof key, "step%03d", s + 1);
      TensorView nt = g.get(std::string(key) + ".tokens");
      if (nt.as<int32_t>()[size_t(b) * nt.dim(1)] != expected) break;  // the reference departed here
    }
  }
  EXPECT_GT(checked, 20) << c;
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenGenerate, ::testing::ValuesIn(golden_cases()));

TEST(GenerateCommand, RefusesBadInput) {
  std::string bad = tmp_path("gen_bad.txt");
  auto run = [&](const std::string& content, const std::string& extra) {
    std::ofstream(bad) << content;
    std::string err = tmp_path("gen_err.txt");
    int rc = std::system((std::string(DSV3_BINARY) + " generate --model " + case_dir("v3_fp8") + "/hf --input-ids " +
                          bad + " --json --backend ref " + extra + " >/dev/null 2>" + err).c_str());
    EXPECT_NE(rc, 0);
    return slurp(err);
  };
  EXPECT_NE(run("1 2 999\n", "").find("token id 999 is outside the vocabulary"), std::string::npos);
  EXPECT_NE(run("1 x 3\n", "").find("'x' is not a token id"), std::string::npos);
  EXPECT_NE(run("\n\n", "").find("no prompts"), std::string::npos);
  std::string longp;
  for (int i = 0; i < 300; ++i) longp += "5 ";
  EXPECT_NE(run(longp + "\n", "").find("does not fit the context"), std::string::npos);
  EXPECT_NE(run("1 2\n", "--temperature -1").find("temperature"), std::string::npos);
  EXPECT_NE(run("1 2\n", "--max-seqs 0").find("--max-seqs must be in [1, 4096], got 0"), std::string::npos);
  EXPECT_NE(run("1 2\n", "--max-step-tokens 0").find("--max-step-tokens must be in [1, 65536], got 0"),
            std::string::npos);
}

// Many prompts, a few in flight at a time (the rest queued in the scheduler): every prompt gets
// the completion it gets alone, in the input's order.
TEST(GenerateCommand, ManyPromptsAFewAtATimeGiveTheirAloneCompletions) {
  const std::string ids = tmp_path("gen_many.txt");
  std::ofstream f(ids);
  for (int i = 0; i < 40; ++i) {
    for (int t = 0; t <= i % 13; ++t) f << (3 + (i * 31 + t * 7) % 400) << " ";
    f << "\n";
  }
  f.close();
  auto completions = [&](const std::string& input, const std::string& extra) {
    const std::string out = tmp_path("gen_many_out.json");
    const std::string cmd = std::string(DSV3_BINARY) + " generate --model " + case_dir("v3_fp8") + "/hf --input-ids " +
                            input + " --json --backend ref --max-new-tokens 6 --temperature 0 " + extra + " >" + out +
                            " 2>/dev/null";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::vector<std::vector<int32_t>> c;
    for (auto& r : nlohmann::json::parse(slurp(out))) c.push_back(r["completion_ids"].get<std::vector<int32_t>>());
    return c;
  };
  const auto all = completions(ids, "--max-seqs 5");
  ASSERT_EQ(all.size(), 40u);
  // Steps of at most 3 tokens: the prompts go in chunks beside the decodes, the completions stay.
  EXPECT_EQ(completions(ids, "--max-seqs 5 --max-step-tokens 3"), all);
  std::ifstream in(ids);
  std::string line;
  for (int i = 0; std::getline(in, line); ++i) {
    if (i % 9 != 0) continue;  // a sample of them alone
    const std::string one = tmp_path("gen_one.txt");
    std::ofstream(one) << line << "\n";
    const auto alone = completions(one, "");
    ASSERT_EQ(alone.size(), 1u);
    EXPECT_EQ(all[size_t(i)], alone[0]) << "prompt " << i;
  }
}

}  // namespace

#include "runtime/model.h"
#include "runtime/generate.h"

namespace {
TEST(Generator, NeverSamplesPastTheVocabularyLimit) {
  ModelOptions opt;
  opt.max_seqs = 2;
  Model m(Checkpoint::open(case_dir("v3_fp8") + "/hf"), make_ref_backend(), opt);
  Generator gen(m, -1);
  gen.set_vocab_limit(100);
  GenerateRequest r;
  r.prompt = {5, 6, 7};
  r.sampling.temperature = 20.f;  // nearly uniform over the model's 512 ids
  r.max_new_tokens = 150;
  auto res = gen.run({r, r});
  for (auto& x : res) {
    ASSERT_EQ(x.tokens.size(), 150u);
    for (int32_t t : x.tokens) EXPECT_LT(t, 100);
  }
}
}  // namespace
