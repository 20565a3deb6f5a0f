#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/mmap_file.h"

namespace dsv3 {

using json = nlohmann::json;

float ModelArgs::softmax_scale() const {
  float s = 1.f / std::sqrt(float(qk_head_dim()));
  if (yarn) {
    float m = 0.1f * mscale_all_dim * std::log(rope_factor) + 1.f;  // HF: mscale_all_dim; reference: mscale (equal in every real config)
    s *= m * m;
  }
  return s;
}

void ModelArgs::validate(const std::string& what) const {
  auto need = [&](bool ok, const std::string& msg) {
    if (!ok) fail(what, ": impossible config: ", msg);
  };
  need(vocab_size > 0, "vocab_size must be positive");
  need(dim > 0, "hidden_size (dim) must be positive");
  need(n_layers > 0, "num_hidden_layers must be positive");
  need(n_heads > 0, "num_attention_heads must be positive");
  need(kv_lora_rank > 0, "kv_lora_rank must be positive");
  need(q_lora_rank >= 0, "q_lora_rank must be null/0 or positive");
  need(qk_nope_head_dim > 0 && v_head_dim > 0, "head dims must be positive");
  need(qk_rope_head_dim > 0 && qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be positive and even");
  need(max_seq_len > 0, "max_position_embeddings must be positive");
  need(n_dense_layers >= 0, "first_k_dense_replace must be >= 0");
  need(moe_layer_freq > 0, "moe_layer_freq must be positive");
  need(rms_norm_eps > 0, "rms_norm_eps must be positive");
  need(rope_theta > 1, "rope_theta must be > 1");
  // Which kinds of layer exist, without walking up to 2^31 layers: MoE layers are the multiples
  // of moe_layer_freq in [max(n_dense_layers, 0), n_layers) (is_moe_layer), the rest are dense.
  const int64_t first = std::max<int64_t>(n_dense_layers, 0);
  const int64_t first_moe = (first + moe_layer_freq - 1) / moe_layer_freq * moe_layer_freq;
  const bool any_moe = n_routed_experts > 0 && first_moe < n_layers;
  const bool any_dense = !any_moe || first > 0 || (moe_layer_freq > 1 && n_layers > 1);
  if (any_dense) need(inter_dim > 0, "intermediate_size must be positive");
  if (any_moe) {
    need(moe_inter_dim > 0, "moe_intermediate_size must be positive");
    need(n_shared_experts >= 0, "n_shared_experts must be >= 0");
    need(n_activated_experts > 0, "num_experts_per_tok must be positive");
    need(n_activated_experts <= n_routed_experts,
         str("num_experts_per_tok (", n_activated_experts, ") exceeds n_routed_experts (",
             n_routed_experts, ")"));
    need(n_expert_groups > 0, "n_group must be positive");
    need(n_routed_experts % n_expert_groups == 0,
         str("n_group (", n_expert_groups, ") does not divide n_routed_experts (", n_routed_experts, ")"));
    need(n_limited_groups > 0 && n_limited_groups <= n_expert_groups,
         str("topk_group (", n_limited_groups, ") must be in [1, n_group=", n_expert_groups, "]"));
    need(n_activated_experts <= n_limited_groups * (n_routed_experts / n_expert_groups),
         "num_experts_per_tok exceeds the experts in topk_group groups");
    if (n_expert_groups > 1 && score_func == "sigmoid")
      need(n_routed_experts / n_expert_groups >= 2, "sigmoid group scoring needs >= 2 experts per group");
    need(score_func == "softmax" || score_func == "sigmoid",
         "scoring_func must be softmax or sigmoid, got '" + score_func + "'");
  }
  if (yarn) {
    need(rope_factor >= 1, "rope_scaling.factor must be >= 1");
    need(original_seq_len > 0, "rope_scaling.original_max_position_embeddings must be positive");
    need(beta_fast > 0 && beta_slow > 0, "rope_scaling beta_fast/beta_slow must be positive");
  }
  need(dtype == "bf16" || dtype == "fp8", "dtype must be bf16 or fp8");
  need(scale_fmt.empty() || scale_fmt == "ue8m0", "scale_fmt must be absent or ue8m0, got '" + scale_fmt + "'");
  need(weight_block_size == 128, "only 128x128 weight blocks are supported");
}

namespace {

// A value for an error message; nested ones by type only (dump() recurses once per level).
std::string show(const json& v) { return v.is_structured() ? std::string("an ") + v.type_name() : v.dump(); }

// An int field's value; unsigned JSON numbers above INT64_MAX must not wrap around.
int to_int(const json& v, const std::string& what, const char* k) {
  if (!v.is_number_integer()) fail(what, ": field '", k, "' must be an integer, got ", show(v));
  if (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t(INT32_MAX)
                             : (v.get<int64_t>() < INT32_MIN || v.get<int64_t>() > INT32_MAX))
    fail(what, ": field '", k, "' out of range: ", v.dump());
  return int(v.get<int64_t>());
}

struct Reader {
  const json& j;
  const std::string& what;
  bool has(const char* k) const { return j.contains(k) && !j[k].is_null(); }
  template <class T>
  T num(const char* k) const {
    if (!j.contains(k)) fail(what, ": missing required field '", k, "'");
    return num_or<T>(k, T());
  }
  template <class T>
  T num_or(const char* k, T dflt) const {
    if (!has(k)) return dflt;
    const json& v = j[k];
    if (!v.is_number()) fail(what, ": field '", k, "' must be a number, got ", show(v));
    if constexpr (std::is_integral_v<T>) {
      return T(to_int(v, what, k));
    } else {
      return T(v.get<double>());
    }
  }
  std::string s_or(const char* k, const std::string& dflt) const {
    if (!has(k)) return dflt;
    if (!j[k].is_string()) fail(what, ": field '", k, "' must be a string, got ", show(j[k]));
    return j[k].get<std::string>();
  }
  bool b_or(const char* k, bool dflt) const {
    if (!has(k)) return dflt;
    if (!j[k].is_boolean()) fail(what, ": field '", k, "' must be true or false");
    return j[k].get<bool>();
  }
};

int first_int(const json& v, const std::string& what, const char* k) {
  // eos_token_id may be a list in some configs: take the first.
  return to_int(v.is_array() && !v.empty() ? v[0] : v, what, k);
}

ModelArgs from_hf(const json& j, const std::string& what) {
  Reader r{j, what};
  ModelArgs a;
  a.vocab_size = r.num<int>("vocab_size");
  a.dim = r.num<int>("hidden_size");
  a.n_layers = r.num<int>("num_hidden_layers");
  a.n_heads = r.num<int>("num_attention_heads");
  a.kv_lora_rank = r.num<int>("kv_lora_rank");
  a.qk_nope_head_dim = r.num<int>("qk_nope_head_dim");
  a.qk_rope_head_dim = r.num<int>("qk_rope_head_dim");
  a.v_head_dim = r.num<int>("v_head_dim");
  a.inter_dim = r.num_or<int>("intermediate_size", 0);
  a.moe_inter_dim = r.num_or<int>("moe_intermediate_size", 0);
  a.n_routed_experts = r.num_or<int>("n_routed_experts", 0);
  a.n_shared_experts = r.num_or<int>("n_shared_experts", 0);
  a.n_activated_experts = r.num_or<int>("num_experts_per_tok", 0);
  a.n_dense_layers = r.num_or<int>("first_k_dense_replace", 0);
  a.moe_layer_freq = r.num_or<int>("moe_layer_freq", 1);
  a.n_expert_groups = r.num_or<int>("n_group", 1);
  a.n_limited_groups = r.num_or<int>("topk_group", 1);
  a.route_scale = r.num_or<float>("routed_scaling_factor", 1.f);
  a.score_func = r.s_or("scoring_func", "softmax");
  a.topk_method = r.s_or("topk_method", "greedy");
  a.norm_topk_prob = r.b_or("norm_topk_prob", a.score_func == "sigmoid");
  a.q_lora_rank = r.num_or<int>("q_lora_rank", 0);
  a.rope_theta = r.num_or<float>("rope_theta", 10000.f);
  a.rms_norm_eps = r.num_or<float>("rms_norm_eps", 1e-6f);
  a.max_seq_len = r.num_or<int>("max_position_embeddings", 4096);
  a.n_mtp_layers = r.num_or<int>("num_nextn_predict_layers", 0);
  if (r.has("bos_token_id")) a.bos_token_id = first_int(j["bos_token_id"], what, "bos_token_id");
  if (r.has("eos_token_id")) a.eos_token_id = first_int(j["eos_token_id"], what, "eos_token_id");
  if (r.has("rope_scaling")) {
    const json& rs = j["rope_scaling"];
    if (!rs.is_object()) fail(what, ": rope_scaling must be an object");
    Reader q{rs, what};
    std::string type = q.s_or("type", q.s_or("rope_type", "yarn"));
    if (type != "yarn") fail(what, ": rope_scaling type '", type, "' is not supported (only yarn)");
    a.yarn = true;
    a.rope_factor = q.num<float>("factor");
    a.original_seq_len = q.num<int>("original_max_position_embeddings");
    a.beta_fast = q.num_or<float>("beta_fast", 32.f);
    a.beta_slow = q.num_or<float>("beta_slow", 1.f);
    a.mscale = q.num_or<float>("mscale", 1.f);
    a.mscale_all_dim = q.num_or<float>("mscale_all_dim", a.mscale);
  }
  if (r.has("quantization_config")) {
    const json& qc = j["quantization_config"];
    if (!qc.is_object()) fail(what, ": quantization_config must be an object");
    Reader q{qc, what};
    std::string method = q.s_or("quant_method", "fp8"), fmt = q.s_or("fmt", "e4m3");
    if (method != "fp8" || fmt != "e4m3")
      fail(what, ": quantization_config ", method, "/", fmt, " is not supported (only fp8 e4m3)");
    a.dtype = "fp8";
    a.scale_fmt = q.s_or("scale_fmt", "");
    if (qc.contains("weight_block_size")) {
      const json& b = qc["weight_block_size"];
      if (!b.is_array() || b.size() != 2 || to_int(b[0], what, "weight_block_size") !=
                                                  to_int(b[1], what, "weight_block_size"))
        fail(what, ": quantization_config.weight_block_size must be [n, n]");
      a.weight_block_size = to_int(b[0], what, "weight_block_size");
    }
  }
  return a;
}

ModelArgs from_ref(const json& j, const std::string& what) {
  Reader r{j, what};
  ModelArgs a;  // defaults are the reference's ModelArgs defaults
  a.max_batch_size = r.num_or("max_batch_size", a.max_batch_size);
  a.max_seq_len = r.num_or("max_seq_len", a.max_seq_len);
  a.vocab_size = r.num_or("vocab_size", a.vocab_size);
  a.dim = r.num_or("dim", a.dim);
  a.inter_dim = r.num_or("inter_dim", a.inter_dim);
  a.moe_inter_dim = r.num_or("moe_inter_dim", a.moe_inter_dim);
  a.n_layers = r.num_or("n_layers", a.n_layers);
  a.n_dense_layers = r.num_or("n_dense_layers", a.n_dense_layers);
  a.n_heads = r.num_or("n_heads", a.n_heads);
  a.n_routed_experts = r.num_or("n_routed_experts", a.n_routed_experts);
  a.n_shared_experts = r.num_or("n_shared_experts", a.n_shared_experts);
  a.n_activated_experts = r.num_or("n_activated_experts", a.n_activated_experts);
  a.n_expert_groups = r.num_or("n_expert_groups", a.n_expert_groups);
  a.n_limited_groups = r.num_or("n_limited_groups", a.n_limited_groups);
  a.score_func = r.s_or("score_func", a.score_func);
  a.route_scale = r.num_or("route_scale", a.route_scale);
  a.norm_topk_prob = a.score_func == "sigmoid";
  a.q_lora_rank = r.num_or("q_lora_rank", a.q_lora_rank);
  a.kv_lora_rank = r.num_or("kv_lora_rank", a.kv_lora_rank);
  a.qk_nope_head_dim = r.num_or("qk_nope_head_dim", a.qk_nope_head_dim);
  a.qk_rope_head_dim = r.num_or("qk_rope_head_dim", a.qk_rope_head_dim);
  a.v_head_dim = r.num_or("v_head_dim", a.v_head_dim);
  a.original_seq_len = r.num_or("original_seq_len", a.original_seq_len);
  a.rope_theta = r.num_or("rope_theta", a.rope_theta);
  a.rope_factor = r.num_or("rope_factor", a.rope_factor);
  a.beta_fast = r.num_or("beta_fast", a.beta_fast);
  a.beta_slow = r.num_or("beta_slow", a.beta_slow);
  a.mscale = r.num_or("mscale", a.mscale);
  a.mscale_all_dim = a.mscale;
  a.dtype = r.s_or("dtype", a.dtype);
  a.scale_fmt = r.s_or("scale_fmt", "");
  a.yarn = a.max_seq_len > a.original_seq_len;  // precompute_freqs_cis / MLA.__init__
  a.rms_norm_eps = 1e-6f;
  return a;
}

}  // namespace

ModelArgs parse_model_args(const std::string& text, const std::string& what) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail(what, ": not valid JSON: ", e.what());
  }
  if (!j.is_object()) fail(what, ": config is not a JSON object");
  ModelArgs a;
  if (j.contains("hidden_size")) a = from_hf(j, what);
  else if (j.contains("dim")) a = from_ref(j, what);
  else fail(what, ": neither a Hugging Face config (hidden_size) nor a reference ModelArgs (dim)");
  a.validate(what);
  return a;
}

