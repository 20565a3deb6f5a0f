// The shapes of the released DeepSeek models (configs/config_*.json of the reference).
#include "model/shapes.h"

#include <algorithm>

#include "core/error.h"

namespace dsv3 {

const std::vector<std::string>& model_shape_names() {
  static const std::vector<std::string> k = {"tiny", "16B", "236B", "671B", "v3.1"};
  return k;
}

static std::string shape_list() {
  std::string s;
  for (auto& n : model_shape_names()) s += (s.empty() ? "" : ", ") + n;
  return s;
}

ModelArgs model_shape(const std::string& name) {
  ModelArgs a;
  // Fields every shape shares: the real tokenizer's vocabulary, MLA head dims, YaRN from 4096.
  a.vocab_size = 129280;
  a.bos_token_id = 0;
  a.eos_token_id = 1;
  a.max_seq_len = 163840;  // max_position_embeddings of every released V2/V3 config
  a.kv_lora_rank = 512;
  a.qk_nope_head_dim = 128;
  a.qk_rope_head_dim = 64;
  a.v_head_dim = 128;
  a.rope_theta = 10000.f;
  a.rms_norm_eps = 1e-6f;
  a.yarn = true;
  a.original_seq_len = 4096;
  a.rope_factor = 40.f;
  a.beta_fast = 32.f;
  a.beta_slow = 1.f;
  a.moe_layer_freq = 1;
  a.n_mtp_layers = 0;  // the 671B checkpoint's MTP layer is not synthesised (convert.py skips it too)
  a.scale_fmt = "";
  auto v3 = [&] {  // DeepSeek-V3 (configs/config_671B.json)
    a.dim = 7168, a.inter_dim = 18432, a.moe_inter_dim = 2048, a.n_layers = 61, a.n_dense_layers = 3;
    a.n_heads = 128, a.n_routed_experts = 256, a.n_shared_experts = 1, a.n_activated_experts = 8;
    a.n_expert_groups = 8, a.n_limited_groups = 4, a.score_func = "sigmoid", a.route_scale = 2.5f;
    a.norm_topk_prob = true, a.topk_method = "noaux_tc", a.q_lora_rank = 1536;
    a.mscale = a.mscale_all_dim = 1.f;
    a.dtype = "fp8";
  };
  if (name == "tiny") {
    // V3 routing (sigmoid + bias, 4 groups of 4, top-2 groups) and q LoRA at toy width; dim 160,
    // q_lora 96, wkv_a out 160, inter 400, moe_inter 96 leave ragged 128-blocks in FP8.
    // embed + head (bf16 at the real vocabulary) are ~83 MB of the ~90 MB.
    v3();
    a.dim = 160, a.inter_dim = 400, a.moe_inter_dim = 96, a.n_layers = 3, a.n_dense_layers = 1;
    a.n_heads = 4, a.n_routed_experts = 16, a.n_shared_experts = 1, a.n_activated_experts = 4;
    a.n_expert_groups = 4, a.n_limited_groups = 2;
    a.q_lora_rank = 96, a.kv_lora_rank = 128, a.qk_nope_head_dim = 48, a.qk_rope_head_dim = 32;
    a.v_head_dim = 48;
    a.max_seq_len = 16384, a.rope_factor = 4.f;  // keeps a default-sized KV cache small
  } else if (name == "16B") {  // DeepSeek-V2-Lite (configs/config_16B.json)
    a.dim = 2048, a.inter_dim = 10944, a.moe_inter_dim = 1408, a.n_layers = 27, a.n_dense_layers = 1;
    a.n_heads = 16, a.n_routed_experts = 64, a.n_shared_experts = 2, a.n_activated_experts = 6;
    a.n_expert_groups = 1, a.n_limited_groups = 1, a.score_func = "softmax", a.route_scale = 1.f;
    a.norm_topk_prob = false, a.topk_method = "greedy", a.q_lora_rank = 0;
    a.mscale = a.mscale_all_dim = 0.707f;
    a.dtype = "bf16";
  } else if (name == "236B") {  // DeepSeek-V2 (configs/config_236B.json)
    a.dim = 5120, a.inter_dim = 12288, a.moe_inter_dim = 1536, a.n_layers = 60, a.n_dense_layers = 1;
    a.n_heads = 128, a.n_routed_experts = 160, a.n_shared_experts = 2, a.n_activated_experts = 6;
    a.n_expert_groups = 8, a.n_limited_groups = 3, a.score_func = "softmax", a.route_scale = 16.f;
    a.norm_topk_prob = false, a.topk_method = "group_limited_greedy", a.q_lora_rank = 1536;
    a.mscale = a.mscale_all_dim = 0.707f;
    a.dtype = "bf16";
  } else if (name == "671B") {
    v3();
  } else if (name == "v3.1") {  // configs/config_v3.1.json: 671B with ue8m0 (power-of-two) scales
    v3();
    a.scale_fmt = "ue8m0";
  } else {
    fail("unknown shape '", name, "' (known: ", shape_list(), ")");
  }
  return a;
}

ModelArgs shape_args(const std::string& shape, const std::string& dtype, int layers) {
  ModelArgs a = model_shape(shape);
  if (!dtype.empty()) {
    if (dtype != "bf16" && dtype != "fp8") fail("dtype must be bf16 or fp8, got '", dtype, "'");
    a.dtype = dtype;
  }
  if (a.dtype != "fp8") a.scale_fmt = "";
  if (layers < 0) fail("the number of layers must be at least 1, got ", layers);
  if (layers > 0) {
    if (layers > 4096) fail("the number of layers must be at most 4096, got ", layers);
    a.n_layers = layers;
    a.n_dense_layers = std::min(a.n_dense_layers, layers);
  }
  a.validate("shape " + shape);
  return a;
}

}  // namespace dsv3
