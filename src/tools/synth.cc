#include "tools/synth.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "io/checkpoint.h"
#include "io/mmap_file.h"
#include "io/safetensors_writer.h"
#include "model/weights.h"
#include "text/tokenizer.h"

namespace dsv3 {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// A float as the short decimal it was written as (0.707f -> 0.707, not 0.7070000171661377).
static double nice(float f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.7g", double(f));
  return std::strtod(buf, nullptr);
}

std::string synth_config_json(const ModelArgs& a) {
  const bool v3 = a.score_func == "sigmoid";
  ordered_json j;
  j["architectures"] = {v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM"};
  j["model_type"] = v3 ? "deepseek_v3" : "deepseek_v2";
  j["vocab_size"] = a.vocab_size;
  j["hidden_size"] = a.dim;
  j["intermediate_size"] = a.inter_dim;
  j["moe_intermediate_size"] = a.moe_inter_dim;
  j["num_hidden_layers"] = a.n_layers;
  j["first_k_dense_replace"] = a.n_dense_layers;
  j["moe_layer_freq"] = a.moe_layer_freq;
  j["num_attention_heads"] = a.n_heads;
  j["num_key_value_heads"] = a.n_heads;
  j["n_routed_experts"] = a.n_routed_experts;
  j["n_shared_experts"] = a.n_shared_experts;
  j["num_experts_per_tok"] = a.n_activated_experts;
  j["n_group"] = a.n_expert_groups;
  j["topk_group"] = a.n_limited_groups;
  j["routed_scaling_factor"] = nice(a.route_scale);
  j["scoring_func"] = a.score_func;
  j["norm_topk_prob"] = a.norm_topk_prob;
  j["topk_method"] = a.topk_method;
  if (a.q_lora_rank > 0) j["q_lora_rank"] = a.q_lora_rank;
  else j["q_lora_rank"] = nullptr;
  j["kv_lora_rank"] = a.kv_lora_rank;
  j["qk_nope_head_dim"] = a.qk_nope_head_dim;
  j["qk_rope_head_dim"] = a.qk_rope_head_dim;
  j["v_head_dim"] = a.v_head_dim;
  j["rope_theta"] = nice(a.rope_theta);
  j["rms_norm_eps"] = nice(a.rms_norm_eps);
  j["max_position_embeddings"] = a.max_seq_len;
  j["tie_word_embeddings"] = false;
  j["attention_bias"] = false;
  j["bos_token_id"] = a.bos_token_id;
  j["eos_token_id"] = a.eos_token_id;
  j["hidden_act"] = "silu";
  j["torch_dtype"] = "bfloat16";
  j["num_nextn_predict_layers"] = a.n_mtp_layers;
  if (a.yarn) {
    ordered_json rs;
    rs["type"] = "yarn";
    rs["factor"] = nice(a.rope_factor);
    rs["original_max_position_embeddings"] = a.original_seq_len;
    rs["beta_fast"] = nice(a.beta_fast);
    rs["beta_slow"] = nice(a.beta_slow);
    rs["mscale"] = nice(a.mscale);
    rs["mscale_all_dim"] = nice(a.mscale_all_dim);
    j["rope_scaling"] = rs;
  }
  if (a.dtype == "fp8") {
    ordered_json q;
    q["quant_method"] = "fp8";
    q["fmt"] = "e4m3";
    q["activation_scheme"] = "dynamic";
    q["weight_block_size"] = {a.weight_block_size, a.weight_block_size};
    if (!a.scale_fmt.empty()) q["scale_fmt"] = a.scale_fmt;
    j["quantization_config"] = q;
  }
  return j.dump(2) + "\n";
}

// ---------------------------------------------------------------------------------------------
// Numbers

// Branch-free, so that it inlines and the compiler may vectorise it.
static inline uint8_t e4m3_rne(float f) {
  const uint32_t u = bits_from_f32(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal (|f| >= 2^-6): round the 23-bit mantissa to 3 bits, half to even; then the byte is
  // (exponent + 7) << 3 | mantissa = (rounded bits >> 20) - (120 << 3). A carry bumps the exponent.
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  const uint32_t normal = (r >> 20) - 960u;
  // Subnormal (quantum 2^-9): |f| * 512 rounded half to even by adding 2^23 (0..8; 8 is the
  // first normal's encoding).
  const uint32_t sub = bits_from_f32(f32_from_bits(a) * 512.f + 8388608.f) - 0x4b000000u;
  uint32_t v = a < 0x3c800000u ? sub : normal;
  v = v > 0x7eu ? 0x7eu : v;       // saturate at 448 (0x7f would be NaN), infinities included
  v = a > 0x7f800000u ? 0x7fu : v;  // NaN stays NaN
  return uint8_t(sign | v);
}

uint8_t synth_f32_to_e4m3(float f) { return e4m3_rne(f); }

namespace {

constexpr int64_t kBlock = 128;                     // FP8 block and generation band (rows)
constexpr uint64_t kBatchBytes = uint64_t(64) << 20;  // bytes generated between writes
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t mix64(uint64_t z) {  // splitmix64's finaliser
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ull;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebull;
  z ^= z >> 31;
  return z;
}

uint64_t tensor_key(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return mix64(mix64(seed + kGolden) ^ h);
}

// out[k] = center + amp * u(i0 + k), u uniform in [-1, 1): a counter-based generator, one 64-bit
// hash per pair of consecutive flat indices, so any split of a tensor gives the same values.
void fill_uniform(uint64_t key, int64_t i0, int64_t n, float center, float amp, float* out) {
  const float k = amp * 0x1p-31f;
  int64_t i = i0, end = i0 + n;
  float* o = out;
  if ((i & 1) && i < end) {
    uint64_t h = mix64(key + uint64_t(i >> 1) * kGolden);
    *o++ = center + k * float(int32_t(uint32_t(h >> 32)));
    ++i;
  }
  for (; i + 1 < end; i += 2) {
    uint64_t h = mix64(key + uint64_t(i >> 1) * kGolden);
    *o++ = center + k * float(int32_t(uint32_t(h)));
    *o++ = center + k * float(int32_t(uint32_t(h >> 32)));
  }
  if (i < end) {
    uint64_t h = mix64(key + uint64_t(i >> 1) * kGolden);
    *o++ = center + k * float(int32_t(uint32_t(h)));
  }
}

// One stored tensor.
struct Item {
  std::string name;  // Hugging Face name
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t key = 0;  // RNG key of the reference name: the same values whatever the dtype
  float center = 0, amp = 0;
  int weight_item = -1;  // for a scale tensor: its weight (the item just before)
  int shard = 0;
  uint64_t nbytes = 0;
  int64_t rows() const { return shape.size() == 2 ? shape[0] : 1; }
  int64_t cols() const { return shape.back(); }
  int64_t bands() const { return weight_item >= 0 ? 1 : (rows() + kBlock - 1) / kBlock; }
};

std::vector<Item> plan_items(const ModelArgs& a, uint64_t seed) {
  const bool fp8 = a.dtype == "fp8";
  std::vector<Item> items;
  for (const WeightSpec& s : weight_manifest(a)) {
    // The correction bias belongs to noaux_tc (sigmoid) routing only, as in the real checkpoints.
    if (s.kind == WeightKind::kBias && a.score_func != "sigmoid") continue;
    const std::string ref = s.tensor_name();
    Item it;
    it.name = ref_to_hf_name(ref);
    it.shape = s.shape;
    it.key = tensor_key(seed, ref);
    it.dtype = DType::BF16;
    switch (s.kind) {
      case WeightKind::kLinear:  // variance 1/fan_in: outputs keep the scale of the inputs
        it.amp = std::sqrt(3.f / float(s.shape[1]));
        if (fp8 && s.name != "head") it.dtype = DType::F8_E4M3;  // the real files keep lm_head bf16
        break;
      case WeightKind::kEmbed: it.amp = std::sqrt(3.f); break;  // variance 1
      case WeightKind::kNorm: it.center = 1.f, it.amp = 0.05f; break;
      case WeightKind::kGate: it.amp = std::sqrt(3.f / float(a.dim)); break;  // scores ~ N(0, 1)
      case WeightKind::kBias: it.amp = 0.02f, it.dtype = DType::F32; break;
    }
    items.push_back(it);
    if (it.dtype == DType::F8_E4M3) {
      Item sc;
      sc.name = ref_to_hf_name(s.name + ".scale");
      sc.dtype = DType::F32;
      sc.shape = {(s.shape[0] + kBlock - 1) / kBlock, (s.shape[1] + kBlock - 1) / kBlock};
      sc.weight_item = int(items.size()) - 1;
      items.push_back(sc);
    }
  }
  for (Item& it : items) it.nbytes = TensorDecl{it.name, it.dtype, it.shape}.nbytes();
  return items;
}

// Greedy packing in manifest order; a weight and its scale stay together. Returns the count.
int assign_shards(std::vector<Item>& items, uint64_t limit) {
  int shard = 0;
  uint64_t used = 0;
  for (size_t i = 0; i < items.size();) {
    size_t j = i + 1;
    if (j < items.size() && items[j].weight_item == int(i)) ++j;
    uint64_t group = 0;
    for (size_t k = i; k < j; ++k) group += items[k].nbytes;
    if (used > 0 && used + group > limit) ++shard, used = 0;
    for (size_t k = i; k < j; ++k) items[k].shard = shard;
    used += group;
    i = j;
  }
  return shard + 1;
}

// Generates band `band` of weight `it` into `out` (rows [band*128, ...) of the stored tensor);
// for F8 also that band's row of block scales.
void gen_band(const Item& it, int64_t band, bool ue8m0, uint8_t* out, std::vector<float>& scratch,
              float* scales) {
  const int64_t C = it.cols(), R = it.rows();
  const int64_t r0 = band * kBlock, r1 = std::min(R, r0 + kBlock), n = (r1 - r0) * C;
  scratch.resize(size_t(n));
  float* v = scratch.data();
  fill_uniform(it.key, r0 * C, n, it.center, it.amp, v);
  switch (it.dtype) {
    case DType::F32: std::memcpy(out, v, size_t(n) * 4); break;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b = f32_to_bf16(v[i]);
        std::memcpy(out + 2 * i, &b, 2);
      }
      break;
    case DType::F8_E4M3: {
      const int64_t nb = (C + kBlock - 1) / kBlock;
      for (int64_t cb = 0; cb < nb; ++cb) {
        const int64_t c0 = cb * kBlock, c1 = std::min(C, c0 + kBlock);
        float amax = 0;
        for (int64_t r = 0; r < r1 - r0; ++r) {
          const float* vr = v + r * C;
          for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(vr[c]));
        }
        float s = std::max(amax, 1e-12f) / 448.f;  // weight_scale_inv: w = q * s
        if (ue8m0) {  // the next power of two up, as the V3.1 checkpoint stores them
          int e;
          float f = std::frexp(s, &e);
          s = std::ldexp(1.f, f == 0.5f ? e - 1 : e);
        }
        scales[band * nb + cb] = s;
        const float inv = 1.f / s;  // a multiply, not a division: exact for ue8m0, within an ulp otherwise
        for (int64_t r = 0; r < r1 - r0; ++r) {
          const float* vr = v + r * C;
          uint8_t* o = out + r * C;
          for (int64_t c = c0; c < c1; ++c) o[c] = e4m3_rne(vr[c] * inv);
        }
      }
      break;
    }
    default: DSV3_CHECK(false, "synth: unexpected dtype ", dtype_name(it.dtype));
  }
}

std::string strip_slashes(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

bool dir_is_empty(const std::string& d) { return fs::is_empty(fs::path(d)); }

// Removes `base`.partial-<pid> folders of processes that are gone (a SIGKILLed synth's leftovers).
void remove_stale_partials(const fs::path& out) {
  const std::string prefix = out.filename().string() + ".partial-";
  std::error_code ec;
  fs::path parent = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  for (auto& e : fs::directory_iterator(parent, ec)) {
    std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) != 0) continue;
    std::string pid_s = n.substr(prefix.size());
    if (pid_s.empty() || pid_s.find_first_not_of("0123456789") != std::string::npos || pid_s.size() > 9) continue;
    pid_t pid = pid_t(std::stol(pid_s));
    if (pid == ::getpid()) continue;
    if (::kill(pid, 0) == -1 && errno == ESRCH) {
      std::error_code ec2;
      fs::remove_all(e.path(), ec2);
    }
  }
}

void fsync_dir(const std::string& d) {
  int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::string shard_name(int i, int n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", i + 1, n);
  return buf;
}

// Writes the shards of `items` into `dir`, streaming: batches of bands are generated in
// parallel into one buffer while the previous batch is written from the other.
void write_shards(const std::string& dir, const std::vector<Item>& items, int n_shards, bool ue8m0,
                  const SynthOptions& opt, uint64_t total) {
  std::unique_ptr<ThreadPool> own_pool;
  if (opt.threads > 0) own_pool = std::make_unique<ThreadPool>(opt.threads);
  ThreadPool& pool = own_pool ? *own_pool : ThreadPool::global();
  std::vector<std::vector<float>> scratch(static_cast<size_t>(pool.size()));
  std::vector<std::vector<float>> scales(items.size());  // F8 weights' block scales, until written
  std::vector<size_t> index_in_shard(items.size());
  std::vector<std::unique_ptr<SafetensorsWriter>> writers(static_cast<size_t>(n_shards));
  std::vector<uint8_t> bufs[2];
  std::future<void> pending;
  uint64_t done = 0;
  int batch_no = 0;
  if (opt.progress) opt.progress(0, total);

  struct Unit {
    int item;
    int64_t band;  // band of a weight; 0 for a scale tensor (copied from `scales`)
    uint64_t off;  // in the batch buffer
    uint64_t bytes;
  };
  struct Piece {  // one write: bytes [offset, offset + n) of the shard's tensor `index`
    size_t index;
    uint64_t offset;
    const uint8_t* data;
    size_t n;
  };
  auto wait_pending = [&] {
    if (!pending.valid()) return;
    pending.get();
    if (opt.progress) opt.progress(done, total);
  };
  try {
    size_t item = 0;
    int64_t band = 0;
    while (item < items.size()) {
      if (opt.cancel && opt.cancel->load()) fail("interrupted");
      const int shard = items[item].shard;
      if (!writers[size_t(shard)]) {
        std::vector<TensorDecl> decls;
        for (size_t i = 0; i < items.size(); ++i)
          if (items[i].shard == shard) {
            index_in_shard[i] = decls.size();
            decls.push_back({items[i].name, items[i].dtype, items[i].shape});
          }
        writers[size_t(shard)] = std::make_unique<SafetensorsWriter>(
            dir + "/" + shard_name(shard, n_shards), std::move(decls),
            std::map<std::string, std::string>{{"format", "pt"}});
      }
      // A batch: consecutive bands (in manifest order) of this shard, up to kBatchBytes.
      std::vector<Unit> units;
      uint64_t size = 0;
      while (item < items.size() && items[item].shard == shard) {
        const Item& it = items[item];
        uint64_t bytes = it.weight_item >= 0
                             ? it.nbytes
                             : uint64_t(std::min(it.rows() - band * kBlock, kBlock)) * uint64_t(it.cols()) *
                                   dtype_size(it.dtype);
        if (!units.empty() && size + bytes > kBatchBytes) break;
        if (it.dtype == DType::F8_E4M3 && band == 0)
          scales[item].assign(size_t(items[item + 1].shape[0] * items[item + 1].shape[1]), 0.f);
        units.push_back({int(item), band, size, bytes});
        size += bytes;
        if (++band >= it.bands()) ++item, band = 0;
      }
      const bool last_of_shard = item >= items.size() || items[item].shard != shard;
      std::vector<uint8_t>& buf = bufs[batch_no++ % 2];  // its previous write has completed
      buf.resize(size);
      std::vector<const Unit*> gen;
      for (const Unit& u : units)
        if (items[size_t(u.item)].weight_item < 0) gen.push_back(&u);
      std::atomic<size_t> next{0};
      pool.parallel_for(pool.size(), [&](int64_t, int64_t, int tid) {
        for (size_t k; (k = next.fetch_add(1)) < gen.size();) {
          const Unit& u = *gen[k];
          const Item& it = items[size_t(u.item)];
          gen_band(it, u.band, ue8m0, buf.data() + u.off, scratch[size_t(tid)],
                   it.dtype == DType::F8_E4M3 ? scales[size_t(u.item)].data() : nullptr);
        }
      });
      std::vector<Piece> pieces;
      for (const Unit& u : units) {
        const Item& it = items[size_t(u.item)];
        if (it.weight_item >= 0) {
          auto& s = scales[size_t(it.weight_item)];
          std::memcpy(buf.data() + u.off, s.data(), s.size() * 4);
          std::vector<float>().swap(s);
        }
        const size_t index = index_in_shard[size_t(u.item)];
        const uint64_t offset = uint64_t(u.band) * uint64_t(kBlock) * uint64_t(it.cols()) * dtype_size(it.dtype);
        if (!pieces.empty() && pieces.back().index == index && pieces.back().offset + pieces.back().n == offset)
          pieces.back().n += size_t(u.bytes);  // the next band of the same tensor: adjacent in both
        else
          pieces.push_back({index, offset, buf.data() + u.off, size_t(u.bytes)});
      }
      wait_pending();  // the previous batch, written while this one was generated
      SafetensorsWriter* w = writers[size_t(shard)].get();
      pending = std::async(std::launch::async,
                           [w, pieces = std::move(pieces), size, last_of_shard, &done, sync = opt.fsync] {
                             for (const Piece& p : pieces) w->write(p.index, p.offset, p.data, p.n);
                             done += size;
                             if (last_of_shard) w->finish(sync);
                           });
    }
    wait_pending();
  } catch (...) {
    if (pending.valid()) try {
        pending.get();
      } catch (...) {
      }
    throw;  // the writers' destructors remove their unfinished files
  }
}

}  // namespace

SynthResult synthesize(const SynthOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  SynthResult res;
  if (opt.args) {
    res.args = *opt.args;
    res.args.validate("synth args");
  } else {
    res.args = shape_args(opt.shape, opt.dtype, opt.layers);
  }
  const ModelArgs& a = res.args;
  if (!(opt.shard_gb > 0) || !std::isfinite(opt.shard_gb))
    fail("the shard size must be a positive number of GB, got ", opt.shard_gb);
  if (opt.out_dir.empty()) fail("no output directory given");
  const std::string out = strip_slashes(opt.out_dir);
  const fs::path out_path(out);
  if (out == "/" || out_path.filename() == "." || out_path.filename() == "..")
    fail("output directory '", opt.out_dir, "' must name a new folder");
  res.out_dir = out;

  // Refuse before any work: an existing non-empty target (unless --force on a model folder).
  bool replace = false;
  std::error_code ec;
  if (fs::exists(out_path, ec)) {
    if (!fs::is_directory(out_path, ec)) fail(out, " exists and is not a directory");
    if (!dir_is_empty(out)) {
      if (!opt.force) fail(out, " exists and is not empty (pass --force to replace it)");
      if (!fs::exists(out_path / "config.json"))
        fail(out, " is not empty and holds no config.json: refusing to replace it, even with --force");
      replace = true;
    }
  }
  std::string tok_dir;
  if (opt.tokenizer) {
    try {
      tok_dir = opt.tokenizer_dir.empty() ? find_tokenizer_dir("") : opt.tokenizer_dir;
    } catch (const Error& e) {
      fail(e.what(), " (or pass --no-tokenizer to write the model without tokenizer files)");
    }
    if (!file_exists(tok_dir + "/tokenizer.json"))
      fail(tok_dir, ": no tokenizer.json to copy (or pass --no-tokenizer to write the model without tokenizer files)");
  }

  std::vector<Item> items = plan_items(a, opt.seed);
  const int n_shards = assign_shards(items, uint64_t(opt.shard_gb * 1e9));
  uint64_t total = 0;
  for (auto& it : items) total += it.nbytes;
  res.n_shards = n_shards;
  res.n_tensors = int(items.size());
  res.data_bytes = total;

  if (!out_path.parent_path().empty()) {
    fs::create_directories(out_path.parent_path(), ec);
    if (ec) fail(out, ": cannot create the parent folder: ", ec.message());
  }
  remove_stale_partials(out_path);
  const std::string partial = out + ".partial-" + std::to_string(::getpid());
  fs::remove_all(partial, ec);
  if (::mkdir(partial.c_str(), 0755) != 0) fail(partial, ": cannot create: ", std::strerror(errno));
  try {
    struct statvfs sv;
    if (::statvfs(partial.c_str(), &sv) == 0) {
      const uint64_t avail = uint64_t(sv.f_bavail) * uint64_t(sv.f_frsize);
      const uint64_t need = total + (uint64_t(64) << 20);
      if (avail < need)
        fail(out, ": the checkpoint needs ", need / 1e9, " GB but only ", avail / 1e9, " GB are free there");
    }
    write_file_atomic(partial + "/config.json", synth_config_json(a));
    write_shards(partial, items, n_shards, a.scale_fmt == "ue8m0", opt, total);
    json index;
    index["metadata"] = {{"total_size", total}};
    json wm = json::object();
    for (auto& it : items) wm[it.name] = shard_name(it.shard, n_shards);
    index["weight_map"] = wm;
    write_file_atomic(partial + "/model.safetensors.index.json", index.dump(2) + "\n");
    if (opt.tokenizer)
      for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
        if (file_exists(tok_dir + "/" + f))
          write_file_atomic(partial + "/" + f, read_text_file(tok_dir + "/" + f));
    if (opt.fsync) fsync_dir(partial);
    if (opt.cancel && opt.cancel->load()) fail("interrupted");

    // Into place. An empty existing folder is replaced by rename(2) itself.
    if (replace) {
      const std::string old = out + ".old-" + std::to_string(::getpid());
      if (::rename(out.c_str(), old.c_str()) != 0)
        fail(out, ": cannot move the old folder aside: ", std::strerror(errno));
      if (::rename(partial.c_str(), out.c_str()) != 0) {
        int e = errno;
        ::rename(old.c_str(), out.c_str());
        fail(out, ": cannot rename ", partial, " into place: ", std::strerror(e));
      }
      fs::remove_all(old, ec);
    } else if (::rename(partial.c_str(), out.c_str()) != 0) {
      fail(out, ": cannot rename ", partial, " into place: ", std::strerror(errno));
    }
  } catch (...) {
    fs::remove_all(partial, ec);
    throw;
  }
  if (opt.fsync) fsync_dir(out_path.parent_path().empty() ? "." : out_path.parent_path().string());
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace dsv3
