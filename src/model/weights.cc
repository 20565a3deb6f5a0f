#include "model/weights.h"

#include <algorithm>

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

void check_shardable(const ModelArgs& a, int ranks) {
  if (ranks < 1) fail("the number of ranks must be at least 1, got ", ranks);
  if (ranks == 1) return;
  auto need = [&](int64_t v, const char* what) {
    if (v % ranks != 0) fail(what, " ", v, " does not divide among ", ranks, " ranks");
  };
  need(a.n_heads, "num_attention_heads");
  need(a.vocab_size, "vocab_size");
  if (a.n_dense_layers > 0) need(a.inter_dim, "intermediate_size");
  if (a.n_routed_experts > 0) need(a.n_routed_experts, "n_routed_experts");
  if (a.n_shared_experts > 0) need(int64_t(a.n_shared_experts) * a.moe_inter_dim, "n_shared_experts x moe_intermediate_size");
}

bool shard_shape(const WeightSpec& s, const ModelArgs& a, const Shard& shard, std::vector<int64_t>* shape) {
  const int P = std::max(shard.size, 1);
  const int64_t E_local = a.n_routed_experts / P, e0 = shard.rank * E_local;
  if (s.expert >= 0 && P > 1 && (s.expert < e0 || s.expert >= e0 + E_local)) return false;
  *shape = s.shape;
  if (P > 1 && s.split_axis >= 0) (*shape)[size_t(s.split_axis)] /= P;
  return true;
}

int64_t shard_vocab0(const ModelArgs& a, const Shard& shard) {
  return shard.size > 1 ? int64_t(shard.rank) * (a.vocab_size / shard.size) : 0;
}

namespace {

// Whether rows or columns [i0, i0 + n) of a block-scaled weight keep its 128-wide blocks: every
// one of them maps to the slice's own block i / 128 (the slice starts on a block, or lies inside
// one). Then the scales' [first, count) blocks go with it.
bool on_blocks(int64_t i0, int64_t n) { return i0 % 128 == 0 || i0 / 128 == (i0 + n - 1) / 128; }
std::pair<int64_t, int64_t> scale_range(int64_t i0, int64_t n) {
  return i0 % 128 == 0 ? std::pair<int64_t, int64_t>{i0 / 128, (n + 127) / 128} : std::pair<int64_t, int64_t>{i0 / 128, 1};
}

// Rows (axis 0) or columns (axis 1) [i0, i0 + n) of an e4m3 weight with its block scales,
// dequantised to float32 (each element's w * scale rounded once, as the reference's
// weight_dequant does in float32): for a slice that cuts through scale blocks.
TensorView dequant_slice(const TensorView& t, const TensorView& sc, int axis, int64_t i0, int64_t n, ModelWeights& w) {
  const int64_t rows = t.dim(0), cols = t.dim(1), out_r = axis == 0 ? n : rows, out_c = axis == 1 ? n : cols;
  auto buf = std::make_shared<std::vector<uint8_t>>(size_t(out_r * out_c) * sizeof(float));
  float* dst = reinterpret_cast<float*>(buf->data());
  const float* s = sc.as<float>();
  const int64_t sc_cols = sc.dim(1);
  for (int64_t r = 0; r < out_r; ++r)
    for (int64_t c = 0; c < out_c; ++c) {
      const int64_t gr = axis == 0 ? i0 + r : r, gc = axis == 1 ? i0 + c : c;
      dst[r * out_c + c] = load_f32(t, gr * cols + gc) * s[(gr / 128) * sc_cols + gc / 128];
    }
  w.owned.push_back(buf);
  return TensorView{DType::F32, {out_r, out_c}, buf->data()};
}

// Rows [r0, r0 + n) of a row-major tensor: a view.
TensorView rows_of(const TensorView& t, int64_t r0, int64_t n) {
  TensorView v = t;
  const int64_t row = t.numel() / t.dim(0);
  v.data = static_cast<const uint8_t*>(t.data) + size_t(r0 * row) * dtype_size(t.dtype);
  v.shape[0] = n;
  return v;
}

// Columns [c0, c0 + n) of a 2-D tensor, copied into `owned`.
TensorView cols_of(const TensorView& t, int64_t c0, int64_t n, ModelWeights& w) {
  const size_t es = dtype_size(t.dtype);
  const int64_t rows = t.dim(0), cols = t.dim(1);
  auto buf = std::make_shared<std::vector<uint8_t>>(size_t(rows * n) * es);
  const uint8_t* src = static_cast<const uint8_t*>(t.data);
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(src + size_t(r * cols + c0) * es, size_t(n) * es, buf->data() + size_t(r * n) * es);
  w.owned.push_back(buf);
  TensorView v = t;
  v.data = buf->data();
  v.shape[1] = n;
  return v;
}

}  // namespace

