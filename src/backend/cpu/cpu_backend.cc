// The "cpu" backend: the ops of backend.h on the SIMD kernels of kernels.h, split over the one
// global ThreadPool. Weights stay in the checkpoint's mmap (FP8 is dequantised in registers);
// activations are float32 between ops. MoE runs once per active expert over the tokens routed to
// it (w1 and w3 in one pass, parallel over experts x row tiles); MLA uses the absorbed form over
// the latent cache (the naive form goes to the ref backend).
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "backend/host_weights.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/gate.h"
#include "model/rope.h"

namespace dsv3 {
namespace {

using cpu::Isa;
using cpu::Kernels;
using cpu::Scratch;

constexpr int64_t kFewTokens = 8;  // up to this many tokens a product streams its weights (decode)
constexpr size_t kMmapThreshold = size_t(1) << 20;  // bytes; larger buffers come zeroed from mmap

// A float32 vector that grows and never shrinks (workspace).
struct Grow {
  std::vector<float> v;
  float* get(size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};

// One expert's share of a MoE call: the tokens routed to it and their weights.
struct ExpertJob {
  const MLPWeights* w = nullptr;
  std::vector<int32_t> rows;  // token indices
  std::vector<float> wts;     // routing weight per token
  const float* x = nullptr;   // [m, dim] gathered activations (or the input itself)
  float* h = nullptr;         // [m, inter] silu(w1 x) * w3 x
  int64_t inter = 0;
};

// DSV3_CPU_PROFILE=1: wall time per op and per phase of the big ops, separately for one-token
// calls (decode at batch 1: "1|") and larger ones ("n|"), with the weight bytes each read and, for
// parallel regions, how long the other threads took to start and how long the first finisher
// waited for the last. Printed to stderr when the backend is destroyed.
using Clock = std::chrono::steady_clock;
inline double secs_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct OpProfile {
  struct Entry {
    double t = 0, bytes = 0, lag = 0, imbalance = 0;
    int64_t calls = 0, regions = 0;
  };
  bool on = false;
  std::map<std::string, Entry> e;
  Entry* cur = nullptr;  // the innermost open section (parallel regions report to it)
};

class OpTimer {
 public:
  OpTimer(OpProfile& p, const char* name, int64_t n, double bytes = 0) : p_(p) {
    if (!p_.on) return;
    ent_ = &p_.e[std::string(n == 1 ? "1|" : "n|") + name];
    ent_->bytes += bytes;
    prev_ = p_.cur;
    p_.cur = ent_;
    t0_ = Clock::now();
  }
  ~OpTimer() {
    if (!p_.on) return;
    ent_->t += secs_since(t0_);
    ++ent_->calls;
    p_.cur = prev_;
  }

 private:
  OpProfile& p_;
  OpProfile::Entry* ent_ = nullptr;
  OpProfile::Entry* prev_ = nullptr;
  Clock::time_point t0_;
};

inline double linear_bytes(const Linear& w) {
  return double(w.weight.nbytes()) + (w.scale.empty() ? 0.0 : double(w.scale.nbytes()));
}

struct TileItem {
  int32_t job;
  int64_t r0, nr;
};

class CpuBackend final : public Backend {
 public:
  CpuBackend(Isa isa, ThreadPool* pool)
      : pool_(pool ? *pool : ThreadPool::global()), k_(cpu::kernels(isa)), f32k_(cpu::isa_supported(Isa::kAvx2) ? cpu::kAvx2Kernels : cpu::kScalarKernels),
        ref_(make_ref_backend()) {
    const char* e = std::getenv("DSV3_CPU_PROFILE");
    prof_.on = e && *e && *e != '0';
  }
  ~CpuBackend() override {
    for (auto& [p, n] : mapped_) ::munmap(p, n);
    if (prof_.on) print_profile();
  }

  std::string name() const override { return "cpu"; }

  WeightPlacement prepare_weights(const ModelArgs&, ModelWeights& w, const WeightMemory& m) override {
    return place_host_weights(w, m, &weights_);
  }

