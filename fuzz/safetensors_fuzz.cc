// libFuzzer target: arbitrary bytes as a whole safetensors file given to the header parser.
// Refusing with dsv3::Error is fine; any other exception, a sanitizer report, or an accepted
// header whose entries break the promised invariants is a bug.
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <utility>
#include <vector>

#include "core/error.h"
#include "io/safetensors.h"

namespace {
void require(bool ok) {
  if (!ok) std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dsv3::SafetensorsHeader h;
  try {
    h = dsv3::parse_safetensors_header(data, size, size, "fuzz.safetensors");
  } catch (const dsv3::Error&) {
    return 0;
  }
  // What parse_safetensors_header promises about an accepted header.
  require(h.data_start >= 8 && h.data_start <= size);
  const uint64_t data_size = size - h.data_start;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto& [name, e] : h.tensors) {
    require(e.begin <= e.end && e.end <= data_size);
    uint64_t numel = 1;
    for (int64_t d : e.shape) {
      require(d >= 0);
      numel *= uint64_t(d);
    }
    require(e.end - e.begin == numel * dsv3::dtype_size(e.dtype));
    ranges.push_back({e.begin, e.end});
  }
  // No two tensors share a byte (checked pairwise, independently of the parser's sort).
  for (size_t i = 0; i < ranges.size(); ++i)
    for (size_t j = i + 1; j < ranges.size(); ++j)
      require(std::max(ranges[i].first, ranges[j].first) >= std::min(ranges[i].second, ranges[j].second));
  return 0;
}
