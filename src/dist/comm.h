// The ranks a model is spread over (tensor and expert parallelism, as the reference's
// torch.distributed world). Collectives on host memory here; a device backend runs them on its own
// stream through the implementation it knows (NCCL). World size 1 is the single-process engine:
// the model records no collective at all then.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

namespace dsv3 {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // x [n] summed over the ranks, in place (host memory).
  virtual void all_reduce_sum(float* x, int64_t n) = 0;
  // y [size, n] = every rank's x [n], rank r's at y + r * n (host memory).
  virtual void all_gather(const float* x, int64_t n, float* y) = 0;
  // `bytes` of data from rank `root` to every rank (host memory): sampled token ids.
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
};

// World size 1: every collective is the identity.
std::unique_ptr<Comm> make_single_comm();

}  // namespace dsv3
