// Config parsing: every golden HF config.json and reference ModelArgs JSON maps to the expected
// ModelArgs, the two spellings of one model agree, and bad configs are refused with a dsv3::Error
// naming the source and the field.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "io/mmap_file.h"
#include "model/config.h"

using namespace dsv3;
using json = nlohmann::json;

namespace {

const char* const kCases[] = {"v2_groups_bf16", "v2lite_bf16", "v31_fp8_ue8m0", "v3_fp8", "v3_fp8_long"};

std::string case_dir(const std::string& c) { return std::string(DSV3_TEST_DATA) + "/golden/models/" + c; }
ModelArgs hf_args(const std::string& c) { return load_model_args(case_dir(c) + "/hf/config.json"); }
ModelArgs ref_args(const std::string& c) { return load_model_args(case_dir(c) + "/ref_config.json"); }
json hf_json(const std::string& c) { return json::parse(read_text_file(case_dir(c) + "/hf/config.json")); }
json ref_json(const std::string& c) { return json::parse(read_text_file(case_dir(c) + "/ref_config.json")); }

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-dsv3 exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

// parse_model_args(text) must fail with a message naming the source and containing each part.
void expect_refused(const std::string& text, std::initializer_list<const char*> parts) {
  std::string msg = error_of([&] { parse_model_args(text, "cfg.json"); });
  EXPECT_NE(msg.find("cfg.json"), std::string::npos) << msg;
  for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
}

// The v3_fp8 HF config with one edit applied.
std::string v3_with(const std::function<void(json&)>& edit) {
  json j = hf_json("v3_fp8");
  edit(j);
  return j.dump();
}

}  // namespace

TEST(Config, MapsTheV3Fp8HfConfig) {
  ModelArgs a = hf_args("v3_fp8");
  EXPECT_EQ(a.dim, 256);
  EXPECT_EQ(a.vocab_size, 512);
  EXPECT_EQ(a.inter_dim, 512);
  EXPECT_EQ(a.moe_inter_dim, 128);
  EXPECT_EQ(a.n_layers, 3);
  EXPECT_EQ(a.n_dense_layers, 1);
  EXPECT_EQ(a.n_heads, 4);
  EXPECT_EQ(a.n_routed_experts, 16);
  EXPECT_EQ(a.n_shared_experts, 1);
  EXPECT_EQ(a.n_activated_experts, 4);
  EXPECT_EQ(a.n_expert_groups, 4);
  EXPECT_EQ(a.n_limited_groups, 2);
  EXPECT_EQ(a.score_func, "sigmoid");
  EXPECT_EQ(a.topk_method, "noaux_tc");
  EXPECT_TRUE(a.norm_topk_prob);
  EXPECT_FLOAT_EQ(a.route_scale, 2.5f);
  EXPECT_EQ(a.q_lora_rank, 128);
  EXPECT_EQ(a.kv_lora_rank, 128);
  EXPECT_EQ(a.qk_nope_head_dim, 32);
  EXPECT_EQ(a.qk_rope_head_dim, 16);
  EXPECT_EQ(a.qk_head_dim(), 48);
  EXPECT_EQ(a.v_head_dim, 32);
  EXPECT_EQ(a.max_seq_len, 256);
  EXPECT_TRUE(a.yarn);
  EXPECT_FLOAT_EQ(a.rope_factor, 40.f);
  EXPECT_EQ(a.original_seq_len, 64);
  EXPECT_FLOAT_EQ(a.beta_fast, 32.f);
  EXPECT_FLOAT_EQ(a.beta_slow, 1.f);
  EXPECT_FLOAT_EQ(a.mscale, 1.f);
  EXPECT_FLOAT_EQ(a.rope_theta, 10000.f);
  EXPECT_FLOAT_EQ(a.rms_norm_eps, 1e-6f);
  EXPECT_EQ(a.dtype, "fp8");
  EXPECT_EQ(a.scale_fmt, "");
  EXPECT_EQ(a.weight_block_size, 128);
  EXPECT_EQ(a.n_mtp_layers, 0);
  EXPECT_EQ(a.bos_token_id, 0);
  EXPECT_EQ(a.eos_token_id, 1);
  EXPECT_FALSE(a.is_moe_layer(0));
  EXPECT_TRUE(a.is_moe_layer(1));
  EXPECT_TRUE(a.is_moe_layer(2));
  // MLA.__init__: qk_head_dim^-0.5 * (0.1 * mscale * ln(factor) + 1)^2.
  float m = 0.1f * std::log(40.f) + 1.f;
  EXPECT_NEAR(a.softmax_scale(), m * m / std::sqrt(48.f), 1e-6f);
}

