#include "tools/ckpt_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace dsv3 {

namespace fs = std::filesystem;

namespace {

void fsync_path(const std::string& p) {
  int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// A partial directory's pid suffix, or 0 when `name` is not `prefix` + digits.
pid_t partial_pid(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0) return 0;
  const std::string digits = name.substr(prefix.size());
  if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) return 0;
  return pid_t(std::stol(digits));
}

// Removes `out`.partial-<pid> directories whose process is gone (a killed run's leftovers).
void remove_dead_partials(const fs::path& out) {
  const std::string prefix = out.filename().string() + ".partial-";
  std::error_code ec;
  for (auto& e : fs::directory_iterator(out.parent_path().empty() ? fs::path(".") : out.parent_path(), ec)) {
    const pid_t pid = partial_pid(e.path().filename().string(), prefix);
    if (pid > 0 && pid != ::getpid() && ::kill(pid, 0) == -1 && errno == ESRCH) fs::remove_all(e.path(), ec);
  }
}

}  // namespace

StagedDir::StagedDir(const std::string& out, const std::string& flag) : out_(out) {
  while (out_.size() > 1 && out_.back() == '/') out_.pop_back();
  const fs::path p(out_);
  if (out_.empty() || out_ == "/" || p.filename() == "." || p.filename() == "..")
    fail(flag, " '", out, "' must name a new folder");
  std::error_code ec;
  if (fs::exists(p, ec)) {
    if (!fs::is_directory(p, ec)) fail(flag, " ", out_, " exists and is not a directory");
    if (!fs::is_empty(p, ec)) fail(flag, " ", out_, " exists and is not empty (remove it or name a new folder)");
  }
  partial_ = out_ + ".partial-" + std::to_string(::getpid());
}

StagedDir::~StagedDir() {
  if (committed_ || !begun_) return;
  std::error_code ec;
  fs::remove_all(partial_, ec);
  if (!created_parent_.empty()) fs::remove_all(created_parent_, ec);
}

const std::string& StagedDir::begin(uint64_t bytes) {
  DSV3_CHECK(!begun_, "StagedDir::begin called twice");
  fs::path parent = fs::path(out_).parent_path();
  std::error_code ec;
  if (!parent.empty() && !fs::exists(parent, ec)) {
    fs::path top = parent;
    while (top.has_parent_path() && !top.parent_path().empty() && !fs::exists(top.parent_path(), ec))
      top = top.parent_path();
    fs::create_directories(parent, ec);
    if (ec) fail(out_, ": cannot create the parent folder ", parent.string(), ": ", ec.message());
    created_parent_ = top.string();
  }
  begun_ = true;
  remove_dead_partials(out_);
  fs::remove_all(partial_, ec);
  if (::mkdir(partial_.c_str(), 0755) != 0) fail(partial_, ": cannot create: ", std::strerror(errno));
  struct statvfs sv;
  if (::statvfs(partial_.c_str(), &sv) == 0) {
    const uint64_t avail = uint64_t(sv.f_bavail) * uint64_t(sv.f_frsize);
    const uint64_t need = bytes + (uint64_t(16) << 20);
    if (avail < need)
      fail(out_, ": the output needs ", double(need) / 1e9, " GB but only ", double(avail) / 1e9,
           " GB are free there");
  }
  return partial_;
}

void StagedDir::commit() {
  DSV3_CHECK(begun_ && !committed_, "StagedDir::commit without begin");
  fsync_path(partial_);
  // An empty directory at `out` is replaced by rename(2) itself.
  if (::rename(partial_.c_str(), out_.c_str()) != 0)
    fail(out_, ": cannot rename ", partial_, " into place: ", std::strerror(errno));
  committed_ = true;
  const fs::path parent = fs::path(out_).parent_path();
  fsync_path(parent.empty() ? "." : parent.string());
}

std::vector<std::string> list_files(const std::string& dir, const std::string& suffix) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail(dir, ": no such directory");
  std::vector<std::string> out;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (!e.is_regular_file(ec) || n.size() < suffix.size()) continue;
    if (n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0) out.push_back(n);
  }
  if (ec) fail(dir, ": cannot list: ", ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

void copy_file_atomic(const std::string& from, const std::string& to) {
  const std::string tmp = to + ".tmp-" + std::to_string(::getpid());
  int in = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) fail(from, ": cannot open: ", std::strerror(errno));
  int out = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0) {
    const int e = errno;
    ::close(in);
    fail(tmp, ": cannot create: ", std::strerror(e));
  }
  std::string err;
  std::vector<char> buf(size_t(1) << 20);
  for (;;) {
    ssize_t n = ::read(in, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) err = from + ": read failed: " + std::strerror(errno);
    if (n <= 0) break;
    for (ssize_t done = 0; done < n && err.empty();) {
      ssize_t w = ::write(out, buf.data() + done, size_t(n - done));
      if (w < 0 && errno != EINTR) err = tmp + ": write failed: " + std::strerror(errno);
      if (w > 0) done += w;
    }
    if (!err.empty()) break;
  }
  if (err.empty() && ::fsync(out) != 0) err = tmp + ": fsync failed: " + std::strerror(errno);
  ::close(in);
  if (::close(out) != 0 && err.empty()) err = tmp + ": close failed: " + std::strerror(errno);
  if (err.empty() && ::rename(tmp.c_str(), to.c_str()) != 0)
    err = to + ": cannot rename " + tmp + " into place: " + std::strerror(errno);
  if (!err.empty()) {
    ::unlink(tmp.c_str());
    fail(err);
  }
}

void release_pages(const void* p, size_t n) {
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + n;
  if (n > 0) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace dsv3
