#!/bin/bash
set -u
O=$OUT; B=/tmp/dsv3_cuda_build
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=$O/s CLI=0 BENCH_ARGS=none PACK=0 TESTS=none bash scripts/cuda_device_run.sh > $O/build.log 2>&1
grep "build done" $O/s/summary.txt
A="--dtypes fp8 --variants default --batches 1 --ctx 512 --decode-only --steps 8"
for m in fast base; do
  E=""; [ $m = fast ] && E="DSV3_CUDA_FAST=1"
  env $E DSV3_CUDA_GRAPH=0 timeout 100 ncu --clock-control none --kernel-name regex:decode_attn_warps --launch-skip 200 --launch-count 1 --section SpeedOfLight --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy $B/bench $A > $O/ncu_$m.txt 2>&1
  grep -E "decode_attn_warps|Duration|DRAM Throughput|Grid Size|Block Size|Registers Per|L2 Hit|L1/TEX Hit|Warp Cycles Per Issued|Achieved Occ|Dynamic Shared" $O/ncu_$m.txt
done
env DSV3_CUDA_FAST=1 DSV3_CUDA_GRAPH=0 timeout 120 ncu --clock-control none --kernel-name regex:decode_attn_warps --launch-skip 200 --launch-count 1 --section SourceCounters --section WarpStateStats --page source --print-source sass --csv $B/bench $A > $O/ncu_src_fast.csv 2>/dev/null
echo "src rc=$?"
rm -rf $O/s
