#include "tools/convert.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/mmap_file.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "tools/ckpt_files.h"

namespace dsv3 {

namespace {

using json = nlohmann::json;

constexpr size_t kChunk = size_t(32) << 20;  // bytes gathered or written at a time

// convert.py's mapping keys: the Hugging Face module word (a tensor name's second-to-last word)
// -> the dim its tensors are split along across ranks (-1: every rank gets the whole tensor).
// The renaming itself is hf_to_ref_name's (the same mapping's words).
const std::map<std::string, int>& split_dims() {
  static const std::map<std::string, int> k = {
      {"embed_tokens", 0},   {"input_layernorm", -1},  {"post_attention_layernorm", -1},
      {"q_proj", 0},         {"q_a_proj", -1},         {"q_a_layernorm", -1},
      {"q_b_proj", 0},       {"kv_a_proj_with_mqa", -1}, {"kv_a_layernorm", -1},
      {"kv_b_proj", 0},      {"o_proj", 1},            {"gate", -1},
      {"gate_proj", 0},      {"down_proj", 1},         {"up_proj", 0},
      {"norm", -1},          {"lm_head", 0},           {"scale", -1}};
  return k;
}

std::vector<std::string> words_of(const std::string& name) {
  std::vector<std::string> w(1);
  for (char c : name) {
    if (c == '.') w.emplace_back();
    else w.back() += c;
  }
  return w;
}

// A non-negative decimal integer, or -1.
long parse_index(const std::string& s) {
  if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stol(s);
}

// What config.json (when present) says that decides the conversion.
struct HfConfig {
  long n_layers = -1;   // num_hidden_layers; layers past it (multi-token prediction) are skipped
  long n_experts = -1;  // n_routed_experts
};

HfConfig read_config(const std::string& dir) {
  HfConfig c;
  const std::string path = dir + "/config.json";
  if (!file_exists(path)) return c;
  json j;
  try {
    j = json::parse(read_text_file(path));
  } catch (const json::exception& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
  if (!j.is_object()) fail(path, ": not a JSON object");
  auto get = [&](const char* key) -> long {
    if (!j.contains(key)) return -1;
    if (!j[key].is_number_integer() || j[key].get<long>() < 0)
      fail(path, ": ", key, " must be a non-negative integer");
    return j[key].get<long>();
  };
  c.n_layers = get("num_hidden_layers");
  c.n_experts = get("n_routed_experts");
  return c;
}

struct Source {  // one input tensor and where it goes
  size_t file = 0;
  std::string hf_name, ref_name;
  TensorEntry entry;
  int split = -1;         // dim narrowed per rank; -1: whole
  int expert = -1;        // routed expert index (one rank gets it whole); -1: none
  std::vector<int> slot;  // per rank: its index in that rank's tensor list, -1 when absent
  uint64_t nbytes() const { return entry.end - entry.begin; }
};

struct Plan {
  std::vector<std::string> files;              // input *.safetensors, sorted
  std::vector<Source> sources;                 // by file, then name
  std::vector<std::vector<TensorDecl>> ranks;  // each rank's output tensors
  std::vector<std::string> token_files;        // *token* files to copy
  int n_skipped = 0;
  uint64_t bytes_in = 0, bytes_out = 0;
};

// True when convert.py leaves the tensor out: the multi-token-prediction layers past the model's
// own (convert.py names the 671B model's: "model.layers.61").
bool skipped(const std::vector<std::string>& words, const HfConfig& cfg) {
  if (words.size() < 3 || words[0] != "model" || words[1] != "layers") return false;
  const long layer = parse_index(words[2]);
  return layer >= 0 && (cfg.n_layers >= 0 ? layer >= cfg.n_layers : layer == 61);
}

// Fills in a source's name, split dim and expert, validating them against convert.py's rules.
void classify(Source& s, const ConvertOptions& opt, const std::string& where) {
  const std::vector<std::string> w = words_of(s.hf_name);
  const std::string key = w.size() >= 2 ? w[w.size() - 2] : "";
  auto it = split_dims().find(key);
  if (it == split_dims().end())
    fail(where, ": tensor '", s.hf_name, "': unknown module name '", key,
         "' (convert.py's mapping has no entry for it)");
  s.ref_name = hf_to_ref_name(s.hf_name);
  if (s.ref_name.find("experts") != std::string::npos && s.ref_name.find("shared_experts") == std::string::npos) {
    const long e = w.size() >= 3 ? parse_index(w[w.size() - 3]) : -1;
    if (e < 0) fail(where, ": tensor '", s.hf_name, "': no expert index before '", key, "'");
    if (e >= opt.n_experts)
      fail(where, ": tensor '", s.hf_name, "' is expert ", e, " but --n-experts is ", opt.n_experts);
    s.expert = int(e);
    return;
  }
  s.split = it->second;
  if (s.split < 0) return;
  const auto& shape = s.entry.shape;
  if (size_t(s.split) >= shape.size())
    fail(where, ": tensor '", s.hf_name, "' ", shape_str(shape), " has no dim ", s.split, " to split along");
  if (shape[size_t(s.split)] % opt.mp != 0)
    fail(where, ": tensor '", s.hf_name, "' ", shape_str(shape), ": dim ", s.split, " (size ",
         shape[size_t(s.split)], ") is not divisible by --model-parallel ", opt.mp);
}

// Reads every input header and decides every output tensor; all input errors surface here,
// before anything is written.
Plan make_plan(const ConvertOptions& opt) {
  Plan p;
  p.files = list_files(opt.hf_dir, ".safetensors");
  if (p.files.empty()) fail(opt.hf_dir, ": no *.safetensors files");
  for (auto& f : list_files(opt.hf_dir))
    if (f.find("token") != std::string::npos) p.token_files.push_back(f);
  const HfConfig cfg = read_config(opt.hf_dir);
  if (cfg.n_experts >= 0 && cfg.n_experts != opt.n_experts)
    fail("--n-experts is ", opt.n_experts, " but ", opt.hf_dir, "/config.json has n_routed_experts ",
         cfg.n_experts);
  p.ranks.resize(size_t(opt.mp));
  std::map<std::string, std::string> seen;  // reference name -> file
  const int per_rank = opt.n_experts / opt.mp;
  for (size_t f = 0; f < p.files.size(); ++f) {
    const std::string where = opt.hf_dir + "/" + p.files[f];
    SafetensorsFile file(where);
    for (auto& [name, entry] : file.entries()) {
      if (skipped(words_of(name), cfg)) {
        ++p.n_skipped;
        continue;
      }
      Source s;
      s.file = f;
      s.hf_name = name;
      s.entry = entry;
      classify(s, opt, where);
      auto [prev, fresh] = seen.emplace(s.ref_name, p.files[f]);
      if (!fresh)
        fail(where, ": tensor '", name, "' becomes '", s.ref_name, "', which ", prev->second, " already holds");
      s.slot.assign(size_t(opt.mp), -1);
      for (int r = 0; r < opt.mp; ++r) {
        if (s.expert >= 0 && s.expert / per_rank != r) continue;
        TensorDecl d{s.ref_name, entry.dtype, entry.shape};
        if (s.split >= 0) d.shape[size_t(s.split)] /= opt.mp;
        s.slot[size_t(r)] = int(p.ranks[size_t(r)].size());
        p.bytes_out += d.nbytes();
        p.ranks[size_t(r)].push_back(std::move(d));
      }
      p.bytes_in += s.nbytes();
      p.sources.push_back(std::move(s));
    }
  }
  return p;
}

// Writes rank r's slice of `t` (narrowed along s.split, or whole) to its writer, letting go of
// the input pages as it goes: the resident set stays at the buffer, whatever the tensor's size.
class SliceWriter {
 public:
  explicit SliceWriter(int mp) : mp_(mp), buf_(kChunk) {}

  void write(const Source& s, const TensorView& t, int r, SafetensorsWriter& w) {
    const size_t index = size_t(s.slot[size_t(r)]);
    const auto* base = static_cast<const uint8_t*>(t.data);
    if (s.split < 0) return put(w, index, 0, base, t.nbytes());
    // t viewed as [outer, len, inner bytes]; rank r's slice is [outer, len/mp, inner bytes].
    uint64_t outer = 1, inner = dtype_size(t.dtype);
    for (int d = 0; d < s.split; ++d) outer *= uint64_t(t.shape[size_t(d)]);
    for (size_t d = size_t(s.split) + 1; d < t.shape.size(); ++d) inner *= uint64_t(t.shape[d]);
    const uint64_t len = uint64_t(t.shape[size_t(s.split)]), part = len / uint64_t(mp_);
    const uint64_t piece = part * inner;
    uint64_t out_off = 0, filled = 0;
    auto flush = [&] {
      w.write(index, out_off, buf_.data(), size_t(filled));
      out_off += filled;
      filled = 0;
    };
    for (uint64_t o = 0; o < outer; ++o) {
      const uint8_t* src = base + (o * len + uint64_t(r) * part) * inner;
      if (piece >= kChunk) {  // large enough to write straight from the mapping
        if (filled) flush();
        put(w, index, out_off, src, piece);
        out_off += piece;
        continue;
      }
      if (filled + piece > kChunk) flush();
      std::memcpy(buf_.data() + filled, src, size_t(piece));
      release_pages(src, size_t(piece));
      filled += piece;
    }
    if (filled) flush();
  }

 private:
  // Bytes [off, off + n) of tensor `index`, straight from the mapping, a chunk at a time.
  static void put(SafetensorsWriter& w, size_t index, uint64_t off, const uint8_t* src, uint64_t n) {
    for (uint64_t k = 0; k < n; k += kChunk) {
      const size_t m = size_t(std::min<uint64_t>(kChunk, n - k));
      w.write(index, off + k, src + k, m);
      release_pages(src + k, m);
    }
  }

  int mp_;
  std::vector<uint8_t> buf_;
};

void check_options(const ConvertOptions& opt) {
  if (opt.mp < 1) fail("--model-parallel must be at least 1, got ", opt.mp);
  if (opt.n_experts < 1) fail("--n-experts must be at least 1, got ", opt.n_experts);
  if (opt.n_experts % opt.mp != 0)
    fail("--n-experts ", opt.n_experts, " is not divisible by --model-parallel ", opt.mp);
}

}  // namespace

ConvertResult convert_checkpoint(const ConvertOptions& opt) {
  check_options(opt);
  StagedDir out(opt.save_dir, "--save-path");
  const Plan plan = make_plan(opt);
  const std::string& dir = out.begin(plan.bytes_out);

  std::vector<std::unique_ptr<SafetensorsWriter>> writers;
  for (int r = 0; r < opt.mp; ++r)
    writers.push_back(std::make_unique<SafetensorsWriter>(
        dir + "/model" + std::to_string(r) + "-mp" + std::to_string(opt.mp) + ".safetensors",
        plan.ranks[size_t(r)], std::map<std::string, std::string>{{"format", "pt"}}));
  SliceWriter slicer(opt.mp);
  uint64_t done = 0;
  if (opt.progress) opt.progress(0, plan.bytes_in);
  size_t next = 0;
  for (size_t f = 0; f < plan.files.size(); ++f) {
    SafetensorsFile file(opt.hf_dir + "/" + plan.files[f]);
    for (; next < plan.sources.size() && plan.sources[next].file == f; ++next) {
      if (opt.cancel && opt.cancel->load()) fail("interrupted");
      const Source& s = plan.sources[next];
      const TensorView t = file.get(s.hf_name);
      for (int r = 0; r < opt.mp; ++r)
        if (s.slot[size_t(r)] >= 0) slicer.write(s, t, r, *writers[size_t(r)]);
      done += s.nbytes();
      if (opt.progress) opt.progress(done, plan.bytes_in);
    }
  }
  for (auto& w : writers) w->finish();
  for (auto& f : plan.token_files) copy_file_atomic(opt.hf_dir + "/" + f, dir + "/" + f);
  if (opt.cancel && opt.cancel->load()) fail("interrupted");
  out.commit();

  ConvertResult res;
  res.n_inputs = int(plan.files.size());
  res.n_tensors = int(plan.sources.size());
  res.n_skipped = plan.n_skipped;
  res.bytes_in = plan.bytes_in;
  res.bytes_out = plan.bytes_out;
  res.n_copied = int(plan.token_files.size());
  return res;
}

}  // namespace dsv3
