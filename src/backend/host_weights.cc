#include "backend/host_weights.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "core/error.h"
#include "io/mmap_file.h"

namespace dsv3 {
namespace {

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kAlign = 64;  // each tensor starts on a cache line

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

std::string gb(int64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GB", double(bytes) / 1e9);
  return b;
}

// Whether the kernel gives anonymous memory huge pages on request ("always" or "madvise").
bool huge_pages_on_request() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s;
  std::getline(f, s);
  return s.find("[never]") == std::string::npos && !s.empty();
}

// Pins [p, p + n) (whole pages); false with errno set when refused.
bool lock_range(const void* p, size_t n) {
  const uintptr_t page = 4096, a = uintptr_t(p) / page * page;
  return ::mlock(reinterpret_cast<void*>(a), uintptr_t(p) + n - a) == 0;
}

}  // namespace

HostArena::HostArena(size_t bytes) : size_(bytes) {
  map_bytes_ = round_up(std::max<size_t>(bytes, 1), kHugePage) + kHugePage;
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map_ == MAP_FAILED) {
    const int e = errno;
    map_ = nullptr;
    fail("cannot map ", gb(int64_t(bytes)), " of anonymous memory for the weights: ", std::strerror(e),
         " (--weight-memory map reads them in place)");
  }
  data_ = reinterpret_cast<uint8_t*>(round_up(reinterpret_cast<uintptr_t>(map_), kHugePage));
  ::madvise(data_, round_up(bytes, kHugePage), MADV_HUGEPAGE);  // advice only: 4 KB pages where refused
}

HostArena::~HostArena() {
  if (map_) ::munmap(map_, map_bytes_);
}

HostArena::HostArena(HostArena&& o) noexcept { *this = std::move(o); }

HostArena& HostArena::operator=(HostArena&& o) noexcept {
  if (this != &o) {
    if (map_) ::munmap(map_, map_bytes_);
    map_ = std::exchange(o.map_, nullptr);
    map_bytes_ = std::exchange(o.map_bytes_, 0);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

int64_t host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = -1;
  for (std::string line; std::getline(f, line);) {
    std::istringstream ss(line);
    if (ss >> key && key == "MemAvailable:" && ss >> kb) break;
    kb = -1;
  }
  if (kb < 0) return -1;
  long ranks = 1;
  if (const char* e = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) ranks = std::max(1L, std::atol(e));
  return kb * 1024 / ranks;
}

bool weights_copied(const WeightMemory& m, int64_t bytes, int64_t available) {
  switch (m.mode) {
    case WeightMemory::kCopy: return true;
    case WeightMemory::kMap: return false;
    case WeightMemory::kAuto: return available >= 0 && bytes + m.keep_free <= available;
  }
  return false;
}

WeightPlacement place_host_weights(ModelWeights& w, const WeightMemory& m, HostArena* arena) {
  std::vector<TensorView*> all;
  size_t total = 0;
  int64_t bytes = 0;
  for_each_tensor(w, [&](TensorView& t, TensorRole) {
    if (t.empty() || t.nbytes() == 0) return;
    all.push_back(&t);
    total += round_up(t.nbytes(), kAlign);
    bytes += int64_t(t.nbytes());
  });
  const int64_t available = host_available_bytes();
  WeightPlacement p;
  if (arena && weights_copied(m, bytes, available)) {
    const auto t0 = std::chrono::steady_clock::now();
    *arena = HostArena(total);
    size_t at = 0;
    for (TensorView* t : all) {
      std::memcpy(arena->data() + at, t->data, t->nbytes());
      // The checkpoint's pages leave this process's resident set as they are copied: it holds one
      // copy of the weights at a time, not two (a page shared with a tensor not yet copied maps
      // back in when that one is read).
      release_mapped_pages(t->data, t->nbytes());
      t->data = arena->data() + at;
      at += round_up(t->nbytes(), kAlign);
    }
    w.owned.clear();  // (row-parallel slices: copied with the rest)
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    p.note = str("weights: ", gb(bytes), " copied into anonymous memory in ", int(s * 10 + 0.5) / 10.0, " s",
                 huge_pages_on_request() ? " (transparent huge pages)" : " (4 KB pages: transparent huge pages are off)");
    p.off_checkpoint = p.copied = true;
  } else {
    p.note = str("weights: ", gb(bytes), " read in place from the checkpoint's pages");
    if (arena && m.mode == WeightMemory::kAuto)
      p.note += available < 0 ? " (free memory unknown)"
                              : str(" (a copy needs ", gb(bytes + m.keep_free), " available, ", gb(available), " are)");
  }
  if (m.lock) {
    int err = 0;
    if (p.off_checkpoint) {
      if (!lock_range(arena->data(), total)) err = errno;
    } else {
      for (TensorView* t : all)
        if (!lock_range(t->data, t->nbytes())) err = errno;
    }
    p.locked = err == 0;
    p.note += err == 0 ? ", locked" : str("; warning: mlock refused (", std::strerror(err), "): the weights stay pageable");
  }
  return p;
}

}  // namespace dsv3
