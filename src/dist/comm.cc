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

}  // namespace

std::unique_ptr<Comm> make_single_comm() { return std::make_unique<SingleComm>(); }

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(v)) return true;
  return false;
}

Comm& world_comm() {
  static std::unique_ptr<Comm> world = [] {
    if (!launched_by_mpi()) return make_single_comm();
#ifdef DSV3_HAVE_MPI
    double timeout = 60;
    if (const char* t = std::getenv("DSV3_COMM_TIMEOUT")) {
      char* end = nullptr;
      timeout = std::strtod(t, &end);
      if (*end || !(timeout > 0)) fail("DSV3_COMM_TIMEOUT must be a number of seconds > 0, got '", t, "'");
    }
    return make_mpi_comm(timeout);
#else
    fail("started by mpirun, but this build has no MPI (configure with OpenMPI installed, -DDSV3_MPI=ON)");
#endif
  }();
  return *world;
}

}  // namespace dsv3
