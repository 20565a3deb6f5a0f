#include "model/model.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace dsv3 {

Model::Model(std::unique_ptr<Checkpoint> ck, std::unique_ptr<Backend> backend, const ModelOptions& opt)
    : ck_(std::move(ck)), be_(std::move(backend)), opt_(opt), args_(load_model_args(*ck_)) {
  if (opt_.max_slots <= 0) fail("max_slots must be positive");
  w_ = load_weights(*ck_);
  be_->prepare_weights(args_, w_);
  init();
}

Model::Model(const ModelArgs& args, ModelWeights w, std::unique_ptr<Backend> backend, const ModelOptions& opt)
    : be_(std::move(backend)), opt_(opt), args_(args), w_(std::move(w)) {
  if (opt_.max_slots <= 0) fail("max_slots must be positive");
  init();
}

int64_t kv_cache_bytes_per_position(const ModelArgs& a, AttnImpl attn) {
  const int64_t per_layer = attn == AttnImpl::kAbsorb ? a.kv_lora_rank + a.qk_rope_head_dim
                                                      : int64_t(a.n_heads) * (a.qk_head_dim() + a.v_head_dim);
  return per_layer * int64_t(sizeof(float)) * a.n_layers;
}

int64_t Model::kv_cache_bytes() const {
  return int64_t(opt_.max_slots) * opt_.max_len * kv_cache_bytes_per_position(args_, opt_.attn);
}

void Model::init() {
  if (opt_.max_len <= 0 || opt_.max_len > args_.max_seq_len) opt_.max_len = args_.max_seq_len;
  if (opt_.kv_cache_gb < 0) fail("--kv-cache-gb must not be negative, got ", opt_.kv_cache_gb);
  if (opt_.kv_cache_gb > 0) {
    const int64_t per_pos = kv_cache_bytes_per_position(args_, opt_.attn);
    const int64_t fit = int64_t(opt_.kv_cache_gb * 1e9) / per_pos / opt_.max_slots;
    if (fit < 1)
      fail("--kv-cache-gb ", opt_.kv_cache_gb, " holds less than one position for each of ", opt_.max_slots,
           " sequences (one position takes ", per_pos, " bytes); raise it or lower the batch");
    if (fit < opt_.max_len) {
      opt_.max_len = int(fit);
      budget_limited_ = true;
    }
  }
  rope_ = RopeTable(args_, opt_.max_len);
  const int64_t rows = int64_t(opt_.max_slots) * opt_.max_len;
  cache_.resize(size_t(args_.n_layers));
  for (auto& c : cache_) {
    if (opt_.attn == AttnImpl::kAbsorb) {
      c.kv = be_->alloc(size_t(rows * args_.kv_lora_rank));
      c.pe = be_->alloc(size_t(rows * args_.qk_rope_head_dim));
    } else {
      c.k = be_->alloc(size_t(rows * args_.n_heads * args_.qk_head_dim()));
      c.v = be_->alloc(size_t(rows * args_.n_heads * args_.v_head_dim));
    }
  }
}

Model::~Model() {
  for (auto& c : cache_)
    for (float* p : {c.kv, c.pe, c.k, c.v})
      if (p) be_->release(p);
  for (float* p : {h_, x_, q_, qa_, kv_, attn_, y_, last_, logits_})
    if (p) be_->release(p);
}

void Model::ensure_workspace(int64_t n) {
  if (n <= ws_tokens_) return;
  for (float** p : {&h_, &x_, &q_, &qa_, &kv_, &attn_, &y_})
    if (*p) be_->release(*p), *p = nullptr;
  const ModelArgs& a = args_;
  ws_tokens_ = n;
  h_ = be_->alloc(size_t(n * a.dim));
  x_ = be_->alloc(size_t(n * a.dim));
  q_ = be_->alloc(size_t(n * a.n_heads * a.qk_head_dim()));
  qa_ = be_->alloc(size_t(n * std::max(a.q_lora_rank, 1)));
  kv_ = be_->alloc(size_t(n * (a.kv_lora_rank + a.qk_rope_head_dim)));
  attn_ = be_->alloc(size_t(n * a.n_heads * a.v_head_dim));
  y_ = be_->alloc(size_t(n * a.dim));
}

void Model::ensure_logit_rows(int64_t m) {
  if (m <= logit_rows_) return;
  if (logits_) be_->release(logits_);
  if (last_) be_->release(last_);
  logit_rows_ = m;
  last_ = be_->alloc(size_t(m * args_.dim));
  logits_ = be_->alloc(size_t(m * args_.vocab_size));
}

void Model::tap(const char* what, int layer, const float* buf, int64_t n, int64_t cols) {
  if (!tap_) return;
  std::vector<float> host(static_cast<size_t>(n * cols));
  be_->download(host.data(), buf, host.size());
  tap_(std::string(what) + "." + std::to_string(layer), host.data(), n, cols);
}

void Model::forward(const int32_t* tokens, int B, int T, int start_pos, float* logits) {
  if (B <= 0 || T <= 0) fail("forward: empty batch (B=", B, ", T=", T, ")");
  if (B > opt_.max_slots) fail("forward: batch of ", B, " rows exceeds the cache's ", opt_.max_slots, " slots");
  if (start_pos < 0) fail("forward: negative start_pos ", start_pos);
  std::vector<TokenPos> pos(static_cast<size_t>(B) * size_t(T));
  std::vector<int64_t> last(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) pos[size_t(b * T + t)] = {b, start_pos + t};
    last[size_t(b)] = int64_t(b) * T + T - 1;
  }
  forward(tokens, pos.data(), int64_t(pos.size()), last, logits);
}

