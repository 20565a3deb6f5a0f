// dsv3 generate: the reference's batch generation — prompts (text through the chat template, or
// raw ids) of different lengths in one batch, sampled until EOS or the token budget, printed as
// prompt/completion pairs (or JSON).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/thread_pool.h"
#include "io/mmap_file.h"
#include "runtime/generate.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "tools/command.h"
#include "tools/model_options.h"
#include "tools/sampling_options.h"

namespace dsv3 {
namespace {

std::vector<std::vector<int32_t>> read_id_lines(const std::string& path) {
  std::ifstream f(path);
  if (!f) fail(path, ": cannot open");
  std::vector<std::vector<int32_t>> out;
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::istringstream ss(line);
    std::vector<int32_t> ids;
    std::string w;
    while (ss >> w) {
      char* end = nullptr;
      long v = std::strtol(w.c_str(), &end, 10);
      if (*end || v < INT32_MIN || v > INT32_MAX) fail(path, ":", n, ": '", w, "' is not a token id");
      ids.push_back(int32_t(v));
    }
    out.push_back(std::move(ids));
  }
  if (out.empty()) fail(path, ": no prompts (one prompt per line, space-separated ids)");
  return out;
}

std::vector<std::string> read_text_lines(const std::string& path) {
  std::ifstream f(path);
  if (!f) fail(path, ": cannot open");
  std::vector<std::string> out;
  std::string line;
  while (std::getline(f, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") != std::string::npos) out.push_back(line);
  }
  if (out.empty()) fail(path, ": no prompts (one prompt per line)");
  return out;
}

int run_generate(int argc, char** argv) {
  Args args(argc, argv,
            with_model_options(with_sampling_options(
                {"input-file", "input-ids", "prompt", "max-new-tokens", "system", "tokenizer", "max-seqs",
                 "max-step-tokens"})),
            {"raw", "json", "ignore-eos"});
  if (follow_leader(args)) return 0;  // (under mpirun, ranks but 0)
  int sources = args.has("input-file") + args.has("input-ids") + args.has("prompt");
  if (sources != 1) fail("give exactly one of --prompt TEXT, --input-file F, --input-ids F");
  const SamplingParams sp = parse_sampling_options(args);
  const bool json_out = args.has("json");

  std::unique_ptr<Tokenizer> tok;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> texts;
  std::string model_dir = args.require("model");
  if (args.has("input-ids")) {
    prompts = read_id_lines(args.get("input-ids"));
    try {
      tok = Tokenizer::load(args.has("tokenizer") ? args.get("tokenizer") : find_tokenizer_dir(model_dir));
    } catch (const Error&) {
      if (!json_out) throw;  // ids in, ids out: no tokenizer needed
    }
  } else {
    texts = args.has("prompt") ? std::vector<std::string>{args.get("prompt")} : read_text_lines(args.get("input-file"));
    std::string tdir = args.has("tokenizer") ? args.get("tokenizer") : find_tokenizer_dir(model_dir);
    tok = Tokenizer::load(tdir);
    std::unique_ptr<ChatTemplate> tmpl;
    if (!args.has("raw")) tmpl = std::make_unique<ChatTemplate>(ChatTemplate::load(tdir));
    for (auto& t : texts) {
      if (t.empty()) fail("empty prompt");
      std::string rendered = t;
      if (tmpl) {
        nlohmann::json msgs = nlohmann::json::array();
        if (args.has("system")) msgs.push_back({{"role", "system"}, {"content", args.get("system")}});
        msgs.push_back({{"role", "user"}, {"content", t}});
        rendered = tmpl->render(msgs, true);
      }
      prompts.push_back(tok->encode(rendered));
    }
  }

  const int max_new = int(args.get_int("max-new-tokens", 200));  // the reference's default
  const long max_seqs = args.get_int("max-seqs", 8);
  if (max_new < 0) fail("--max-new-tokens must be >= 0, got ", max_new);
  if (max_seqs < 1 || max_seqs > 4096) fail("--max-seqs must be in [1, 4096], got ", max_seqs);
  const int step_tokens = parse_max_step_tokens(args, chosen_backend(args));

  size_t longest = 0;
  for (auto& p : prompts) longest = std::max(longest, p.size());
  LoadedModel lm = load_model(args, int(std::min<long>(max_seqs, long(prompts.size()))), int(longest) + max_new + 1);
  Model& model = *lm.model;
  int eos = tok ? tok->eos_id() : model.args().eos_token_id;
  if (eos < 0) eos = model.args().eos_token_id;
  if (args.has("ignore-eos")) eos = -1;  // as the reference's eos_id=-1: always max_new_tokens
  // Every prompt at once through the scheduler: at most --max-seqs in flight, the rest queued;
  // shared prompt prefixes (a system prompt) computed once; steps of at most --max-step-tokens.
  Generator gen(model, eos, step_tokens);
  gen.set_max_seqs(int(max_seqs));
  gen.set_reuse_prefix(true);
  if (tok) gen.set_vocab_limit(tok->vocab_size());
  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateRequest r;
    r.prompt = prompts[i];
    r.sampling = sp;
    r.sampling.seed = sp.seed + i;  // distinct streams per prompt, reproducible per seed
    r.max_new_tokens = max_new;
    reqs.push_back(std::move(r));
  }
  const std::vector<GenerateResult> res = gen.run(reqs);
  nlohmann::json results = nlohmann::json::array();
  for (size_t i = 0; i < res.size(); ++i) {
    std::string completion = tok ? tok->decode(res[i].tokens, true) : "";
    if (json_out) {
      nlohmann::json o = {{"prompt_ids", prompts[i]}, {"completion_ids", res[i].tokens},
                          {"finish_reason", res[i].finish_reason}};
      if (tok) {
        o["prompt"] = texts.empty() ? tok->decode(prompts[i], false) : texts[i];
        o["completion"] = completion;
      }
      results.push_back(o);
    } else {
      std::printf("Prompt: %s\nCompletion: %s\n\n", texts.empty() ? tok->decode(prompts[i], false).c_str() : texts[i].c_str(),
                  completion.c_str());
    }
  }
  if (json_out) std::printf("%s\n", results.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  const GenerateStats& st = gen.stats();
  std::fprintf(stderr, "prefill %lld tokens in %.2f s (%.1f tok/s); decode %lld tokens in %.2f s (%.1f tok/s)\n",
               (long long)st.prompt_tokens, st.prefill_s, st.prefill_s > 0 ? st.prompt_tokens / st.prefill_s : 0.0,
               (long long)st.generated_tokens, st.decode_s, st.decode_s > 0 ? st.generated_tokens / st.decode_s : 0.0);
  return 0;
}

}  // namespace

DSV3_COMMAND(
    generate,
    "--model DIR (--prompt TEXT | --input-file F | --input-ids F) [--max-new-tokens N] " DSV3_SAMPLING_USAGE
    " [--raw] [--json] [--ignore-eos] [--system TEXT] [--max-seqs N] [--max-step-tokens T]: batch generation of any "
    "number of prompts, at most N (8) at once, steps of at most T tokens (8192 with --backend cuda, else 2048)",
    run_generate);

}  // namespace dsv3
