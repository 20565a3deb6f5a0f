// dsv3 bench --concurrency 1,64,256 --input-len I --output-len O: serving measured offline, the
// continuous-batching scheduler in this process (no HTTP): R requests of I random prompt tokens
// (after an optional shared prefix, as a system prompt) and exactly O output tokens, at most N in
// flight, arriving all at once or as a Poisson process; reported as vLLM's `bench serve` reports
// (tools/serving_report.h) plus the KV blocks the run held at most and the prefix-cache hit rate.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/thread_pool.h"
#include "runtime/generate.h"
#include "runtime/scheduler.h"
#include "tools/bench_model.h"
#include "tools/model_options.h"
#include "tools/serving_report.h"

namespace dsv3 {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<int> int_list(const std::string& s, const char* what, int lo, int hi) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    char* end = nullptr;
    const long x = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end || x < lo || x > hi)
      fail("--", what, " must be a comma-separated list of integers in [", lo, ", ", hi, "], got '", s, "'");
    v.push_back(int(x));
  }
  if (v.empty()) fail("--", what, " is empty");
  return v;
}

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The level's prompts: random ids after the shared prefix.
std::vector<std::vector<int32_t>> level_prompts(const Model& model, const ServingLoad& l,
                                                const std::vector<int32_t>& prefix) {
  const int V = model.args().vocab_size;
  std::vector<std::vector<int32_t>> prompts = random_prompts(l, std::min(1000, V / 4), std::min(32000, V));
  for (auto& p : prompts) p.insert(p.begin(), prefix.begin(), prefix.end());
  return prompts;
}

// One concurrency level: every request through the scheduler, timed from its submission.
json run_level(Model& model, const ServingLoad& l, const std::vector<int32_t>& prefix, const SchedulerOptions& base) {
  SchedulerOptions so = base;
  so.eos = -1, so.max_seqs = l.concurrency;
  Scheduler sched(model, so);
  sched.start();
  const std::vector<std::vector<int32_t>> prompts = level_prompts(model, l, prefix);
  const std::vector<double> arrival = arrival_times(l);
  std::vector<RequestTiming> out(size_t(l.requests));
  std::vector<Clock::time_point> t0(size_t(l.requests)), last(size_t(l.requests));
  std::mutex mu;
  std::condition_variable cv;
  int inflight = 0, done = 0;
  int64_t peak_blocks = 0;
  const EngineStats before = sched.stats();
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < l.requests; ++i) {
    std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(arrival[size_t(i)])));
    {
      std::unique_lock<std::mutex> lk(mu);
      cv.wait(lk, [&] { return inflight < l.concurrency; });
      ++inflight;
    }
    EngineRequest r;
    r.prompt = prompts[size_t(i)];
    r.max_tokens = l.output_len;
    r.ignore_eos = true;
    t0[size_t(i)] = last[size_t(i)] = Clock::now();
    sched.submit(std::move(r), [&, i](const StreamEvent& ev) {
      const int64_t used = sched.stats().kv_blocks_used;
      std::lock_guard<std::mutex> lk(mu);
      RequestTiming& o = out[size_t(i)];
      peak_blocks = std::max(peak_blocks, used);
      const Clock::time_point now = Clock::now();
      if (!ev.tokens.empty()) {
        if (o.output_tokens == 0) o.ttft = std::chrono::duration<double>(now - t0[size_t(i)]).count();
        else o.itl.push_back(std::chrono::duration<double>(now - last[size_t(i)]).count());
        o.output_tokens += int(ev.tokens.size());
        last[size_t(i)] = now;
      }
      if (ev.finish == Finish::kNone) return;
      o.e2e = std::chrono::duration<double>(now - t0[size_t(i)]).count();
      o.ok = ev.finish == Finish::kLength && o.output_tokens == l.output_len;
      if (!o.ok) o.error = ev.finish == Finish::kError ? "engine" : "short_output";
      --inflight, ++done;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return done == l.requests; });
  }
  const double duration = since(start);
  const EngineStats st = sched.stats();
  sched.shutdown(0);
  json rep = serving_report(l, out, duration);
  const int64_t queried = st.prefix_query_tokens - before.prefix_query_tokens;
  rep["shared_prefix_len"] = int(prefix.size());
  rep["kv_blocks_peak"] = peak_blocks;
  rep["kv_blocks_total"] = st.kv_blocks_total;
  rep["prefix_cache_hit_rate"] = queried > 0 ? double(st.prefix_hit_tokens - before.prefix_hit_tokens) / double(queried) : 0.0;
  rep["preemptions"] = st.preemptions - before.preemptions;
  // Where the time went: the model steps, and the decode-only ones among them.
  rep["steps"] = st.steps - before.steps;
  rep["step_tokens"] = st.step_tokens - before.step_tokens;
  rep["step_time_s"] = st.step_s - before.step_s;
  rep["decode_steps"] = st.decode_steps - before.decode_steps;
  rep["decode_step_time_s"] = st.decode_step_s - before.decode_step_s;
  rep["prefix_cache"] = so.prefix_cache;
  return rep;
}