  float* alloc(size_t n) override {
    const size_t bytes = std::max<size_t>(n, 1) * sizeof(float);
    if (bytes >= kMmapThreshold) {
      // Anonymous pages are zero and cost no memory until touched: a KV cache sized for the
      // budget only becomes resident as sequences grow.
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) fail("cannot allocate ", bytes, " bytes for the cpu backend");
      mapped_[p] = bytes;
      return static_cast<float*>(p);
    }
    float* p = static_cast<float*>(std::aligned_alloc(64, (bytes + 63) & ~size_t(63)));
    if (!p) fail("cannot allocate ", bytes, " bytes for the cpu backend");
    std::memset(p, 0, bytes);
    return p;
  }
  void release(float* p) override {
    if (!p) return;
    auto it = mapped_.find(p);
    if (it != mapped_.end()) {
      ::munmap(it->first, it->second);
      mapped_.erase(it);
    } else {
      std::free(p);
    }
  }
  void upload(float* dst, const float* host, size_t n) override { std::memcpy(dst, host, n * 4); }
  void download(float* host, const float* src, size_t n) override { std::memcpy(host, src, n * 4); }

  void embed(const Step& s, const TensorView& table, int64_t row0, float* y) override {
    OpTimer tm(prof_, "embed", s.n);
    const int64_t d = table.dim(1), rows = table.dim(0);
    for (int64_t i = 0; i < s.n; ++i) {
      const int64_t r = s.tokens[i] - row0;
      if (r >= 0 && r < rows) row_to_f32(table, r, d, y + i * d);
      else std::fill(y + i * d, y + (i + 1) * d, 0.f);
    }
  }

  void rmsnorm(const float* x, int64_t n, int64_t d, int64_t stride, const TensorView& w, float eps,
               float* y) override {
    OpTimer tm(prof_, "rmsnorm", n);
    last_n_ = n;
    const float* wf = vec_f32(w, d, norm_w_);
    if (n * d < (1 << 16)) {
      k_.rmsnorm({x, n, stride}, d, wf, eps, {y, stride});
      return;
    }
    par(n, [&](int64_t b, int64_t e, int) {
      k_.rmsnorm({x + b * stride, e - b, stride}, d, wf, eps, {y + b * stride, stride});
    });
  }

  void linear(const float* x, int64_t n, const Linear& w, float* y) override {
    OpTimer tm(prof_, prof_.on ? linear_name(w).c_str() : "", n, linear_bytes(w));
    linear_k(k_, x, n, w, y);
  }

  void add(float* y, const float* x, int64_t n) override {
    OpTimer tm(prof_, "add", last_n_);
    k_.axpy(1.f, x, n, y);
  }

  // add_rmsnorm (runtime/rewrites.h): the residual add and the norm of each row in one pass.
  bool fuses(const StepGraph& g, Fusion f, int first, int count) const override { return f == Fusion::kAddRmsNorm; }
  void run_fused(const StepGraph& g, const Step& s, const Node& nd) override {
    if (nd.fusion != Fusion::kAddRmsNorm || nd.defer_combine) return Backend::run_fused(g, s, nd);
    const Op &add = g.ops[size_t(nd.first)], &norm = g.ops[size_t(nd.first + 1)];
    const Value &h = g.val(add.out), &r = g.val(add.in), &x = g.val(norm.out);
    OpTimer tm(prof_, "add+rmsnorm", h.rows);
    const int64_t d = h.cols;
    const float* wf = vec_f32(*norm.weight, d, norm_w_);
    auto rows = [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) k_.axpy(1.f, r.data + i * d, d, h.data + i * d);
      k_.rmsnorm({h.data + b * d, e - b, d}, d, wf, norm.eps, {x.data + b * x.stride, x.stride});
    };
    if (h.rows * d < (1 << 16)) rows(0, h.rows, 0);
    else par(h.rows, rows);
  }

  void mla(const MlaCall& c) override {
    OpTimer tm(prof_, "mla", c.step->n);
    if (c.impl == AttnImpl::kNaive) {  // the full K/V cache form: the reference implementation
      ref_->mla(c);
      return;
    }
    mla_absorb(c);
  }

  void mlp(const MLPWeights& w, const float* x, int64_t n, float* y) override {
    OpTimer tm(prof_, "mlp", n, linear_bytes(w.w1) + linear_bytes(w.w2) + linear_bytes(w.w3));
    jobs_.resize(1);
    ExpertJob& j = jobs_[0];
    j.w = &w;
    j.rows.resize(size_t(n));
    j.wts.assign(size_t(n), 1.f);
    for (int64_t i = 0; i < n; ++i) j.rows[size_t(i)] = int32_t(i);
    j.x = x;
    j.inter = w.w1.out();
    run_experts(1, x, n, w.w2.out(), y, "mlp");
  }

