#include "io/safetensors_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace dsv3 {

using json = nlohmann::json;

uint64_t TensorDecl::nbytes() const {
  uint64_t n = 1;
  for (auto d : shape) n *= uint64_t(d);
  return n * dtype_size(dtype);
}

std::string safetensors_header(const std::vector<TensorDecl>& tensors,
                               const std::map<std::string, std::string>& metadata,
                               std::vector<uint64_t>* begin) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return dtype_size(tensors[a].dtype) > dtype_size(tensors[b].dtype);
  });
  if (begin) begin->assign(tensors.size(), 0);
  uint64_t off = 0;
  for (size_t i : order) {
    const TensorDecl& t = tensors[i];
    if (t.name == "__metadata__") fail("safetensors: tensor name '__metadata__' is reserved");
    if (h.contains(t.name)) fail("safetensors: tensor '", t.name, "' is given more than once");
    for (auto d : t.shape)
      if (d < 0) fail("safetensors: tensor '", t.name, "' has a negative dimension");
    uint64_t n = t.nbytes();
    h[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {off, off + n}}};
    if (begin) (*begin)[i] = off;
    off += n;
  }
  std::string hs = h.dump();
  while ((8 + hs.size()) % 8) hs += ' ';
  std::string out(8, '\0');
  uint64_t hl = hs.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((hl >> (8 * i)) & 0xff);
  return out + hs;
}

static void pwrite_all(int fd, const char* p, size_t n, uint64_t pos, const std::string& what) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, std::min<size_t>(n, size_t(1) << 30), off_t(pos));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(what, ": write failed: ", std::strerror(errno));
    }
    p += w;
    pos += uint64_t(w);
    n -= size_t(w);
  }
}

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<TensorDecl> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path), tensors_(std::move(tensors)) {
  std::string header = safetensors_header(tensors_, metadata, &begin_);
  header_size_ = header.size();
  for (auto& t : tensors_) {
    size_.push_back(t.nbytes());
    data_size_ += size_.back();
  }
  done_bytes_.assign(tensors_.size(), 0);
  tmp_ = path_ + ".tmp-" + std::to_string(::getpid());
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(path_, ": cannot create ", tmp_, ": ", std::strerror(errno));
  try {
    pwrite_all(fd_, header.data(), header.size(), 0, tmp_);
  } catch (...) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
    fd_ = -1;
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!done_) ::unlink(tmp_.c_str());
}

std::string SafetensorsWriter::current_tensor() const {
  size_t c = cursor_;
  uint64_t off = cursor_off_;
  while (c < tensors_.size() && off == size_[c]) ++c, off = 0;
  return c < tensors_.size() ? tensors_[c].name : std::string();
}

void SafetensorsWriter::write(size_t index, uint64_t offset, const void* data, size_t n) {
  if (done_ || fd_ < 0) fail(path_, ": write after finish");
  if (index >= tensors_.size()) fail(path_, ": no tensor #", index, " (the file holds ", tensors_.size(), ")");
  if (offset > size_[index] || n > size_[index] - offset)
    fail(path_, ": bytes [", offset, ", ", offset + n, ") of tensor '", tensors_[index].name,
         "' are past its end (", size_[index], " bytes)");
  if (n == 0) return;
  pwrite_all(fd_, static_cast<const char*>(data), n, header_size_ + begin_[index] + offset, tmp_);
  done_bytes_[index] += n;
  written_ += n;
}

void SafetensorsWriter::append(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  if (n > data_size_ - appended_)
    fail(path_, ": ", n, " bytes appended after ", appended_, " run past the end of the last tensor (the header declares ",
         data_size_, " bytes)");
  appended_ += n;
  while (n > 0) {
    while (cursor_ < tensors_.size() && cursor_off_ == size_[cursor_]) ++cursor_, cursor_off_ = 0;
    size_t k = size_t(std::min<uint64_t>(n, size_[cursor_] - cursor_off_));
    write(cursor_, cursor_off_, p, k);
    cursor_off_ += k;
    p += k;
    n -= k;
  }
}

void SafetensorsWriter::finish(bool sync) {
  if (done_) return;
  for (size_t i = 0; i < tensors_.size(); ++i)
    if (done_bytes_[i] != size_[i])
      fail(path_, ": ", done_bytes_[i], " of the ", size_[i], " bytes of tensor '", tensors_[i].name,
           "' were written");
  if (sync && ::fsync(fd_) != 0) fail(tmp_, ": fsync failed: ", std::strerror(errno));
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) fail(tmp_, ": close failed: ", std::strerror(errno));
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    fail(path_, ": cannot rename ", tmp_, " into place: ", std::strerror(errno));
  done_ = true;
}

}  // namespace dsv3
