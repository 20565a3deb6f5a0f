// dsv3 chat: interactive multi-turn chat. Tokens stream as they are generated; /clear forgets
// the history, /exit (or end of input) quits; Ctrl-C stops the current answer, not the program.
// After each answer: prompt and generation speed.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "runtime/generate.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "tools/command.h"
#include "tools/model_options.h"
#include "tools/sampling_options.h"

namespace dsv3 {
namespace {

std::atomic<bool> g_cancel{false};
std::atomic<bool> g_generating{false};

void on_sigint(int) {
  if (g_generating) {
    g_cancel = true;
  } else {
    const char msg[] = "\n(Ctrl-C stops an answer; type /exit to quit)\n> ";
    ssize_t r = ::write(STDOUT_FILENO, msg, sizeof msg - 1);
    (void)r;
  }
}

int run_chat(int argc, char** argv) {
  Args args(argc, argv,
            with_model_options(with_sampling_options({"system", "max-new-tokens", "tokenizer", "max-len"})),
            {});
  if (follow_leader(args)) return 0;  // (under mpirun, ranks but 0)
  const SamplingParams sp = parse_sampling_options(args);
  std::string model_dir = args.require("model");
  std::string tdir = args.has("tokenizer") ? args.get("tokenizer") : find_tokenizer_dir(model_dir);
  auto tok = Tokenizer::load(tdir);
  ChatTemplate tmpl = ChatTemplate::load(tdir);
  const int max_new = int(args.get_int("max-new-tokens", 200));
  LoadedModel lm = load_model(args, 1, int(args.get_int("max-len", 4096)));
  Model& model = *lm.model;
  Generator gen(model, tok->eos_id() >= 0 ? tok->eos_id() : model.args().eos_token_id);
  gen.set_reuse_prefix(true);
  gen.set_vocab_limit(tok->vocab_size());

  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigint;
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, nullptr);

  nlohmann::json history = nlohmann::json::array();
  if (args.has("system")) history.push_back({{"role", "system"}, {"content", args.get("system")}});
  const nlohmann::json base = history;
  std::printf("dsv3 chat: %s (%d layers, context %d tokens). /clear forgets, /exit quits, Ctrl-C stops an answer.\n",
              model_dir.c_str(), model.args().n_layers, model.max_len());
  std::string line;
  int turn = 0;
  for (;;) {
    std::printf("> ");
    std::fflush(stdout);
    if (!std::getline(std::cin, line)) break;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/clear") {
      history = base;
      std::printf("(history cleared)\n");
      continue;
    }
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json msgs = history;
    msgs.push_back({{"role", "user"}, {"content", line}});
    std::vector<int32_t> prompt;
    try {
      prompt = tok->encode(tmpl.render(msgs, true));
    } catch (const Error& e) {
      std::printf("error: %s\n", e.what());
      continue;
    }
    if (int(prompt.size()) >= model.max_len()) {
      std::printf("error: the conversation (%zu tokens) no longer fits the context of %d tokens; /clear to start over\n",
                  prompt.size(), model.max_len());
      continue;
    }
    GenerateRequest req;
    req.prompt = prompt;
    req.sampling = sp;
    req.sampling.seed = sp.seed + uint64_t(turn++);
    req.max_new_tokens = max_new;
    StreamDecoder stream(*tok, true);
    GenerateStats before = gen.stats();
    g_cancel = false;
    g_generating = true;
    std::vector<GenerateResult> res;
    try {
      res = gen.run({req},
                    [&](size_t, int32_t id) {
                      std::string piece = stream.push(id);
                      std::fwrite(piece.data(), 1, piece.size(), stdout);
                      std::fflush(stdout);
                    },
                    &g_cancel);
    } catch (const Error& e) {
      g_generating = false;
      std::printf("\nerror: %s\n", e.what());
      continue;
    }
    g_generating = false;
    std::string rest = stream.flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    const GenerateStats& st = gen.stats();
    double pt = double(st.prompt_tokens - before.prompt_tokens), ps = st.prefill_s - before.prefill_s;
    double gt = double(st.generated_tokens - before.generated_tokens), gs = st.decode_s - before.decode_s;
    std::printf("%s\n[prompt %d tokens (%d new) %.1f tok/s | answer %.0f tokens %.1f tok/s%s]\n",
                res[0].finish_reason == "cancelled" ? " ^C" : "", res[0].prompt_tokens,
                res[0].prompt_tokens - res[0].reused_prompt_tokens, ps > 0 ? pt / ps : 0.0, gt, gs > 0 ? gt / gs : 0.0,
                res[0].finish_reason == "length" ? ", stopped at the token limit" : "");
    msgs.push_back({{"role", "assistant"}, {"content", tok->decode(res[0].tokens, true)}});
    history = msgs;
  }
  std::printf("\n");
  return 0;
}

}  // namespace

DSV3_COMMAND(chat,
             "--model DIR [--system TEXT] [--max-new-tokens N] [--max-len N] " DSV3_SAMPLING_USAGE
             ": interactive chat",
             run_chat);

}  // namespace dsv3