  void moe(const ModelArgs& a, const MoEWeights& w, const float* x, int64_t n, float* y) override {
    OpTimer tm(prof_, "moe", n);
    const int64_t E = a.n_routed_experts, K = a.n_activated_experts, D = a.dim;
    // Router in float32 (as the reference's float32 path): routing decisions are sensitive.
    float* logits = gate_logits_.get(size_t(n * E));
    std::optional<OpTimer> ph(std::in_place, prof_, "moe.router", n, double(w.gate.nbytes()));
    linear_k(f32k_, x, n, Linear{w.gate, {}}, logits);
    const float* bias = w.bias.empty() ? nullptr : vec_f32(w.bias, E, bias_);
    idx_.resize(size_t(n * K));
    wts_.resize(size_t(n * K));
    std::vector<float> scratch(size_t(2 * E + a.n_expert_groups));
    for (int64_t i = 0; i < n; ++i)
      route_token(a, logits + i * E, bias, &idx_[size_t(i * K)], &wts_[size_t(i * K)], scratch.data());
    // Group tokens by expert: one job per active expert (+ the shared experts over all tokens).
    expert_job_.assign(size_t(E), -1);
    int njobs = 0;
    if (jobs_.size() < size_t(E + 1)) jobs_.resize(size_t(E + 1));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = idx_[size_t(i * K + k)];
        if (w.experts[size_t(e)].w1.weight.empty()) continue;  // another rank's expert (its share is summed there)
        if (expert_job_[size_t(e)] < 0) {
          expert_job_[size_t(e)] = njobs;
          ExpertJob& j = jobs_[size_t(njobs++)];
          j.w = &w.experts[size_t(e)];
          j.rows.clear();
          j.wts.clear();
          j.inter = j.w->w1.out();
        }
        ExpertJob& j = jobs_[size_t(expert_job_[size_t(e)])];
        j.rows.push_back(int32_t(i));
        j.wts.push_back(wts_[size_t(i * K + k)]);
      }
    routed_run_ += njobs;
    ph.reset();
    // Gather each routed expert's tokens into one contiguous block.
    int64_t total = 0;
    for (int j = 0; j < njobs; ++j) total += int64_t(jobs_[size_t(j)].rows.size());
    float* xg = gathered_.get(size_t(total * D));
    for (int j = 0; j < njobs; ++j) {
      ExpertJob& job = jobs_[size_t(j)];
      job.x = xg;
      for (size_t r = 0; r < job.rows.size(); ++r) std::memcpy(xg + r * D, x + job.rows[r] * D, size_t(D) * 4);
      xg += int64_t(job.rows.size()) * D;
    }
    if (w.has_shared) {
      ExpertJob& j = jobs_[size_t(njobs++)];
      j.w = &w.shared_experts;
      j.rows.resize(size_t(n));
      j.wts.assign(size_t(n), 1.f);
      for (int64_t i = 0; i < n; ++i) j.rows[size_t(i)] = int32_t(i);
      j.x = x;
      j.inter = j.w->w1.out();
    }
    run_experts(njobs, x, n, D, y, "moe");
  }

  int64_t routed_experts_run() const override { return routed_run_; }
  void reset_counters() override { routed_run_ = 0; }

 private:
  static std::string linear_name(const Linear& w) {
    return "linear " + std::to_string(w.out()) + "x" + std::to_string(w.in()) + " " + dtype_name(w.weight.dtype);
  }

  // pool_.parallel_for; when profiling, also the other threads' start lag and the spread of the
  // threads' finishing times, charged to the open section.
  template <class F>
  void par(int64_t n, F&& fn) {
    if (!prof_.on || !prof_.cur) {
      pool_.parallel_for(n, fn);
      return;
    }
    constexpr int kMax = 64;
    double start[kMax], end[kMax];
    bool ran[kMax] = {};
    const Clock::time_point t0 = Clock::now();
    pool_.parallel_for(n, [&](int64_t b, int64_t e, int t) {
      if (t < kMax) start[t] = secs_since(t0);
      fn(b, e, t);
      if (t < kMax) end[t] = secs_since(t0), ran[t] = true;
    });
    double lag = 0, lo = 1e30, hi = 0;
    int used = 0;
    for (int t = 0; t < std::min(kMax, pool_.size()); ++t)
      if (ran[t]) {
        ++used;
        if (t > 0) lag = std::max(lag, start[t]);
        lo = std::min(lo, end[t]), hi = std::max(hi, end[t]);
      }
    ++prof_.cur->regions;
    if (used > 1) prof_.cur->lag += lag, prof_.cur->imbalance += hi - lo;
  }