TEST(Config, MapsTheOtherGoldenCases) {
  ModelArgs v31 = hf_args("v31_fp8_ue8m0");
  EXPECT_EQ(v31.scale_fmt, "ue8m0");
  EXPECT_EQ(v31.dtype, "fp8");
  EXPECT_EQ(ref_args("v31_fp8_ue8m0").scale_fmt, "ue8m0");

  ModelArgs lite = hf_args("v2lite_bf16");
  EXPECT_EQ(lite.q_lora_rank, 0);  // null in the JSON
  EXPECT_EQ(lite.dtype, "bf16");
  EXPECT_EQ(lite.score_func, "softmax");
  EXPECT_FALSE(lite.norm_topk_prob);
  EXPECT_EQ(lite.n_expert_groups, 1);
  EXPECT_TRUE(lite.yarn);
  EXPECT_FLOAT_EQ(lite.rope_factor, 4.f);
  EXPECT_FLOAT_EQ(lite.mscale, 0.707f);
  EXPECT_FLOAT_EQ(lite.mscale_all_dim, 0.707f);
  EXPECT_EQ(lite.original_seq_len, 64);

  ModelArgs groups = hf_args("v2_groups_bf16");
  EXPECT_FALSE(groups.yarn);
  EXPECT_FALSE(ref_args("v2_groups_bf16").yarn);  // max_seq_len 128 <= original_seq_len 4096
  EXPECT_EQ(groups.n_expert_groups, 4);
  EXPECT_EQ(groups.n_limited_groups, 2);
  EXPECT_EQ(groups.topk_method, "group_limited_greedy");
  EXPECT_FLOAT_EQ(groups.route_scale, 16.f);
  EXPECT_FLOAT_EQ(groups.softmax_scale(), 1.f / std::sqrt(48.f));

  ModelArgs lng = hf_args("v3_fp8_long");
  EXPECT_EQ(lng.max_seq_len, 512);
  EXPECT_EQ(lng.original_seq_len, 128);
}

TEST(Config, HfAndReferenceJsonOfOneModelAgree) {
  for (const char* c : kCases) {
    SCOPED_TRACE(c);
    ModelArgs h = hf_args(c), r = ref_args(c);
    EXPECT_EQ(h.max_seq_len, r.max_seq_len);
    EXPECT_EQ(h.vocab_size, r.vocab_size);
    EXPECT_EQ(h.dim, r.dim);
    EXPECT_EQ(h.inter_dim, r.inter_dim);
    EXPECT_EQ(h.moe_inter_dim, r.moe_inter_dim);
    EXPECT_EQ(h.n_layers, r.n_layers);
    EXPECT_EQ(h.n_dense_layers, r.n_dense_layers);
    EXPECT_EQ(h.moe_layer_freq, r.moe_layer_freq);
    EXPECT_EQ(h.n_heads, r.n_heads);
    EXPECT_EQ(h.n_routed_experts, r.n_routed_experts);
    EXPECT_EQ(h.n_shared_experts, r.n_shared_experts);
    EXPECT_EQ(h.n_activated_experts, r.n_activated_experts);
    EXPECT_EQ(h.n_expert_groups, r.n_expert_groups);
    EXPECT_EQ(h.n_limited_groups, r.n_limited_groups);
    EXPECT_EQ(h.score_func, r.score_func);
    EXPECT_FLOAT_EQ(h.route_scale, r.route_scale);
    EXPECT_EQ(h.norm_topk_prob, r.norm_topk_prob);
    EXPECT_EQ(h.q_lora_rank, r.q_lora_rank);
    EXPECT_EQ(h.kv_lora_rank, r.kv_lora_rank);
    EXPECT_EQ(h.qk_nope_head_dim, r.qk_nope_head_dim);
    EXPECT_EQ(h.qk_rope_head_dim, r.qk_rope_head_dim);
    EXPECT_EQ(h.v_head_dim, r.v_head_dim);
    EXPECT_FLOAT_EQ(h.rope_theta, r.rope_theta);
    EXPECT_FLOAT_EQ(h.rms_norm_eps, r.rms_norm_eps);
    EXPECT_EQ(h.yarn, r.yarn);
    if (h.yarn) {  // the rope_scaling fields mean something only under YaRN
      EXPECT_EQ(h.original_seq_len, r.original_seq_len);
      EXPECT_FLOAT_EQ(h.rope_factor, r.rope_factor);
      EXPECT_FLOAT_EQ(h.beta_fast, r.beta_fast);
      EXPECT_FLOAT_EQ(h.beta_slow, r.beta_slow);
      EXPECT_FLOAT_EQ(h.mscale, r.mscale);
      EXPECT_FLOAT_EQ(h.mscale_all_dim, r.mscale_all_dim);
    }
    EXPECT_FLOAT_EQ(h.softmax_scale(), r.softmax_scale());
    EXPECT_EQ(h.dtype, r.dtype);
    EXPECT_EQ(h.scale_fmt, r.scale_fmt);
    EXPECT_EQ(h.weight_block_size, r.weight_block_size);
    for (int i = 0; i < h.n_layers; ++i) EXPECT_EQ(h.is_moe_layer(i), r.is_moe_layer(i)) << "layer " << i;
  }
}

