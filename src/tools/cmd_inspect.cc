// dsv3 inspect: what a checkpoint is (config summary, parameters, bytes by dtype, bytes a decode
// token reads) and whether every tensor matches the weights manifest.
#include <cstdio>
#include <set>

#include "core/error.h"
#include "io/checkpoint.h"
#include "model/weights.h"
#include "tools/command.h"

namespace dsv3 {
namespace {

std::string human(double bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 1000 && u < 4) bytes /= 1000, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", bytes, units[u]);
  return buf;
}

int run_inspect(int argc, char** argv) {
  Args args(argc, argv, {"model", "config"});
  auto ck = Checkpoint::open(args.require("model"), args.get("config"));
  const ModelArgs a = load_model_args(*ck);
  int moe_layers = 0;
  for (int i = 0; i < a.n_layers; ++i) moe_layers += a.is_moe_layer(i);
  std::printf("checkpoint  %s (%s layout)\n", ck->dir().c_str(), ck->layout().c_str());
  std::printf("shape       dim %d, %d layers (%d dense, %d MoE), %d heads, vocab %d, max positions %d\n", a.dim,
              a.n_layers, a.n_layers - moe_layers, moe_layers, a.n_heads, a.vocab_size, a.max_seq_len);
  std::printf("attention   MLA: q_lora_rank %d, kv_lora_rank %d, qk_nope %d, qk_rope %d, v %d, softmax scale %.6g\n",
              a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim,
              a.softmax_scale());
  if (a.yarn)
    std::printf("rope        theta %g, YaRN factor %g from %d positions, beta %g/%g, mscale %g/%g\n", a.rope_theta,
                a.rope_factor, a.original_seq_len, a.beta_fast, a.beta_slow, a.mscale, a.mscale_all_dim);
  else
    std::printf("rope        theta %g, no scaling\n", a.rope_theta);
  if (moe_layers)
    std::printf("moe         %d routed (%d active, %d groups, top %d groups) + %d shared, inter %d, %s scores, "
                "route_scale %g, %snormalised\n",
                a.n_routed_experts, a.n_activated_experts, a.n_expert_groups, a.n_limited_groups, a.n_shared_experts,
                a.moe_inter_dim, a.score_func.c_str(), a.route_scale, a.norm_topk_prob ? "" : "not ");
  std::printf("weights     %s%s%s\n", a.dtype.c_str(), a.dtype == "fp8" ? " e4m3, 128x128 block scales" : "",
              a.scale_fmt.empty() ? "" : (" (" + a.scale_fmt + ")").c_str());
  ModelWeights w = load_weights(*ck);  // validates every manifest tensor (throws on the first problem)
  WeightStats st = weight_stats(a, w);
  std::printf("parameters  %.3f B (%lld)\n", double(st.params) / 1e9, (long long)st.params);
  for (auto& [dt, b] : st.bytes_by_dtype) std::printf("  %-12s %s\n", dt.c_str(), human(double(b)).c_str());
  std::printf("decode      %s read per token at batch 1\n", human(double(st.decode_bytes_per_token)).c_str());
  std::set<std::string> used;
  for (auto& s : weight_manifest(a)) {
    used.insert(s.tensor_name());
    used.insert(s.name + ".scale");
  }
  int unused = 0;
  for (auto& n : ck->names())
    if (!used.count(n)) {
      if (unused < 5) std::printf("  not used by the model: %s\n", n.c_str());
      ++unused;
    }
  if (unused > 5) std::printf("  ... and %d more not used by the model\n", unused - 5);
  size_t present = 0;
  for (auto& s : weight_manifest(a)) present += ck->has(s.tensor_name());
  std::printf("validation  ok: %zu manifest tensors present with the expected dtype and shape\n", present);
  return 0;
}

}  // namespace

DSV3_COMMAND(inspect, "--model DIR [--config F]: config summary, parameters, bytes, validation", run_inspect);

}  // namespace dsv3
