#!/usr/bin/env bash
# ncu of the decode GEMVs with and without the L2 prefetch ahead of them (caches not flushed between kernels)
set -u
B=/tmp/dsv3_cuda_build
export PATH=/usr/local/cuda/bin:$PATH
for pf in 3 0; do
  DSV3_CUDA_L2_PREFETCH=$pf timeout 200 ncu --clock-control none --cache-control none --kernel-name "regex:gemv_kernel|moe_gemv|l2_prefetch|gate_route" \
    --launch-skip 300 --launch-count 12 --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats \
    "$B/bench" --dtypes bf16 --quick --steps 8 --decode-only > "$OUT/ncu_pf$pf.txt" 2>&1
  echo "== pf=$pf rc=$?"
  grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|L2 Hit Rate|Grid Size" "$OUT/ncu_pf$pf.txt" | head -80
done
