// The Engine interface as the server uses it (runtime/scheduler.h on its own thread, the tiny
// synthetic model): the same tokens as Generator (greedy and seeded sampling with every filter
// and penalty), log-probabilities equal to the log-softmax of the model's own logits, stop ids /
// EOS / ignore_eos / max_tokens, cancellation (running and queued), refusals, shutdown, and the
// stats a server reports.
#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "runtime/generate.h"
#include "runtime/scheduler.h"
#include "tiny_model.h"

using namespace dsv3;

namespace {

constexpr int kVocabLimit = 128815;  // the tokenizer's: ids past it are padding rows

std::unique_ptr<Model> tiny(int max_len = 512) {
  ModelOptions opt;
  opt.max_seqs = 2;
  opt.max_len = max_len;
  return std::make_unique<Model>(Checkpoint::open(server_test::tiny_model()), make_backend("cpu"), opt);
}

// Collects events by request; wait() returns a request's events once its last one came.
class Events {
 public:
  StreamFn fn() {
    return [this](const StreamEvent& ev) {
      std::lock_guard<std::mutex> lk(mu_);
      got_[ev.request].push_back(ev);
      cv_.notify_all();
    };
  }
  std::vector<StreamEvent> wait(uint64_t id, double seconds = 120) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_for(lk, std::chrono::duration<double>(seconds),
                 [&] { return !got_[id].empty() && got_[id].back().finish != Finish::kNone; });
    return got_[id];
  }
  size_t count(uint64_t id) {
    std::lock_guard<std::mutex> lk(mu_);
    return got_[id].size();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::vector<StreamEvent>> got_;
};

std::vector<int32_t> tokens_of(const std::vector<StreamEvent>& evs) {
  std::vector<int32_t> out;
  for (const auto& e : evs)
    for (const auto& t : e.tokens) out.push_back(t.id);
  return out;
}

// The engine's options over the tokenizer's vocabulary, with `eos` (-1: none), one sequence at a
// time unless asked.
SchedulerOptions options(int eos = -1, int max_seqs = 1) {
  SchedulerOptions eo;
  eo.vocab_limit = kVocabLimit;
  eo.eos = eos;
  eo.max_seqs = max_seqs;
  return eo;
}

// A scheduler stepping on its own thread, as `dsv3 serve` runs it.
struct Engine_ {
  Scheduler s;
  Engine_(Model& m, const SchedulerOptions& o) : s(m, o) { s.start(); }
  uint64_t submit(EngineRequest r, StreamFn fn) { return s.submit(std::move(r), std::move(fn)); }
  void cancel(uint64_t id) { s.cancel(id); }
  EngineStats stats() const { return s.stats(); }
  void shutdown(double grace) { s.shutdown(grace); }
};

EngineRequest request(std::vector<int32_t> prompt, int max_tokens) {
  EngineRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  return r;
}

std::vector<int32_t> generator_tokens(Model& m, const GenerateRequest& g) {
  Generator gen(m, -1);
  gen.set_vocab_limit(kVocabLimit);
  gen.set_device_sampling(false);
  return gen.run({g})[0].tokens;
}

TEST(Engine, GreedyAndSeededSamplingMatchGenerator) {
  auto m = tiny();
  std::vector<SamplingParams> params(3);
  params[1].temperature = 0.8f, params[1].top_k = 40, params[1].top_p = 0.9f, params[1].min_p = 0.01f;
  params[1].seed = 7;
  params[2].temperature = 1.2f, params[2].repetition_penalty = 1.3f, params[2].presence_penalty = 0.5f;
  params[2].frequency_penalty = 0.25f, params[2].seed = 11;
  const std::vector<int32_t> prompt = {0, 1234, 5678, 910, 4242};
  std::vector<std::vector<int32_t>> expected;
  for (const auto& p : params) {
    GenerateRequest g;
    g.prompt = prompt;
    g.sampling = p;
    g.max_new_tokens = 16;
    expected.push_back(generator_tokens(*m, g));
  }
  Engine_ engine(*m, options());
  Events ev;
  std::vector<uint64_t> ids;
  for (const auto& p : params) {
    EngineRequest r = request(prompt, 16);
    r.sampling = p;
    ids.push_back(engine.submit(r, ev.fn()));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    auto got = ev.wait(ids[i]);
    ASSERT_FALSE(got.empty());
    EXPECT_EQ(got.back().finish, Finish::kLength);
    EXPECT_EQ(got.back().completion_tokens, 16);
    EXPECT_EQ(got.back().prompt_tokens, 5);
    EXPECT_EQ(tokens_of(got), expected[i]) << "params " << i;
  }
  EXPECT_NE(expected[0], expected[1]);
}

TEST(Engine, LogprobsAreTheLogSoftmaxOfTheLogits) {
  auto m = tiny();
  const std::vector<int32_t> prompt = {0, 300, 301, 302};
  std::vector<float> logits(size_t(m->args().vocab_size));
  m->forward(prompt.data(), 1, int(prompt.size()), 0, logits.data());
  double mx = -INFINITY, sum = 0;
  for (int i = 0; i < kVocabLimit; ++i) mx = std::max(mx, double(logits[size_t(i)]));
  for (int i = 0; i < kVocabLimit; ++i) sum += std::exp(double(logits[size_t(i)]) - mx);
  const double lse = mx + std::log(sum);

  Engine_ engine(*m, options());
  Events ev;
  EngineRequest r = request(prompt, 3);
  r.top_logprobs = 5;
  r.sampling.temperature = 1.f;
  r.sampling.seed = 3;
  auto got = ev.wait(engine.submit(r, ev.fn()));
  ASSERT_EQ(tokens_of(got).size(), 3u);
  const SampledToken& t = got[0].tokens[0];
  EXPECT_NEAR(t.logprob, double(logits[size_t(t.id)]) - lse, 1e-4);
  ASSERT_EQ(t.top.size(), 5u);
  const int32_t best = int32_t(std::max_element(logits.begin(), logits.begin() + kVocabLimit) - logits.begin());
  EXPECT_EQ(t.top[0].id, best);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_NEAR(t.top[i].logprob, double(logits[size_t(t.top[i].id)]) - lse, 1e-4);
    if (i > 0) {
      EXPECT_LE(t.top[i].logprob, t.top[i - 1].logprob);
    }
  }
  for (const auto& e : got)
    for (const auto& s : e.tokens) EXPECT_LE(s.logprob, 0.f);
}

