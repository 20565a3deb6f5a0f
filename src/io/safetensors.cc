#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors_writer.h"

namespace dsv3 {

using json = nlohmann::json;

SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, size_t n_bytes, uint64_t file_size,
                                           const std::string& what) {
  if (file_size < 8 || n_bytes < 8)
    fail(what, ": truncated safetensors file (", file_size, " bytes, the 8-byte header length is missing)");
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | bytes[i];
  if (hlen > file_size - 8)
    fail(what, ": safetensors header length ", hlen, " exceeds the file size ", file_size);
  if (hlen > 100u * 1024 * 1024) fail(what, ": safetensors header length ", hlen, " is implausibly large");
  if (hlen > n_bytes - 8) fail(what, ": header not fully available (", n_bytes, " bytes given)");
  SafetensorsHeader h;
  h.data_start = 8 + hlen;
  const uint64_t data_size = file_size - h.data_start;
  json j;
  try {
    j = json::parse(bytes + 8, bytes + 8 + hlen);
  } catch (const json::exception& e) {
    fail(what, ": safetensors header is not valid JSON: ", e.what());
  }
  if (!j.is_object()) fail(what, ": safetensors header is not a JSON object");
  std::vector<std::pair<std::pair<uint64_t, uint64_t>, std::string>> ranges;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(what, ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) fail(what, ": __metadata__ value '", m.key(), "' is not a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& why) { fail(what, ": tensor '", name, "': ", why); };
    if (!v.is_object()) bad("entry is not an object");
    if (!v.contains("dtype") || !v["dtype"].is_string()) bad("missing or non-string dtype");
    if (!v.contains("shape") || !v["shape"].is_array()) bad("missing or non-array shape");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      bad("data_offsets must be [begin, end]");
    TensorEntry e;
    std::string dt = v["dtype"].get<std::string>();
    if (!parse_dtype(dt, &e.dtype)) bad("unsupported dtype '" + dt + "'");
    uint64_t numel = 1;
    for (auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) bad("shape entries must be non-negative integers");
      uint64_t x = d.get<uint64_t>();
      if (x > (uint64_t(1) << 40) || (x && numel > (uint64_t(1) << 50) / x)) bad("shape too large");
      numel *= x;
      e.shape.push_back(int64_t(x));
    }
    for (auto& d : v["data_offsets"])
      if (!d.is_number_unsigned()) bad("data_offsets must be non-negative integers");
    e.begin = v["data_offsets"][0].get<uint64_t>();
    e.end = v["data_offsets"][1].get<uint64_t>();
    if (e.end < e.begin) bad(str("data_offsets [", e.begin, ", ", e.end, "] are reversed"));
    if (e.end > data_size)
      bad(str("data_offsets end ", e.end, " is past the data section (", data_size,
              " bytes): file truncated or header lying"));
    uint64_t want = numel * dtype_size(e.dtype);
    if (e.end - e.begin != want)
      bad(str("holds ", e.end - e.begin, " bytes but dtype ", dt, " x shape ", shape_str(e.shape),
              " needs ", want));
    ranges.push_back({{e.begin, e.end}, name});
    h.tensors.emplace(name, std::move(e));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first.first < ranges[i - 1].first.second)
      fail(what, ": tensors '", ranges[i - 1].second, "' and '", ranges[i].second,
           "' have overlapping data ranges");
  return h;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  header_ = parse_safetensors_header(file_.data(), file_.size(), file_.size(), path);
}

TensorView SafetensorsFile::get(const std::string& name) const {
  auto it = header_.tensors.find(name);
  if (it == header_.tensors.end()) fail(path(), ": no tensor named '", name, "'");
  const TensorEntry& e = it->second;
  return {e.dtype, e.shape, file_.data() + header_.data_start + e.begin};
}

std::string safetensors_bytes(const std::vector<NamedTensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  // The layout (largest element size first, stable; header padded to 8) is safetensors_header's.
  std::vector<TensorDecl> decls;
  decls.reserve(tensors.size());
  for (const NamedTensor& t : tensors) decls.push_back({t.name, t.dtype, t.shape});
  std::vector<uint64_t> begin;
  std::string out = safetensors_header(decls, metadata, &begin);
  const size_t base = out.size();
  uint64_t end = 0;
  for (size_t i = 0; i < decls.size(); ++i) end = std::max(end, begin[i] + decls[i].nbytes());
  out.resize(base + end);
  for (size_t i = 0; i < decls.size(); ++i)
    if (const uint64_t n = decls[i].nbytes())  // empty: data may be null
      std::memcpy(out.data() + base + begin[i], tensors[i].data, n);
  return out;
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  write_file_atomic(path, safetensors_bytes(tensors, metadata));
}

}  // namespace dsv3
