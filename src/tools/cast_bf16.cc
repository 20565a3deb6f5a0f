#include "tools/cast_bf16.h"

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "io/mmap_file.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "tools/ckpt_files.h"

namespace dsv3 {

namespace {

using ojson = nlohmann::ordered_json;

constexpr int64_t kBlock = 128;               // the FP8 scale block (fp8_cast_bf16.py's weight_dequant)
constexpr uint64_t kChunk = uint64_t(32) << 20;  // bytes written at a time
const std::string kScaleSuffix = "_scale_inv";
const std::string kIndex = "model.safetensors.index.json";

struct Located {  // a tensor of the input: which shard, and its entry there
  size_t file = 0;
  TensorEntry entry;
};

struct Item {  // one output tensor
  std::string name;
  Located src;
  bool cast = false;  // F8_E4M3 -> BF16 with `scale`
  std::string scale_name;
  Located scale;
};

struct CastPlan {
  std::vector<std::string> files;               // input shards, sorted; outputs keep the names
  std::vector<std::vector<Item>> items;         // per shard, by name
  std::vector<std::vector<TensorDecl>> decls;   // per shard: the output tensors, as items
  std::vector<std::map<std::string, std::string>> metadata;  // per shard: its header metadata
  std::vector<std::string> dropped;             // scale tensors left out
  std::vector<std::string> other_files;         // copied as they are
  int n_cast = 0;
  uint64_t bytes_in = 0, bytes_out = 0;  // tensor bytes of the items, read and written
};

bool is_scale(const std::string& name) {
  return name.size() > kScaleSuffix.size() &&
         name.compare(name.size() - kScaleSuffix.size(), kScaleSuffix.size(), kScaleSuffix) == 0;
}

// Every tensor of every shard by name; a name in two shards is an error.
std::map<std::string, Located> read_headers(const std::string& dir, const std::vector<std::string>& files,
                                            std::vector<std::map<std::string, std::string>>* metadata) {
  std::map<std::string, Located> all;
  for (size_t f = 0; f < files.size(); ++f) {
    SafetensorsFile file(dir + "/" + files[f]);
    metadata->push_back(file.metadata());
    for (auto& [name, e] : file.entries()) {
      auto [it, fresh] = all.emplace(name, Located{f, e});
      if (!fresh) fail(dir, ": tensor '", name, "' is in both ", files[it->second.file], " and ", files[f]);
    }
  }
  return all;
}

// Decides one tensor: copied, cast with its scale, or (a scale) dropped.
void plan_tensor(const std::string& name, const Located& at, const std::map<std::string, Located>& all,
                 const std::string& dir, CastPlan& p) {
  const std::string where = dir + "/" + p.files[at.file] + ": tensor '" + name + "'";
  const auto& shape = at.entry.shape;
  if (is_scale(name)) {
    const std::string weight = name.substr(0, name.size() - kScaleSuffix.size());
    auto w = all.find(weight);
    if (w == all.end()) fail(where, " is a scale, but the checkpoint has no weight '", weight, "'");
    if (w->second.entry.dtype != DType::F8_E4M3)
      fail(where, " is a scale, but its weight is ", dtype_name(w->second.entry.dtype), ", not F8_E4M3");
    p.dropped.push_back(name);
    return;
  }
  Item it{name, at, at.entry.dtype == DType::F8_E4M3, "", {}};
  TensorDecl d{name, at.entry.dtype, shape};
  if (it.cast) {
    it.scale_name = name + kScaleSuffix;
    auto s = all.find(it.scale_name);
    if (s == all.end()) fail(where, " is F8_E4M3 but the checkpoint has no '", it.scale_name, "'");
    if (shape.size() != 2) fail(where, " is F8_E4M3 with shape ", shape_str(shape), "; only matrices are cast");
    const std::vector<int64_t> want = {(shape[0] + kBlock - 1) / kBlock, (shape[1] + kBlock - 1) / kBlock};
    if (s->second.entry.dtype != DType::F32 || s->second.entry.shape != want)
      fail(where, ": its scale '", it.scale_name, "' is ", dtype_name(s->second.entry.dtype), " ",
           shape_str(s->second.entry.shape), ", expected F32 ", shape_str(want), " (128x128 blocks)");
    it.scale = s->second;
    d.dtype = DType::BF16;
    ++p.n_cast;
  }
  p.bytes_in += at.entry.end - at.entry.begin;
  p.bytes_out += d.nbytes();
  p.decls[at.file].push_back(std::move(d));
  p.items[at.file].push_back(std::move(it));
}

CastPlan make_plan(const std::string& dir) {
  CastPlan p;
  p.files = list_files(dir, ".safetensors");
  if (p.files.empty()) fail(dir, ": no *.safetensors files");
  const auto all = read_headers(dir, p.files, &p.metadata);
  p.items.resize(p.files.size());
  p.decls.resize(p.files.size());
  for (auto& [name, at] : all) plan_tensor(name, at, all, dir, p);
  if (p.n_cast == 0) fail(dir, ": no F8_E4M3 weights: not an FP8 checkpoint, nothing to cast");
  for (auto& f : list_files(dir))
    if (f != kIndex && f != "config.json" && !std::binary_search(p.files.begin(), p.files.end(), f))
      p.other_files.push_back(f);
  return p;
}

ojson parse_json_file(const std::string& path) {
  try {
    return ojson::parse(read_text_file(path));
  } catch (const ojson::exception& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
}

// The index with the dropped scales left out of weight_map and metadata.total_size recomputed;
// its weight_map must place every tensor where the shards have it.
std::string rewrite_index(const std::string& dir, const CastPlan& p) {
  const std::string path = dir + "/" + kIndex;
  ojson j = parse_json_file(path);
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    fail(path, ": missing the weight_map object");
  std::map<std::string, std::string> in_files;  // tensor -> shard, from the headers
  for (size_t f = 0; f < p.files.size(); ++f)
    for (auto& it : p.items[f]) in_files[it.name] = p.files[f];
  for (auto& s : p.dropped) in_files[s] = "";  // placed anywhere; checked through their weights
  ojson& wm = j["weight_map"];
  for (auto& [name, file] : wm.items()) {
    auto it = in_files.find(name);
    if (it == in_files.end()) fail(path, ": weight_map names tensor '", name, "', which no shard holds");
    if (!file.is_string()) fail(path, ": weight_map['", name, "'] is not a file name");
    if (!it->second.empty() && file.get<std::string>() != it->second)
      fail(path, ": weight_map places '", name, "' in ", file.get<std::string>(), " but it is in ", it->second);
  }
  for (auto& [name, file] : in_files)
    if (!file.empty() && !wm.contains(name)) fail(path, ": weight_map lacks tensor '", name, "' (in ", file, ")");
  for (auto& s : p.dropped) wm.erase(s);
  if (!j.contains("metadata") || !j["metadata"].is_object()) j["metadata"] = ojson::object();
  j["metadata"]["total_size"] = p.bytes_out;
  return j.dump(2) + "\n";
}

// config.json without quantization_config (its block size must be the 128 this cast uses).
std::string rewrite_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  ojson j = parse_json_file(path);
  if (!j.is_object()) fail(path, ": not a JSON object");
  if (j.contains("quantization_config")) {
    const ojson& q = j["quantization_config"];
    if (q.is_object() && q.contains("weight_block_size") && q["weight_block_size"] != ojson::array({kBlock, kBlock}))
      fail(path, ": quantization_config.weight_block_size is ", q["weight_block_size"].dump(),
           "; this cast handles [128, 128] blocks");
    j.erase("quantization_config");
  }
  return j.dump(2) + "\n";
}

// out[i, j] = bf16(e4m3(q[i, j]) * scale[i / 128, j / 128]) for rows [r0, r1) of a [rows, cols]
// weight: the product in float32, then rounded to nearest even, as the reference's weight_dequant
// stores a float32 product into a bf16 tensor.
void dequant_rows(const TensorView& q, const TensorView& scale, int64_t r0, int64_t r1, uint16_t* out) {
  static const std::array<float, 256> lut = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[size_t(b)] = e4m3_to_f32(uint8_t(b));
    return t;
  }();
  const int64_t cols = q.shape[1], scols = scale.shape[1];
  ThreadPool::global().parallel_for(r1 - r0, [&](int64_t b, int64_t e, int) {
    for (int64_t i = r0 + b; i < r0 + e; ++i) {
      const uint8_t* qi = q.as<uint8_t>() + i * cols;
      const float* si = scale.as<float>() + (i / kBlock) * scols;
      uint16_t* oi = out + (i - r0) * cols;
      for (int64_t j = 0; j < cols; ++j) oi[j] = f32_to_bf16(lut[qi[j]] * si[j / kBlock]);
    }
  }, 16);
}

// Writes one output shard from its input shard (and the shards holding its weights' scales).
class ShardCaster {
 public:
  ShardCaster(const std::string& dir, const CastPlan& p, const CastOptions& opt) : dir_(dir), p_(p), opt_(opt) {}

