// One forward step as data: the ops the model's layer loop records (runtime/model.cc), the
// values they read and write, the step's metadata (tokens, positions, the paged KV cache's block
// tables), and the plan a backend executes: the ops grouped into nodes by the named rewrites of
// runtime/rewrites.cc (a node of one op, or a fusion the backend accepted). A backend runs the
// nodes in order and keeps nothing between them; everything an op needs is in the graph.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace dsv3 {

class Comm;

enum class AttnImpl { kAbsorb, kNaive };

// Where each token of a step sits: its sequence (a row of the step's block table) and position.
struct TokenPos {
  int32_t slot;  // row of Step::kv's block table
  int32_t pos;   // position in that sequence; attends to [0, pos] of it
};

// One layer's paged cache: `n_blocks * block` rows, row r of a sequence's position p being
// KvView::row(slot, p). Float32, or (absorbed, Backend::bf16_latent_cache) bf16: kv and pe then
// hold two bf16 values per float slot, row r at element r * kv_lora_rank (r * qk_rope_head_dim).
struct LayerCache {
  float* kv = nullptr;  // absorbed: [rows, kv_lora_rank] (kv_norm(latent))
  float* pe = nullptr;  // absorbed: [rows, qk_rope_head_dim] (roped key)
  float* k = nullptr;   // naive: [rows, n_heads, qk_head_dim]
  float* v = nullptr;   // naive: [rows, n_heads, v_head_dim]
  bool bf16 = false;    // kv and pe hold bf16 rows
};

// The block tables of a step's sequences (host memory): row s, logical block b -> physical block.
struct KvView {
  const int32_t* table = nullptr;  // [rows, width]
  int64_t rows = 0, width = 0;
  int block = 64;                  // positions per block (a power of two)
  int64_t max_len() const { return width * block; }
  int64_t row(int32_t slot, int64_t pos) const {
    return int64_t(table[slot * width + pos / block]) * block + pos % block;
  }
};

// The rotary table (model/rope.h) in host memory and in the backend's memory.
struct RopeView {
  const float* host = nullptr;  // [n_positions, half, 2]
  const float* data = nullptr;  // the same in the backend's memory
  int n_positions = 0, half = 0;
};

// A step's metadata (host memory, valid while the step runs).
struct Step {
  const int32_t* tokens = nullptr;  // [n]
  const TokenPos* pos = nullptr;    // [n]
  int64_t n = 0;
  const int64_t* logit_rows = nullptr;  // [m] tokens whose logits the step produces
  int64_t m = 0;
  KvView kv;
};

enum class OpKind : uint8_t {
  kEmbed,      // out [n, dim] = table[tokens]
  kRmsNorm,    // out [rows, d] = rmsnorm(in) * weight (in place allowed)
  kLinear,     // out [rows, linear.out] = in [rows, linear.in] · Wᵀ
  kAdd,        // out [rows, d] += in
  kMla,        // out [n, H * V] = attention of q (in) and kv (in2) over the cache of `layer`
  kMoe,        // out [n, dim] = DeepSeekMoE(in)
  kMlp,        // out [n, dim] = w2(silu(w1 in) * w3 in)
  kGatherRows, // out [m, d] = in[logit_rows]
  kAllReduce,  // out [rows, d] summed over the ranks of `comm` (in place)
  kAllGather,  // out [rows, parts * d] = every rank's in [rows, d], rank r at columns r * d
};
const char* op_kind_name(OpKind k);

// A float32 buffer of the step in the backend's memory: [rows, cols], rows `stride` floats apart.
struct Value {
  const char* name = "";
  float* data = nullptr;
  int64_t rows = 0, cols = 0, stride = 0;
};

struct Op {
  OpKind kind = OpKind::kEmbed;
  int layer = -1;          // -1 outside the layers (embedding, head)
  const char* name = "";   // the reference's name: "attn_norm", "wq", "wkv_a", "attn", "wo", "ffn_norm",
                           // "ffn", "norm", "head", ... (debug taps use "<name>.<layer>")
  int in = -1, in2 = -1, out = -1;  // Value ids
  const Linear* linear = nullptr;       // kLinear
  const TensorView* weight = nullptr;   // kRmsNorm: the norm; kEmbed: the table
  float eps = 0.f;                      // kRmsNorm
  int64_t row0 = 0;                     // kEmbed: the token id of the table's first row
  const AttnWeights* attn = nullptr;    // kMla
  const MoEWeights* moe = nullptr;      // kMoe
  const MLPWeights* mlp = nullptr;      // kMlp
  Comm* comm = nullptr;                 // kAllReduce, kAllGather
};

// The fusions a backend may accept (runtime/rewrites.cc decides where they apply, the backend
// whether it runs them). A node covers ops [first, first + count) of the graph.
enum class Fusion : uint8_t {
  kNone,                 // one op
  kAddRmsNorm,           // add; rmsnorm of the sum                                   (2 ops)
  kLinearPair,           // two linears of the same input                             (2 ops)
  kAddRmsNormMoe,        // add; rmsnorm; the MoE of the norm (the gate normalises)   (3 ops)
  kCombineAddRmsNorm,    // add of a deferred MoE output (its combine); rmsnorm      (2 ops)
  kCombineAddRmsNormPair,  // kCombineAddRmsNorm feeding a kLinearPair               (4 ops)
};
const char* fusion_name(Fusion f);

struct Node {
  Fusion fusion = Fusion::kNone;
  int first = 0, count = 1;
  // The node's MoE leaves its routed output uncombined: the next node (a kCombine* fusion, the
  // only consumer) combines it. Set by the rewrite moe_combine_into_norm.
  bool defer_combine = false;
};

// A fresh StepGraph::id (process-wide, never 0).
uint64_t new_graph_id();

struct StepGraph {
  uint64_t id = new_graph_id();  // unique per graph (a backend may key recorded launches on it)
  const ModelArgs* args = nullptr;
  AttnImpl attn = AttnImpl::kAbsorb;
  RopeView rope;
  const std::vector<LayerCache>* cache = nullptr;  // [n_layers]
  std::vector<Value> values;
  std::vector<Op> ops;
  std::vector<Node> nodes;       // the plan; one node per op until rewritten
  int64_t n = 0, m = 0;          // tokens and logit rows it was recorded for

  const Value& val(int id) const { return values[size_t(id)]; }
};

}  // namespace dsv3
