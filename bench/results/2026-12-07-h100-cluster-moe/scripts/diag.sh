#!/bin/bash
# diagnosis of the cluster MoE kernel: A/B of its signal lag (compile flag) and Nsight Compute of it and its twin
set -u
O=$OUT; B=/tmp/dsv3_cuda_build
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1
OUT=$O/s TESTS=none PACK=0 JOBS=16 ALT_NVFLAGS="-DDSV3_MF8_LAG=1" ALT_ROUNDS=1 \
  BENCH_ARGS="--dtypes fp8 --variants default,moe-persist-0 --batches 256 --ctx 512 --steps 16" bash scripts/cuda_device_run.sh > $O/build.log 2>&1
cp $O/s/summary.txt $O/ab_summary.txt
NC="ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
timeout 100 $NC --kernel-name regex:moe_f8_kernel --launch-skip 10 --launch-count 2 $B/bench --dtypes fp8 --variants default --batches 256 --ctx 512 --decode-only --steps 2 > $O/ncu_persist_b256.txt 2>&1
timeout 100 $NC --kernel-name regex:tc_gemm_kernel --launch-skip 20 --launch-count 4 $B/bench --dtypes fp8 --variants moe-persist-0 --batches 256 --ctx 512 --decode-only --steps 2 > $O/ncu_twin_b256.txt 2>&1
timeout 100 $NC --kernel-name regex:moe_f8_kernel --launch-skip 6 --launch-count 2 $B/bench --dtypes fp8 --variants default --prefill-only --quick > $O/ncu_persist_prefill.txt 2>&1
for f in $O/ncu_*.txt; do echo "## $f"; grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|Memory Throughput|L2 Hit|Compute \(SM\)|Achieved Occupancy|Cluster|Waves|Grid Size|Registers Per|Dynamic Shared" $f | head -40; grep issue_stalled $f | awk '$NF+0 >= 0.1' | sed 's/smsp__average_warps_issue_stalled_//'; done