  // Rows [0, n) shared out in chunks that shrink as the work runs out (guided scheduling): a
  // thread takes ~remaining / (2 x threads) rows, at least `unit`, in multiples of `unit`, from a
  // shared counter, so a thread that starts late or runs slower (two shared cores) takes fewer
  // and the threads finish within a small chunk of each other. fn(r0, r1, thread) per chunk.
  template <class F>
  void guided(int64_t n, int64_t unit, F&& fn) {
    if (n <= 0) return;
    const int threads = pool_.size();
    if (threads == 1 || n <= unit) {
      fn(int64_t(0), n, 0);
      return;
    }
    std::atomic<int64_t> next{0};
    par(threads, [&](int64_t, int64_t, int t) {
      int64_t b = next.load(std::memory_order_relaxed);
      for (;;) {
        if (b >= n) return;
        const int64_t want = std::max(unit, (n - b) / (2 * threads) / unit * unit);
        const int64_t e = std::min(n, b + want);
        if (next.compare_exchange_weak(b, e, std::memory_order_relaxed)) {
          fn(b, e, t);
          b = next.load(std::memory_order_relaxed);
        }
      }
    });
  }

  void print_profile() const {
    for (const char* pre : {"1|", "n|"}) {
      double total = 0;
      for (const auto& [k, v] : prof_.e)
        if (k.rfind(pre, 0) == 0 && k.find('.') == std::string::npos) total += v.t;
      if (total == 0) continue;
      std::fprintf(stderr, "cpu backend profile (%s, %d threads), %s calls: %.3f s in ops\n", cpu::isa_name(k_.isa),
                   pool_.size(), pre[0] == '1' ? "one-token" : "multi-token", total);
      std::fprintf(stderr, "  %-28s %9s %6s %8s %9s %7s %8s %8s\n", "op", "s", "%", "calls", "us/call", "GB/s",
                   "lag us", "imbal us");
      for (const auto& [k, v] : prof_.e) {
        if (k.rfind(pre, 0) != 0) continue;
        const std::string name = k.substr(2);
        std::fprintf(stderr, "  %-28s %9.4f %6.1f %8lld %9.1f %7.2f %8.1f %8.1f\n",
                     (name.find('.') == std::string::npos ? name : "  " + name).c_str(), v.t, 100 * v.t / total,
                     (long long)v.calls, 1e6 * v.t / double(std::max<int64_t>(1, v.calls)),
                     v.bytes > 0 ? v.bytes / v.t / 1e9 : 0.0,
                     v.regions ? 1e6 * v.lag / double(v.regions) : 0.0,
                     v.regions ? 1e6 * v.imbalance / double(v.regions) : 0.0);
      }
    }
  }

  Scratch& scratch(int t) {
    while (int(scratch_.size()) <= t) scratch_.push_back(std::make_unique<Scratch>());
    return *scratch_[size_t(t)];
  }
  // Every op starts here: makes sure each thread has its scratch and forgets packed activations
  // (their buffers may hold new values now).
  void ensure_scratch() {
    scratch(pool_.size() - 1);
    for (auto& sc : scratch_) sc->invalidate();
  }

  static void row_to_f32(const TensorView& t, int64_t row, int64_t d, float* out) {
    if (t.dtype == DType::F32) {
      std::memcpy(out, t.as<float>() + row * d, size_t(d) * 4);
    } else if (t.dtype == DType::BF16) {
      const uint16_t* p = t.as<uint16_t>() + row * d;
      for (int64_t k = 0; k < d; ++k) out[k] = bf16_to_f32(p[k]);
    } else {
      for (int64_t k = 0; k < d; ++k) out[k] = load_f32(t, row * d + k);
    }
  }
  static const float* vec_f32(const TensorView& t, int64_t d, Grow& buf) {
    if (t.dtype == DType::F32) return t.as<float>();
    float* p = buf.get(size_t(d));
    row_to_f32(t, 0, d, p);
    return p;
  }