TEST(Config, IgnoresUnknownFields) {
  for (const char* c : kCases) {
    SCOPED_TRACE(c);
    json h = hf_json(c), r = ref_json(c);
    for (json* j : {&h, &r}) {
      (*j)["some_future_field"] = {{"nested", {1, 2, 3}}, {"s", "x"}};
      (*j)["another"] = nullptr;
      (*j)["use_cache"] = "yes";
    }
    ModelArgs a = parse_model_args(h.dump(), "h"), b = hf_args(c);
    EXPECT_EQ(a.dim, b.dim);
    EXPECT_EQ(a.n_routed_experts, b.n_routed_experts);
    EXPECT_EQ(a.yarn, b.yarn);
    ModelArgs x = parse_model_args(r.dump(), "r"), y = ref_args(c);
    EXPECT_EQ(x.dim, y.dim);
    EXPECT_EQ(x.max_batch_size, y.max_batch_size);
  }
}

TEST(Config, AcceptsListEosAndNullOptionals) {
  ModelArgs a = parse_model_args(v3_with([](json& j) {
                                   j["eos_token_id"] = {7, 8};
                                   j["q_lora_rank"] = nullptr;
                                   j["rope_scaling"] = nullptr;
                                   j["quantization_config"] = nullptr;
                                 }),
                                 "cfg.json");
  EXPECT_EQ(a.eos_token_id, 7);
  EXPECT_EQ(a.q_lora_rank, 0);
  EXPECT_FALSE(a.yarn);
  EXPECT_EQ(a.dtype, "bf16");
}

TEST(Config, RefusesTextThatIsNotAJsonObject) {
  expect_refused("", {"not valid JSON"});
  expect_refused("{\"hidden_size\": 256", {"not valid JSON"});
  expect_refused("[1, 2, 3]", {"not a JSON object"});
  expect_refused("\"config\"", {"not a JSON object"});
  expect_refused("{\"architectures\": []}", {"neither a Hugging Face config", "nor a reference"});
}

