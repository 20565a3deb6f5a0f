// Nothing is specific to the golden shapes: random checkpoints of other sizes (head counts,
// dims that are not multiples of 128 so FP8 blocks are ragged, expert/group counts, q LoRA on or
// off, YaRN on or off) checked against an independent oracle written here from the reference's
// semantics in double precision (full recomputation, no cache), through both attention modes,
// with two sequences of different lengths interleaved in the cache.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <map>
#include <random>

#include "golden_util.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "runtime/model.h"

using namespace dsv3;
using namespace dsv3::testing_util;

namespace {

using Mat = std::vector<double>;  // row-major

struct Shape {
  std::string name;
  std::string config;  // HF config.json text
  bool fp8;
};

// A random checkpoint in the reference layout (model0-mp1.safetensors, reference names) plus an
// HF config.json; also returns every weight dequantised, by reference name, for the oracle.
struct RandomCheckpoint {
  std::string dir;
  std::map<std::string, Mat> w;  // reference tensor name (".weight"/".bias") -> values
  std::map<std::string, std::vector<int64_t>> shape;
};

RandomCheckpoint make_checkpoint(const Shape& s, uint64_t seed) {
  RandomCheckpoint rc;
  rc.dir = ::testing::TempDir() + "/dsv3_shape_" + s.name + "_" + std::to_string(::getpid());
  std::system(("rm -rf '" + rc.dir + "' && mkdir -p '" + rc.dir + "'").c_str());
  std::ofstream(rc.dir + "/config.json") << s.config;
  ModelArgs a = parse_model_args(s.config, s.name);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uni(-1, 1);
  std::vector<std::vector<uint8_t>> store;
  std::vector<std::string> names;
  std::vector<NamedTensor> out;
  names.reserve(4096);
  auto add = [&](const std::string& name, DType dt, std::vector<int64_t> shape, std::vector<uint8_t> bytes) {
    store.push_back(std::move(bytes));
    names.push_back(name);
    out.push_back({names.back(), dt, shape, store.back().data()});
  };
  for (const WeightSpec& spec : weight_manifest(a)) {
    std::string tn = spec.tensor_name();
    int64_t n = 1;
    for (auto d : spec.shape) n *= d;
    Mat vals(static_cast<size_t>(n));
    rc.shape[tn] = spec.shape;
    if (spec.kind == WeightKind::kBias) {
      std::vector<uint8_t> b(size_t(n) * 4);
      for (int64_t i = 0; i < n; ++i) {
        float v = float(0.05 * uni(rng));
        vals[size_t(i)] = v;
        std::memcpy(&b[size_t(i) * 4], &v, 4);
      }
      add(tn, DType::F32, spec.shape, std::move(b));
    } else if (spec.kind == WeightKind::kLinear && s.fp8) {
      const int64_t O = spec.shape[0], I = spec.shape[1], so = (O + 127) / 128, si = (I + 127) / 128;
      std::vector<uint8_t> q(size_t(O * I));
      std::vector<uint8_t> sb(size_t(so * si) * 4);
      std::vector<float> sc(size_t(so * si));
      for (auto& v : sc) v = float((0.5 + 0.5 * (uni(rng) + 1)) / std::sqrt(double(I)) / 200.0);
      std::memcpy(sb.data(), sc.data(), sb.size());
      for (int64_t o = 0; o < O; ++o)
        for (int64_t i = 0; i < I; ++i) {
          uint8_t b = f32_to_e4m3(float(300 * uni(rng)));
          q[size_t(o * I + i)] = b;
          vals[size_t(o * I + i)] = double(e4m3_to_f32(b)) * sc[size_t((o / 128) * si + i / 128)];
        }
      add(tn, DType::F8_E4M3, spec.shape, std::move(q));
      add(spec.name + ".scale", DType::F32, {so, si}, std::move(sb));
    } else {
      double scale = spec.kind == WeightKind::kNorm ? 0.2 : spec.kind == WeightKind::kEmbed ? 1.0
                                                                                           : 1.5 / std::sqrt(double(spec.shape.back()));
      double center = spec.kind == WeightKind::kNorm ? 1.0 : 0.0;
      std::vector<uint8_t> b(size_t(n) * 2);
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h = f32_to_bf16(float(center + scale * uni(rng)));
        vals[size_t(i)] = bf16_to_f32(h);
        std::memcpy(&b[size_t(i) * 2], &h, 2);
      }
      add(tn, DType::BF16, spec.shape, std::move(b));
    }
    rc.w[tn] = std::move(vals);
  }
  write_safetensors(rc.dir + "/model0-mp1.safetensors", out);
  return rc;
}

