// dsv3 serve: the OpenAI-compatible HTTP server (src/server/) on a model, with its chat page.
// SIGTERM or Ctrl-C drains (new requests get 503, those in flight finish within
// --drain-timeout seconds) and exits 0; a second signal cancels what still runs.
#include <pthread.h>
#include <signal.h>

#include <climits>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "runtime/scheduler.h"
#include "server/http_server.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "tools/command.h"
#include "tools/model_options.h"

namespace dsv3 {
namespace {

// What the signal thread and main() share. The signal thread lives until the process ends.
struct Signals {
  std::mutex mu;
  std::condition_variable cv;
  int count = 0;
  server::HttpServer* server = nullptr;  // set while it serves
  bool up = false;                       // it has served (a signal after that is not a start-up's)
  bool listener_done = false;
};

void wait_for_signals(Signals& s, sigset_t set) {
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    std::lock_guard<std::mutex> lk(s.mu);
    if (!s.server) {
      if (s.up) continue;  // already stopping
      std::fprintf(stderr, "dsv3 serve: %s while starting; exiting\n", strsignal(sig));  // nothing to drain
      std::_Exit(128 + sig);
    }
    if (++s.count == 2) {
      std::fprintf(stderr, "dsv3 serve: second signal: cancelling the requests still running\n");
      s.server->hurry();
    }
    s.cv.notify_all();
  }
}

std::string default_model_name(const std::string& dir) {
  std::filesystem::path p(dir);
  if (!p.has_filename()) p = p.parent_path();  // "models/x/" -> "x"
  return p.filename().string().empty() ? "dsv3" : p.filename().string();
}

int run_serve(int argc, char** argv) {
  Args args(argc, argv,
            with_model_options({"host", "port", "api-key", "max-seqs", "max-queue", "served-model-name", "tokenizer",
                                "max-model-len", "drain-timeout", "max-step-tokens"}));
  if (follow_leader(args)) return 0;  // (under mpirun, ranks but 0)
  // Every thread started from here on (the backend's, the engine's, httplib's) inherits this
  // mask, so SIGTERM and SIGINT reach only the thread that waits for them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  static Signals signals;  // outlives main's locals: the signal thread is never joined
  std::thread(wait_for_signals, std::ref(signals), set).detach();

  server::ServeOptions opt;
  opt.host = args.get("host", "127.0.0.1");
  const long port = args.get_int("port", 8000);
  if (port < 0 || port > 65535) fail("--port must be in [0, 65535] (0: any free port), got ", port);
  opt.port = int(port);
  opt.api_key = args.get("api-key");
  opt.max_seqs = int(args.get_int("max-seqs", 8));
  if (opt.max_seqs < 1 || opt.max_seqs > 4096) fail("--max-seqs must be in [1, 4096], got ", opt.max_seqs);
  opt.max_queue = int(args.get_int("max-queue", -1));
  if (opt.max_queue < -1 || opt.max_queue > 65536) fail("--max-queue must be in [0, 65536], got ", opt.max_queue);
  const int step_tokens = parse_max_step_tokens(args, chosen_backend(args));
  opt.drain_timeout_s = args.get_float("drain-timeout", 30);
  if (!(opt.drain_timeout_s >= 0)) fail("--drain-timeout must be >= 0 seconds");
  const std::string model_dir = args.require("model");
  opt.model_name = args.get("served-model-name", default_model_name(model_dir));
  const long max_len = args.get_int("max-model-len", INT_MAX);
  if (max_len < 2) fail("--max-model-len must be >= 2, got ", max_len);

  const std::string tdir = args.has("tokenizer") ? args.get("tokenizer") : find_tokenizer_dir(model_dir);
  auto tok = Tokenizer::load(tdir);
  std::unique_ptr<ChatTemplate> tmpl;
  try {
    tmpl = std::make_unique<ChatTemplate>(ChatTemplate::load(tdir));
  } catch (const Error& e) {
    std::fprintf(stderr, "dsv3 serve: no chat template (%s): /v1/chat/completions will refuse requests\n", e.what());
  }
  // Continuous batching: up to --max-seqs sequences per step, shared prompt prefixes cached.
  LoadedModel lm = load_model(args, opt.max_seqs, int(max_len));
  SchedulerOptions eo;
  eo.eos = tok->eos_id() >= 0 ? tok->eos_id() : lm.model->args().eos_token_id;
  eo.vocab_limit = tok->vocab_size();
  eo.max_seqs = opt.max_seqs;
  eo.max_step_tokens = step_tokens;  // the prefill chunk: larger steps, more throughput, longer decode stalls
  Scheduler engine(*lm.model, eo);
  engine.start();

  server::HttpServer http(engine, *tok, tmpl.get(), opt);
  const int bound = http.bind();
  std::printf("dsv3 serve: %s, context %d tokens, up to %d sequences at once, KV cache of %lld blocks of %d positions\n",
              opt.model_name.c_str(), engine.max_context(), opt.max_seqs, (long long)lm.model->kv_cache().n_blocks(),
              lm.model->kv_cache().block());
  std::printf("dsv3 serve: listening on http://%s:%d\n", opt.host.c_str(), bound);
  std::fflush(stdout);
  {
    std::lock_guard<std::mutex> lk(signals.mu);
    signals.server = &http;
    signals.up = true;
  }
  std::thread listener([&] {
    http.serve();
    std::lock_guard<std::mutex> lk(signals.mu);
    signals.listener_done = true;
    signals.cv.notify_all();
  });
  bool signalled = false;
  {
    std::unique_lock<std::mutex> lk(signals.mu);
    signals.cv.wait(lk, [&] { return signals.count > 0 || signals.listener_done; });
    signalled = signals.count > 0;
  }
  if (signalled) {
    std::fprintf(stderr, "dsv3 serve: shutting down: refusing new requests, finishing those in flight (up to %g s)\n",
                 opt.drain_timeout_s);
    http.shutdown();
  }
  listener.join();
  {
    std::lock_guard<std::mutex> lk(signals.mu);
    signals.server = nullptr;
  }
  engine.shutdown(0);
  std::fprintf(stderr, "dsv3 serve: stopped\n");
  return signalled ? 0 : 1;
}

}  // namespace

DSV3_COMMAND(serve,
             "--model DIR [--host 127.0.0.1] [--port 8000] [--api-key K] [--max-seqs N] [--max-queue N] "
             "[--kv-cache-gb X] [--served-model-name NAME] [--max-model-len N] [--max-step-tokens N] [--drain-timeout S]: "
             "OpenAI-compatible HTTP server and chat page",
             run_serve);

}  // namespace dsv3