  // Rows per work item: FP8 tiles stay inside 128-row scale blocks where there is enough work.
  static int64_t row_tile(int64_t out, int threads) {
    int64_t t = 128;
    while (t > 16 && out < t * threads * 2) t /= 2;
    return t;
  }

  void linear_k(const Kernels& k, const float* x, int64_t n, const Linear& w, float* y) {
    ensure_scratch();
    const int64_t out = w.out(), in = w.in();
    if (n <= kFewTokens) {
      // Weight streaming (decode): guided chunks of 16-row multiples.
      guided(out, 16, [&](int64_t r0, int64_t r1, int t) {
        k.matmul({x, n, in}, w, {r0, r1 - r0}, {y + r0, out}, scratch(t));
      });
      return;
    }
    // Compute-bound: row tiles in guided chunks (the threads' speeds differ on shared cores).
    const int threads = pool_.size();
    const int64_t tile = row_tile(out, threads), items = (out + tile - 1) / tile;
    guided(items, 1, [&](int64_t b, int64_t e, int t) {
      Scratch& s = scratch(t);
      const int64_t r0 = b * tile, r1 = std::min(out, e * tile);
      k.matmul({x, n, in}, w, {r0, r1 - r0}, {y + r0, out}, s);
    });
  }

  // Experts jobs_[0..njobs): up (w1, w3, activation) over expert x row tiles, then down (w2) over
  // output row tiles, each tile summing its experts' weighted outputs.
  void run_experts(int njobs, const float* x, int64_t n, int64_t D, float* y, const char* op) {
    ensure_scratch();
    int64_t hsize = 0;
    for (int j = 0; j < njobs; ++j) hsize += int64_t(jobs_[size_t(j)].rows.size()) * jobs_[size_t(j)].inter;
    float* hbuf = hidden_.get(size_t(hsize));
    items_.clear();
    const int threads = pool_.size();
    // Beyond 8 tokens (compute-bound; experts of unequal token counts): 128-row items, taken in
    // guided chunks. (At decode the jobs' rows form one row space instead: below.)
    constexpr int64_t target = 128;
    int64_t max_m = 0;
    for (int j = 0; j < njobs; ++j) max_m = std::max<int64_t>(max_m, int64_t(jobs_[size_t(j)].rows.size()));
    const bool few = max_m <= kFewTokens;
    for (int j = 0; j < njobs; ++j) {
      ExpertJob& job = jobs_[size_t(j)];
      job.h = hbuf;
      hbuf += int64_t(job.rows.size()) * job.inter;
      const int64_t tile = std::min(job.inter, target);
      for (int64_t r = 0; r < job.inter; r += tile) items_.push_back({j, r, std::min(tile, job.inter - r)});
    }
    double up_bytes = 0, down_bytes = 0;
    if (prof_.on)
      for (int j = 0; j < njobs; ++j) {
        up_bytes += linear_bytes(jobs_[size_t(j)].w->w1) + linear_bytes(jobs_[size_t(j)].w->w3);
        down_bytes += linear_bytes(jobs_[size_t(j)].w->w2);
      }
    std::optional<OpTimer> ph(std::in_place, prof_, (std::string(op) + ".up").c_str(), n, up_bytes);
    // One tile of the up step: rows [r0, r0 + nr) of w1 and w3 of one job, and the activation.
    auto up_tile = [&](const ExpertJob& job, int64_t r0, int64_t nr, Scratch& s) {
      const int64_t m = int64_t(job.rows.size());
      float* h1 = s.get<float>(8, size_t(m * nr));
      float* h3 = s.get<float>(9, size_t(m * nr));
      k_.matmul({job.x, m, D}, job.w->w1, {r0, nr}, {h1, nr}, s);
      k_.matmul({job.x, m, D}, job.w->w3, {r0, nr}, {h3, nr}, s);
      for (int64_t r = 0; r < m; ++r) k_.silu_mul(h1 + r * nr, h3 + r * nr, nr, job.h + r * job.inter + r0);
    };
    if (few) {
      // Decode: the jobs' rows as one row space, shared out in guided chunks (a chunk may span
      // the end of one expert and the start of the next).
      job_row0_.resize(size_t(njobs + 1));
      job_row0_[0] = 0;
      for (int j = 0; j < njobs; ++j) job_row0_[size_t(j + 1)] = job_row0_[size_t(j)] + jobs_[size_t(j)].inter;
      guided(job_row0_[size_t(njobs)], 16, [&](int64_t a, int64_t b, int t) {
        Scratch& s = scratch(t);
        int j = int(std::upper_bound(job_row0_.begin(), job_row0_.end(), a) - job_row0_.begin()) - 1;
        for (; a < b; ++j) {
          const int64_t base = job_row0_[size_t(j)], e = std::min(b, job_row0_[size_t(j + 1)]);
          up_tile(jobs_[size_t(j)], a - base, e - a, s);
          a = e;
        }
      });
    } else {
      guided(int64_t(items_.size()), 1, [&](int64_t b, int64_t e, int t) {
        Scratch& s = scratch(t);
        for (int64_t it = b; it < e; ++it) {
          const TileItem& ti = items_[size_t(it)];
          up_tile(jobs_[size_t(ti.job)], ti.r0, ti.nr, s);
        }
      });
    }
    ph.emplace(prof_, (std::string(op) + ".down").c_str(), n, down_bytes);
    // Output rows [d0, d1): expert outer, rows inner: one call per expert, whose activations are
    // packed once.
    auto down_rows = [&](int64_t d0, int64_t d1, Scratch& s) {
      const int64_t nd = d1 - d0;
      for (int64_t i = 0; i < n; ++i) std::fill(y + i * D + d0, y + i * D + d1, 0.f);
      for (int j = 0; j < njobs; ++j) {
        const ExpertJob& job = jobs_[size_t(j)];
        const int64_t m = int64_t(job.rows.size());
        float* tmp = s.get<float>(8, size_t(m * nd));
        k_.matmul({job.h, m, job.inter}, job.w->w2, {d0, nd}, {tmp, nd}, s);
        for (int64_t r = 0; r < m; ++r) k_.axpy(job.wts[size_t(r)], tmp + r * nd, nd, y + job.rows[size_t(r)] * D + d0);
      }
    };
    if (few) {
      guided(D, 16, [&](int64_t d0, int64_t d1, int t) { down_rows(d0, d1, scratch(t)); });
      return;
    }
    const int64_t tile = row_tile(D, threads), items = (D + tile - 1) / tile;
    guided(items, 1, [&](int64_t b, int64_t e, int t) { down_rows(b * tile, std::min(D, e * tile), scratch(t)); });
  }

