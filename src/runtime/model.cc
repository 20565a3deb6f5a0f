#include "runtime/model.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "core/error.h"
#include "dist/comm.h"
#include "runtime/rewrites.h"

namespace dsv3 {

Model::Model(std::unique_ptr<Checkpoint> ck, std::unique_ptr<Backend> backend, const ModelOptions& opt)
    : ck_(std::move(ck)), be_(std::move(backend)), opt_(opt), args_(load_model_args(*ck_)) {
  if (ranks() > 1) {  // the same model everywhere: the leader's config, field by field
    const std::string mine = describe(args_);
    std::string lead = mine;
    int64_t len = int64_t(lead.size());
    opt_.comm->broadcast(&len, sizeof len, 0);
    lead.resize(size_t(len));
    opt_.comm->broadcast(lead.data(), lead.size(), 0);
    std::string err;
    if (lead != mine) {
      err = str("rank ", rank(), ": its config (", ck_->config_path(), ") differs from rank 0's:");
      std::istringstream a(mine), b(lead);
      for (std::string la, lb; std::getline(a, la) && std::getline(b, lb);)
        if (la != lb) err += str(" ", la, " (rank 0: ", lb.substr(lb.find(' ') + 1), ");");
    }
    agree(err, "its config check");
  }
  std::string err;
  try {
    w_ = load_weights(*ck_, {rank(), ranks()});
  } catch (const Error& e) {
    err = ranks() > 1 ? str("rank ", rank(), ": ", e.what()) : e.what();
  }
  agree(err, "loading its weights");
  WeightMemory wm = opt_.weights;
  wm.keep_free += int64_t(opt_.kv_cache_gb * 1e9) + int64_t(2e9);  // the cache, activations, the rest
  placed_ = be_->prepare_weights(args_, w_, wm);
  if (placed_.off_checkpoint) ck_->release_pages();
  init();
}

int Model::rank() const { return opt_.comm ? opt_.comm->rank() : 0; }
int Model::ranks() const { return opt_.comm ? opt_.comm->size() : 1; }

void Model::agree(const std::string& err, const char* what) {
  if (ranks() == 1) {
    if (!err.empty()) throw Error(err);
    return;
  }
  if (opt_.comm->all_ok(err.empty())) return;
  if (!err.empty()) throw Error(err);
  fail("rank ", rank(), ": another rank failed at ", what, " (its message says why)");
}

Model::Model(const ModelArgs& args, ModelWeights w, std::unique_ptr<Backend> backend, const ModelOptions& opt)
    : be_(std::move(backend)), opt_(opt), args_(args), w_(std::move(w)) {
  init();
}

void Model::init() {
  local_ = args_;
  local_.n_heads = args_.n_heads / ranks();
  local_.inter_dim = args_.inter_dim / ranks();
  if (opt_.max_seqs <= 0) fail("max_seqs must be positive, got ", opt_.max_seqs);
  if (opt_.max_len <= 0 || opt_.max_len > args_.max_seq_len) opt_.max_len = args_.max_seq_len;
  if (opt_.kv_cache_gb < 0) fail("--kv-cache-gb must not be negative, got ", opt_.kv_cache_gb);
  KvCache::Options co;
  co.attn = opt_.attn, co.block = opt_.kv_block, co.max_len = opt_.max_len;
  const int64_t per_block = KvCache::bytes_per_position(local_, opt_.attn, be_->bf16_latent_cache()) * co.block;
  const int64_t width = (opt_.max_len + co.block - 1) / co.block;
  if (opt_.kv_cache_gb > 0) {
    co.n_blocks = int64_t(opt_.kv_cache_gb * 1e9) / per_block;
    if (co.n_blocks < 1)
      fail("--kv-cache-gb ", opt_.kv_cache_gb, " holds less than one block of ", co.block, " positions (",
           per_block, " bytes); raise it");
  } else {
    co.n_blocks = int64_t(opt_.max_seqs) * width;
    const int64_t free_bytes = be_->device_free_bytes();  // a device: at most 90% of what it has free
    if (free_bytes >= 0) co.n_blocks = std::max<int64_t>(1, std::min(co.n_blocks, free_bytes / 10 * 9 / per_block));
  }
  if (ranks() > 1) {  // the followers' caches as the leader's: its block tables index them
    int64_t geo[2] = {co.n_blocks, co.max_len};
    opt_.comm->broadcast(geo, sizeof geo, 0);
    co.n_blocks = geo[0], co.max_len = int(geo[1]);
    opt_.max_len = co.max_len;
  }
  cache_ = std::make_unique<KvCache>(local_, *be_, co);
  rope_ = RopeTable(args_, opt_.max_len);
  const size_t rope_n = size_t(rope_.n_positions()) * size_t(2 * rope_.half());
  rope_dev_ = be_->alloc(rope_n);
  be_->upload(rope_dev_, rope_.at(0), rope_n);
}

Model::~Model() {
  if (ranks() > 1 && leader()) {
    try {
      Step stop;
      send_step(stop, false);  // (n = 0: the followers' loop ends)
    } catch (...) {
    }
  }
  graphs_[0].clear(), graphs_[1].clear();
  cache_.reset();
  for (float* p : {h_, x_, q_, qa_, kv_, attn_, y_, last_, logits_, part_logits_, rope_dev_})
    if (p) be_->release(p);
}

void Model::ensure_workspace(int64_t n, int64_t m) {
  if (n <= ws_tokens_ && m <= ws_rows_) return;
  graphs_[0].clear(), graphs_[1].clear();  // they point at the old buffers
  const ModelArgs& a = local_;
  if (n > ws_tokens_) {
    for (float** p : {&h_, &x_, &q_, &qa_, &kv_, &attn_, &y_})
      if (*p) be_->release(*p), *p = nullptr;
    ws_tokens_ = n;
    h_ = be_->alloc(size_t(n * a.dim));
    x_ = be_->alloc(size_t(n * a.dim));
    q_ = be_->alloc(size_t(n * a.n_heads * a.qk_head_dim()));
    qa_ = be_->alloc(size_t(n * std::max(a.q_lora_rank, 1)));
    kv_ = be_->alloc(size_t(n * (a.kv_lora_rank + a.qk_rope_head_dim)));
    attn_ = be_->alloc(size_t(n * a.n_heads * a.v_head_dim));
    y_ = be_->alloc(size_t(n * a.dim));
  }
  if (m > ws_rows_) {
    for (float** p : {&last_, &logits_, &part_logits_})
      if (*p) be_->release(*p), *p = nullptr;
    ws_rows_ = m;
    last_ = be_->alloc(size_t(m * a.dim));
    logits_ = be_->alloc(size_t(m * a.vocab_size));
    if (ranks() > 1) part_logits_ = be_->alloc(size_t(m * (a.vocab_size / ranks())));
  }
}

namespace {

// Records ops into a graph: one call per op of the layer loop, values by id.
struct Recorder {
  StepGraph& g;
  int layer = -1;
  int value(const char* name, float* data, int64_t rows, int64_t cols) {
    g.values.push_back({name, data, rows, cols, cols});
    return int(g.values.size()) - 1;
  }
  Op& op(OpKind k, const char* name, int in, int in2, int out) {
    Op o;
    o.kind = k, o.layer = layer, o.name = name, o.in = in, o.in2 = in2, o.out = out;
    g.ops.push_back(o);
    return g.ops.back();
  }
  void rmsnorm(const char* name, int in, const TensorView& w, float eps, int out) {
    Op& o = op(OpKind::kRmsNorm, name, in, -1, out);
    o.weight = &w, o.eps = eps;
  }
  void linear(const char* name, int in, const Linear& w, int out) { op(OpKind::kLinear, name, in, -1, out).linear = &w; }
  void all_reduce(Comm* comm, int v) {
    if (comm && comm->size() > 1) op(OpKind::kAllReduce, "all_reduce", -1, -1, v).comm = comm;
  }
};

}  // namespace

// The reference's Transformer.forward for n tokens (m of them giving logits), as ops: embed,
// then per layer h += attn(attn_norm(h)); h += ffn(ffn_norm(h)), then norm and head for the
// logit rows. With several ranks, the collectives go where the reference's ParallelEmbedding,
// RowParallelLinear (wo, w2), MoE and head put them.
std::unique_ptr<StepGraph> Model::record(int64_t n, int64_t m) {
  const ModelArgs& a = local_;  // (one rank's heads)
  auto g = std::make_unique<StepGraph>();
  g->args = &local_, g->attn = opt_.attn, g->cache = &cache_->layers(), g->n = n, g->m = m;
  g->rope = {rope_.at(0), rope_dev_, rope_.n_positions(), rope_.half()};
  Recorder r{*g};
  const int64_t D = a.dim;
  const int h = r.value("h", h_, n, D);                                               // [n, dim] residual
  const int x = r.value("x", x_, n, D);                                               // [n, dim] normed
  const int q = r.value("q", q_, n, int64_t(a.n_heads) * a.qk_head_dim());            // [n, H * qk]
  const int qa = r.value("qa", qa_, n, std::max(a.q_lora_rank, 1));                    // [n, q_lora_rank]
  const int kv = r.value("kv", kv_, n, a.kv_lora_rank + a.qk_rope_head_dim);           // [n, C + R]
  const int att = r.value("attn", attn_, n, int64_t(a.n_heads) * a.v_head_dim);        // [n, H * V]
  const int y = r.value("y", y_, n, D);                                               // [n, dim]
  Comm* comm = opt_.comm;

  Op& embed = r.op(OpKind::kEmbed, "embed", -1, -1, h);
  embed.weight = &w_.embed, embed.row0 = w_.vocab0;
  r.all_reduce(comm, h);  // vocab-parallel embedding: each rank's rows, zeros elsewhere
  for (int l = 0; l < a.n_layers; ++l) {
    const LayerWeights& L = w_.layers[size_t(l)];
    r.layer = l;
    // h += wo(MLA(attn_norm(h)))
    r.rmsnorm("attn_norm", h, L.attn_norm, a.rms_norm_eps, x);
    if (a.q_lora_rank == 0) {
      r.linear("wq", x, L.attn.wq, q);
      r.linear("wkv_a", x, L.attn.wkv_a, kv);
    } else {  // (wkv_a next to wq_a: the two products of x)
      r.linear("wq_a", x, L.attn.wq_a, qa);
      r.linear("wkv_a", x, L.attn.wkv_a, kv);
      r.rmsnorm("q_norm", qa, L.attn.q_norm, a.rms_norm_eps, qa);
      r.linear("wq_b", qa, L.attn.wq_b, q);
    }
    r.op(OpKind::kMla, "attn", q, kv, att).attn = &L.attn;
    r.linear("wo", att, L.attn.wo, y);
    r.all_reduce(comm, y);
    r.op(OpKind::kAdd, "attn_residual", y, -1, h);
    // h += ffn(ffn_norm(h))
    r.rmsnorm("ffn_norm", h, L.ffn_norm, a.rms_norm_eps, x);
    if (L.moe) r.op(OpKind::kMoe, "ffn", x, -1, y).moe = &L.moe_w;
    else r.op(OpKind::kMlp, "ffn", x, -1, y).mlp = &L.ffn;
    r.all_reduce(comm, y);
    r.op(OpKind::kAdd, "ffn_residual", y, -1, h);
  }
  if (m > 0) {  // logits = head(norm(h[logit rows]))
    r.layer = -1;
    const int last = r.value("last", last_, m, D);                  // [m, dim]
    const int logits = r.value("logits", logits_, m, a.vocab_size);  // [m, vocab]
    r.op(OpKind::kGatherRows, "last", h, -1, last);
    r.rmsnorm("norm", last, w_.norm, a.rms_norm_eps, last);
    if (ranks() == 1) {
      r.linear("head", last, w_.head, logits);
    } else {  // column-parallel head: this rank's slice of the vocabulary, then every rank's
      const int part = r.value("part_logits", part_logits_, m, a.vocab_size / ranks());
      r.linear("head", last, w_.head, part);
      r.op(OpKind::kAllGather, "all_gather", part, -1, logits).comm = comm;
    }
  }
  return g;
}

const StepGraph& Model::graph(int64_t n, int64_t m, bool fused) {
  ensure_workspace(n, m);
  auto& slot = graphs_[fused ? 1 : 0][{n, m}];
  if (!slot) {
    slot = record(n, m);
    plan(*slot, *be_, fused ? opt_.rewrites : 0);
  }
  return *slot;
}

void Model::check(const Batch& b) const {
  const ModelArgs& a = args_;
  if (b.n <= 0) fail("forward: empty batch");
  for (int64_t i = 0; i < b.n; ++i) {
    if (b.tokens[i] < 0 || b.tokens[i] >= a.vocab_size)
      fail("token id ", b.tokens[i], " is outside the vocabulary [0, ", a.vocab_size, ")");
    const TokenPos& p = b.pos[i];
    if (p.slot < 0 || p.slot >= int64_t(b.seqs.size())) fail("token ", i, ": sequence ", p.slot, " not in the step");
    if (p.pos < 0 || p.pos >= opt_.max_len)
      fail("position ", p.pos, " is past the maximum sequence length ", opt_.max_len);
    const int64_t blocks = int64_t(b.seqs[size_t(p.slot)]->blocks.size());
    if (p.pos >= blocks * cache_->block())
      fail("position ", p.pos, " of sequence ", p.slot, " is past its ", blocks * cache_->block(),
           " cached positions (reserve them first)");
  }
  for (int64_t r : b.logit_rows) DSV3_CHECK(r >= 0 && r < b.n, "logit row ", r, " of ", b.n);
}

bool Model::run(const Batch& b, int64_t limit, const Backend::SampleSpec* spec, int32_t* ids, float* logits) {
  check(b);
  const int64_t m = int64_t(b.logit_rows.size());
  const StepGraph& g = graph(b.n, m, !tap_);
  // The step's block tables: one row per sequence, as wide as the longest sequence may be.
  const int64_t width = cache_->width();
  table_.assign(b.seqs.size() * size_t(width), 0);
  for (size_t s = 0; s < b.seqs.size(); ++s)
    std::copy(b.seqs[s]->blocks.begin(), b.seqs[s]->blocks.end(), table_.begin() + long(s * size_t(width)));
  Step st;
  st.tokens = b.tokens, st.pos = b.pos, st.n = b.n, st.logit_rows = b.logit_rows.data(), st.m = m;
  st.kv = {table_.data(), int64_t(b.seqs.size()), width, cache_->block()};
  if (ranks() > 1) send_step(st, !tap_);
  if (tap_) {
    be_->run(g, st, [&](int last_op) {
      const Op& op = g.ops[size_t(last_op)];
      const char* tap = nullptr;
      if (op.kind == OpKind::kRmsNorm && (std::strcmp(op.name, "attn_norm") == 0 || std::strcmp(op.name, "ffn_norm") == 0))
        tap = op.name;
      else if (std::strcmp(op.name, "wo") == 0) tap = "attn_out";
      else if (std::strcmp(op.name, "ffn") == 0) tap = "ffn_out";
      else if (std::strcmp(op.name, "ffn_residual") == 0) tap = "h";
      if (!tap || op.layer < 0) return;
      const Value& v = g.val(op.out);
      std::vector<float> host(static_cast<size_t>(v.rows * v.cols));
      be_->download(host.data(), v.data, host.size());
      tap_(std::string(tap) + "." + std::to_string(op.layer), host.data(), v.rows, v.cols);
    });
  } else {
    be_->run(g, st);
  }
  if (m == 0) return false;
  const ModelArgs& a = args_;
  const int64_t lim = limit > 0 ? std::min<int64_t>(limit, a.vocab_size) : a.vocab_size;
  if (ids && spec && be_->sample_rows(logits_, m, a.vocab_size, lim, spec, ids, logits)) return true;
  if (ids && !spec && be_->argmax_rows(logits_, m, a.vocab_size, lim, ids)) return true;
  be_->download(logits, logits_, size_t(m * a.vocab_size));
  return false;
}

// The leader's step to the followers: [n, m, sequences, table width, fused] then the tokens, their
// (sequence, position), the logit rows and the block tables, as int32. n = 0: stop.
void Model::send_step(const Step& s, bool fused) {
  int64_t head[5] = {s.n, s.m, s.kv.rows, s.kv.width, fused ? 1 : 0};
  opt_.comm->broadcast(head, sizeof head, 0, /*wait=*/true);
  if (s.n == 0) return;
  std::vector<int32_t> body;
  body.reserve(size_t(3 * s.n + s.m + s.kv.rows * s.kv.width));
  body.insert(body.end(), s.tokens, s.tokens + s.n);
  const int32_t* pos = reinterpret_cast<const int32_t*>(s.pos);
  body.insert(body.end(), pos, pos + 2 * s.n);
  for (int64_t r = 0; r < s.m; ++r) body.push_back(int32_t(s.logit_rows[r]));
  body.insert(body.end(), s.kv.table, s.kv.table + s.kv.rows * s.kv.width);
  opt_.comm->broadcast(body.data(), body.size() * sizeof(int32_t), 0);
}

void Model::follow() {
  DSV3_CHECK(!leader(), "the leader does not follow");
  for (;;) {
    int64_t head[5] = {};
    opt_.comm->broadcast(head, sizeof head, 0, /*wait=*/true);  // (the leader may wait for its user)
    const int64_t n = head[0], m = head[1], rows = head[2], width = head[3];
    if (n == 0) return;
    std::vector<int32_t> body(size_t(3 * n + m + rows * width));
    opt_.comm->broadcast(body.data(), body.size() * sizeof(int32_t), 0);
    std::vector<int64_t> logit_rows(body.begin() + 3 * n, body.begin() + 3 * n + m);
    Step st;
    st.tokens = body.data(), st.pos = reinterpret_cast<const TokenPos*>(body.data() + n), st.n = n;
    st.logit_rows = logit_rows.data(), st.m = m;
    st.kv = {body.data() + 3 * n + m, rows, width, cache_->block()};
    be_->run(graph(n, m, head[4] != 0), st);
  }
}

void Model::forward(const Batch& b, float* logits) { run(b, 0, nullptr, nullptr, logits); }

bool Model::forward_greedy(const Batch& b, int64_t limit, int32_t* ids, float* logits) {
  return run(b, limit, nullptr, ids, logits);
}

bool Model::forward_sample(const Batch& b, int64_t limit, const Backend::SampleSpec* spec, int32_t* ids,
                           float* logits) {
  return run(b, limit, spec, ids, logits);
}

void Model::forward(const int32_t* tokens, int B, int T, int start_pos, float* logits) {
  if (B <= 0 || T <= 0) fail("forward: empty batch (B=", B, ", T=", T, ")");
  if (start_pos < 0) fail("forward: negative start_pos ", start_pos);
  if (int64_t(start_pos) + T > opt_.max_len)
    fail("position ", start_pos + T - 1, " is past the maximum sequence length ", opt_.max_len);
  if (int(rows_.size()) < B) rows_.resize(size_t(B));
  Batch b;
  b.tokens = tokens, b.n = int64_t(B) * T;
  std::vector<TokenPos> pos(size_t(b.n));
  for (int r = 0; r < B; ++r) {
    cache_->reserve(rows_[size_t(r)], int64_t(start_pos) + T);
    b.seqs.push_back(&rows_[size_t(r)]);
    for (int t = 0; t < T; ++t) pos[size_t(r * T + t)] = {r, start_pos + t};
    b.logit_rows.push_back(int64_t(r) * T + T - 1);
  }
  b.pos = pos.data();
  forward(b, logits);
}

void Model::reset_rows() {
  for (BlockTable& t : rows_) cache_->free(t);
  rows_.clear();
}

}  // namespace dsv3
