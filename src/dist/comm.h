// The ranks a model is spread over (tensor and expert parallelism, as the reference's
// torch.distributed world). Collectives on host memory here; a device backend runs them on its own
// stream through the implementation it knows (NCCL). World size 1 is the single-process engine:
// the model records no collective at all then.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

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
  // `bytes` of data from rank `root` to every rank (host memory). wait = false: a call that may
  // wait indefinitely for the root (a follower waiting for the next step while the leader waits
  // for its user); otherwise a collective that makes no progress for the timeout ends the process.
  virtual void broadcast(void* data, size_t bytes, int root, bool wait = false) = 0;
  // Whether every rank's `ok` is true (a start-up check that one rank may fail alone).
  virtual bool all_ok(bool ok) = 0;
  // A stand-in world (dsv3 bench --tp-shard): this process is rank 0 of size() ranks that do not
  // run. Its collectives move nothing: all_reduce_sum keeps this rank's part, all_gather puts it in
  // every rank's slot, broadcast keeps the data; a device backend does the same on its own memory.
  virtual bool stand_in() const { return false; }
};

// World size 1: every collective is the identity.
std::unique_ptr<Comm> make_single_comm();

// Rank 0 of a stand-in world of `size` ranks (see Comm::stand_in): one rank's share of the work of
// a model spread over `size` ranks, measured on one device.
std::unique_ptr<Comm> make_stand_in_comm(int size);

// The process's world: the MPI world when this process was started by mpirun (and the build has
// MPI), else world size 1. Created on first use; lives until exit. `timeout_s`: how long an
// in-step collective may make no progress before the process reports the stuck ranks and ends
// (default 60 s; DSV3_COMM_TIMEOUT).
Comm& world_comm();
// Whether this process was started by an MPI launcher (mpirun's environment).
bool launched_by_mpi();
// DSV3_COMM_TIMEOUT in seconds (default 60): how long an in-step collective may make no progress
// before the job ends (the MPI Comm, and the CUDA backend's NCCL communicators).
double comm_timeout_s();
// This process's rank among the ranks on its node (OpenMPI's OMPI_COMM_WORLD_LOCAL_RANK), -1 when
// not set: a CUDA rank takes GPU local_rank() % devices. parse_local_rank: the variable's value
// (null: -1; not a number >= 0: Error naming it).
int local_rank();
int parse_local_rank(const char* value);

}  // namespace dsv3