// ---- The oracle: the reference's forward for one sequence, double precision, no cache. ----
struct Oracle {
  const ModelArgs& a;
  const std::map<std::string, Mat>& w;

  const Mat& W(const std::string& n) const { return w.at(n); }
  Mat linear(const Mat& x, const std::string& name, int64_t out, int64_t in) const {
    const Mat& m = W(name + ".weight");
    Mat y(static_cast<size_t>(out));
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < in; ++i) acc += x[size_t(i)] * m[size_t(o * in + i)];
      y[size_t(o)] = acc;
    }
    return y;
  }
  Mat rmsnorm(Mat x, const std::string& name) const {
    double ss = 0;
    for (double v : x) ss += v * v;
    double r = 1 / std::sqrt(ss / double(x.size()) + double(a.rms_norm_eps));
    const Mat& g = W(name + ".weight");
    for (size_t i = 0; i < x.size(); ++i) x[i] *= r * g[i];
    return x;
  }
  std::vector<double> freqs() const {
    const int d = a.qk_rope_head_dim;
    std::vector<double> f(static_cast<size_t>(d / 2));
    for (int i = 0; i < d / 2; ++i) f[size_t(i)] = std::pow(double(a.rope_theta), -2.0 * i / d);
    if (a.yarn) {
      auto cdim = [&](double rot) { return d * std::log(a.original_seq_len / (rot * 2 * M_PI)) / (2 * std::log(double(a.rope_theta))); };
      double lo = std::max(0.0, std::floor(cdim(a.beta_fast))), hi = std::min(double(d - 1), std::ceil(cdim(a.beta_slow)));
      if (lo == hi) hi += 0.001;
      for (int i = 0; i < d / 2; ++i) {
        double smooth = 1 - std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
        f[size_t(i)] = f[size_t(i)] / a.rope_factor * (1 - smooth) + f[size_t(i)] * smooth;
      }
    }
    return f;
  }
  void rope(double* x, int pos) const {
    auto f = freqs();
    for (size_t i = 0; i < f.size(); ++i) {
      double c = std::cos(pos * f[i]), s = std::sin(pos * f[i]), p = x[2 * i], q = x[2 * i + 1];
      x[2 * i] = p * c - q * s;
      x[2 * i + 1] = p * s + q * c;
    }
  }
  Mat mlp(const Mat& x, const std::string& p, int64_t inter) const {
    Mat g = linear(x, p + ".w1", inter, a.dim), u = linear(x, p + ".w3", inter, a.dim);
    for (int64_t i = 0; i < inter; ++i) g[size_t(i)] = g[size_t(i)] / (1 + std::exp(-g[size_t(i)])) * u[size_t(i)];
    return linear(g, p + ".w2", a.dim, inter);
  }
  Mat moe(const Mat& x, const std::string& p) const {
    const int E = a.n_routed_experts, G = a.n_expert_groups, per = E / G;
    Mat s = linear(x, p + ".gate", E, a.dim);
    if (a.score_func == "softmax") {
      double mx = *std::max_element(s.begin(), s.end()), sum = 0;
      for (auto& v : s) sum += (v = std::exp(v - mx));
      for (auto& v : s) v /= sum;
    } else {
      for (auto& v : s) v = 1 / (1 + std::exp(-v));
    }
    bool has_bias = w.count(p + ".gate.bias") > 0;
    Mat c = s;
    if (has_bias)
      for (int e = 0; e < E; ++e) c[size_t(e)] += W(p + ".gate.bias")[size_t(e)];
    if (G > 1) {
      std::vector<std::pair<double, int>> gs;
      for (int g = 0; g < G; ++g) {
        Mat part(c.begin() + g * per, c.begin() + (g + 1) * per);
        std::sort(part.rbegin(), part.rend());
        gs.push_back({has_bias ? part[0] + part[1] : part[0], -g});
      }
      std::sort(gs.rbegin(), gs.rend());
      for (int r = a.n_limited_groups; r < G; ++r)
        for (int i = 0; i < per; ++i) c[size_t(-gs[size_t(r)].second * per + i)] = -INFINITY;
    }
    std::vector<std::pair<double, int>> order;
    for (int e = 0; e < E; ++e) order.push_back({c[size_t(e)], -e});
    std::sort(order.rbegin(), order.rend());
    double sum = 0;
    for (int k = 0; k < a.n_activated_experts; ++k) sum += s[size_t(-order[size_t(k)].second)];
    Mat y(size_t(a.dim), 0.0);
    for (int k = 0; k < a.n_activated_experts; ++k) {
      int e = -order[size_t(k)].second;
      double wt = s[size_t(e)] / (a.norm_topk_prob ? sum : 1.0) * a.route_scale;
      Mat o = mlp(x, p + ".experts." + std::to_string(e), a.moe_inter_dim);
      for (int d = 0; d < a.dim; ++d) y[size_t(d)] += wt * o[size_t(d)];
    }
    if (a.n_shared_experts > 0) {
      Mat z = mlp(x, p + ".shared_experts", int64_t(a.n_shared_experts) * a.moe_inter_dim);
      for (int d = 0; d < a.dim; ++d) y[size_t(d)] += z[size_t(d)];
    }
    return y;
  }
  // Logits at every position of `toks`.
  std::vector<Mat> forward(const std::vector<int32_t>& toks) const {
    const int L = int(toks.size()), H = a.n_heads, nope = a.qk_nope_head_dim, R = a.qk_rope_head_dim,
              qk = nope + R, V = a.v_head_dim, C = a.kv_lora_rank;
    std::vector<Mat> h(static_cast<size_t>(L));
    for (int t = 0; t < L; ++t)
      h[size_t(t)] = Mat(W("embed.weight").begin() + int64_t(toks[size_t(t)]) * a.dim,
                         W("embed.weight").begin() + int64_t(toks[size_t(t)] + 1) * a.dim);
    for (int l = 0; l < a.n_layers; ++l) {
      std::string p = "layers." + std::to_string(l);
      std::vector<Mat> q(static_cast<size_t>(L)), k(static_cast<size_t>(L)), v(static_cast<size_t>(L));
      for (int t = 0; t < L; ++t) {
        Mat x = rmsnorm(h[size_t(t)], p + ".attn_norm");
        if (a.q_lora_rank == 0) {
          q[size_t(t)] = linear(x, p + ".attn.wq", H * qk, a.dim);
        } else {
          Mat qa = rmsnorm(linear(x, p + ".attn.wq_a", a.q_lora_rank, a.dim), p + ".attn.q_norm");
          q[size_t(t)] = linear(qa, p + ".attn.wq_b", H * qk, a.q_lora_rank);
        }
        for (int hh = 0; hh < H; ++hh) rope(&q[size_t(t)][size_t(hh * qk + nope)], t);
        Mat kv = linear(x, p + ".attn.wkv_a", C + R, a.dim);
        rope(&kv[size_t(C)], t);
        Mat lat = rmsnorm(Mat(kv.begin(), kv.begin() + C), p + ".attn.kv_norm");
        Mat kvb = linear(lat, p + ".attn.wkv_b", H * (nope + V), C);
        k[size_t(t)].resize(size_t(H * qk));
        v[size_t(t)].resize(size_t(H * V));
        for (int hh = 0; hh < H; ++hh) {
          for (int d = 0; d < nope; ++d) k[size_t(t)][size_t(hh * qk + d)] = kvb[size_t(hh * (nope + V) + d)];
          for (int d = 0; d < R; ++d) k[size_t(t)][size_t(hh * qk + nope + d)] = kv[size_t(C + d)];
          for (int d = 0; d < V; ++d) v[size_t(t)][size_t(hh * V + d)] = kvb[size_t(hh * (nope + V) + nope + d)];
        }
      }
      double scale = a.softmax_scale();
      for (int t = 0; t < L; ++t) {
        Mat o(size_t(H * V), 0.0);
        for (int hh = 0; hh < H; ++hh) {
          Mat sc(static_cast<size_t>(t + 1));
          for (int u = 0; u <= t; ++u) {
            double acc = 0;
            for (int d = 0; d < qk; ++d) acc += q[size_t(t)][size_t(hh * qk + d)] * k[size_t(u)][size_t(hh * qk + d)];
            sc[size_t(u)] = acc * scale;
          }
          double mx = *std::max_element(sc.begin(), sc.end()), sum = 0;
          for (auto& x : sc) sum += (x = std::exp(x - mx));
          for (int u = 0; u <= t; ++u)
            for (int d = 0; d < V; ++d) o[size_t(hh * V + d)] += sc[size_t(u)] / sum * v[size_t(u)][size_t(hh * V + d)];
        }
        Mat y = linear(o, p + ".attn.wo", a.dim, H * V);
        for (int d = 0; d < a.dim; ++d) h[size_t(t)][size_t(d)] += y[size_t(d)];
        Mat x = rmsnorm(h[size_t(t)], p + ".ffn_norm");
        Mat f = a.is_moe_layer(l) ? moe(x, p + ".ffn") : mlp(x, p + ".ffn", a.inter_dim);
        for (int d = 0; d < a.dim; ++d) h[size_t(t)][size_t(d)] += f[size_t(d)];
      }
    }
    std::vector<Mat> logits;
    for (int t = 0; t < L; ++t) logits.push_back(linear(rmsnorm(h[size_t(t)], "norm"), "head", a.vocab_size, a.dim));
    return logits;
  }
};

