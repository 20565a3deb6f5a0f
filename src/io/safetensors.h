// safetensors: an 8-byte little-endian header length, a JSON header
// {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the
// data. Reading validates every entry; tensors are zero-copy views into the mapping.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/mmap_file.h"

namespace dsv3 {

struct TensorEntry {
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // offsets relative to the data section
};

struct SafetensorsHeader {
  std::map<std::string, TensorEntry> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // 8 + header length
};

// Parses and validates a header against a file of `file_size` bytes whose first bytes are
// `bytes` (at least the 8-byte prefix and the header itself). `what` names the file in errors.
// Checks: header length within the file, valid JSON object, known dtypes, non-negative shapes,
// offsets inside the data section, end - begin == numel * dtype size, no overlapping ranges.
SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, size_t n_bytes, uint64_t file_size,
                                           const std::string& what);

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::string& path() const { return file_.path(); }
  bool has(const std::string& name) const { return header_.tensors.count(name) != 0; }
  TensorView get(const std::string& name) const;  // throws Error naming the tensor and file
  const std::map<std::string, TensorEntry>& entries() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  MmapFile& mapping() { return file_; }

 private:
  MmapFile file_;
  SafetensorsHeader header_;
};

// A tensor to write: name, dtype, shape and the bytes (numel * dtype size of them).
struct NamedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data;
};

// Serialises tensors into safetensors bytes: the data of the largest element size first, in the
// given order within one size, so that every tensor is aligned to its element size.
std::string safetensors_bytes(const std::vector<NamedTensor>& tensors,
                              const std::map<std::string, std::string>& metadata = {});
// Writes a safetensors file atomically (temporary file + rename).
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace dsv3