  void run(size_t f, const std::string& out_path) {
    SafetensorsWriter w(out_path, p_.decls[f], p_.metadata[f]);
    std::map<size_t, std::unique_ptr<SafetensorsFile>> open;  // this shard and its scales' shards
    auto file = [&](size_t k) -> SafetensorsFile& {
      auto& slot = open[k];
      if (!slot) slot = std::make_unique<SafetensorsFile>(dir_ + "/" + p_.files[k]);
      return *slot;
    };
    for (size_t i = 0; i < p_.items[f].size(); ++i) {
      if (opt_.cancel && opt_.cancel->load()) fail("interrupted");
      const Item& it = p_.items[f][i];
      const TensorView t = file(f).get(it.name);
      if (it.cast) {
        const TensorView scale = file(it.scale.file).get(it.scale_name);
        write_cast(w, i, t, scale);
        release_pages(scale.data, scale.nbytes());
      } else {
        for (uint64_t off = 0; off < t.nbytes(); off += kChunk) {
          const auto* p = static_cast<const uint8_t*>(t.data) + off;
          const size_t n = size_t(std::min(kChunk, t.nbytes() - off));
          w.write(i, off, p, n);
          release_pages(p, n);  // the resident set stays at a chunk, whatever the tensor's size
        }
      }
      done_ += t.nbytes();
      if (opt_.progress) opt_.progress(done_, p_.bytes_in);
    }
    w.finish();
  }

