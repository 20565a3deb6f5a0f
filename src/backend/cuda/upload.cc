#include "backend/cuda/upload.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "backend/cuda/kernels.h"
#include "core/error.h"

namespace dsv3::cuda {

Uploader::Uploader(char* dst, size_t total, size_t chunk, cudaStream_t stream, bool progress)
    : dst_(dst), total_(total), chunk_(std::max<size_t>(chunk, 1)), stream_(stream), progress_(progress),
      t0_(std::chrono::steady_clock::now()) {
  chunk_ = std::min(chunk_, std::max<size_t>(total_, 1));
  for (int i = 0; i < 2; ++i) {
    DSV3_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&pin_[i]), chunk_, cudaHostAllocDefault));
    DSV3_CUDA_CHECK(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming));
    DSV3_CUDA_CHECK(cudaEventRecord(done_[i], stream_));  // "free" from the start
  }
}

Uploader::~Uploader() {
  for (int i = 0; i < 2; ++i) {
    if (done_[i]) cudaEventSynchronize(done_[i]), cudaEventDestroy(done_[i]);
    if (pin_[i]) cudaFreeHost(pin_[i]);
  }
}

void Uploader::put(size_t at, const void* src, size_t n) {
  DSV3_CHECK(at >= c0_ + fill_ && at + n <= total_, "upload out of order or past the device range");
  const char* s = static_cast<const char*>(src);
  while (n > 0) {
    if (at - c0_ >= chunk_) {  // past the staged window: send it, start a new one here
      flush();
      c0_ = at;
    }
    const size_t off = at - c0_, len = std::min(n, chunk_ - off);
    std::memcpy(pin_[b_] + off, s, len);
    fill_ = off + len;
    at += len, s += len, n -= len;
  }
}

void Uploader::flush() {
  if (fill_ == 0) return;
  DSV3_CUDA_CHECK(cudaMemcpyAsync(dst_ + c0_, pin_[b_], fill_, cudaMemcpyHostToDevice, stream_));
  DSV3_CUDA_CHECK(cudaEventRecord(done_[b_], stream_));
  sent_ = c0_ + fill_;
  fill_ = 0;
  b_ ^= 1;
  DSV3_CUDA_CHECK(cudaEventSynchronize(done_[b_]));  // the copy that last read this buffer
  if (progress_) {
    const int pct = int(100.0 * double(sent_) / double(std::max<size_t>(total_, 1)));
    if (pct != shown_) {
      shown_ = pct;
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
      std::fprintf(stderr, "\rdsv3: weights to the GPU %6.2f / %.2f GB (%3d%%, %.1f GB/s)", double(sent_) / 1e9,
                   double(total_) / 1e9, pct, s > 0 ? double(sent_) / 1e9 / s : 0.0);
      std::fflush(stderr);
    }
  }
}

void Uploader::finish() {
  flush();
  for (int i = 0; i < 2; ++i) DSV3_CUDA_CHECK(cudaEventSynchronize(done_[i]));
  if (progress_ && shown_ >= 0) std::fprintf(stderr, "\n");
}

}  // namespace dsv3::cuda