TEST(Config, RefusesMissingAndMistypedFields) {
  for (const char* k : {"vocab_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}) {
    SCOPED_TRACE(k);
    expect_refused(v3_with([&](json& j) { j.erase(k); }), {"missing required field", k});
  }
  expect_refused(v3_with([](json& j) { j["hidden_size"] = "256"; }), {"'hidden_size'", "must be a number", "\"256\""});
  expect_refused(v3_with([](json& j) { j["hidden_size"] = {256}; }), {"'hidden_size'", "must be a number"});
  expect_refused(v3_with([](json& j) { j["num_hidden_layers"] = 2.5; }), {"'num_hidden_layers'", "must be an integer"});
  expect_refused(v3_with([](json& j) { j["rope_theta"] = true; }), {"'rope_theta'", "must be a number"});
  expect_refused(v3_with([](json& j) { j["scoring_func"] = 1; }), {"'scoring_func'", "must be a string"});
  expect_refused(v3_with([](json& j) { j["norm_topk_prob"] = "true"; }), {"'norm_topk_prob'", "true or false"});
  expect_refused(v3_with([](json& j) { j["vocab_size"] = 1ll << 31; }), {"'vocab_size'", "out of range"});
  expect_refused(v3_with([](json& j) { j["vocab_size"] = -(1ll << 40); }), {"'vocab_size'", "out of range"});
  // Above INT64_MAX the number is unsigned in JSON; it must not wrap to a small or negative int.
  expect_refused(v3_with([](json& j) { j["vocab_size"] = 18446744073709551615ull; }),
                 {"'vocab_size'", "out of range"});
  expect_refused(v3_with([](json& j) { j["n_routed_experts"] = 18446744073709551600ull; }),
                 {"'n_routed_experts'", "out of range"});
  expect_refused(v3_with([](json& j) { j["eos_token_id"] = "</s>"; }), {"'eos_token_id'", "integer"});
  expect_refused(v3_with([](json& j) { j["bos_token_id"] = 4294967296ll; }), {"'bos_token_id'", "out of range"});
  expect_refused(v3_with([](json& j) { j["rope_scaling"] = "yarn"; }), {"rope_scaling must be an object"});
  expect_refused(v3_with([](json& j) { j["rope_scaling"].erase("factor"); }), {"missing required field 'factor'"});
  expect_refused(v3_with([](json& j) { j["quantization_config"] = 8; }), {"quantization_config must be an object"});
  // The reference spelling has defaults for everything, but types are still checked.
  json r = ref_json("v3_fp8");
  r["n_layers"] = "3";
  expect_refused(r.dump(), {"'n_layers'", "must be a number"});
}

TEST(Config, RefusesImpossibleCombinations) {
  expect_refused(v3_with([](json& j) { j["num_experts_per_tok"] = 17; }),
                 {"num_experts_per_tok (17) exceeds n_routed_experts (16)"});
  expect_refused(v3_with([](json& j) { j["n_group"] = 3; }), {"n_group (3) does not divide n_routed_experts (16)"});
  expect_refused(v3_with([](json& j) { j["n_group"] = 0; }), {"n_group must be positive"});
  expect_refused(v3_with([](json& j) { j["topk_group"] = 5; }), {"topk_group (5) must be in [1, n_group=4]"});
  expect_refused(v3_with([](json& j) { j["topk_group"] = 0; }), {"topk_group (0)"});
  // 2 groups of 4 experts hold 8 candidates; 9 cannot be picked from them.
  expect_refused(v3_with([](json& j) { j["num_experts_per_tok"] = 9; }), {"topk_group groups"});
  expect_refused(v3_with([](json& j) { j["qk_rope_head_dim"] = 15; }), {"qk_rope_head_dim must be positive and even"});
  expect_refused(v3_with([](json& j) { j["qk_rope_head_dim"] = 0; }), {"qk_rope_head_dim"});
  expect_refused(v3_with([](json& j) { j["hidden_size"] = 0; }), {"hidden_size (dim) must be positive"});
  expect_refused(v3_with([](json& j) { j["hidden_size"] = nullptr; }), {"hidden_size"});
  expect_refused(v3_with([](json& j) { j["num_hidden_layers"] = -1; }), {"num_hidden_layers must be positive"});
  expect_refused(v3_with([](json& j) { j["moe_layer_freq"] = 0; }), {"moe_layer_freq must be positive"});
  expect_refused(v3_with([](json& j) { j["moe_intermediate_size"] = 0; }), {"moe_intermediate_size"});
  expect_refused(v3_with([](json& j) { j["scoring_func"] = "relu"; }), {"scoring_func must be softmax or sigmoid"});
  expect_refused(v3_with([](json& j) { j["rms_norm_eps"] = 0; }), {"rms_norm_eps"});
  expect_refused(v3_with([](json& j) { j["rope_scaling"]["type"] = "linear"; }),
                 {"rope_scaling type 'linear' is not supported"});
  expect_refused(v3_with([](json& j) {
                   j["rope_scaling"].erase("type");
                   j["rope_scaling"]["rope_type"] = "dynamic";
                 }),
                 {"rope_scaling type 'dynamic'"});
  expect_refused(v3_with([](json& j) { j["rope_scaling"]["factor"] = 0.5; }), {"rope_scaling.factor must be >= 1"});
  expect_refused(v3_with([](json& j) { j["quantization_config"]["quant_method"] = "gptq"; }),
                 {"quantization_config gptq/e4m3 is not supported"});
  expect_refused(v3_with([](json& j) { j["quantization_config"]["fmt"] = "e5m2"; }),
                 {"quantization_config fp8/e5m2 is not supported"});
  expect_refused(v3_with([](json& j) { j["quantization_config"]["weight_block_size"] = {64, 64}; }),
                 {"only 128x128 weight blocks"});
  expect_refused(v3_with([](json& j) { j["quantization_config"]["weight_block_size"] = {128, 64}; }),
                 {"weight_block_size must be [n, n]"});
  expect_refused(v3_with([](json& j) {
                   j["quantization_config"]["weight_block_size"] = {4294967424ll, 4294967424ll};
                 }),
                 {"weight_block_size"});
  expect_refused(v3_with([](json& j) { j["quantization_config"]["scale_fmt"] = "e8m0"; }),
                 {"scale_fmt must be absent or ue8m0"});
  json r = ref_json("v3_fp8");
  r["dtype"] = "fp4";
  expect_refused(r.dump(), {"dtype must be bf16 or fp8"});
}

TEST(Config, LoadNamesAMissingFile) {
  std::string path = std::string(DSV3_TEST_DATA) + "/no/such/config.json";
  std::string msg = error_of([&] { load_model_args(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
}

TEST(Config, HugeLayerCountsValidateQuickly) {
  // validate() must not walk two billion layers to find out which kinds exist.
  ModelArgs a = parse_model_args(v3_with([](json& j) { j["num_hidden_layers"] = 2147483647; }), "cfg.json");
  EXPECT_EQ(a.n_layers, 2147483647);
  expect_refused(v3_with([](json& j) {
                   j["num_hidden_layers"] = 2147483647;
                   j["first_k_dense_replace"] = 2147483647;
                   j["intermediate_size"] = 0;
                 }),
                 {"intermediate_size must be positive"});
}

TEST(Config, ValidateFindsDenseAndMoeLayersLikeIsMoeLayer) {
  // Against a walk over the layers: intermediate_size is needed iff some layer is dense,
  // moe_intermediate_size iff some layer is MoE.
  for (int n_layers = 1; n_layers <= 7; ++n_layers)
    for (int n_dense = 0; n_dense <= 8; ++n_dense)
      for (int freq = 1; freq <= 4; ++freq)
        for (int experts : {0, 4}) {
          ModelArgs a;
          a.n_layers = n_layers;
          a.n_dense_layers = n_dense;
          a.moe_layer_freq = freq;
          a.n_routed_experts = experts;
          a.n_activated_experts = experts ? 2 : 0;
          bool dense = false, moe = false;
          for (int i = 0; i < n_layers; ++i) (a.is_moe_layer(i) ? moe : dense) = true;
          SCOPED_TRACE(str(n_layers, " layers, ", n_dense, " dense, freq ", freq, ", ", experts, " experts"));
          ModelArgs no_dense = a, no_moe = a;
          no_dense.inter_dim = 0;
          no_moe.moe_inter_dim = 0;
          EXPECT_NO_THROW(a.validate("x"));
          if (dense) EXPECT_THROW(no_dense.validate("x"), Error);
          else EXPECT_NO_THROW(no_dense.validate("x"));
          if (moe) EXPECT_THROW(no_moe.validate("x"), Error);
          else EXPECT_NO_THROW(no_moe.validate("x"));
        }
}

TEST(Config, DeeplyNestedValuesAreRefusedWithoutRecursion) {
  // Error messages must not dump() a value nested a million levels deep (one stack frame each).
  const size_t depth = 1000000;
  std::string deep = std::string(depth, '[') + std::string(depth, ']');
  std::string base = hf_json("v3_fp8").dump();
  base.pop_back();  // drop the closing brace, then add fields holding the nest
  expect_refused(base + ",\"vocab_size\":" + deep + "}", {"'vocab_size'", "must be a number", "array"});
  expect_refused(base + ",\"eos_token_id\":" + deep + "}", {"'eos_token_id'", "integer"});
  expect_refused(base + ",\"scoring_func\":" + deep + "}", {"'scoring_func'", "must be a string"});
  EXPECT_NO_THROW(parse_model_args(base + ",\"unknown\":" + deep + "}", "cfg.json"));
}
