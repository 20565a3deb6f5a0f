// dsv3_cublaslt_bench: does cuBLASLt's block-scaled FP8 matmul (CUDA 13: A scales
// CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F for the weights, B scales ..._VEC128_32F for the
// activations — DeepSeek's 128x128 weight blocks and 1x128 activation groups) serve the H200 at
// decode and prefill shapes? For each linear of the 16B shape and 1..1024 tokens it times
//   - cuBLASLt FP8 x FP8 with the two block scales (activations already quantised: act_quant
//     comes on top), bf16 output;
//   - cuBLASLt bf16 x bf16 (the same product with bf16 weights and activations), bf16 output;
//   - dsv3's own path for FP8 weights (Backend::linear: the GEMV up to 8 tokens, the wgmma
//     kernel beyond; float32 activations and output), timed from the host over many calls;
// beside the weight bytes per microsecond and the TFLOP/s. First it checks on a small product
// which layout of the two scale tensors cuBLASLt reads (against a float64 product on the host).
//
//   dsv3_cublaslt_bench [--reps N]
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "core/dtype.h"
#include "model/weights.h"

using namespace dsv3;

namespace {

#define CU(x) check_cuda((x), #x, __LINE__)
#define LT(x) check_lt((x), #x, __LINE__)
void check_cuda(cudaError_t e, const char* what, int line) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "line %d: %s: %s\n", line, what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void check_lt(cublasStatus_t s, const char* what, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "line %d: %s: cuBLAS status %d\n", line, what, int(s));
    std::exit(1);
  }
}

double e4m3(uint8_t b) { return double(e4m3_to_f32(b)); }  // exact

std::vector<uint8_t> random_e4m3(size_t n, std::mt19937& g) {
  std::uniform_int_distribution<int> d(0, 255);
  std::vector<uint8_t> v(n);
  for (auto& b : v) {
    b = uint8_t(d(g));
    if ((b & 0x7f) == 0x7f) b &= 0xfe;  // no NaN codes
  }
  return v;
}

std::vector<float> uniform(size_t n, float lo, float hi, std::mt19937& g) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

template <class T>
T* to_dev(const std::vector<T>& h, size_t min_elems = 0) {
  T* p = nullptr;
  const size_t n = std::max(h.size(), min_elems);
  CU(cudaMalloc(&p, n * sizeof(T)));
  CU(cudaMemset(p, 0, n * sizeof(T)));
  CU(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

// One cuBLASLt product of X [M, K] and W [N, K] (row-major) in cuBLAS's TN form. Plain: A = W
// (K x N, transposed, the 128x128 scales), B = X (K x M, the 1x128 scales), D = the [M, N]
// product row-major. swap: A = X, B = W, D = its transpose [N, M].
struct LtGemm {
  cublasLtHandle_t lt;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulHeuristicResult_t heur = {};
  bool ok = false;
  void* ws = nullptr;
  size_t ws_bytes = size_t(32) << 20;
  bool swap;
  LtGemm(cublasLtHandle_t h, bool fp8, bool swap_, int64_t M, int64_t N, int64_t K, const float* w_scale,
         const float* x_scale)
      : lt(h), swap(swap_) {
    const float* a_scale = swap ? x_scale : w_scale;
    const float* b_scale = swap ? w_scale : x_scale;
    const int64_t an = swap ? M : N, bn = swap ? N : M;
    LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof n));
    const cudaDataType in = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    if (fp8) {
      const int32_t blk = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, vec = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      const int32_t am = swap ? vec : blk, bm = swap ? blk : vec;
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof am));
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof bm));
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof a_scale));
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof b_scale));
    }
    LT(cublasLtMatrixLayoutCreate(&a, in, uint64_t(K), uint64_t(an), K));
    LT(cublasLtMatrixLayoutCreate(&b, in, uint64_t(K), uint64_t(bn), K));
    LT(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, uint64_t(an), uint64_t(bn), an));
    cublasLtMatmulPreference_t pref;
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                            sizeof ws_bytes));
    int found = 0;
    const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt, desc, a, b, d, d, pref, 1, &heur, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    ok = s == CUBLAS_STATUS_SUCCESS && found > 0;
    if (ok) CU(cudaMalloc(&ws, ws_bytes));
  }
  ~LtGemm() {
    if (ws) cudaFree(ws);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(d);
    cublasLtMatmulDescDestroy(desc);
  }
  cublasStatus_t run(const void* w, const void* x, void* out, cudaStream_t st) {
    const float one = 1.f, zero = 0.f;
    return cublasLtMatmul(lt, desc, &one, swap ? x : w, a, swap ? w : x, b, &zero, out, d, out, d, &heur.algo, ws,
                          ws_bytes, st);
  }
};

