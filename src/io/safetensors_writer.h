// Streaming safetensors writer: the header is computed from the tensor list up front, then each
// tensor's bytes are written as they are produced (in any order, in pieces), so a file of any
// size is written without holding it in memory. The file appears under its name only when
// finish() succeeds. The layout is safetensors_bytes()'s: largest element size first (stable),
// so every tensor is aligned to its element size.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace dsv3 {

// A tensor to be written: name, dtype and shape (the bytes come later).
struct TensorDecl {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes() const;  // numel * dtype size
};

// The header of a file holding `tensors`: the 8-byte length prefix plus the JSON, padded with
// spaces to a multiple of 8, with the data laid out largest element size first (stable) — byte
// for byte what safetensors_bytes() writes. `begin` (if given) receives each tensor's data
// offset, in the order of `tensors`. Throws Error for a repeated or reserved name.
std::string safetensors_header(const std::vector<TensorDecl>& tensors,
                               const std::map<std::string, std::string>& metadata = {},
                               std::vector<uint64_t>* begin = nullptr);

class SafetensorsWriter {
 public:
  // Creates `path`.tmp-<pid> and writes the header. Throws Error naming the path.
  SafetensorsWriter(const std::string& path, std::vector<TensorDecl> tensors,
                    const std::map<std::string, std::string>& metadata = {});
  // Without a successful finish(), the temporary file is removed.
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Writes bytes [offset, offset + n) of tensor `index` (its position in the constructor's list).
  // Pieces of a tensor must not overlap. Throws Error past the tensor's end or on a write error.
  void write(size_t index, uint64_t offset, const void* data, size_t n);
  // The next `n` bytes in the order of the constructor's list (tensor after tensor, any split).
  void append(const void* data, size_t n);
  // Checks that every byte of every tensor was written, fsyncs (unless !sync), closes and
  // renames to `path`.
  void finish(bool sync = true);

  const std::string& path() const { return path_; }
  uint64_t data_size() const { return data_size_; }  // bytes the tensors need
  uint64_t file_size() const { return header_size_ + data_size_; }
  uint64_t written() const { return written_; }      // data bytes written so far
  // The tensor the next append() goes to ("" once all are appended), for messages.
  std::string current_tensor() const;

 private:
  std::string path_, tmp_;
  std::vector<TensorDecl> tensors_;
  std::vector<uint64_t> begin_, size_, done_bytes_;  // per tensor: data offset, size, bytes written
  uint64_t header_size_ = 0, data_size_ = 0, written_ = 0, appended_ = 0;
  size_t cursor_ = 0;           // append(): tensor and offset within it
  uint64_t cursor_off_ = 0;
  int fd_ = -1;
  bool done_ = false;
};

}  // namespace dsv3
