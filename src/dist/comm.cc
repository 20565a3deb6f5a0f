#include "dist/comm.h"

#include <cstring>

namespace dsv3 {
namespace {

class SingleComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce_sum(float*, int64_t) override {}
  void all_gather(const float* x, int64_t n, float* y) override {
    if (y != x) std::memcpy(y, x, size_t(n) * sizeof(float));
  }
  void broadcast(void*, size_t, int) override {}
};

}  // namespace

std::unique_ptr<Comm> make_single_comm() { return std::make_unique<SingleComm>(); }

}  // namespace dsv3