 private:
  void write_cast(SafetensorsWriter& w, size_t index, const TensorView& q, const TensorView& scale) {
    const int64_t rows = q.shape[0], cols = q.shape[1];
    const int64_t step = std::max<int64_t>(1, int64_t(kChunk / 2) / std::max<int64_t>(cols, 1));
    buf_.resize(size_t(std::min(rows, step) * cols));
    for (int64_t r0 = 0; r0 < rows; r0 += step) {
      const int64_t r1 = std::min(rows, r0 + step);
      dequant_rows(q, scale, r0, r1, buf_.data());
      w.write(index, uint64_t(r0 * cols) * 2, buf_.data(), size_t((r1 - r0) * cols) * 2);
      release_pages(q.as<uint8_t>() + r0 * cols, size_t((r1 - r0) * cols));
    }
  }

  const std::string& dir_;
  const CastPlan& p_;
  const CastOptions& opt_;
  std::vector<uint16_t> buf_;
  uint64_t done_ = 0;
};

}  // namespace

CastResult cast_fp8_to_bf16(const CastOptions& opt) {
  StagedDir out(opt.out_dir, "--output-bf16-hf-path");
  const CastPlan plan = make_plan(opt.in_dir);
  const bool has_index = file_exists(opt.in_dir + "/" + kIndex), has_config = file_exists(opt.in_dir + "/config.json");
  const std::string index = has_index ? rewrite_index(opt.in_dir, plan) : "";
  const std::string config = has_config ? rewrite_config(opt.in_dir) : "";

  const std::string& dir = out.begin(plan.bytes_out);
  if (opt.progress) opt.progress(0, plan.bytes_in);
  ShardCaster caster(opt.in_dir, plan, opt);
  for (size_t f = 0; f < plan.files.size(); ++f) caster.run(f, dir + "/" + plan.files[f]);
  if (has_index) write_file_atomic(dir + "/" + kIndex, index);
  if (has_config) write_file_atomic(dir + "/config.json", config);
  for (auto& f : plan.other_files) copy_file_atomic(opt.in_dir + "/" + f, dir + "/" + f);
  if (opt.cancel && opt.cancel->load()) fail("interrupted");
  out.commit();

  CastResult r;
  r.n_files = int(plan.files.size());
  r.n_cast = plan.n_cast;
  for (auto& v : plan.items) r.n_copied += int(v.size());
  r.n_copied -= plan.n_cast;
  r.n_scales = int(plan.dropped.size());
  r.n_other_files = int(plan.other_files.size());
  r.bytes_in = plan.bytes_in;
  r.bytes_out = plan.bytes_out;
  return r;
}

}  // namespace dsv3