ModelWeights load_weights(const Checkpoint& ck, const Shard& shard) {
  const ModelArgs a = load_model_args(ck);
  const int P = shard.size;
  check_shardable(a, P);
  // The reference's converted files for P ranks hold each rank's slices already.
  const bool presliced = P > 1 && ck.layout() == "reference";
  ModelWeights w;
  for (const WeightSpec& s : weight_manifest(a, &w)) {
    std::vector<int64_t> want;
    if (!shard_shape(s, a, shard, &want)) continue;  // another rank's expert
    const int split = P > 1 ? s.split_axis : -1;
    std::string tname = s.tensor_name();
    if (!ck.has(tname)) {
      if (s.optional) continue;
      fail(ck.dir(), ": missing tensor '", tname, "' (expected shape ", shape_str(presliced ? want : s.shape), ")");
    }
    TensorView t = ck.get(tname);
    auto where = [&] { return str(ck.file_of(tname), ": tensor '", tname, "'"); };
    const std::vector<int64_t>& stored = presliced ? want : s.shape;
    if (t.shape != stored) fail(where(), " has shape ", shape_str(t.shape), ", expected ", shape_str(stored));
    // This rank's slice of dimension `split`: [i0, i0 + n).
    const int64_t n = split >= 0 ? want[size_t(split)] : 0, i0 = int64_t(shard.rank) * n;
    auto slice = [&](const TensorView& v, int64_t at, int64_t len) {
      return presliced || split < 0 ? v : split == 0 ? rows_of(v, at, len) : cols_of(v, at, len, w);
    };
    if (s.kind == WeightKind::kLinear) {
      Linear l;
      std::string sname = s.name + ".scale";
      const bool cut = t.dtype == DType::F8_E4M3 && !presliced && split >= 0 && !on_blocks(i0, n);
      if (!cut) l.weight = slice(t, i0, n);
      if (t.dtype == DType::F8_E4M3) {
        if (!ck.has(sname)) fail(where(), " is F8_E4M3 but its scale '", sname, "' is missing");
        TensorView sc = ck.get(sname);
        std::vector<int64_t> sw = {(stored[0] + 127) / 128, (stored[1] + 127) / 128};
        if (sc.dtype != DType::F32)
          fail(ck.file_of(sname), ": tensor '", sname, "' must be F32, is ", dtype_name(sc.dtype));
        if (sc.shape != sw)
          fail(ck.file_of(sname), ": tensor '", sname, "' has shape ", shape_str(sc.shape), ", expected ",
               shape_str(sw), " (128x128 blocks of ", shape_str(stored), ")");
        if (cut) {
          l.weight = dequant_slice(t, sc, split, i0, n, w);  // (float32: no scale)
        } else {
          if (!presliced && split >= 0) {
            const auto [b0, nb] = scale_range(i0, n);
            sc = slice(sc, b0, nb);
          }
          l.scale = sc;
        }
      } else if (!is_float(t.dtype)) {
        fail(where(), " has dtype ", dtype_name(t.dtype), ", expected F8_E4M3, BF16, F16 or F32");
      }
      *s.linear = l;
    } else {
      if (!is_float(t.dtype))
        fail(where(), " has dtype ", dtype_name(t.dtype), ", expected BF16, F16 or F32");
      *s.tensor = slice(t, i0, n);
    }
  }
  w.vocab0 = shard_vocab0(a, shard);
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
      one_expert = std::max(one_expert, st.decode_bytes_per_token - before);  // (another rank's: empty)
      st.decode_bytes_per_token = before;
    }
    st.decode_bytes_per_token += one_expert * a.n_activated_experts;
  }
  add(w.norm, true);
  add_lin(w.head, true);
  return st;
}

}  // namespace dsv3
