#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <memory>

namespace dsv3 {

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
    std::unique_lock<std::mutex> lk(mu_);
    cv_work_.wait(lk, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (idx >= n_chunks_) continue;
    auto* fn = task_;
    int64_t b = idx * chunk_, e = std::min(n_, b + chunk_);
    lk.unlock();
    std::exception_ptr err;
    try {
      (*fn)(b, e, idx);
    } catch (...) {
      err = std::current_exception();
    }
    lk.lock();
    if (err && !worker_err_) worker_err_ = err;
    if (--pending_ == 0) cv_done_.notify_one();
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
  {
    std::lock_guard<std::mutex> lk(mu_);
    task_ = &fn;
    n_ = n;
    chunk_ = chunk;
    n_chunks_ = chunks;
    pending_ = chunks - 1;
    ++generation_;
  }
  cv_work_.notify_all();
  std::exception_ptr err;
  try {
    fn(0, std::min(n, chunk), 0);
  } catch (...) {
    err = std::current_exception();
  }
  std::unique_lock<std::mutex> lk(mu_);
  cv_done_.wait(lk, [&] { return pending_ == 0; });
  task_ = nullptr;
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
