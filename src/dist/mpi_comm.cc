// The MPI world (OpenMPI from Debian) as a Comm for CPU ranks: non-blocking collectives waited on
// with a deadline, so a rank that died or hangs ends the others with a message naming what
// stalled, not a silent hang (a rank that dies outright is also noticed by mpirun itself, which
// ends the job and names it).
#define OMPI_SKIP_MPICXX 1  // the C API only (no C++ bindings to link)
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <thread>

#include "core/error.h"
#include "dist/comm.h"

namespace dsv3 {
namespace {

using Clock = std::chrono::steady_clock;

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw Error(str("MPI: ", what, " failed: ", std::string(msg, size_t(len))));
}

class MpiComm final : public Comm {
 public:
  explicit MpiComm(double timeout_s) : timeout_s_(timeout_s) {
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
  }
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce_sum(float* x, int64_t n) override {
    MPI_Request r;
    check(MPI_Iallreduce(MPI_IN_PLACE, x, count(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r), "MPI_Iallreduce");
    wait(r, "an all-reduce", false);
  }
  void all_gather(const float* x, int64_t n, float* y) override {
    MPI_Request r;
    check(MPI_Iallgather(x, count(n), MPI_FLOAT, y, count(n), MPI_FLOAT, MPI_COMM_WORLD, &r), "MPI_Iallgather");
    wait(r, "an all-gather", false);
  }
  void broadcast(void* data, size_t bytes, int root, bool wait_long) override {
    MPI_Request r;
    check(MPI_Ibcast(data, count(int64_t(bytes)), MPI_BYTE, root, MPI_COMM_WORLD, &r), "MPI_Ibcast");
    wait(r, "a broadcast", wait_long);
  }
  bool all_ok(bool ok) override {
    int v = ok ? 1 : 0, all = 0;
    MPI_Request r;
    check(MPI_Iallreduce(&v, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD, &r), "MPI_Iallreduce");
    wait(r, "the start-up check", false);
    return all == 1;
  }

 private:
  static int count(int64_t n) {
    if (n < 0 || n > INT_MAX) fail("MPI: a collective of ", n, " elements (at most ", INT_MAX, ")");
    return int(n);
  }
  // Polls r: spinning at first (a collective inside a step is short), then sleeping a little. A
  // collective that has not completed after timeout_s ends the job (unless `forever`).
  void wait(MPI_Request& r, const char* what, bool forever) {
    const auto t0 = Clock::now();
    for (int polls = 0;; ++polls) {
      int done = 0;
      check(MPI_Test(&r, &done, MPI_STATUS_IGNORE), what);
      if (done) return;
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (!forever && s > timeout_s_) {
        std::fprintf(stderr,
                     "dsv3: rank %d of %d: %s made no progress for %.0f s: another rank has died or hangs; ending "
                     "the job (DSV3_COMM_TIMEOUT)\n",
                     rank_, size_, what, s);
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 3);
      }
      if (s > 0.002) std::this_thread::sleep_for(std::chrono::microseconds(s > 0.1 ? 1000 : 50));
    }
  }
  int rank_ = 0, size_ = 1;
  double timeout_s_;
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm(double timeout_s) { return std::make_unique<MpiComm>(timeout_s); }

}  // namespace dsv3
