// Rotary embedding tables with the reference's YaRN correction (precompute_freqs_cis) and the
// rotation of interleaved pairs (apply_rotary_emb: x[2i], x[2i+1] as one complex number).
#pragma once
#include <vector>

#include "model/config.h"

namespace dsv3 {

// freqs[i], i < qk_rope_head_dim/2, YaRN-corrected when args.yarn; float32 as the reference.
std::vector<float> rope_freqs(const ModelArgs& args);

// cos/sin of position t: out[2i] = cos(t*freqs[i]) * m, out[2i+1] = sin(t*freqs[i]) * m, the angle
// rounded to float32 first (torch.outer in float32); m = yarn mscale ratio (1 unless mscale and
// mscale_all_dim differ, Hugging Face's _mscale).
class RopeTable {
 public:
  RopeTable() = default;
  RopeTable(const ModelArgs& args, int n_positions);
  int n_positions() const { return n_pos_; }
  int half() const { return half_; }
  const float* at(int pos) const { return cos_sin_.data() + size_t(pos) * size_t(2 * half_); }

 private:
  int n_pos_ = 0, half_ = 0;
  std::vector<float> cos_sin_;  // [n_positions, half, 2]
};

// Rotates x[0..2*half) in place by the pairs of `cs` (RopeTable::at(pos)).
inline void apply_rope(float* x, const float* cs, int half) {
  for (int i = 0; i < half; ++i) {
    float a = x[2 * i], b = x[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = a * s + b * c;
  }
}

}  // namespace dsv3