const char* kShapeA = R"({"vocab_size": 301, "hidden_size": 200, "intermediate_size": 160, "moe_intermediate_size": 72,
  "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 3, "n_routed_experts": 6,
  "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.5,
  "scoring_func": "softmax", "norm_topk_prob": false, "q_lora_rank": null, "kv_lora_rank": 96,
  "qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 20, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
  "max_position_embeddings": 64, "rope_scaling": {"type": "yarn", "factor": 4.0,
  "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}})";

const char* kShapeB = R"({"vocab_size": 333, "hidden_size": 264, "intermediate_size": 200, "moe_intermediate_size": 100,
  "num_hidden_layers": 2, "first_k_dense_replace": 0, "num_attention_heads": 5, "n_routed_experts": 12,
  "n_shared_experts": 2, "num_experts_per_tok": 3, "n_group": 3, "topk_group": 2, "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": true, "q_lora_rank": 136,
  "kv_lora_rank": 144, "qk_nope_head_dim": 16, "qk_rope_head_dim": 12, "v_head_dim": 24, "rope_theta": 50000.0,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 48,
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}})";

void PrintTo(const Shape& s, std::ostream* os) { *os << s.name; }

class Shapes : public ::testing::TestWithParam<Shape> {};

TEST_P(Shapes, MatchTheDoublePrecisionOracle) {
  const Shape& s = GetParam();
  RandomCheckpoint rc = make_checkpoint(s, 1234);
  ModelArgs a = parse_model_args(s.config, s.name);
  Oracle oracle{a, rc.w};
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> seqs = {{}, {}};
  for (int t = 0; t < 11; ++t) seqs[0].push_back(int32_t(rng() % uint32_t(a.vocab_size)));
  for (int t = 0; t < 7; ++t) seqs[1].push_back(int32_t(rng() % uint32_t(a.vocab_size)));
  std::vector<std::vector<Mat>> want = {oracle.forward(seqs[0]), oracle.forward(seqs[1])};
  for (AttnImpl impl : {AttnImpl::kAbsorb, AttnImpl::kNaive}) {
    ModelOptions opt;
    opt.attn = impl;
    opt.max_seqs = 3;
    opt.kv_block = 4;  // small blocks: the prompts and steps cross block boundaries
    Model m(Checkpoint::open(rc.dir), make_ref_backend(), opt);
    BlockTable tables[3];
    m.kv_cache().reserve(tables[2], 11);
    m.kv_cache().reserve(tables[0], 7);
    auto forward = [&](const std::vector<int32_t>& toks, const std::vector<TokenPos>& pos,
                       const std::vector<int64_t>& rows, float* logits) {
      Model::Batch b;
      b.tokens = toks.data(), b.pos = pos.data(), b.n = int64_t(toks.size()), b.logit_rows = rows;
      b.seqs = {&tables[0], &tables[1], &tables[2]};
      m.forward(b, logits);
    };
    ASSERT_EQ(m.checkpoint().layout(), "reference");
    const int V = a.vocab_size;
    auto check = [&](int seq, int t, const float* got) {
      double err = rel_l2(std::vector<float>(got, got + V).data(),
                          std::vector<float>(want[size_t(seq)][size_t(t)].begin(), want[size_t(seq)][size_t(t)].end()).data(),
                          size_t(V));
      EXPECT_LE(err, 1e-4) << s.name << (impl == AttnImpl::kAbsorb ? " absorb" : " naive") << " seq " << seq
                           << " position " << t;
    };
    // Prefill: sequence 0 in table 2 (5 tokens, every position's logits), sequence 1 in table 0 (3).
    std::vector<int32_t> toks;
    std::vector<TokenPos> pos;
    for (int t = 0; t < 5; ++t) toks.push_back(seqs[0][size_t(t)]), pos.push_back({2, t});
    for (int t = 0; t < 3; ++t) toks.push_back(seqs[1][size_t(t)]), pos.push_back({0, t});
    std::vector<int64_t> rows = {0, 1, 2, 3, 4, 5, 6, 7};
    std::vector<float> got(rows.size() * size_t(V));
    forward(toks, pos, rows, got.data());
    for (int t = 0; t < 5; ++t) check(0, t, got.data() + size_t(t) * V);
    for (int t = 0; t < 3; ++t) check(1, t, got.data() + size_t(5 + t) * V);
    // Decode: one token per live sequence per step, both in one call while both last.
    for (int step = 0;; ++step) {
      toks.clear(), pos.clear();
      std::vector<int> which;
      if (5 + step < 11) toks.push_back(seqs[0][size_t(5 + step)]), pos.push_back({2, 5 + step}), which.push_back(0);
      if (3 + step < 7) toks.push_back(seqs[1][size_t(3 + step)]), pos.push_back({0, 3 + step}), which.push_back(1);
      if (toks.empty()) break;
      rows.assign(toks.size(), 0);
      for (size_t r = 0; r < rows.size(); ++r) rows[r] = int64_t(r);
      forward(toks, pos, rows, got.data());
      for (size_t r = 0; r < which.size(); ++r) check(which[r], pos[r].pos, got.data() + r * size_t(V));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Random, Shapes,
                         ::testing::Values(Shape{"softmax_noqlora_yarn_bf16", kShapeA, false},
                                           Shape{"sigmoid_groups_qlora_fp8_ragged", kShapeB, true}),
                         [](const auto& p) { return p.param.name; });

}  // namespace
