#include "model/weights.h"

#include "core/error.h"
#include "io/checkpoint.h"

namespace dsv3 {

std::vector<WeightSpec> weight_manifest(const ModelArgs& a, ModelWeights* w) {
  std::vector<WeightSpec> specs;
  if (w) w->layers.assign(size_t(a.n_layers), LayerWeights{});
  auto lin = [&](std::string name, int64_t out, int64_t in, int split, Linear* slot, int expert = -1) {
    specs.push_back({std::move(name), {out, in}, WeightKind::kLinear, split, expert, false, slot, nullptr});
  };
  auto vec = [&](std::string name, std::vector<int64_t> shape, WeightKind kind, int split,
                 TensorView* slot, bool optional = false) {
    specs.push_back({std::move(name), std::move(shape), kind, split, -1, optional, nullptr, slot});
  };
  auto mlp = [&](const std::string& p, int64_t inter, MLPWeights* m, int expert) {
    // Routed experts are partitioned whole across ranks (split -1, expert >= 0).
    int s0 = expert >= 0 ? -1 : 0, s1 = expert >= 0 ? -1 : 1;
    lin(p + ".w1", inter, a.dim, s0, m ? &m->w1 : nullptr, expert);
    lin(p + ".w2", a.dim, inter, s1, m ? &m->w2 : nullptr, expert);
    lin(p + ".w3", inter, a.dim, s0, m ? &m->w3 : nullptr, expert);
  };
  const int64_t H = a.n_heads, qk = a.qk_head_dim();
  vec("embed", {a.vocab_size, a.dim}, WeightKind::kEmbed, 0, w ? &w->embed : nullptr);
  for (int i = 0; i < a.n_layers; ++i) {
    LayerWeights* L = w ? &w->layers[size_t(i)] : nullptr;
    std::string p = "layers." + std::to_string(i);
    vec(p + ".attn_norm", {a.dim}, WeightKind::kNorm, -1, L ? &L->attn_norm : nullptr);
    if (a.q_lora_rank == 0) {
      lin(p + ".attn.wq", H * qk, a.dim, 0, L ? &L->attn.wq : nullptr);
    } else {
      lin(p + ".attn.wq_a", a.q_lora_rank, a.dim, -1, L ? &L->attn.wq_a : nullptr);
      vec(p + ".attn.q_norm", {a.q_lora_rank}, WeightKind::kNorm, -1, L ? &L->attn.q_norm : nullptr);
      lin(p + ".attn.wq_b", H * qk, a.q_lora_rank, 0, L ? &L->attn.wq_b : nullptr);
    }
    lin(p + ".attn.wkv_a", a.kv_lora_rank + a.qk_rope_head_dim, a.dim, -1, L ? &L->attn.wkv_a : nullptr);
    vec(p + ".attn.kv_norm", {a.kv_lora_rank}, WeightKind::kNorm, -1, L ? &L->attn.kv_norm : nullptr);
    lin(p + ".attn.wkv_b", H * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank, 0,
        L ? &L->attn.wkv_b : nullptr);
    lin(p + ".attn.wo", a.dim, H * a.v_head_dim, 1, L ? &L->attn.wo : nullptr);
    vec(p + ".ffn_norm", {a.dim}, WeightKind::kNorm, -1, L ? &L->ffn_norm : nullptr);
    if (!a.is_moe_layer(i)) {
      mlp(p + ".ffn", a.inter_dim, L ? &L->ffn : nullptr, -1);
      continue;
    }
    if (L) {
      L->moe = true;
      L->moe_w.experts.resize(size_t(a.n_routed_experts));
      L->moe_w.has_shared = a.n_shared_experts > 0;
    }
    vec(p + ".ffn.gate", {a.n_routed_experts, a.dim}, WeightKind::kGate, -1, L ? &L->moe_w.gate : nullptr);
    vec(p + ".ffn.gate", {a.n_routed_experts}, WeightKind::kBias, -1, L ? &L->moe_w.bias : nullptr, true);
    for (int e = 0; e < a.n_routed_experts; ++e)
      mlp(p + ".ffn.experts." + std::to_string(e), a.moe_inter_dim, L ? &L->moe_w.experts[size_t(e)] : nullptr, e);
    if (a.n_shared_experts > 0)
      mlp(p + ".ffn.shared_experts", int64_t(a.n_shared_experts) * a.moe_inter_dim,
          L ? &L->moe_w.shared_experts : nullptr, -1);
  }
  vec("norm", {a.dim}, WeightKind::kNorm, -1, w ? &w->norm : nullptr);
  lin("head", a.vocab_size, a.dim, 0, w ? &w->head : nullptr);
  return specs;
}

static bool is_float(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16;
}

ModelWeights load_weights(const Checkpoint& ck) {
  const ModelArgs a = load_model_args(ck);
  ModelWeights w;
  for (const WeightSpec& s : weight_manifest(a, &w)) {
    std::string tname = s.tensor_name();
    if (!ck.has(tname)) {
      if (s.optional) continue;
      fail(ck.dir(), ": missing tensor '", tname, "' (expected shape ", shape_str(s.shape), ")");
    }
    TensorView t = ck.get(tname);
    auto where = [&] { return str(ck.file_of(tname), ": tensor '", tname, "'"); };
    if (t.shape != s.shape)
      fail(where(), " has shape ", shape_str(t.shape), ", expected ", shape_str(s.shape));
    if (s.kind == WeightKind::kLinear) {
      Linear l;
      l.weight = t;
      std::string sname = s.name + ".scale";
      if (t.dtype == DType::F8_E4M3) {
        if (!ck.has(sname)) fail(where(), " is F8_E4M3 but its scale '", sname, "' is missing");
        l.scale = ck.get(sname);
        std::vector<int64_t> want = {(s.shape[0] + 127) / 128, (s.shape[1] + 127) / 128};
        if (l.scale.dtype != DType::F32)
          fail(ck.file_of(sname), ": tensor '", sname, "' must be F32, is ", dtype_name(l.scale.dtype));
        if (l.scale.shape != want)
          fail(ck.file_of(sname), ": tensor '", sname, "' has shape ", shape_str(l.scale.shape),
               ", expected ", shape_str(want), " (128x128 blocks of ", shape_str(s.shape), ")");
      } else if (!is_float(t.dtype)) {
        fail(where(), " has dtype ", dtype_name(t.dtype), ", expected F8_E4M3, BF16, F16 or F32");
      }
      *s.linear = l;
    } else {
      if (!is_float(t.dtype))
        fail(where(), " has dtype ", dtype_name(t.dtype), ", expected BF16, F16 or F32");
      *s.tensor = t;
    }
  }
  return w;
}

WeightStats weight_stats(const ModelArgs& a, const ModelWeights& w) {
  WeightStats st;
  // Walk the bound views (weights plus scales).
  auto add = [&](const TensorView& t, bool read_per_token) {
    if (t.empty()) return;
    st.params += t.numel();
    st.bytes_by_dtype[dtype_name(t.dtype)] += int64_t(t.nbytes());
    if (read_per_token) st.decode_bytes_per_token += int64_t(t.nbytes());
  };
  auto add_lin = [&](const Linear& l, bool read) {
    add(l.weight, read);
    if (!l.scale.empty()) {  // scales are not parameters, but they are read
      st.bytes_by_dtype["F32 (scales)"] += int64_t(l.scale.nbytes());
      if (read) st.decode_bytes_per_token += int64_t(l.scale.nbytes());
    }
  };
  auto add_mlp = [&](const MLPWeights& m, bool read) {
    add_lin(m.w1, read);
    add_lin(m.w2, read);
    add_lin(m.w3, read);
  };
  add(w.embed, false);
  if (!w.embed.empty()) st.decode_bytes_per_token += a.dim * int64_t(dtype_size(w.embed.dtype));
  for (const LayerWeights& L : w.layers) {
    add(L.attn_norm, true);
    add(L.ffn_norm, true);
    const AttnWeights& at = L.attn;
    for (const Linear* l : {&at.wq, &at.wq_a, &at.wq_b, &at.wkv_a, &at.wkv_b, &at.wo}) add_lin(*l, true);
    add(at.q_norm, true);
    add(at.kv_norm, true);
    if (!L.moe) {
      add_mlp(L.ffn, true);
      continue;
    }
    add(L.moe_w.gate, true);
    add(L.moe_w.bias, true);
    if (L.moe_w.has_shared) add_mlp(L.moe_w.shared_experts, true);
    int64_t one_expert = 0;
    for (const MLPWeights& e : L.moe_w.experts) {
      int64_t before = st.decode_bytes_per_token;
      add_mlp(e, true);
      one_expert = st.decode_bytes_per_token - before;
      st.decode_bytes_per_token = before;
    }
    st.decode_bytes_per_token += one_expert * a.n_activated_experts;
  }
  add(w.norm, true);
  add_lin(w.head, true);
  return st;
}

}  // namespace dsv3
