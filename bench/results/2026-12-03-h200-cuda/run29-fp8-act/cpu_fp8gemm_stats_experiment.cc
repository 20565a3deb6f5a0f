#include <algorithm>
#include <cstdio>
#include <cmath>
#include <vector>
#include "backend/backend.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/model.h"
using namespace dsv3;

int main(int argc, char** argv) {
  std::string c = argv[1];
  std::string dir = std::string("/work/main/tests/data/golden/models/") + c;
  SafetensorsFile g(dir + "/golden.safetensors");
  ModelOptions mo; mo.max_slots = 4; mo.attn = argc > 2 ? AttnImpl::kNaive : AttnImpl::kAbsorb;
  Model model(Checkpoint::open(dir + "/hf"), make_ref_backend(), mo);
  const int V = model.args().vocab_size;
  std::vector<double> errs, errs8; int agree = 0, total = 0;
  for (int s = 0;; ++s) {
    char key[32]; std::snprintf(key, sizeof key, "step%03d", s);
    if (!g.has(std::string(key) + ".tokens")) break;
    TensorView tok = g.get(std::string(key) + ".tokens"), want = g.get(std::string(key) + ".logits_fp32"), w8 = g.get(std::string(key) + ".logits_fp8gemm");
    int B = int(tok.dim(0)), T = int(tok.dim(1)), start = g.get(std::string(key) + ".start_pos").as<int32_t>()[0];
    std::vector<float> got(size_t(B) * V);
    model.forward(tok.as<int32_t>(), B, T, start, got.data());
    double num = 0, den = 0, n8 = 0, d8 = 0;
    for (int b = 0; b < B; ++b) {
      const float* w = want.as<float>() + size_t(b) * V; const float* r8 = w8.as<float>() + size_t(b) * V;
      for (int i = 0; i < V; ++i) { double d = got[size_t(b)*V+i] - w[i]; num += d*d; den += double(w[i])*w[i]; double e = double(r8[i]) - w[i]; n8 += e*e; }
      int a1 = int(std::max_element(got.begin() + size_t(b)*V, got.begin() + size_t(b+1)*V) - (got.begin() + size_t(b)*V));
      int a2 = int(std::max_element(w, w + V) - w);
      agree += a1 == a2; ++total;
    }
    errs.push_back(std::sqrt(num/den)); errs8.push_back(std::sqrt(n8/den));
  }
  auto st = [](std::vector<double> v) { std::sort(v.begin(), v.end()); std::printf("max %.3f median %.3f  ", v.back(), v[v.size()/2]); };
  std::printf("%s ours: ", c.c_str()); st(errs); std::printf("argmax %d/%d | reference fp8gemm: ", agree, total); st(errs8); std::printf("\n");
}
