// A non-owning, type-erased view of a contiguous tensor (weights in an mmap, golden data, buffers).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace dsv3 {

struct TensorView {
  DType dtype = DType::F32;
  std::vector<int64_t> shape;  // outer to inner
  const void* data = nullptr;

  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const { return shape.at(size_t(i < 0 ? i + int(shape.size()) : i)); }
  template <class T>
  const T* as() const { return static_cast<const T*>(data); }
  bool empty() const { return data == nullptr; }
};

std::string shape_str(const std::vector<int64_t>& shape);  // "[2, 3]"

// Reads element i of a float-like view (F32, BF16, F16, F8_E4M3) as float.
float load_f32(const TensorView& t, int64_t i);

}  // namespace dsv3
