// What every backend shares: running a step graph node by node, the op dispatch, and the
// defaults of the optional ops.
#include "backend/backend.h"
#include "backend/host_weights.h"

#include <atomic>

#include "core/error.h"
#include "dist/comm.h"

namespace dsv3 {

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kEmbed: return "embed";
    case OpKind::kRmsNorm: return "rmsnorm";
    case OpKind::kLinear: return "linear";
    case OpKind::kAdd: return "add";
    case OpKind::kMla: return "mla";
    case OpKind::kMoe: return "moe";
    case OpKind::kMlp: return "mlp";
    case OpKind::kGatherRows: return "gather_rows";
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kAllGather: return "all_gather";
  }
  return "?";
}

const char* fusion_name(Fusion f) {
  switch (f) {
    case Fusion::kNone: return "none";
    case Fusion::kAddRmsNorm: return "add_rmsnorm";
    case Fusion::kLinearPair: return "linear_pair";
    case Fusion::kAddRmsNormMoe: return "add_rmsnorm_moe";
    case Fusion::kCombineAddRmsNorm: return "combine_add_rmsnorm";
    case Fusion::kCombineAddRmsNormPair: return "combine_add_rmsnorm_pair";
  }
  return "?";
}

uint64_t new_graph_id() {
  static std::atomic<uint64_t> next{1};
  return next++;
}

void Backend::run(const StepGraph& g, const Step& s, const AfterNode& after) {
  for (const Node& nd : g.nodes) {
    if (nd.fusion == Fusion::kNone && !nd.defer_combine) run_op(g, s, g.ops[size_t(nd.first)]);
    else run_fused(g, s, nd);
    if (after) after(nd.first + nd.count - 1);
  }
}

void Backend::run_fused(const StepGraph& g, const Step& s, const Node& nd) {
  fail("internal error: backend '", name(), "' was given fusion ", fusion_name(nd.fusion),
       nd.defer_combine ? " (combine deferred)" : "", ", which it does not run");
}

void Backend::run_op(const StepGraph& g, const Step& s, const Op& op) {
  const Value* in = op.in >= 0 ? &g.val(op.in) : nullptr;
  const Value* in2 = op.in2 >= 0 ? &g.val(op.in2) : nullptr;
  const Value& out = g.val(op.out);
  switch (op.kind) {
    case OpKind::kEmbed: embed(s, *op.weight, op.row0, out.data); return;
    case OpKind::kRmsNorm:
      rmsnorm(in->data, in->rows, in->cols, in->stride, *op.weight, op.eps, out.data);
      return;
    case OpKind::kLinear: linear(in->data, in->rows, *op.linear, out.data); return;
    case OpKind::kAdd: add(out.data, in->data, out.rows * out.cols); return;
    case OpKind::kMla: {
      MlaCall c;
      c.a = g.args, c.impl = g.attn, c.w = op.attn, c.rope = &g.rope, c.step = &s;
      c.cache = &(*g.cache)[size_t(op.layer)], c.q = in->data, c.kv = in2->data, c.out = out.data;
      mla(c);
      return;
    }
    case OpKind::kMoe: moe(*g.args, *op.moe, in->data, in->rows, out.data); return;
    case OpKind::kMlp: mlp(*op.mlp, in->data, in->rows, out.data); return;
    case OpKind::kGatherRows: gather_rows(in->data, in->cols, s.logit_rows, s.m, out.data); return;
    case OpKind::kAllReduce: all_reduce(*op.comm, out.data, out.rows * out.cols); return;
    case OpKind::kAllGather: all_gather(*op.comm, in->data, in->rows, in->cols, out.data); return;
  }
}

void Backend::gather_rows(const float* x, int64_t d, const int64_t* rows, int64_t m, float* y) {
  std::vector<float> row(static_cast<size_t>(d));
  for (int64_t r = 0; r < m; ++r) {
    download(row.data(), x + rows[r] * d, size_t(d));
    upload(y + r * d, row.data(), size_t(d));
  }
}

WeightPlacement Backend::prepare_weights(const ModelArgs&, ModelWeights& w, const WeightMemory& m) {
  WeightMemory in_place = m;
  in_place.mode = WeightMemory::kMap;
  return place_host_weights(w, in_place, nullptr);
}

// (Host staging kept per thread and reused: the logits' gather runs every step, and fresh buffers of
// its size cost page faults each time.)
void Backend::all_reduce(Comm& comm, float* x, int64_t n) {
  thread_local std::vector<float> h;
  h.resize(static_cast<size_t>(n));
  download(h.data(), x, h.size());
  comm.all_reduce_sum(h.data(), n);
  upload(x, h.data(), h.size());
}

void Backend::all_gather(Comm& comm, const float* x, int64_t rows, int64_t d, float* y) {
  const int64_t P = comm.size();
  thread_local std::vector<float> mine, all, out;
  mine.resize(static_cast<size_t>(rows * d)), all.resize(static_cast<size_t>(P * rows * d));
  download(mine.data(), x, mine.size());
  comm.all_gather(mine.data(), rows * d, all.data());
  if (rows == 1) return upload(y, all.data(), all.size());  // [P, 1, d] is [1, P * d]
  out.resize(all.size());
  for (int64_t p = 0; p < P; ++p)  // [P, rows, d] -> [rows, P * d]
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(&all[size_t((p * rows + r) * d)], d, &out[size_t(r * P * d + p * d)]);
  upload(y, out.data(), out.size());
}

}  // namespace dsv3
