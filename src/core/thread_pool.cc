#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>

namespace dsv3 {

namespace {
// How long a thread spins for the next task (worker) or for the workers to finish (caller)
// before it sleeps on a condition variable.
constexpr double kSpinSeconds = 100e-6;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until pred() or about kSpinSeconds have passed; returns pred().
template <class P>
bool spin_until(P pred) {
  if (pred()) return true;
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (pred()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() - t0 > std::chrono::duration<double>(kSpinSeconds)) return pred();
  }
}
}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
  for (int i = 1; i < n_threads_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::worker(int idx) {
  uint64_t seen = 0;
  for (;;) {
    auto changed = [&] { return stop_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen; };
    if (!spin_until(changed)) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_work_.wait(lk, changed);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);
    // Every worker acknowledges every task (pending_ counts them all), so the caller does not
    // rewrite the task parameters while a worker may still be reading them.
    if (idx < n_chunks_) {
      auto* fn = task_;
      int64_t b = idx * chunk_, e = std::min(n_, b + chunk_);
      try {
        (*fn)(b, e, idx);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu_);
        if (!worker_err_) worker_err_ = std::current_exception();
      }
    }
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // The caller may be asleep on cv_done_: take the lock so that the notify cannot fall
      // between its check of pending_ and its wait.
      { std::lock_guard<std::mutex> lk(mu_); }
      cv_done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                              int64_t grain) {
  if (n <= 0) return;
  int64_t max_chunks = std::max<int64_t>(1, n / std::max<int64_t>(1, grain));
  int chunks = int(std::min<int64_t>(n_threads_, max_chunks));
  if (chunks == 1) {
    fn(0, n, 0);
    return;
  }
  int64_t chunk = (n + chunks - 1) / chunks;
  chunks = int((n + chunk - 1) / chunk);
  task_ = &fn;
  n_ = n;
  chunk_ = chunk;
  n_chunks_ = chunks;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  {
    // Under the lock: a worker about to sleep either sees the new generation or gets the notify.
    std::lock_guard<std::mutex> lk(mu_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_work_.notify_all();
  std::exception_ptr err;
  try {
    fn(0, std::min(n, chunk), 0);
  } catch (...) {
    err = std::current_exception();
  }
  auto done = [&] { return pending_.load(std::memory_order_acquire) == 0; };
  if (!spin_until(done)) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, done);
  }
  task_ = nullptr;
  std::lock_guard<std::mutex> lk(mu_);
  if (!err) err = worker_err_;
  worker_err_ = nullptr;
  if (err) std::rethrow_exception(err);
}

static std::atomic<int> g_threads{0};

void ThreadPool::set_global_threads(int n) { g_threads = n; }

ThreadPool& ThreadPool::global() {
  static ThreadPool pool(g_threads > 0 ? g_threads.load()
                                       : int(std::max(1u, std::thread::hardware_concurrency())));
  return pool;
}

}  // namespace dsv3