// GPU time per call: `reps` calls recorded as one CUDA graph (no host launch cost in between).
double time_us(int reps, cudaStream_t st, auto&& f) {
  for (int i = 0; i < 3; ++i) f();
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < reps; ++i) f();
  CU(cudaStreamEndCapture(st, &graph));
  CU(cudaGraphInstantiate(&exec, graph, 0));
  CU(cudaGraphLaunch(exec, st));
  cudaEvent_t e0, e1;
  CU(cudaEventCreate(&e0));
  CU(cudaEventCreate(&e1));
  CU(cudaEventRecord(e0, st));
  CU(cudaGraphLaunch(exec, st));
  CU(cudaEventRecord(e1, st));
  CU(cudaEventSynchronize(e1));
  float ms = 0;
  CU(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return ms * 1e3 / reps;
}

// A [rows][kb] scale tensor (blocks along K fastest: the checkpoint's [N/128][K/128] and
// act_quant's [M][K/128]) in one of three orders: 0 as given, 1 K-blocks fastest with the row
// length padded to a multiple of 4, 2 rows fastest (padded to a multiple of 4).
std::vector<float> arrange(const std::vector<float>& s, int64_t rows, int64_t kb, int mode) {
  const int64_t kp = (kb + 3) / 4 * 4, rp = (rows + 3) / 4 * 4;
  std::vector<float> o(size_t(std::max(rows * kp, rp * kb)), 0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < kb; ++k)
      o[size_t(mode == 0 ? r * kb + k : mode == 1 ? r * kp + k : k * rp + r)] = s[size_t(r * kb + k)];
  return o;
}
const char* kOrder[3] = {"[rows][K/128]", "[rows][K/128 padded to 4]", "[K/128][rows padded to 4]"};

