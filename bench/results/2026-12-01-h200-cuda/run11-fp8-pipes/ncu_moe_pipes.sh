#!/usr/bin/env bash
# ncu of the decode expert GEMVs (moe_gemv_kernel), FP8 against bf16 weights: pipes, issue, stalls
set -u
B=/tmp/dsv3_cuda_build
export PATH=/usr/local/cuda/bin:$PATH
for dt in fp8 bf16; do
  timeout 200 ncu --clock-control none --kernel-name "regex:moe_gemv" --launch-skip 40 --launch-count 2 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats \
    --section Occupancy --section LaunchStats --metrics sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fp16.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
    "$B/bench" --dtypes $dt --quick --steps 8 --decode-only > "$OUT/ncu_moe_$dt.txt" 2>&1
  echo "== $dt rc=$?"
  grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|pipe|Issue Slots|Executed Ipc|Registers Per|Achieved Occ|Stall|highest|Warp Cycles Per Issued|smsp__inst" "$OUT/ncu_moe_$dt.txt" | head -60
done
