#!/bin/bash
# Nsight Compute of the cluster MoE kernel after the barrier change: decode b256 and a 1024-token prefill
set -u
O=$OUT; B=/tmp/dsv3_cuda_build
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1
OUT=$O/s TESTS=none PACK=0 JOBS=16 BENCH_ARGS=none bash scripts/cuda_device_run.sh > $O/build.log 2>&1
grep "build done" $O/s/summary.txt
NC="ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
timeout 120 $NC --kernel-name regex:moe_f8_kernel --launch-skip 300 --launch-count 4 $B/bench --dtypes fp8 --variants default --batches 256 --ctx 16 --decode-only --steps 8 > $O/ncu_persist_b256.txt 2>&1
timeout 100 $NC --kernel-name regex:moe_f8_kernel --launch-skip 6 --launch-count 2 $B/bench --dtypes fp8 --variants default --prefill-only --quick > $O/ncu_persist_prefill.txt 2>&1
timeout 100 $NC --kernel-name regex:tc_gemm_kernel --launch-skip 300 --launch-count 8 $B/bench --dtypes fp8 --variants moe-persist-0 --batches 256 --ctx 16 --decode-only --steps 8 > $O/ncu_twin_b256.txt 2>&1
for f in $O/ncu_*.txt; do echo "## $f"; grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|L2 Hit|Memory Throughput|Compute \(SM\)|Issued Warp|No Eligible" $f | head -60; grep issue_stalled $f | awk '$NF+0 >= 0.2' | sed 's/smsp__average_warps_issue_stalled_//' | head -24; done
