// The CUDA backend's sampling where the logits are (only the ids come back), and its test hooks.
#include <vector>

#include "backend/cuda/backend_impl.h"
#include "core/error.h"

namespace dsv3::cuda_impl {

// The host sampler's checks and messages for logit row r of x (device): `bad` the index of a
// NaN / +inf logit (< 0: none), `none` every one of its `limit` logits -inf.
void CudaBackend::check_logit_row(const float* x, int64_t r, int64_t cols, int64_t limit, int32_t bad, bool none) {
  if (bad >= 0) {
    float v = 0.f;
    CK(cudaMemcpy(&v, x + r * cols + bad, 4, cudaMemcpyDeviceToHost));
    fail("sampling: logit of token ", bad, " is ", v, " (must be finite or -inf)");
  }
  if (none) fail("sampling: every one of the ", limit, " logits is -inf");
}

bool CudaBackend::argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t limit, int32_t* ids) {
  on_device();
  no_capture("argmax_rows");
  flush_marks();
  int32_t* d = static_cast<int32_t*>(scratch(kTopk, size_t(rows) * 12));
  cuda::argmax_rows(L_, x, rows, cols, limit, d);
  std::vector<int32_t> h(static_cast<size_t>(rows) * 3);
  wait_collectives();
  CK(cudaMemcpyAsync(h.data(), d, h.size() * 4, cudaMemcpyDeviceToHost, stream_));
  sync();
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* o = &h[size_t(r) * 3];
    check_logit_row(x, r, cols, limit, o[1], o[2] != 0);
    ids[r] = o[0];
  }
  return true;
}

bool CudaBackend::sample_rows(const float* x, int64_t rows, int64_t cols, int64_t limit, const SampleSpec* spec,
                              int32_t* ids, float* host_logits) {
  on_device();
  no_capture("sample_rows");
  flush_marks();
  std::vector<cuda::DevSample> hs(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const SampleSpec& s = spec[r];
    hs[size_t(r)] = {s.temperature, s.top_p, s.min_p, s.top_k, s.u, s.host ? 1 : 0, 0};
  }
  const size_t sb = hs.size() * sizeof(cuda::DevSample), ob = (size_t(rows) * 12 + 15) / 16 * 16;
  char* d = static_cast<char*>(scratch(kTopk, sb + ob + size_t(rows * limit) * sizeof(double)));
  auto* ds = reinterpret_cast<cuda::DevSample*>(d);
  auto* dout = reinterpret_cast<int32_t*>(d + sb);
  auto* dw = reinterpret_cast<double*>(d + sb + ob);
  CK(cudaMemcpyAsync(ds, hs.data(), sb, cudaMemcpyHostToDevice, stream_));
  cuda::sample_rows(L_, x, rows, cols, limit, ds, dout, dw);
  std::vector<int32_t> h(static_cast<size_t>(rows) * 3);
  wait_collectives();
  CK(cudaMemcpyAsync(h.data(), dout, h.size() * 4, cudaMemcpyDeviceToHost, stream_));
  sync();
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* o = &h[size_t(r) * 3];  // {id, status, index}: cuda::sample_rows
    check_logit_row(x, r, cols, limit, o[1] == 2 ? o[2] : -1, o[1] == 3);
    ids[r] = o[1] == 0 ? o[0] : -1;
    if (o[1] == 1) CK(cudaMemcpy(host_logits + r * cols, x + r * cols, size_t(cols) * 4, cudaMemcpyDeviceToHost));
  }
  return true;
}

// Test hook: act_quant.
void CudaBackend::act_quant(const float* x, int64_t rows, int64_t cols, bool ue8m0, uint8_t* y, float* s) {
  const size_t n = size_t(rows * cols), nb = n / 128;
  uint8_t* dy = static_cast<uint8_t*>(scratch(kTopk, n + nb * 4 + 16));
  float* ds = reinterpret_cast<float*>(dy + (n + 15) / 16 * 16);
  cuda::act_quant(L_, x, rows, cols, ue8m0, dy, ds);
  CK(cudaMemcpyAsync(y, dy, n, cudaMemcpyDeviceToHost, stream_));
  CK(cudaMemcpyAsync(s, ds, nb * 4, cudaMemcpyDeviceToHost, stream_));
  sync();
}

}  // namespace dsv3::cuda_impl