TEST(Engine, StopIdsEosAndIgnoreEos) {
  auto m = tiny();
  const std::vector<int32_t> prompt = {0, 77, 78, 79};
  GenerateRequest g;
  g.prompt = prompt;
  g.max_new_tokens = 8;
  const std::vector<int32_t> greedy = generator_tokens(*m, g);
  ASSERT_EQ(greedy.size(), 8u);
  const int32_t third = greedy[2];
  ASSERT_NE(third, greedy[0]);
  ASSERT_NE(third, greedy[1]);
  {  // a stop id: reported last, not counted
    Engine_ engine(*m, options());
    Events ev;
    EngineRequest r = request(prompt, 8);
    r.stop_ids = {third};
    auto got = ev.wait(engine.submit(r, ev.fn()));
    EXPECT_EQ(got.back().finish, Finish::kStop);
    EXPECT_EQ(got.back().completion_tokens, 2);
    EXPECT_EQ(tokens_of(got), std::vector<int32_t>(greedy.begin(), greedy.begin() + 3));
  }
  {  // the same id as EOS; with ignore_eos it is an ordinary token
    Engine_ engine(*m, options(third));
    Events ev;
    auto got = ev.wait(engine.submit(request(prompt, 8), ev.fn()));
    EXPECT_EQ(got.back().finish, Finish::kStop);
    EXPECT_EQ(got.back().completion_tokens, 2);
    EngineRequest r = request(prompt, 8);
    r.ignore_eos = true;
    got = ev.wait(engine.submit(r, ev.fn()));
    EXPECT_EQ(got.back().finish, Finish::kLength);
    EXPECT_EQ(got.back().completion_tokens, 8);
    EXPECT_EQ(tokens_of(got), greedy);
  }
}

