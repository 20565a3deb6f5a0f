// The scheduler (runtime/scheduler.h) on the golden checkpoints: batch invariance under greedy
// decoding (a request's tokens the same alone or among 31 others of different lengths arriving at
// different steps), preemption and recompute, prefix-cache hits against misses, cancellation and
// the block counts, many short requests with random cancellations, the thread mode, refusals.
#include "runtime/scheduler.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "golden_util.h"
#include "io/checkpoint.h"
#include "runtime/model.h"

namespace dsv3 {
namespace {

using testing_util::case_dir;
using testing_util::tmp_path;

std::unique_ptr<Model> make_model(const std::string& backend, int kv_block = 8, double kv_gb = 0,
                                  int max_seqs = 32) {
  ModelOptions o;
  o.max_seqs = max_seqs, o.max_len = 256, o.kv_block = kv_block, o.kv_cache_gb = kv_gb;
  return std::make_unique<Model>(Checkpoint::open(case_dir("v2lite_bf16") + "/hf"), make_backend(backend), o);
}

// What one request received: its tokens (with log-probabilities when asked), its end.
struct Got {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  std::vector<std::vector<TokenLogprob>> top;
  Finish finish = Finish::kNone;
  int events_after_finish = 0, prompt = 0, cached = 0, completion = 0;
  std::string error;
};

struct Collector {
  std::map<uint64_t, Got> got;
  StreamFn fn() {
    return [this](const StreamEvent& e) {
      Got& g = got[e.request];
      if (g.finish != Finish::kNone) ++g.events_after_finish;
      for (const SampledToken& t : e.tokens)
        g.ids.push_back(t.id), g.logprobs.push_back(t.logprob), g.top.push_back(t.top);
      if (e.finish != Finish::kNone) {
        g.finish = e.finish, g.error = e.error;
        g.prompt = e.prompt_tokens, g.cached = e.cached_prompt_tokens, g.completion = e.completion_tokens;
      }
    };
  }
};

EngineRequest greedy(std::vector<int32_t> prompt, int max_tokens) {
  EngineRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0.f;
  return r;
}

std::vector<int32_t> prompt_of(int len, uint32_t seed, int vocab) {
  std::mt19937 g(seed);
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (auto& t : p) t = int32_t(g() % uint32_t(vocab - 2)) + 2;  // (not BOS / EOS)
  return p;
}

// The request's tokens when it runs alone in a fresh scheduler.
Got alone(Model& m, const EngineRequest& r) {
  SchedulerOptions o;
  o.eos = load_model_args(m.checkpoint()).eos_token_id;
  Scheduler s(m, o);
  Collector c;
  const uint64_t id = s.submit(r, c.fn());
  s.run_until_idle();
  return c.got[id];
}

TEST(Scheduler, GreedyTokensAreTheSameAloneOrAmong31Others) {
  for (const std::string be : {"ref", "cpu"}) {
    auto m = make_model(be);
    const int V = m->args().vocab_size;
    std::vector<EngineRequest> reqs;
    for (int i = 0; i < 32; ++i)
      reqs.push_back(greedy(prompt_of(3 + (i * 7) % 41, uint32_t(i), V), 4 + i % 9));
    std::vector<Got> want;
    for (const EngineRequest& r : reqs) want.push_back(alone(*m, r));
    SchedulerOptions o;
    o.eos = load_model_args(m->checkpoint()).eos_token_id;
    o.max_step_tokens = 64;  // long prompts go in chunks beside the decodes
    Scheduler s(*m, o);
    Collector c;
    std::vector<uint64_t> ids;
    for (size_t i = 0; i < reqs.size(); ++i) {  // arriving four at a time, a step apart
      ids.push_back(s.submit(reqs[i], c.fn()));
      if (i % 4 == 3) s.step();
    }
    s.run_until_idle();
    for (size_t i = 0; i < reqs.size(); ++i) {
      const Got& g = c.got[ids[i]];
      EXPECT_EQ(g.ids, want[i].ids) << be << " request " << i;
      EXPECT_EQ(g.finish, want[i].finish) << be << " request " << i;
      EXPECT_EQ(g.events_after_finish, 0);
    }
    EXPECT_EQ(m->kv_cache().used_blocks(), 0) << be;
    EXPECT_EQ(s.stats().running + s.stats().waiting, 0);
  }
}

// A cache too small for every sequence at once: the newest are preempted and recomputed later,
// and every request still gets its alone tokens.
TEST(Scheduler, PreemptionAndRecomputeGiveTheSameTokens) {
  auto m = make_model("ref", 8, 0, 32);
  const int V = m->args().vocab_size;
  const int64_t per_block = KvCache::bytes_per_position(m->args(), AttnImpl::kAbsorb) * 8;
  auto small = make_model("ref", 8, double(12 * per_block) / 1e9);  // 12 blocks of 8 positions
  ASSERT_EQ(small->kv_cache().n_blocks(), 12);
  std::vector<EngineRequest> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(greedy(prompt_of(10 + i, uint32_t(100 + i), V), 14));
  for (bool prefix : {false, true}) {
    SchedulerOptions o;
    o.eos = -1, o.prefix_cache = prefix;
    Scheduler s(*small, o);
    Collector c;
    std::vector<uint64_t> ids;
    for (const EngineRequest& r : reqs) ids.push_back(s.submit(r, c.fn()));
    s.run_until_idle();
    EXPECT_GT(s.stats().preemptions, 0) << "the case is meant to preempt";
    for (size_t i = 0; i < reqs.size(); ++i) {
      SchedulerOptions ao;
      ao.eos = -1;
      Scheduler a(*m, ao);
      Collector ac;
      const uint64_t id = a.submit(reqs[i], ac.fn());
      a.run_until_idle();
      EXPECT_EQ(c.got[ids[i]].ids, ac.got[id].ids) << "request " << i << (prefix ? " (prefix cache)" : "");
      EXPECT_EQ(c.got[ids[i]].finish, Finish::kLength);
    }
    EXPECT_EQ(small->kv_cache().used_blocks(), 0);
  }
}

// A prompt whose first blocks are cached gives the log-probabilities it gives computed from scratch:
// exactly on the ref backend (every row's arithmetic independent of the batch), to float32
// rounding on the SIMD one (its products of many rows tile by the batch's size).
TEST(Scheduler, PrefixCacheHitsGiveTheSameLogitsAsMisses) {
  for (const std::string be : {"ref", "cpu"}) {
    auto m = make_model(be, 8);
    const int V = m->args().vocab_size;
    const std::vector<int32_t> shared = prompt_of(29, 7, V);
    std::vector<int32_t> p2 = shared;
    for (int32_t t : prompt_of(5, 8, V)) p2.push_back(t);
    EngineRequest first = greedy(shared, 3), second = greedy(p2, 6);
    second.top_logprobs = 4;
    Got got[2];
    for (int cached = 0; cached < 2; ++cached) {
      SchedulerOptions o;
      o.eos = -1, o.prefix_cache = cached == 1;
      Scheduler s(*m, o);
      Collector c;
      s.submit(first, c.fn());
      s.run_until_idle();
      const uint64_t id = s.submit(second, c.fn());
      s.run_until_idle();
      got[cached] = c.got[id];
      const EngineStats st = s.stats();
      if (cached) {
        EXPECT_EQ(got[1].cached, 24) << "three full blocks of the 29 shared tokens";
        EXPECT_EQ(st.prefix_hit_tokens, 24);
        EXPECT_EQ(st.prefix_query_tokens, 29 + 34);
      } else {
        EXPECT_EQ(got[0].cached, 0);
      }
    }
    const float tol = be == "ref" ? 0.f : 2e-5f;
    EXPECT_EQ(got[1].ids, got[0].ids) << be;
    ASSERT_EQ(got[1].top.size(), got[0].top.size());
    for (size_t i = 0; i < got[0].top.size(); ++i) {
      EXPECT_NEAR(got[1].logprobs[i], got[0].logprobs[i], tol) << be << " token " << i;
      ASSERT_EQ(got[1].top[i].size(), 4u);
      for (size_t k = 0; k < 4; ++k) {
        EXPECT_EQ(got[1].top[i][k].id, got[0].top[i][k].id) << be;
        EXPECT_NEAR(got[1].top[i][k].logprob, got[0].top[i][k].logprob, tol) << be << " token " << i;
      }
    }
    // The chosen token's log-probability is its top-1 where greedy.
    for (size_t i = 0; i < got[0].ids.size(); ++i) EXPECT_EQ(got[0].top[i][0].id, got[0].ids[i]);
  }
}

TEST(Scheduler, CancellationReturnsEveryBlock) {
  auto m = make_model("cpu", 8);
  const int V = m->args().vocab_size;
  SchedulerOptions o;
  o.eos = -1;
  Scheduler s(*m, o);
  Collector c;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(s.submit(greedy(prompt_of(20 + i, uint32_t(i), V), 100), c.fn()));
  for (int k = 0; k < 4; ++k) s.step();
  EXPECT_GT(m->kv_cache().used_blocks(), 0);
  s.cancel(ids[1]);
  s.cancel(ids[3]);
  s.cancel(12345);  // unknown: ignored
  s.step();
  EXPECT_EQ(c.got[ids[1]].finish, Finish::kCancelled);
  EXPECT_EQ(c.got[ids[3]].finish, Finish::kCancelled);
  for (uint64_t id : {ids[0], ids[2], ids[4]}) s.cancel(id);
  s.step();
  EXPECT_EQ(m->kv_cache().used_blocks(), 0);
  EXPECT_FALSE(s.step());
  for (uint64_t id : ids) EXPECT_EQ(c.got[id].events_after_finish, 0);
}

// A step that fails (here: a checkpoint whose head row 0 is NaN, so every logit row has a NaN and
// sampling refuses it) ends each request in that step with the error, exactly once; nothing stays
// held, and the scheduler goes on (the next request fails the same way instead of hanging).
TEST(Scheduler, AFailedStepEndsItsRequestsWithTheErrorAndHoldsNothing) {
  const std::string dir = tmp_path("sched_nan_head");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string src = case_dir("v2lite_bf16") + "/hf";
  std::filesystem::copy_file(src + "/config.json", dir + "/config.json");
  std::filesystem::copy_file(src + "/model.safetensors", dir + "/model.safetensors");
  {
    std::fstream f(dir + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    uint64_t hlen = 0;
    f.read(reinterpret_cast<char*>(&hlen), 8);
    std::string header(hlen, '\0');
    f.read(header.data(), std::streamsize(hlen));
    const auto h = nlohmann::json::parse(header);
    ASSERT_EQ(h.at("lm_head.weight").at("dtype"), "BF16");
    const uint64_t at = 8 + hlen + h.at("lm_head.weight").at("data_offsets")[0].get<uint64_t>();
    const uint16_t nan = 0x7FC0;
    f.seekp(std::streamoff(at));
    f.write(reinterpret_cast<const char*>(&nan), 2);
  }
  ModelOptions mo;
  mo.max_seqs = 4, mo.max_len = 256, mo.kv_block = 8;
  Model m(Checkpoint::open(dir), make_backend("ref"), mo);
  const int V = m.args().vocab_size;
  Scheduler s(m, SchedulerOptions{});
  Collector c;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(s.submit(greedy(prompt_of(5 + 7 * i, uint32_t(i), V), 4), c.fn()));
  s.run_until_idle();
  ids.push_back(s.submit(greedy({5, 6, 7}, 4), c.fn()));
  s.run_until_idle();
  for (uint64_t id : ids) {
    const Got& g = c.got[id];
    EXPECT_EQ(g.finish, Finish::kError) << id;
    EXPECT_NE(g.error.find("logit of token 0 is"), std::string::npos) << g.error;
    EXPECT_NE(g.error.find("nan"), std::string::npos) << g.error;
    EXPECT_TRUE(g.ids.empty()) << id;
    EXPECT_EQ(g.events_after_finish, 0) << id;
  }
  EXPECT_EQ(m.kv_cache().used_blocks(), 0);
  EXPECT_EQ(s.stats().running, 0);
  EXPECT_FALSE(s.step());
}

// 1,000 short requests, sampled and greedy, some with stop ids, cancels at random moments (of
// requests before they run, while they prefill, while they decode, or already ended): every one
// ends exactly once, and no block is left held.
TEST(Scheduler, ManyShortRequestsWithRandomCancellationsLeaveNothingHeld) {
  auto m = make_model("cpu", 8, 0, 8);
  const int V = m->args().vocab_size;
  SchedulerOptions o;
  o.eos = load_model_args(m->checkpoint()).eos_token_id, o.max_seqs = 24, o.max_step_tokens = 96;
  Scheduler s(*m, o);
  Collector c;
  std::mt19937 g(99);
  std::vector<uint64_t> ids, live;
  for (int i = 0; i < 1000; ++i) {
    EngineRequest r = greedy(prompt_of(1 + int(g() % 12), uint32_t(i), V), 1 + int(g() % 6));
    if (i % 3 == 1) r.sampling.temperature = 0.9f, r.sampling.top_k = 20, r.sampling.seed = uint64_t(i);
    if (i % 7 == 0) r.stop_ids = {int32_t(g() % uint32_t(V))};
    ids.push_back(s.submit(r, c.fn()));
    live.push_back(ids.back());
    if (g() % 2 == 0) s.cancel(live[g() % live.size()]);
    if (i % 5 == 4) s.step();
  }
  s.run_until_idle();
  int cancelled = 0;
  for (uint64_t id : ids) {
    const Got& got = c.got[id];
    ASSERT_NE(got.finish, Finish::kNone) << "request " << id << " never ended";
    EXPECT_EQ(got.events_after_finish, 0);
    cancelled += got.finish == Finish::kCancelled;
  }
  EXPECT_GT(cancelled, 30);
  EXPECT_EQ(m->kv_cache().used_blocks(), 0);
  const EngineStats st = s.stats();
  EXPECT_EQ(st.running + st.waiting, 0);
}

// start(): requests from other threads, events from the scheduler's; shutdown cancels what is left.
TEST(Scheduler, ThreadModeServesOtherThreadsAndShutsDown) {
  auto m = make_model("cpu", 8);
  const int V = m->args().vocab_size;
  SchedulerOptions o;
  o.eos = -1;
  Scheduler s(*m, o);
  s.start();
  std::mutex mu;
  Collector c;
  StreamFn fn = c.fn();
  auto locked = [&](const StreamEvent& e) {
    std::lock_guard<std::mutex> lk(mu);
    fn(e);
  };
  std::vector<std::thread> clients;
  std::vector<uint64_t> ids(8);
  for (int t = 0; t < 8; ++t)
    clients.emplace_back(
        [&, t] { ids[size_t(t)] = s.submit(greedy(prompt_of(5 + t, uint32_t(t), V), 6), locked); });
  for (auto& t : clients) t.join();
  const uint64_t long_one = s.submit(greedy(prompt_of(9, 77, V), 200), locked);
  for (int k = 0; k < 2000; ++k) {
    {
      std::lock_guard<std::mutex> lk(mu);
      bool done = true;
      for (uint64_t id : ids) done = done && c.got[id].finish != Finish::kNone;
      if (done) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  s.shutdown(0.0);
  std::lock_guard<std::mutex> lk(mu);
  for (uint64_t id : ids) {
    EXPECT_EQ(c.got[id].finish, Finish::kLength);
    EXPECT_EQ(c.got[id].ids.size(), 6u);
  }
  EXPECT_EQ(c.got[long_one].finish, Finish::kCancelled);
  EXPECT_EQ(m->kv_cache().used_blocks(), 0);
  EXPECT_THROW(s.submit(greedy({5, 6}, 1), locked), Error);
}

TEST(Scheduler, RefusesRequestsThatCannotRun) {
  auto m = make_model("ref", 8, 0, 2);
  const int V = m->args().vocab_size;
  SchedulerOptions o;
  o.max_waiting = 2;
  Scheduler s(*m, o);
  auto refused = [&](EngineRequest r, const std::string& want) {
    try {
      s.submit(std::move(r), {});
      ADD_FAILURE() << "accepted; wanted: " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  refused(greedy({}, 4), "empty prompt");
  refused(greedy({5, V}, 4), "token id " + std::to_string(V) + " is outside the vocabulary");
  refused(greedy({5, -1}, 4), "token id -1 is outside the vocabulary");
  refused(greedy({5, 6}, -1), "max_tokens must be >= 0");
  refused(greedy(prompt_of(200, 1, V), 57),
          "200 tokens + max_tokens 57 = 257 tokens are past the context of 256");
  EngineRequest bad = greedy({5, 6}, 4);
  bad.sampling.top_p = 0.f;
  refused(bad, "top_p");
  s.submit(greedy({5, 6}, 2), {});
  s.submit(greedy({5, 7}, 2), {});
  EXPECT_THROW(s.submit(greedy({5, 8}, 2), {}), QueueFull);
  s.run_until_idle();
  EXPECT_NO_THROW(s.submit(greedy({5, 8}, 2), {}));
  s.run_until_idle();
  // The cache's capacity: 2 sequences' worth of blocks (256 positions each)
  auto tiny =
      make_model("ref", 8, double(KvCache::bytes_per_position(m->args(), AttnImpl::kAbsorb) * 16) / 1e9);
  Scheduler t(*tiny, SchedulerOptions{});
  try {
    t.submit(greedy(prompt_of(10, 2, V), 7), {});
    FAIL() << "17 positions in a cache of 16";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the KV cache holds 16"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dsv3

// dsv3 bench --concurrency: the scheduler measured offline, vLLM's serving metrics as JSON.
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

namespace dsv3 {
namespace {

TEST(ServingBench, ReportsEveryLevelWithExactOutputsAndThePrefixCache) {
  const std::string out = testing_util::tmp_path("serving_bench.json");
  const std::string cmd = std::string(DSV3_BINARY) + " bench --model " + case_dir("v3_fp8") +
                          "/hf --concurrency 1,4 --requests 6 --input-len 20 --output-len 5 --shared-prefix 64 "
                          "--threads 2 --json >" + out + " 2>/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream f(out);
  const nlohmann::json all = nlohmann::json::parse(f);
  ASSERT_EQ(all.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const nlohmann::json& r = all[i];
    EXPECT_EQ(r["concurrency"].get<int>(), i == 0 ? 1 : 4);
    EXPECT_EQ(r["completed"].get<int>(), 6);
    EXPECT_EQ(r["failed"].get<int>(), 0);
    EXPECT_EQ(r["total_output_tokens"].get<int>(), 6 * 5);
    EXPECT_GT(r["output_throughput"].get<double>(), 0);
    for (const char* k : {"ttft", "tpot", "itl", "e2el"})
      for (const char* p : {"mean_ms", "p50_ms", "p90_ms", "p99_ms"}) EXPECT_GT(r[k][p].get<double>(), 0) << k << " " << p;
    EXPECT_LE(r["ttft"]["p50_ms"].get<double>(), r["ttft"]["p99_ms"].get<double>());
    EXPECT_GT(r["kv_blocks_peak"].get<int>(), 0);
    // The 64-token prefix every prompt shares comes from the cache once published.
    EXPECT_GT(r["prefix_cache_hit_rate"].get<double>(), 0.5);
    EXPECT_TRUE(r["prefix_cache"].get<bool>());
    // One request: beside the same request as `dsv3 generate` runs it (its decode time per token).
    EXPECT_EQ(r.contains("generate_tpot_ms"), i == 0);
    if (i == 0) {
      EXPECT_GT(r["generate_tpot_ms"].get<double>(), 0);
      const double ratio = r["vs_generate"].get<double>();
      EXPECT_NEAR(ratio, r["generate_tpot_ms"].get<double>() / r["tpot"]["mean_ms"].get<double>(), 1e-9 * ratio);
      EXPECT_GT(ratio, 0);
    }
  }
  // --prefix-cache off: the same load computes every prefix.
  const std::string off = std::string(DSV3_BINARY) + " bench --model " + case_dir("v3_fp8") +
                          "/hf --concurrency 4 --requests 6 --input-len 20 --output-len 5 --shared-prefix 64 "
                          "--prefix-cache off --threads 2 --json >" + out + " 2>/dev/null";
  ASSERT_EQ(std::system(off.c_str()), 0) << off;
  std::ifstream f2(out);
  const nlohmann::json r = nlohmann::json::parse(f2).at(0);
  EXPECT_EQ(r["completed"].get<int>(), 6);
  EXPECT_FALSE(r["prefix_cache"].get<bool>());
  EXPECT_EQ(r["prefix_cache_hit_rate"].get<double>(), 0.0);
  EXPECT_EQ(r["max_step_tokens"].get<int>(), 2048);  // the CPU backend's default step budget
  // The steps computed every prompt token (64 + 20, nothing cached) and every drawn token but the
  // last of each request (it is never fed back); their time lies within the run's.
  ASSERT_EQ(r["preemptions"].get<int>(), 0);
  EXPECT_EQ(r["step_tokens"].get<int64_t>(), 6 * (64 + 20 + 5 - 1));
  EXPECT_GT(r["decode_steps"].get<int64_t>(), 0);
  EXPECT_LT(r["decode_steps"].get<int64_t>(), r["steps"].get<int64_t>());
  EXPECT_GT(r["decode_step_time_s"].get<double>(), 0.0);
  EXPECT_LT(r["decode_step_time_s"].get<double>(), r["step_time_s"].get<double>());
  EXPECT_LE(r["step_time_s"].get<double>(), r["duration_s"].get<double>());
  std::remove(out.c_str());
  for (const char* args : {" --concurrency 0", " --concurrency 4 --prefix-cache maybe"}) {
    const std::string bad = std::string(DSV3_BINARY) + " bench --model " + case_dir("v3_fp8") + "/hf" + args +
                            " >/dev/null 2>&1";
    EXPECT_NE(std::system(bad.c_str()), 0) << args;
  }
}

}  // namespace
}  // namespace dsv3