ModelArgs load_model_args(const std::string& path) { return parse_model_args(read_text_file(path), path); }

std::string describe(const ModelArgs& a) {
  std::ostringstream s;
  s.precision(9);
#define DSV3_FIELD(f) s << #f << " " << a.f << "\n"
  DSV3_FIELD(max_seq_len); DSV3_FIELD(vocab_size); DSV3_FIELD(dim); DSV3_FIELD(inter_dim); DSV3_FIELD(moe_inter_dim);
  DSV3_FIELD(n_layers); DSV3_FIELD(n_dense_layers); DSV3_FIELD(moe_layer_freq); DSV3_FIELD(n_heads);
  DSV3_FIELD(n_routed_experts); DSV3_FIELD(n_shared_experts); DSV3_FIELD(n_activated_experts);
  DSV3_FIELD(n_expert_groups); DSV3_FIELD(n_limited_groups); DSV3_FIELD(score_func); DSV3_FIELD(route_scale);
  DSV3_FIELD(norm_topk_prob); DSV3_FIELD(q_lora_rank); DSV3_FIELD(kv_lora_rank); DSV3_FIELD(qk_nope_head_dim);
  DSV3_FIELD(qk_rope_head_dim); DSV3_FIELD(v_head_dim); DSV3_FIELD(yarn); DSV3_FIELD(original_seq_len);
  DSV3_FIELD(rope_theta); DSV3_FIELD(rope_factor); DSV3_FIELD(beta_fast); DSV3_FIELD(beta_slow); DSV3_FIELD(mscale);
  DSV3_FIELD(mscale_all_dim); DSV3_FIELD(rms_norm_eps); DSV3_FIELD(dtype); DSV3_FIELD(scale_fmt);
  DSV3_FIELD(weight_block_size); DSV3_FIELD(bos_token_id); DSV3_FIELD(eos_token_id);
#undef DSV3_FIELD
  return s.str();
}
ModelArgs load_model_args(const Checkpoint& ck) { return parse_model_args(ck.config_text(), ck.config_path()); }

}  // namespace dsv3
