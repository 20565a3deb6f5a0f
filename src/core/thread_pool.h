// One persistent pool of worker threads, sized once; parallel_for splits [0, n) into contiguous
// chunks. The calling thread works too, so a pool of size 1 runs everything inline. Between
// tasks a worker spins briefly before it sleeps (and the caller spins briefly for the workers to
// finish): a forward pass runs hundreds of short regions back to back, and waking a sleeping
// thread costs tens of microseconds on a virtual machine.
#pragma once
#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dsv3 {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  // fn(begin, end, thread_index) over a partition of [0, n) into at most size() chunks of at
  // least `grain` items. Not reentrant: a task must not call parallel_for on the same pool.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                    int64_t grain = 1);

  // The process-wide pool; its size is set by set_global_threads before first use
  // (default: hardware concurrency).
  static ThreadPool& global();
  static void set_global_threads(int n);

 private:
  void worker(int idx);
  int n_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  // Task parameters: written by the caller before generation_ is bumped (release), read by the
  // workers after they see it change (acquire).
  const std::function<void(int64_t, int64_t, int)>* task_ = nullptr;
  int64_t n_ = 0, chunk_ = 0;
  int n_chunks_ = 0;
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::exception_ptr worker_err_;  // under mu_
};

// Shorthand for ThreadPool::global().parallel_for.
inline void parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                         int64_t grain = 1) {
  ThreadPool::global().parallel_for(n, fn, grain);
}

}  // namespace dsv3
