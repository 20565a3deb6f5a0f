// Which 4-D tensor maps the driver encodes: w1 | w3 interleave probe.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
typedef CUresult (*Enc)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                        const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                        CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
int main() {
  void* p = nullptr; cudaDriverEntryPointQueryResult q;
  cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
  Enc enc = (Enc)p;
  char* buf; cudaMalloc(&buf, size_t(64) << 20);
  const cuuint32_t step[4] = {1, 1, 1, 1};
  long rows = 1408, cols = 2048, ld = 2048;
  long deltas[] = {rows * ld, rows * ld + 4096, 3 * rows * ld};
  for (long delta : deltas) {
    cuuint64_t d[4] = {cuuint64_t(cols), 8, 2, cuuint64_t(rows / 8)};
    cuuint64_t s[3] = {cuuint64_t(ld), cuuint64_t(delta), cuuint64_t(8 * ld)};
    cuuint32_t b[4] = {128, 8, 2, 8};
    CUtensorMap m;
    for (int sw = 0; sw < 2; ++sw) {
      CUresult r = enc(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, buf, d, s, b, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                       sw ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
      printf("4-D {K,8,2,rows/8} strides {ld, %ld, 8ld} swizzle %d: %d\n", delta, sw, int(r));
    }
    // the same with the dims reordered so strides grow: {K, 8, rows/8, 2} strides {ld, 8ld, delta}, box {128,8,8,2}
    cuuint64_t d2[4] = {cuuint64_t(cols), 8, cuuint64_t(rows / 8), 2};
    cuuint64_t s2[3] = {cuuint64_t(ld), cuuint64_t(8 * ld), cuuint64_t(delta)};
    cuuint32_t b2[4] = {128, 8, 8, 2};
    CUresult r = enc(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, buf, d2, s2, b2, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    printf("4-D monotone {K,8,rows/8,2} delta %ld: %d\n", delta, int(r));
  }
  return 0;
}
