#include "server/encoder.h"

#include <future>

namespace dsv3::server {

Encoder::Encoder(const Tokenizer& tok) : tok_(tok), worker_([this] { loop(); }) {}

Encoder::~Encoder() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

std::vector<int32_t> Encoder::encode(const std::string& text) {
  std::packaged_task<std::vector<int32_t>()> task([&] { return tok_.encode(text); });
  std::future<std::vector<int32_t>> result = task.get_future();
  {
    std::lock_guard<std::mutex> lk(mu_);
    jobs_.emplace_back([&task] { task(); });
  }
  cv_.notify_one();
  return result.get();  // waits; rethrows what encode() threw
}

void Encoder::loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

}  // namespace dsv3::server
