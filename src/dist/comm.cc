#include "dist/comm.h"

#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace dsv3 {

#ifdef DSV3_HAVE_MPI
std::unique_ptr<Comm> make_mpi_comm(double timeout_s);  // dist/mpi_comm.cc
#endif

namespace {

class SingleComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce_sum(float*, int64_t) override {}
  void all_gather(const float* x, int64_t n, float* y) override {
    if (y != x) std::memcpy(y, x, size_t(n) * sizeof(float));
  }
  void broadcast(void*, size_t, int, bool) override {}
  bool all_ok(bool ok) override { return ok; }
};

class StandInComm final : public Comm {
 public:
  explicit StandInComm(int size) : size_(size) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  void all_reduce_sum(float*, int64_t) override {}
  void all_gather(const float* x, int64_t n, float* y) override {
    for (int r = 0; r < size_; ++r)
      if (y + r * n != x) std::memmove(y + r * n, x, size_t(n) * sizeof(float));
  }
  void broadcast(void*, size_t, int, bool) override {}
  bool all_ok(bool ok) override { return ok; }
  bool stand_in() const override { return true; }

 private:
  int size_;
};

}  // namespace

std::unique_ptr<Comm> make_single_comm() { return std::make_unique<SingleComm>(); }

std::unique_ptr<Comm> make_stand_in_comm(int size) {
  if (size < 1 || size > 1024) fail("the stand-in world's size must be in [1, 1024], got ", size);
  return std::make_unique<StandInComm>(size);
}

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(v)) return true;
  return false;
}

double comm_timeout_s() {
  const char* t = std::getenv("DSV3_COMM_TIMEOUT");
  if (!t) return 60;
  char* end = nullptr;
  const double s = std::strtod(t, &end);
  if (end == t || *end || !(s > 0)) fail("DSV3_COMM_TIMEOUT must be a number of seconds > 0, got '", t, "'");
  return s;
}

int parse_local_rank(const char* v) {
  if (!v) return -1;
  char* end = nullptr;
  const long r = std::strtol(v, &end, 10);
  if (end == v || *end || r < 0 || r > 1 << 20)
    fail("OMPI_COMM_WORLD_LOCAL_RANK must be a rank >= 0, got '", v, "'");
  return int(r);
}

int local_rank() { return parse_local_rank(std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")); }

Comm& world_comm() {
  static std::unique_ptr<Comm> world = [] {
    if (!launched_by_mpi()) return make_single_comm();
#ifdef DSV3_HAVE_MPI
    return make_mpi_comm(comm_timeout_s());
#else
    fail("started by mpirun, but this build has no MPI (configure with OpenMPI installed, -DDSV3_MPI=ON)");
#endif
  }();
  return *world;
}

}  // namespace dsv3
