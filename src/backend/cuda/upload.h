// Host -> device upload of the weights: one contiguous device range written through two pinned
// staging buffers, so that reading the next chunk from the checkpoint's mmap (page faults, disk)
// overlaps the DMA of the previous one; a progress line on a terminal.
#pragma once
#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>

namespace dsv3::cuda {

class Uploader {
 public:
  // dst: device range of `total` bytes, written in increasing offsets; chunk: staging buffer size.
  Uploader(char* dst, size_t total, size_t chunk, cudaStream_t stream, bool progress);
  ~Uploader();
  Uploader(const Uploader&) = delete;
  Uploader& operator=(const Uploader&) = delete;
  // Bytes [at, at + n) of the range from host memory src; `at` never below the previous call's end.
  void put(size_t at, const void* src, size_t n);
  // Sends what is staged and waits for every copy; throws on a CUDA error.
  void finish();

 private:
  void flush();
  char* dst_;
  size_t total_, chunk_;
  cudaStream_t stream_;
  bool progress_;
  char* pin_[2] = {nullptr, nullptr};
  cudaEvent_t done_[2] = {nullptr, nullptr};
  int b_ = 0;
  size_t c0_ = 0, fill_ = 0, sent_ = 0;
  int shown_ = -1;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace dsv3::cuda