  void mla_absorb(const MlaCall& c) {
    ensure_scratch();
    const ModelArgs& a = *c.a;
    const AttnWeights& w = *c.w;
    const LayerCache& cache = *c.cache;
    const TokenPos* tp = c.step->pos;
    const KvView& kvv = c.step->kv;
    const int64_t n = c.step->n;
    float *q = c.q, *kv = c.kv, *out = c.out;
    const int64_t H = a.n_heads, nope = a.qk_nope_head_dim, R = a.qk_rope_head_dim, qk = nope + R,
                  C = a.kv_lora_rank, V = a.v_head_dim, B = kvv.block;
    const float scale = a.softmax_scale();
    const float* kv_norm = vec_f32(w.kv_norm, C, kvnorm_w_);
    // RoPE on q_pe and k_pe; kv_norm(latent) and k_pe into the cache at (slot, pos).
    std::optional<OpTimer> ph(std::in_place, prof_, "mla.rope_cache", n);
    for (int64_t i = 0; i < n; ++i) {
      DSV3_CHECK(tp[i].pos < c.rope->n_positions, "position ", tp[i].pos, " past the rope table");
      const float* cs = c.rope->host + size_t(tp[i].pos) * size_t(2 * c.rope->half);
      for (int64_t h = 0; h < H; ++h) apply_rope(q + (i * H + h) * qk + nope, cs, int(R / 2));
      float* kvi = kv + i * (C + R);
      apply_rope(kvi + C, cs, int(R / 2));
      const int64_t row = kvv.row(tp[i].slot, tp[i].pos);
      k_.rmsnorm({kvi, 1, C}, C, kv_norm, a.rms_norm_eps, {cache.kv + row * C, C});
      std::memcpy(cache.pe + row * R, kvi + C, size_t(R) * 4);
    }
    // q absorbed into the latent space: qa[i, h, :] = q_nope[i, h, :] . wkv_b[h, :nope, :]
    const double wkv_b_half = linear_bytes(w.wkv_b) / 2;
    ph.emplace(prof_, "mla.q_absorb", n, wkv_b_half);
    float* qa = qa_.get(size_t(n * H * C));
    float* ol = ol_.get(size_t(n * H * C));
    // Heads in guided chunks (a late or slower thread takes fewer).
    guided(H, 1, [&](int64_t b, int64_t e, int t) {
      for (int64_t h = b; h < e; ++h)
        k_.matmul_t({q + h * qk, n, H * qk}, w.wkv_b, {h * (nope + V), nope}, {qa + h * C, H * C},
                    scratch(t));
    });
    // Scores over the latent and rope caches, softmax, weighted latent sum: per token and head
    // group (heads share the cache rows: MQA over the latent).
    ph.emplace(prof_, "mla.attn", n);
    const int threads = pool_.size();
    int64_t G = H;
    while (G % 2 == 0 && n * (H / G) < 2 * threads) G /= 2;
    const int64_t groups = H / G;
    std::memset(ol, 0, size_t(n * H * C) * 4);
    // Guided chunks, the last tokens (longest contexts) first: the work grows with the position.
    guided(n * groups, 1, [&](int64_t b, int64_t e, int t) {
      Scratch& s = scratch(t);
      for (int64_t it0 = b; it0 < e; ++it0) {
        const int64_t it = n * groups - 1 - it0;
        const int64_t i = it / groups, h0 = (it % groups) * G, len = tp[i].pos + 1;
        float* sc = s.get<float>(8, size_t(G * len));
        float* sp = s.get<float>(9, size_t(G * len));
        // The sequence's cache rows block by block (each block's rows are contiguous).
        for (int64_t t0 = 0; t0 < len; t0 += B) {
          const int64_t bl = std::min(B, len - t0), row = kvv.row(tp[i].slot, t0);
          k_.gemm_nt_f32({qa + (i * H + h0) * C, G, C}, {cache.kv + row * C, bl, C}, C, scale,
                         {sc + t0, len});
          k_.gemm_nt_f32({q + (i * H + h0) * qk + nope, G, qk}, {cache.pe + row * R, bl, R}, R, scale,
                         {sp + t0, len});
        }
        for (int64_t g = 0; g < G; ++g) {
          float* row = sc + g * len;
          k_.axpy(1.f, sp + g * len, len, row);
          k_.softmax(row, len);
        }
        for (int64_t t0 = 0; t0 < len; t0 += B) {
          const int64_t bl = std::min(B, len - t0), row = kvv.row(tp[i].slot, t0);
          k_.gemm_nn_acc_f32({sc + t0, G, len}, {cache.kv + row * C, bl, C}, C, {ol + (i * H + h0) * C, C});
        }
      }
    });
    // out[i, h, :] = ol[i, h, :] . wkv_b[h, nope:, :]^T
    ph.emplace(prof_, "mla.v_out", n, wkv_b_half);
    guided(H, 1, [&](int64_t b, int64_t e, int t) {
      for (int64_t h = b; h < e; ++h)
        k_.matmul({ol + h * C, n, H * C}, w.wkv_b, {h * (nope + V) + nope, V}, {out + h * V, H * V},
                  scratch(t));
    });
  }

