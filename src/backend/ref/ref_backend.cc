// The scalar float32 backend: each op written the obvious way, mirroring model.py, and
// parallelised over independent rows only (no change to any summation order between runs).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/backend.h"
#include "backend/ref/fp8.h"
#include "backend/ref/rows.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/gate.h"
#include "model/rope.h"

namespace dsv3 {
namespace {

void tensor_row(const TensorView& t, int64_t row, int64_t len, float* out) {
  for (int64_t k = 0; k < len; ++k) out[k] = load_f32(t, row * len + k);
}

float silu(float x) { return x / (1.f + std::exp(-x)); }

class RefBackend final : public Backend {
 public:
  std::string name() const override { return "ref"; }
  float* alloc(size_t n) override { return new float[n](); }
  void release(float* p) override { delete[] p; }
  void upload(float* dst, const float* host, size_t n) override { std::memcpy(dst, host, n * 4); }
  void download(float* host, const float* src, size_t n) override { std::memcpy(host, src, n * 4); }

  void embed(const Step& s, const TensorView& table, int64_t row0, float* y) override {
    const int64_t d = table.dim(1), rows = table.dim(0);
    for (int64_t i = 0; i < s.n; ++i) {
      const int64_t r = s.tokens[i] - row0;
      if (r >= 0 && r < rows) tensor_row(table, r, d, y + i * d);
      else std::fill(y + i * d, y + (i + 1) * d, 0.f);
    }
  }

  void rmsnorm(const float* x, int64_t n, int64_t d, int64_t stride, const TensorView& w, float eps,
               float* y) override {
    std::vector<float> wf(static_cast<size_t>(d));
    tensor_row(w, 0, d, wf.data());
    parallel_for(n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) {
        const float* xi = x + i * stride;
        float ss = dot_f32(xi, xi, d);
        float r = 1.f / std::sqrt(ss / float(d) + eps);
        for (int64_t k = 0; k < d; ++k) y[i * stride + k] = xi[k] * r * wf[size_t(k)];
      }
    });
  }

  void linear(const float* x, int64_t n, const Linear& w, float* y) override {
    const int64_t out = w.out(), in = w.in();
    parallel_for(out, [&](int64_t b, int64_t e, int) {
      std::vector<float> row(static_cast<size_t>(in));
      for (int64_t o = b; o < e; ++o) {
        weight_row_f32(w, o, row.data());
        for (int64_t i = 0; i < n; ++i) y[i * out + o] = dot_f32(x + i * in, row.data(), in);
      }
    }, 16);
  }

