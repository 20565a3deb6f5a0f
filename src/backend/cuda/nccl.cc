// The CUDA backend's NCCL communicators (nccl.h): bootstrap over the host Comm, non-blocking
// calls settled with a deadline, and the watched wait for a step that holds collectives.
#include "backend/cuda/nccl.h"

#include <chrono>
#include <cstdio>
#include <thread>

#include "backend/cuda/kernels.h"
#include "core/error.h"
#include "dist/comm.h"

namespace dsv3::cuda {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A waiting loop's pause: spinning at first (a step's collectives are short), then sleeping a little.
void pause(double waited_s) {
  if (waited_s < 0.05) std::this_thread::yield();
  else std::this_thread::sleep_for(std::chrono::microseconds(waited_s > 1 ? 1000 : 100));
}

}  // namespace

NcclComms::~NcclComms() {
  // The backend has drained its stream: nothing is outstanding. Finalize (bounded), then destroy;
  // a communicator that does not finalize in time is aborted.
  for (auto& [c, e] : comms_) {
    ncclResult_t r = ncclCommFinalize(e.nc);
    const auto t0 = Clock::now();
    while (r == ncclInProgress && seconds_since(t0) < timeout_s_) {
      pause(seconds_since(t0));
      if (ncclCommGetAsyncError(e.nc, &r) != ncclSuccess) break;
    }
    if (r == ncclSuccess) ncclCommDestroy(e.nc);
    else ncclCommAbort(e.nc);
  }
}

NcclComms::Entry& NcclComms::get(Comm& comm) {
  auto it = comms_.find(&comm);
  if (it != comms_.end()) return it->second;
  Entry e;
  e.rank = comm.rank(), e.size = comm.size();
  ncclUniqueId id{};
  if (e.rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) fail("NCCL: ncclGetUniqueId failed on rank 0: ", ncclGetErrorString(r));
  }
  comm.broadcast(&id, sizeof id, 0);  // (the host Comm's own timeout bounds this)
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;  // every call returns at once; settle() bounds the wait
  const ncclResult_t r = ncclCommInitRankConfig(&e.nc, e.size, id, e.rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (e.nc) ncclCommAbort(e.nc);
    fail("NCCL: rank ", e.rank, " of ", e.size, ": ncclCommInitRankConfig failed: ", ncclGetErrorString(r), " (",
         ncclGetLastError(nullptr), ")");
  }
  Entry& in = comms_.emplace(&comm, e).first->second;  // (kept: a failed settle aborts it with the rest)
  settle(in, r, "ncclCommInitRankConfig (the communicator's set-up)");
  return in;
}

void NcclComms::settle(const Entry& e, ncclResult_t r, const char* what) {
  const auto t0 = Clock::now();
  while (r == ncclInProgress) {
    const double s = seconds_since(t0);
    if (s > timeout_s_)
      throw Error(abort_all(e, str(what, " made no progress for ", int(s),
                                   " s: another rank has died or hangs (DSV3_COMM_TIMEOUT)")));
    pause(s);
    if (ncclCommGetAsyncError(e.nc, &r) != ncclSuccess) r = ncclInternalError;
  }
  if (r != ncclSuccess)
    throw Error(abort_all(e, str(what, " failed: ", ncclGetErrorString(r), " (", ncclGetLastError(e.nc), ")")));
}

ncclResult_t NcclComms::async_error(const Entry** which) const {
  for (auto& [c, e] : comms_) {
    ncclResult_t r = ncclSuccess;
    if (ncclCommGetAsyncError(e.nc, &r) != ncclSuccess) r = ncclInternalError;
    if (r != ncclSuccess && r != ncclInProgress) {
      *which = &e;
      return r;
    }
  }
  return ncclSuccess;
}

std::string NcclComms::abort_all(const Entry& e, const std::string& why) {
  const std::string msg = str("rank ", e.rank, " of ", e.size, ": ", why, "; its NCCL communicators are aborted");
  for (auto& [c, x] : comms_) ncclCommAbort(x.nc);
  comms_.clear();
  return msg;
}

void NcclComms::all_reduce(Comm& comm, float* x, int64_t n, cudaStream_t stream) {
  const Entry& e = get(comm);
  settle(e, ncclAllReduce(x, x, size_t(n), ncclFloat32, ncclSum, e.nc, stream), "ncclAllReduce");
}

void NcclComms::all_gather(Comm& comm, const float* x, int64_t n, float* y, cudaStream_t stream) {
  const Entry& e = get(comm);
  settle(e, ncclAllGather(x, y, size_t(n), ncclFloat32, e.nc, stream), "ncclAllGather");
}

void NcclComms::wait(cudaStream_t stream, const char* what) {
  const auto t0 = Clock::now();
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) DSV3_CUDA_CHECK(q);
    const Entry* bad = nullptr;
    if (const ncclResult_t r = async_error(&bad); r != ncclSuccess)
      throw Error(abort_all(*bad, str(what, ": NCCL reports ", ncclGetErrorString(r), " (", ncclGetLastError(bad->nc),
                                      "): another rank has died or failed")));
    const double s = seconds_since(t0);
    if (s > timeout_s_ && !comms_.empty())
      throw Error(abort_all(comms_.begin()->second, str(what, " made no progress for ", int(s),
                                                        " s: another rank has died or hangs (DSV3_COMM_TIMEOUT)")));
    pause(s);
  }
}

bool NcclComms::drained(cudaStream_t stream, const char* what) {
  try {
    wait(stream, what);
    return true;
  } catch (const Error& err) {
    std::fprintf(stderr, "dsv3: %s\n", err.what());
    return false;
  }
}

void parts_to_columns(const float* g, int64_t parts, int64_t rows, int64_t d, float* y, cudaStream_t stream) {
  for (int64_t p = 0; p < parts; ++p)  // part p: rows of d floats, d * parts apart in y
    DSV3_CUDA_CHECK(cudaMemcpy2DAsync(y + p * d, size_t(parts * d) * 4, g + p * rows * d, size_t(d) * 4,
                                      size_t(d) * 4, size_t(rows), cudaMemcpyDeviceToDevice, stream));
}

}  // namespace dsv3::cuda