  ThreadPool& pool_;
  const Kernels& k_;
  const Kernels& f32k_;  // float32 arithmetic (router)
  std::unique_ptr<Backend> ref_;
  std::vector<std::unique_ptr<Scratch>> scratch_;
  std::map<void*, size_t> mapped_;
  HostArena weights_;  // the weights when copied out of the checkpoint (prepare_weights)
  Grow norm_w_, bias_, kvnorm_w_, gate_logits_, gathered_, hidden_, qa_, ol_;
  std::vector<int32_t> idx_, expert_job_;
  std::vector<float> wts_;
  std::vector<ExpertJob> jobs_;
  std::vector<TileItem> items_;
  std::vector<int64_t> job_row0_;
  int64_t routed_run_ = 0;
  int64_t last_n_ = 1;  // tokens of the last rmsnorm (for the profile of add, which sees floats)
  OpProfile prof_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const std::string& isa, ThreadPool* pool) {
  Isa i = cpu::best_isa();
  if (!isa.empty()) {
    if (!cpu::parse_isa(isa, &i)) fail("unknown cpu ISA '", isa, "' (scalar, avx2, avx512, amx)");
    if (!cpu::isa_supported(i)) fail("this CPU does not support ", isa, " (it has: ", cpu::supported_isas(), ")");
  }
  return std::make_unique<CpuBackend>(i, pool);
}

}  // namespace dsv3