TEST(Engine, CancelsRunningAndQueuedRequests) {
  auto m = tiny(4096);
  Engine_ engine(*m, options());
  Events ev;
  const uint64_t a = engine.submit(request({0, 5, 6}, 4000), ev.fn());
  const uint64_t b = engine.submit(request({0, 7, 8}, 4000), ev.fn());
  const uint64_t c = engine.submit(request({0, 9, 10}, 3), ev.fn());
  while (ev.count(a) < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EngineStats s = engine.stats();
  EXPECT_EQ(s.running, 1);
  EXPECT_EQ(s.waiting, 2);
  EXPECT_GT(s.kv_blocks_used, 0);
  engine.cancel(b);  // queued: ended without running
  engine.cancel(a);
  engine.cancel(12345);  // unknown: ignored
  auto ga = ev.wait(a), gb = ev.wait(b), gc = ev.wait(c);
  EXPECT_EQ(ga.back().finish, Finish::kCancelled);
  EXPECT_LT(ga.back().completion_tokens, 4000);
  EXPECT_EQ(gb.size(), 1u);
  EXPECT_EQ(gb.back().finish, Finish::kCancelled);
  EXPECT_TRUE(gb.back().tokens.empty());
  EXPECT_EQ(gc.back().finish, Finish::kLength);
  EXPECT_EQ(gc.back().completion_tokens, 3);
  s = engine.stats();
  EXPECT_EQ(s.running, 0);
  EXPECT_EQ(s.waiting, 0);
  EXPECT_EQ(s.kv_blocks_used, 0);
  EXPECT_EQ(s.kv_blocks_total, m->kv_cache().n_blocks());
  EXPECT_GE(s.prompt_tokens, 6);
  EXPECT_GE(s.generation_tokens, 3 + ga.back().completion_tokens);
}

TEST(Engine, RefusesRequestsThatCanNeverRun) {
  auto m = tiny(64);
  Engine_ engine(*m, options());
  Events ev;
  auto refused = [&](EngineRequest r, const std::string& needle) {
    try {
      engine.submit(r, ev.fn());
    } catch (const Error& e) {
      return std::string(e.what()).find(needle) != std::string::npos
                 ? ::testing::AssertionSuccess()
                 : ::testing::AssertionFailure() << "message: " << e.what();
    }
    return ::testing::AssertionFailure() << "accepted";
  };
  EXPECT_TRUE(refused(request({}, 4), "empty"));
  EXPECT_TRUE(refused(request({0, kVocabLimit}, 4), "outside the vocabulary"));
  EXPECT_TRUE(refused(request({0, -1}, 4), "outside the vocabulary"));
  EXPECT_TRUE(refused(request({0, 1, 2}, 62), "3 tokens + max_tokens 62 = 65 tokens are past the context of 64"));
  EXPECT_TRUE(refused(request({0, 1, 2}, -1), "max_tokens"));
  EngineRequest bad = request({0, 1}, 4);
  bad.sampling.top_p = 0;
  EXPECT_TRUE(refused(bad, "top_p"));
  engine.shutdown(0);
  EXPECT_TRUE(refused(request({0, 1}, 4), "shutting down"));
}

TEST(Engine, ShutdownFinishesWithinTheGraceAndCancelsAfterIt) {
  auto m = tiny(4096);
  {  // a long grace: short requests finish
    Engine_ engine(*m, options());
    Events ev;
    const uint64_t a = engine.submit(request({0, 5}, 5), ev.fn()), b = engine.submit(request({0, 6}, 5), ev.fn());
    engine.shutdown(60);
    EXPECT_EQ(ev.wait(a, 0).back().finish, Finish::kLength);
    EXPECT_EQ(ev.wait(b, 0).back().finish, Finish::kLength);
  }
  {  // no grace: a long request and the queue behind it are cancelled
    Engine_ engine(*m, options());
    Events ev;
    const uint64_t a = engine.submit(request({0, 5}, 4000), ev.fn()), b = engine.submit(request({0, 6}, 5), ev.fn());
    while (ev.count(a) < 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const auto t0 = std::chrono::steady_clock::now();
    engine.shutdown(0);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
    EXPECT_EQ(ev.wait(a, 0).back().finish, Finish::kCancelled);
    EXPECT_EQ(ev.wait(b, 0).back().finish, Finish::kCancelled);
    EXPECT_EQ(engine.stats().kv_blocks_used, 0);
  }
}

}  // namespace
