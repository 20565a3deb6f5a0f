#include "io/mmap_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <utility>
#include <vector>

#include "core/error.h"

namespace dsv3 {
namespace {

// The live mappings (release_mapped_pages releases only inside them).
struct Mappings {
  std::mutex mu;
  std::vector<std::pair<const uint8_t*, size_t>> live;
};
Mappings& mappings() {
  static Mappings m;
  return m;
}

}  // namespace

MmapFile::MmapFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, ": cannot open: ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail(path, ": cannot stat: ", std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": not a regular file");
  }
  size_ = size_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      fail(path, ": mmap failed: ", std::strerror(e));
    }
    data_ = static_cast<const uint8_t*>(p);
    std::lock_guard lock(mappings().mu);
    mappings().live.emplace_back(data_, size_);
  }
  ::close(fd);
}

MmapFile::~MmapFile() {
  if (!data_) return;
  {
    std::lock_guard lock(mappings().mu);
    auto& v = mappings().live;
    std::erase(v, std::pair<const uint8_t*, size_t>(data_, size_));
  }
  ::munmap(const_cast<uint8_t*>(data_), size_);
}

bool release_mapped_pages(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  std::lock_guard lock(mappings().mu);
  for (const auto& [d, size] : mappings().live) {
    if (b < d || b + n > d + size) continue;
    const uintptr_t page = 4096, a = uintptr_t(b) / page * page;  // whole pages, all inside the mapping
    ::madvise(reinterpret_cast<void*>(a), uintptr_t(b) + n - a, MADV_DONTNEED);
    return true;
  }
  return false;
}

void MmapFile::release() {
  if (data_) ::madvise(const_cast<uint8_t*>(data_), size_, MADV_DONTNEED);
}

std::string read_text_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path, ": cannot open: ", std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) fail(path, ": read error");
  return ss.str();
}

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(tmp, ": cannot create: ", std::strerror(errno));
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t w = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (w < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail(tmp, ": write failed: ", std::strerror(e));
    }
    off += size_t(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    fail(tmp, ": cannot flush: ", std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    fail(path, ": cannot rename into place: ", std::strerror(e));
  }
}

}  // namespace dsv3