void Model::forward(const int32_t* tokens, const TokenPos* pos, int64_t n, const std::vector<int64_t>& logit_rows,
                    float* logits) {
  forward_greedy(tokens, pos, n, logit_rows, 0, nullptr, logits);
}

bool Model::forward_greedy(const int32_t* tokens, const TokenPos* pos, int64_t n,
                           const std::vector<int64_t>& logit_rows, int64_t limit, int32_t* ids, float* logits) {
  return forward_sample(tokens, pos, n, logit_rows, limit, nullptr, ids, logits);
}

bool Model::forward_sample(const int32_t* tokens, const TokenPos* pos, int64_t n,
                           const std::vector<int64_t>& logit_rows, int64_t limit, const Backend::SampleSpec* spec,
                           int32_t* ids, float* logits) {
  const ModelArgs& a = args_;
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= a.vocab_size)
      fail("token id ", tokens[i], " is outside the vocabulary [0, ", a.vocab_size, ")");
    if (pos[i].pos >= opt_.max_len && budget_limited_)
      fail("position ", pos[i].pos, " needs more KV cache than --kv-cache-gb ", opt_.kv_cache_gb, " gives: it holds ",
           opt_.max_len, " positions for each of ", opt_.max_slots, " sequences (",
           kv_cache_bytes_per_position(args_, opt_.attn), " bytes per position); raise --kv-cache-gb or run fewer "
           "sequences at once");
    if (pos[i].pos < 0 || pos[i].pos >= opt_.max_len)
      fail("position ", pos[i].pos, " is past the maximum sequence length ", opt_.max_len);
    if (pos[i].slot < 0 || pos[i].slot >= opt_.max_slots)
      fail("cache slot ", pos[i].slot, " outside [0, ", opt_.max_slots, ")");
  }
  for (int64_t r : logit_rows) DSV3_CHECK(r >= 0 && r < n, "logit row ", r, " of ", n);
  ensure_workspace(n);
  const int64_t m = int64_t(logit_rows.size());
  if (m > 0) ensure_logit_rows(m);  // allocate before a device backend records the step
  // A device backend may replay a recorded step of this shape instead of the ops (taps read
  // intermediates mid-step, so they run the ops).
  const bool hooks = !tap_;
  if (!hooks || !be_->begin_step(tokens, pos, n, logit_rows.data(), m)) run_ops(tokens, pos, n, logit_rows);
  if (hooks) be_->end_step();
  if (m == 0) return false;
  const int64_t lim = limit > 0 ? std::min<int64_t>(limit, a.vocab_size) : a.vocab_size;
  if (ids && spec && be_->sample_rows(logits_, m, a.vocab_size, lim, spec, ids, logits)) return true;
  if (ids && !spec && be_->argmax_rows(logits_, m, a.vocab_size, lim, ids)) return true;
  be_->download(logits, logits_, size_t(m * a.vocab_size));
  return false;
}

// The layer loop of one step: embed, every layer, then norm and head for the requested rows.
void Model::run_ops(const int32_t* tokens, const TokenPos* pos, int64_t n, const std::vector<int64_t>& logit_rows) {
  const ModelArgs& a = args_;
  const int64_t D = a.dim;

  be_->embed(tokens, n, w_.embed, h_);  // h: [n, dim]
  for (int l = 0; l < a.n_layers; ++l) {
    const LayerWeights& L = w_.layers[size_t(l)];
    // x = attn_norm(h); h += wo(MLA(x))
    be_->rmsnorm(h_, n, D, D, L.attn_norm, a.rms_norm_eps, x_);
    tap("attn_norm", l, x_, n, D);
    if (a.q_lora_rank == 0) {
      be_->linear(x_, n, L.attn.wq, q_);  // q: [n, n_heads * qk_head_dim]
    } else {
      be_->linear(x_, n, L.attn.wq_a, qa_);  // [n, q_lora_rank]
      be_->rmsnorm(qa_, n, a.q_lora_rank, a.q_lora_rank, L.attn.q_norm, a.rms_norm_eps, qa_);
      be_->linear(qa_, n, L.attn.wq_b, q_);
    }
    be_->linear(x_, n, L.attn.wkv_a, kv_);  // kv: [n, kv_lora_rank + qk_rope_head_dim]
    be_->mla(a, opt_.attn, L.attn, rope_, pos, n, q_, kv_, cache_[size_t(l)], opt_.max_len, attn_);
    be_->linear(attn_, n, L.attn.wo, y_);  // [n, dim]
    tap("attn_out", l, y_, n, D);
    be_->add(h_, y_, n * D);
    // x = ffn_norm(h); h += ffn(x)
    be_->rmsnorm(h_, n, D, D, L.ffn_norm, a.rms_norm_eps, x_);
    tap("ffn_norm", l, x_, n, D);
    if (L.moe) be_->moe(a, L.moe_w, x_, n, y_);
    else be_->mlp(L.ffn, x_, n, y_);
    tap("ffn_out", l, y_, n, D);
    be_->add(h_, y_, n * D);
    tap("h", l, h_, n, D);
  }
  // logits = head(norm(h[last])) for the requested rows.
  const int64_t m = int64_t(logit_rows.size());
  if (m == 0) return;
  be_->gather_rows(h_, D, logit_rows.data(), m, last_);  // [m, dim]
  be_->rmsnorm(last_, m, D, D, w_.norm, a.rms_norm_eps, last_);
  be_->linear(last_, m, w_.head, logits_);
}

}  // namespace dsv3
