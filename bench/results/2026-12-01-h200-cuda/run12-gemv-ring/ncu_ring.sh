#!/usr/bin/env bash
# ncu of the decode GEMVs with the shared-memory ring (default) and with register buffers
set -u
B=/tmp/dsv3_cuda_build
export PATH=/usr/local/cuda/bin:$PATH
for a in 1 0; do
  DSV3_CUDA_GEMV_ASYNC=$a timeout 200 ncu --clock-control none --kernel-name "regex:moe_gemv|gemv_kernel" --launch-skip 300 --launch-count 5 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    "$B/bench" --dtypes bf16 --quick --steps 8 --decode-only > "$OUT/ncu_ring$a.txt" 2>&1
  echo "== async=$a rc=$?"
  grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Block Limit|Shared Memory Configuration|Dynamic Shared|Registers Per" "$OUT/ncu_ring$a.txt" | head -70
done