// One request as `dsv3 generate` runs it (the scheduler stepped on this thread, no hand-off to a
// serving thread), with the level's first prompt (after the shared prefix) and its output length:
// its decode time per token, for the one-request bar (served >= 95% of generate's batch-1 speed).
double generate_tpot_ms(Model& model, const ServingLoad& l, const std::vector<int32_t>& prefix,
                        const SchedulerOptions& so) {
  GenerateRequest r;
  r.prompt = level_prompts(model, l, prefix)[0];
  r.max_new_tokens = 2;
  {
    Generator warm(model, -1, so.max_step_tokens);  // (recorded steps and scratch for this shape)
    warm.run({r});
  }
  r.max_new_tokens = l.output_len;
  Generator g(model, -1, so.max_step_tokens);
  g.run({r});
  const GenerateStats& st = g.stats();
  return st.generated_tokens > 1 ? 1e3 * st.decode_s / double(st.generated_tokens - 1) : 0.0;
}

}  // namespace

int run_serving_bench(const Args& args) {
  if (args.has("threads")) {
    const long t = args.get_int("threads", 0);
    if (t < 1 || t > 1024) fail("--threads must be in [1, 1024], got ", t);
    ThreadPool::set_global_threads(int(t));
  }
  const std::string device = args.get("device", "cpu");
  if (device != "cpu" && device != "cuda") fail("--device must be cpu or cuda, got '", device, "'");
  const std::string backend = device == "cuda" ? "cuda" : args.get("backend", "cpu");
  const std::vector<int> levels = int_list(args.get("concurrency"), "concurrency", 1, 4096);
  ServingLoad base;
  base.input_len = int(args.get_int("input-len", 512));
  base.output_len = int(args.get_int("output-len", 256));
  base.rate = args.get_float("request-rate", INFINITY);
  base.seed = uint64_t(args.get_int("seed", 1));
  const long shared = args.get_int("shared-prefix", 0);
  const int step_tokens = parse_max_step_tokens(args, backend);
  if (base.input_len < 1 || base.output_len < 1) fail("--input-len and --output-len must be >= 1");
  if (!(base.rate > 0)) fail("--request-rate must be > 0 requests per second (default: all at once)");
  if (shared < 0) fail("--shared-prefix must be >= 0 tokens, got ", shared);
  const std::string pc = args.get("prefix-cache", "on");
  if (pc != "on" && pc != "off") fail("--prefix-cache must be on or off, got '", pc, "'");
  SchedulerOptions sched;
  sched.max_step_tokens = step_tokens, sched.prefix_cache = pc == "on";
  BenchSource src = bench_source(args, backend == "cuda");
  const int max_c = *std::max_element(levels.begin(), levels.end());
  ModelOptions opt;
  opt.max_seqs = max_c;
  opt.max_len = int(std::min<long>(src.args.max_seq_len, shared + base.input_len + base.output_len + 1));
  if (shared + base.input_len + base.output_len > opt.max_len)
    fail("--shared-prefix + --input-len + --output-len = ", shared + base.input_len + base.output_len,
         " tokens exceed the model's context of ", src.args.max_seq_len);
  opt.kv_cache_gb = args.get_float("kv-cache-gb", 0);
  opt.weights = parse_weight_memory(args);
  const std::string what = src.what;
  std::unique_ptr<Model> model = bench_model(src, backend, opt, base.seed);
  std::vector<int32_t> prefix;
  {
    ServingLoad p = base;
    p.requests = 1, p.input_len = int(shared), p.seed = base.seed + 999;
    const int V = model->args().vocab_size;
    prefix = random_prompts(p, std::min(1000, V / 4), std::min(32000, V))[0];
  }
  json all = json::array();
  for (int c : levels) {
    ServingLoad l = base;
    l.concurrency = c;
    l.requests = args.has("requests") ? int(args.get_int("requests", 0)) : std::max(4 * c, 8);
    if (l.requests < 1) fail("--requests must be >= 1, got ", l.requests);
    l.seed = base.seed + uint64_t(c);
    {  // warm-up: a few requests of the same shape (recorded steps, scratch, caches)
      ServingLoad w = l;
      w.requests = std::min(c, 4), w.output_len = std::min(l.output_len, 4), w.seed = l.seed + 7;
      run_level(*model, w, prefix, sched);
    }
    json rep = run_level(*model, l, prefix, sched);
    rep["model"] = what, rep["backend"] = backend, rep["max_step_tokens"] = step_tokens;
    if (c == 1 && l.output_len > 1) {  // the same request as generate runs it, on the same model
      const double g = generate_tpot_ms(*model, l, prefix, sched), t = rep["tpot"]["mean_ms"].get<double>();
      rep["generate_tpot_ms"] = g;
      rep["vs_generate"] = t > 0 ? g / t : 0.0;
    }
    if (!args.has("json")) print_serving_report(rep);
    all.push_back(rep);
  }
  if (args.has("json")) std::printf("%s\n", all.dump(2).c_str());
  for (const json& r : all)
    if (r["failed"].get<int>() > 0) return 1;
  return 0;
}

}  // namespace dsv3
