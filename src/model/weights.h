// The weights of a model as views (into the checkpoint's mmap, or device copies), and the one
// manifest that lists every tensor with its shape and tensor-parallel rule. The loader, the
// validator, `dsv3 inspect`, the synthesiser and the tests all walk weight_manifest().
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace dsv3 {

class Checkpoint;

// A linear layer's weight [out, in] and, for FP8 e4m3 weights, its block scales
// [ceil(out/128), ceil(in/128)] (w = q * scale per 128x128 block). One type, so nothing can
// forget the scale.
struct Linear {
  TensorView weight;  // [out, in]: F32, BF16, F16 or F8_E4M3
  TensorView scale;   // [ceil(out/128), ceil(in/128)] F32; empty unless weight is F8_E4M3
  int64_t out() const { return weight.dim(0); }
  int64_t in() const { return weight.dim(1); }
  bool fp8() const { return weight.dtype == DType::F8_E4M3; }
};

struct MLPWeights {  // w2(silu(w1 x) * w3 x)
  Linear w1, w2, w3;  // w1, w3: [inter, dim]; w2: [dim, inter]
};

struct AttnWeights {
  Linear wq;              // [n_heads * qk_head_dim, dim] when q_lora_rank == 0
  Linear wq_a;            // [q_lora_rank, dim]
  TensorView q_norm;      // [q_lora_rank]
  Linear wq_b;            // [n_heads * qk_head_dim, q_lora_rank]
  Linear wkv_a;           // [kv_lora_rank + qk_rope_head_dim, dim]
  TensorView kv_norm;     // [kv_lora_rank]
  Linear wkv_b;           // [n_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
  Linear wo;              // [dim, n_heads * v_head_dim]
};

struct MoEWeights {
  TensorView gate;                  // [n_routed_experts, dim]
  TensorView bias;                  // [n_routed_experts] F32 correction bias; may be empty
  std::vector<MLPWeights> experts;  // n_routed_experts of [moe_inter_dim] each
  MLPWeights shared_experts;        // [n_shared_experts * moe_inter_dim]; empty when none
  bool has_shared = false;
};

struct LayerWeights {
  TensorView attn_norm, ffn_norm;  // [dim]
  AttnWeights attn;
  bool moe = false;
  MLPWeights ffn;   // dense layers
  MoEWeights moe_w; // MoE layers
};

struct ModelWeights {
  TensorView embed;  // [vocab_size, dim] (a rank's vocabulary slice: [vocab_size / ranks, dim])
  std::vector<LayerWeights> layers;
  TensorView norm;   // [dim]
  Linear head;       // [vocab_size, dim] (a rank's slice as embed's)
  int64_t vocab0 = 0;  // the first token id of embed's and head's rows
  // Slices copied out of the checkpoint (a row-parallel weight's columns are not contiguous in
  // the file); the views above point into them.
  std::vector<std::shared_ptr<std::vector<uint8_t>>> owned;
};

// What a tensor of ModelWeights is, for code that walks them all to place them in memory.
enum class TensorRole { kLinear, kScale, kNorm, kEmbed, kGate };

// Calls f(TensorView&, TensorRole) for every tensor of w, empty views included (another rank's
// routed experts, absent optional tensors): embed, norm, head, then each layer's.
template <class F>
void for_each_tensor(ModelWeights& w, F&& f) {
  auto lin = [&](Linear& l) {
    f(l.weight, TensorRole::kLinear);
    f(l.scale, TensorRole::kScale);
  };
  auto mlp = [&](MLPWeights& m) {
    lin(m.w1);
    lin(m.w2);
    lin(m.w3);
  };
  f(w.embed, TensorRole::kEmbed);
  f(w.norm, TensorRole::kNorm);
  lin(w.head);
  for (LayerWeights& L : w.layers) {
    f(L.attn_norm, TensorRole::kNorm);
    f(L.ffn_norm, TensorRole::kNorm);
    AttnWeights& a = L.attn;
    for (Linear* l : {&a.wq, &a.wq_a, &a.wq_b, &a.wkv_a, &a.wkv_b, &a.wo}) lin(*l);
    f(a.q_norm, TensorRole::kNorm);
    f(a.kv_norm, TensorRole::kNorm);
    mlp(L.ffn);
    f(L.moe_w.gate, TensorRole::kGate);
    f(L.moe_w.bias, TensorRole::kNorm);
    for (MLPWeights& e : L.moe_w.experts) mlp(e);
    mlp(L.moe_w.shared_experts);
  }
}

// The part of the model one process holds: rank `rank` of `size`, split as the reference splits
// it (ParallelEmbedding, Column/RowParallelLinear, routed experts partitioned contiguously).
struct Shard {
  int rank = 0, size = 1;
};

// What kind of tensor an entry is: decides which dtypes are accepted.
enum class WeightKind {
  kLinear,  // a projection: float, or F8_E4M3 with a "<name>.scale" companion
  kNorm,    // RMSNorm weight: float
  kEmbed,   // embedding / head: float (the reference never quantises them)
  kGate,    // MoE gate weight: float
  kBias,    // MoE correction bias: float; optional
};

struct WeightSpec {
  std::string name;            // reference name without ".weight"/".scale": "layers.0.attn.wq_a"
  std::vector<int64_t> shape;  // full (unsharded) shape, outer to inner
  WeightKind kind;
  int split_axis;              // tensor parallel: 0 column-split, 1 row-split, -1 replicated
  int expert = -1;             // routed expert index (partitioned across ranks), else -1
  bool optional = false;
  Linear* linear = nullptr;    // where a bound kLinear goes
  TensorView* tensor = nullptr;  // where other kinds go
  std::string tensor_name() const {  // name of the stored tensor
    return kind == WeightKind::kBias ? name + ".bias" : name + ".weight";
  }
};

// Every tensor of the model described by `args`. When `w` is given, it is resized and each spec
// points at its slot in it.
std::vector<WeightSpec> weight_manifest(const ModelArgs& args, ModelWeights* w = nullptr);

// The part of manifest entry `s` that `shard` holds: false for another rank's routed expert; else
// true, and `shape` is its slice (split_axis divided by the ranks).
bool shard_shape(const WeightSpec& s, const ModelArgs& a, const Shard& shard, std::vector<int64_t>* shape);
// The first token id of a shard's embedding and head rows.
int64_t shard_vocab0(const ModelArgs& a, const Shard& shard);

// Binds every manifest entry to the checkpoint's tensors, validating dtype, shape and scale
// shape. Throws Error naming the tensor, the file and what was expected. With several ranks, only
// the shard's slices are bound: rows (split_axis 0) and whole tensors as zero-copy views into the
// mmap, columns (split_axis 1) copied out; routed experts outside the shard's range stay empty. A
// checkpoint in the reference's layout for `shard.size` ranks holds the slices already.
ModelWeights load_weights(const Checkpoint& ck, const Shard& shard = {});

// Whether `a` splits into `ranks` as the reference splits it: heads, routed experts, vocabulary
// and the MLP widths divisible. Throws Error naming the number that does not divide.
void check_shardable(const ModelArgs& a, int ranks);

// Bytes one decode token reads at batch 1: attention + dense/shared weights + n_activated
// routed experts per MoE layer + norms + the head + one embedding row, at stored width.
struct WeightStats {
  int64_t params = 0;
  std::map<std::string, int64_t> bytes_by_dtype;
  int64_t decode_bytes_per_token = 0;
};
WeightStats weight_stats(const ModelArgs& args, const ModelWeights& w);

}  // namespace dsv3