  void add(float* y, const float* x, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) y[i] += x[i];
  }

  void mla(const MlaCall& c) override {
    const ModelArgs& a = *c.a;
    const AttnWeights& w = *c.w;
    const LayerCache& cache = *c.cache;
    const TokenPos* tp = c.step->pos;
    const KvView& kvv = c.step->kv;
    const int64_t n = c.step->n;
    float *q = c.q, *kv = c.kv, *out = c.out;
    const int64_t H = a.n_heads, nope = a.qk_nope_head_dim, R = a.qk_rope_head_dim, qk = nope + R,
                  C = a.kv_lora_rank, V = a.v_head_dim;
    const float scale = a.softmax_scale();
    // RoPE on q_pe and k_pe.
    for (int64_t i = 0; i < n; ++i) {
      DSV3_CHECK(tp[i].pos < c.rope->n_positions, "position ", tp[i].pos, " past the rope table");
      const float* cs = c.rope->host + size_t(tp[i].pos) * size_t(2 * c.rope->half);
      for (int64_t h = 0; h < H; ++h) apply_rope(q + (i * H + h) * qk + nope, cs, int(R / 2));
      apply_rope(kv + i * (C + R) + C, cs, int(R / 2));
    }
    // wkv_b as float: [H, nope + V, C].
    std::vector<float> wkv_b(static_cast<size_t>(H * (nope + V) * C));
    parallel_for(H * (nope + V), [&](int64_t b, int64_t e, int) {
      for (int64_t o = b; o < e; ++o) weight_row_f32(w.wkv_b, o, wkv_b.data() + o * C);
    });
    // kv_norm(latent) for the new tokens.
    std::vector<float> latent(static_cast<size_t>(n * C));
    for (int64_t i = 0; i < n; ++i) std::memcpy(&latent[size_t(i * C)], kv + i * (C + R), size_t(C) * 4);
    rmsnorm(latent.data(), n, C, C, w.kv_norm, a.rms_norm_eps, latent.data());

    if (c.impl == AttnImpl::kAbsorb) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = kvv.row(tp[i].slot, tp[i].pos);
        std::memcpy(cache.kv + row * C, &latent[size_t(i * C)], size_t(C) * 4);
        std::memcpy(cache.pe + row * R, kv + i * (C + R) + C, size_t(R) * 4);
      }
      parallel_for(n * H, [&](int64_t b, int64_t e, int) {
        std::vector<float> qa(static_cast<size_t>(C)), sc, ol(static_cast<size_t>(C));
        for (int64_t ih = b; ih < e; ++ih) {
          int64_t i = ih / H, h = ih % H, len = tp[i].pos + 1;
          const float* qi = q + ih * qk;
          const float* wb = wkv_b.data() + h * (nope + V) * C;
          std::fill(qa.begin(), qa.end(), 0.f);
          for (int64_t d = 0; d < nope; ++d)
            for (int64_t k = 0; k < C; ++k) qa[size_t(k)] += qi[d] * wb[d * C + k];
          sc.assign(size_t(len), 0.f);
          for (int64_t t = 0; t < len; ++t) {
            const int64_t row = kvv.row(tp[i].slot, t);
            sc[size_t(t)] = (dot_f32(qa.data(), cache.kv + row * C, C) + dot_f32(qi + nope, cache.pe + row * R, R)) * scale;
          }
          softmax(sc);
          std::fill(ol.begin(), ol.end(), 0.f);
          for (int64_t t = 0; t < len; ++t) {
            const float* kvr = cache.kv + kvv.row(tp[i].slot, t) * C;
            for (int64_t k = 0; k < C; ++k) ol[size_t(k)] += sc[size_t(t)] * kvr[k];
          }
          for (int64_t d = 0; d < V; ++d) out[i * H * V + h * V + d] = dot_f32(ol.data(), wb + (nope + d) * C, C);
        }
      });
      return;
    }
    // Naive: k = [wkv_b(latent) nope part, k_pe], v = wkv_b(latent) v part; full cache.
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = kvv.row(tp[i].slot, tp[i].pos);
      for (int64_t h = 0; h < H; ++h) {
        const float* wb = wkv_b.data() + h * (nope + V) * C;
        float* kc = cache.k + (row * H + h) * qk;
        float* vc = cache.v + (row * H + h) * V;
        for (int64_t d = 0; d < nope; ++d) kc[d] = dot_f32(&latent[size_t(i * C)], wb + d * C, C);
        std::memcpy(kc + nope, kv + i * (C + R) + C, size_t(R) * 4);
        for (int64_t d = 0; d < V; ++d) vc[d] = dot_f32(&latent[size_t(i * C)], wb + (nope + d) * C, C);
      }
    }
    parallel_for(n * H, [&](int64_t b, int64_t e, int) {
      std::vector<float> sc;
      for (int64_t ih = b; ih < e; ++ih) {
        int64_t i = ih / H, h = ih % H, len = tp[i].pos + 1;
        sc.assign(size_t(len), 0.f);
        for (int64_t t = 0; t < len; ++t)
          sc[size_t(t)] = dot_f32(q + ih * qk, cache.k + (kvv.row(tp[i].slot, t) * H + h) * qk, qk) * scale;
        softmax(sc);
        float* o = out + i * H * V + h * V;
        std::fill(o, o + V, 0.f);
        for (int64_t t = 0; t < len; ++t) {
          const float* vr = cache.v + (kvv.row(tp[i].slot, t) * H + h) * V;
          for (int64_t d = 0; d < V; ++d) o[d] += sc[size_t(t)] * vr[d];
        }
      }
    });
  }

  void mlp(const MLPWeights& w, const float* x, int64_t n, float* y) override {
    const int64_t inter = w.w1.out();
    std::vector<float> h1(static_cast<size_t>(n * inter)), h3(static_cast<size_t>(n * inter));
    linear(x, n, w.w1, h1.data());
    linear(x, n, w.w3, h3.data());
    for (size_t i = 0; i < h1.size(); ++i) h1[i] = silu(h1[i]) * h3[i];
    linear(h1.data(), n, w.w2, y);
  }

  void moe(const ModelArgs& a, const MoEWeights& w, const float* x, int64_t n, float* y) override {
    const int64_t E = a.n_routed_experts, K = a.n_activated_experts, D = a.dim;
    // Gate: scores = x · gate.weightᵀ in float32, then routing per token.
    Linear gate{w.gate, {}};
    std::vector<float> logits(static_cast<size_t>(n * E));
    linear(x, n, gate, logits.data());
    std::vector<float> bias;
    if (!w.bias.empty()) {
      bias.resize(size_t(E));
      tensor_row(w.bias, 0, E, bias.data());
    }
    std::vector<int32_t> idx(static_cast<size_t>(n * K));
    std::vector<float> wts(static_cast<size_t>(n * K)), scratch(static_cast<size_t>(2 * E + a.n_expert_groups));
    for (int64_t i = 0; i < n; ++i)
      route_token(a, &logits[size_t(i * E)], bias.empty() ? nullptr : bias.data(), &idx[size_t(i * K)],
                  &wts[size_t(i * K)], scratch.data());
    // Routed experts, as the reference's loop: gather the expert's tokens, run it, scatter-add.
    std::vector<float> routed(size_t(n * D), 0.f);
    for (int64_t e = 0; e < E; ++e) {
      if (w.experts[size_t(e)].w1.weight.empty()) continue;  // another rank's expert (its share is summed there)
      std::vector<int64_t> rows;
      std::vector<float> rw;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < K; ++k)
          if (idx[size_t(i * K + k)] == e) {
            rows.push_back(i);
            rw.push_back(wts[size_t(i * K + k)]);
          }
      if (rows.empty()) continue;
      const int64_t m = int64_t(rows.size());
      std::vector<float> xe(static_cast<size_t>(m * D)), ye(static_cast<size_t>(m * D));
      for (int64_t r = 0; r < m; ++r) std::memcpy(&xe[size_t(r * D)], x + rows[size_t(r)] * D, size_t(D) * 4);
      mlp(w.experts[size_t(e)], xe.data(), m, ye.data());
      for (int64_t r = 0; r < m; ++r)
        for (int64_t d = 0; d < D; ++d) routed[size_t(rows[size_t(r)] * D + d)] += ye[size_t(r * D + d)] * rw[size_t(r)];
    }
    if (w.has_shared) {
      mlp(w.shared_experts, x, n, y);
    } else {
      std::fill(y, y + n * D, 0.f);
    }
    for (int64_t i = 0; i < n * D; ++i) y[i] = routed[size_t(i)] + y[i];
  }

 private:
  static void softmax(std::vector<float>& s) {
    float mx = -std::numeric_limits<float>::infinity();
    for (float v : s) mx = std::max(mx, v);
    float sum = 0.f;
    for (float& v : s) sum += (v = std::exp(v - mx));
    for (float& v : s) v /= sum;
  }
};

}  // namespace

std::unique_ptr<Backend> make_ref_backend() { return std::make_unique<RefBackend>(); }

}  // namespace dsv3
