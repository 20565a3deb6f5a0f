// Host memory for a model's weights: what this process may still use, and moving the weights out
// of the checkpoint's file pages into anonymous memory with transparent huge pages, where the
// cpu backend's kernels stream them faster (docs/cpu_backend.md, Memory).
#pragma once
#include <cstddef>
#include <cstdint>

#include "backend/backend.h"

namespace dsv3 {

// Anonymous memory aligned to 2 MiB, transparent huge pages asked for (madvise); unmapped when
// destroyed.
class HostArena {
 public:
  HostArena() = default;
  explicit HostArena(size_t bytes);  // throws Error naming the size when the kernel refuses
  ~HostArena();
  HostArena(HostArena&& o) noexcept;
  HostArena& operator=(HostArena&& o) noexcept;
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Bytes of host memory this process may still take: /proc/meminfo's MemAvailable shared among the
// ranks mpirun started on this node (OMPI_COMM_WORLD_LOCAL_SIZE); -1 where unknown.
int64_t host_available_bytes();

// Whether `bytes` of weights are copied under m when `available` bytes are free (-1: unknown):
// kCopy always, kMap never, kAuto when bytes + m.keep_free fit.
bool weights_copied(const WeightMemory& m, int64_t bytes, int64_t available);

// Places w's tensors as m says: copied into *arena (views rewritten, w.owned released) or left
// where they are; then pinned when m.lock (a refusal is a warning in the note, not an error).
// arena == nullptr: never copied.
WeightPlacement place_host_weights(ModelWeights& w, const WeightMemory& m, HostArena* arena);

}  // namespace dsv3