// Which scale layouts make cuBLASLt's result match the float64 product (bf16-output error).
void check_layouts(cublasLtHandle_t lt, cudaStream_t st) {
  const int64_t M = 16, N = 256, K = 384, nb = N / 128, kb = K / 128;
  std::mt19937 g(11);
  const auto w = random_e4m3(size_t(N * K), g), x = random_e4m3(size_t(M * K), g);
  const auto ws = uniform(size_t(nb * kb), 0.5f / 64, 2.f / 64, g), xs = uniform(size_t(M * kb), 0.5f, 2.f, g);
  std::vector<double> want(size_t(M * N));
  double norm = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k)
        acc += e4m3(x[size_t(m * K + k)]) * xs[size_t(m * kb + k / 128)] * e4m3(w[size_t(n * K + k)]) *
               ws[size_t((n / 128) * kb + k / 128)];
      want[size_t(m * N + n)] = acc, norm += acc * acc;
    }
  uint8_t* dw = to_dev(w);
  uint8_t* dx = to_dev(x);
  uint16_t* dd = nullptr;
  CU(cudaMalloc(&dd, size_t(M * N) * 2));
  for (int swap = 0; swap < 2; ++swap)
    for (int wl = 0; wl < 3; ++wl)
      for (int xl = 0; xl < 3; ++xl) {
        float* dws = to_dev(arrange(ws, nb, kb, wl), 4096);
        float* dxs = to_dev(arrange(xs, M, kb, xl), 4096);
        LtGemm gm(lt, true, swap, M, N, K, dws, dxs);
        if (!gm.ok) {
          std::printf("scale layout check: %s: no cuBLASLt algorithm\n", swap ? "A = activations" : "A = weights");
          cudaFree(dws);
          cudaFree(dxs);
          continue;
        }
        LT(gm.run(dw, dx, dd, st));
        CU(cudaStreamSynchronize(st));
        std::vector<uint16_t> got(size_t(M * N));
        CU(cudaMemcpy(got.data(), dd, got.size() * 2, cudaMemcpyDeviceToHost));
        double err = 0;
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            const double v = bf16_to_f32(got[size_t(swap ? n * M + m : m * N + n)]);
            err += std::pow(v - want[size_t(m * N + n)], 2);
          }
        std::printf("scale layout check: %s, weight scales %s, activation scales %s: relative L2 error %.3g\n",
                    swap ? "A = activations (1x128), B = weights (128x128)" : "A = weights (128x128), B = activations (1x128)",
                    kOrder[wl], kOrder[xl], std::sqrt(err / norm));
        cudaFree(dws);
        cudaFree(dxs);
      }
  cudaFree(dw);
  cudaFree(dx);
  cudaFree(dd);
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int main(int argc, char** argv) {
  int reps = 50;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: dsv3_cublaslt_bench [--reps N]\n");
      return 2;
    }
  }
  std::string why;
  if (!cuda::device_available(&why)) {
    std::fprintf(stderr, "dsv3_cublaslt_bench: %s\n", why.c_str());
    return 2;
  }
  cudaDeviceProp prop;
  CU(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, cuBLASLt %zu\n", prop.name, cublasLtGetVersion());
  cublasLtHandle_t lt;
  LT(cublasLtCreate(&lt));
  cudaStream_t st;
  CU(cudaStreamCreate(&st));
  check_layouts(lt, st);

  CudaOptions o = CudaOptions::from_env();
  auto be = make_cuda_backend(o);
  struct Shape {
    const char* name;
    int64_t N, K;
  };
  const Shape shapes[] = {{"wq", 3072, 2048}, {"wo", 2048, 2048}, {"expert w1", 1408, 2048}, {"expert w2", 2048, 1408},
                          {"dense w1", 10880, 2048}};
  std::printf("%-10s %5s %5s %5s | %-26s | %-26s | %-26s | %-26s\n", "linear", "N", "K", "M",
              "cuBLASLt FP8, A = weights", "cuBLASLt FP8, A = activ.", "cuBLASLt bf16", "dsv3 FP8 weights (host-timed)");
  std::mt19937 g(5);
  for (const Shape& s : shapes) {
    const int64_t N = s.N, K = s.K, nb = N / 128, kb = K / 128;
    const auto w8 = random_e4m3(size_t(N * K), g);
    const auto ws = uniform(size_t(nb * kb), 0.5f / 64, 2.f / 64, g);
    uint8_t* dw8 = to_dev(w8);
    float* dws = to_dev(ws, size_t((kb + 4) * (nb + 4)));
    std::vector<uint16_t> wb(size_t(N * K));
    for (size_t i = 0; i < wb.size(); ++i) {
      wb[i] = f32_to_bf16(float(e4m3(w8[i]) * ws[(i / size_t(K)) / 128 * size_t(kb) + (i % size_t(K)) / 128]));
    }
    uint16_t* dwb = to_dev(wb);
    // dsv3's linear on the same FP8 weights (uploaded through prepare_weights).
    ModelWeights mw;
    mw.head.weight = {DType::F8_E4M3, {N, K}, w8.data()};
    mw.head.scale = {DType::F32, {nb, kb}, ws.data()};
    ModelArgs margs;
    be->prepare_weights(margs, mw);
    for (int64_t M : {1, 8, 64, 256, 1024}) {
      const auto x8 = random_e4m3(size_t(M * K), g);
      const auto xs = uniform(size_t(M * kb), 0.5f, 2.f, g);
      uint8_t* dx8 = to_dev(x8);
      float* dxs = to_dev(xs, size_t((kb + 4) * (M + 4)));
      std::vector<uint16_t> xb(size_t(M * K), 0x3f80);
      uint16_t* dxb = to_dev(xb);
      uint16_t* dd = nullptr;
      CU(cudaMalloc(&dd, size_t(M * N) * 2));
      const double flop = 2.0 * double(M) * double(N) * double(K);
      char c8[2][64] = {"no algorithm", "no algorithm"}, cb[64] = "no algorithm", cd[64] = "";
      for (int swap = 0; swap < 2; ++swap) {
        LtGemm gm(lt, true, swap, M, N, K, dws, dxs);
        if (gm.ok) {
          const double us = time_us(reps, st, [&] { LT(gm.run(dw8, dx8, dd, st)); });
          std::snprintf(c8[swap], sizeof c8[swap], "%8.1f us %5.0f GB/s %5.0f TF", us, double(N * K) / us / 1e3,
                        flop / us / 1e6);
        }
      }
      {
        LtGemm gm(lt, false, false, M, N, K, nullptr, nullptr);
        if (gm.ok) {
          const double us = time_us(reps, st, [&] { LT(gm.run(dwb, dxb, dd, st)); });
          std::snprintf(cb, sizeof cb, "%8.1f us %5.0f GB/s %5.0f TF", us, double(N * K * 2) / us / 1e3,
                        flop / us / 1e6);
        }
      }
      {
        std::vector<float> xf(size_t(M * K), 0.5f);
        float* x = be->alloc(xf.size());
        float* y = be->alloc(size_t(M * N));
        be->upload(x, xf.data(), xf.size());
        float probe = 0;
        for (int i = 0; i < 3; ++i) be->linear(x, M, mw.head, y);
        be->download(&probe, y, 1);
        const double t0 = now();
        for (int i = 0; i < reps; ++i) be->linear(x, M, mw.head, y);
        be->download(&probe, y, 1);
        const double us = (now() - t0) * 1e6 / reps;
        std::snprintf(cd, sizeof cd, "%8.1f us %5.0f GB/s %5.0f TF", us, double(N * K) / us / 1e3, flop / us / 1e6);
        be->release(x);
        be->release(y);
      }
      std::printf("%-10s %5ld %5ld %5ld | %-26s | %-26s | %-26s | %-26s\n", s.name, long(N), long(K), long(M), c8[0],
                  c8[1], cb, cd);
      std::fflush(stdout);
      cudaFree(dx8);
      cudaFree(dxs);
      cudaFree(dxb);
      cudaFree(dd);
    }
    cudaFree(dw8);
    cudaFree(dws);
    cudaFree(dwb);
  }
  cublasLtDestroy(lt);
  cudaStreamDestroy(st);
  return 0;
}
