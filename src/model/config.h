// Model hyper-parameters under the reference's ModelArgs names, read from a Hugging Face
// config.json (DeepSeek-V2/V2-Lite/V3/V3.1) or from a reference ModelArgs JSON (configs/*.json).
#pragma once
#include <string>

namespace dsv3 {

class Checkpoint;

struct ModelArgs {
  int max_batch_size = 8;        // reference ModelArgs only; the engine sizes its own KV cache
  int max_seq_len = 4096 * 4;    // HF: max_position_embeddings
  int vocab_size = 102400;
  int dim = 2048;                // HF: hidden_size
  int inter_dim = 10944;         // HF: intermediate_size
  int moe_inter_dim = 1408;      // HF: moe_intermediate_size
  int n_layers = 27;             // HF: num_hidden_layers
  int n_dense_layers = 1;        // HF: first_k_dense_replace
  int moe_layer_freq = 1;        // HF: moe_layer_freq
  int n_heads = 16;              // HF: num_attention_heads
  int n_routed_experts = 64;
  int n_shared_experts = 2;
  int n_activated_experts = 6;   // HF: num_experts_per_tok
  int n_expert_groups = 1;       // HF: n_group
  int n_limited_groups = 1;      // HF: topk_group
  std::string score_func = "softmax";  // HF: scoring_func
  float route_scale = 1.f;       // HF: routed_scaling_factor
  bool norm_topk_prob = false;   // HF field; reference: true exactly for sigmoid scoring
  std::string topk_method;       // HF: greedy | group_limited_greedy | noaux_tc (informational)
  int q_lora_rank = 0;           // 0 = no q LoRA (wq)
  int kv_lora_rank = 512;
  int qk_nope_head_dim = 128;
  int qk_rope_head_dim = 64;
  int v_head_dim = 128;
  // RoPE / YaRN
  bool yarn = false;             // HF: rope_scaling present; reference: max_seq_len > original_seq_len
  int original_seq_len = 4096;
  float rope_theta = 10000.f;
  float rope_factor = 40.f;
  float beta_fast = 32.f;
  float beta_slow = 1.f;
  float mscale = 1.f;
  float mscale_all_dim = 1.f;
  float rms_norm_eps = 1e-6f;
  // Weights
  std::string dtype = "bf16";     // "fp8" when quantization_config says e4m3 block-scaled
  std::string scale_fmt;          // "" or "ue8m0"
  int weight_block_size = 128;
  int n_mtp_layers = 0;           // HF: num_nextn_predict_layers
  int bos_token_id = 0, eos_token_id = 1;

  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool is_moe_layer(int i) const {
    return n_routed_experts > 0 && i >= n_dense_layers && i % moe_layer_freq == 0;
  }
  float softmax_scale() const;  // qk_head_dim^-0.5, times mscale^2 under YaRN (MLA.__init__)
  // Throws Error naming the field when the combination is impossible.
  void validate(const std::string& what) const;
};

// Parses either format, told apart by their keys ("hidden_size" vs "dim"). `what` names the
// source in errors. Unknown fields are ignored; missing required ones are errors.
ModelArgs parse_model_args(const std::string& json_text, const std::string& what);
ModelArgs load_model_args(const std::string& path);
// Every field that decides the model's numbers, one "name value" line each: what ranks compare
// to agree they run the same model.
std::string describe(const ModelArgs& a);
// The config of an opened checkpoint (its --config file or config.json), parsed.
ModelArgs load_model_args(const Checkpoint& ck);

}  // namespace dsv3
