// The CUDA backend's NCCL communicators (built where the CUDA toolkit has NCCL: DSV3_HAVE_NCCL):
// one per host Comm, made on its first collective (rank 0's ncclGetUniqueId broadcast over the
// Comm, then ncclCommInitRankConfig, non-blocking, on every rank), collectives enqueued on the
// backend's stream (so a recorded step's CUDA graph holds them), and bounded waits: a rank whose
// peers died or hang aborts its communicators and fails with a message naming it, after
// DSV3_COMM_TIMEOUT, instead of waiting forever.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <map>
#include <string>

namespace dsv3 {
class Comm;
}

namespace dsv3::cuda {

class NcclComms {
 public:
  explicit NcclComms(double timeout_s) : timeout_s_(timeout_s) {}
  ~NcclComms();  // every communicator destroyed (aborted where it failed or does not drain)
  NcclComms(const NcclComms&) = delete;
  NcclComms& operator=(const NcclComms&) = delete;

  // Whether comm's communicator exists (a collective may be recorded only then).
  bool has(const Comm& comm) const { return comms_.count(&comm) != 0; }
  bool empty() const { return comms_.empty(); }
  // x [n] summed over comm's ranks, in place, on `stream`.
  void all_reduce(Comm& comm, float* x, int64_t n, cudaStream_t stream);
  // y [parts, n] = every rank's x [n], rank r's at y + r * n, on `stream`.
  void all_gather(Comm& comm, const float* x, int64_t n, float* y, cudaStream_t stream);
  // Waits until `stream` has drained, watching the communicators: an error NCCL reports, or no
  // completion within the timeout, aborts them all and throws Error naming this rank and `what`.
  void wait(cudaStream_t stream, const char* what);
  // The same without throwing (a destructor's wait): false after such an abort.
  bool drained(cudaStream_t stream, const char* what);

 private:
  struct Entry {
    ncclComm_t nc = nullptr;
    int rank = 0, size = 1;
  };
  Entry& get(Comm& comm);
  // Polls a non-blocking communicator until `what` is no longer in progress (bounded).
  void settle(const Entry& e, ncclResult_t r, const char* what);
  // The first error any communicator reports (ncclSuccess: none).
  ncclResult_t async_error(const Entry** which) const;
  // Aborts every communicator; the message names the rank.
  std::string abort_all(const Entry& e, const std::string& why);

  std::map<const Comm*, Entry> comms_;
  double timeout_s_;
};

// y [rows, parts * d] = g [parts, rows, d] (the layout of an all-gather of [rows, d] blocks as
// Backend::all_gather gives it), on `stream` (a strided copy per part).
void parts_to_columns(const float* g, int64_t parts, int64_t rows, int64_t d, float* y, cudaStream_t stream);

}  // namespace dsv3::cuda
