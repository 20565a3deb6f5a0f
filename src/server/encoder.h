// Tokenization for the HTTP threads, done on one thread of its own. The tokenizer keeps caches
// per thread (a 2 MB BPE piece cache, PCRE2 match state): encoding on each of the server's many
// connection threads would fill one set per thread, hundreds of MB under load. One worker keeps
// one warm set; encoding is short next to generation, so requests queue for it only briefly.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "text/tokenizer.h"

namespace dsv3::server {

class Encoder {
 public:
  explicit Encoder(const Tokenizer& tok);
  ~Encoder();
  Encoder(const Encoder&) = delete;
  Encoder& operator=(const Encoder&) = delete;

  // tok.encode(text), run on the worker; its Error is thrown here.
  std::vector<int32_t> encode(const std::string& text);

 private:
  void loop();
  const Tokenizer& tok_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace dsv3::server
