#!/bin/bash
set -u
O=$OUT; B=/tmp/dsv3_cuda_build; D=$B/dsv3
export DSV3_TOKENIZER_DIR=$PWD/.devdeps/tokenizer
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
T0=$(date +%s)
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
OUT=$O/s CLI=${CLI:-full} BENCH_ARGS=none PACK=0 TESTS=none bash scripts/cuda_device_run.sh > $O/build.log 2>&1
grep -A3 "moe_f8_kernel" $B/obj/src_backend_cuda_kernels_moe_f8.cu.o.log > $O/ptxas_mf8.txt 2>/dev/null
[ -x $B/tests ] || { echo "no tests binary"; tail -40 $O/build.log; exit 1; }
timeout 120 $B/tests --gtest_filter='*PersistentFp8*:*Fp8GemmMode*' > $O/twin.log 2>&1; echo "twin rc=$?" | tee -a $O/twin.log
grep "persistent fp8\|FAILED" $O/twin.log
run() { local name=$1 t=$2; shift 2; local l=$(left); [ $l -lt 15 ] && { echo "skip $name" >> $O/runs.log; return; }; [ $t -gt $l ] && t=$l
  echo "== $(date +%T) $name: $*" >> $O/runs.log; timeout $t "$@" >> $O/runs.log 2>&1; echo "rc=$?" >> $O/runs.log; }
FF="env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1"
S="$D bench --device cuda --synthetic 16B --vocab 102400"
if grep -q "twin rc=0" $O/twin.log; then
  run kb-prefill 90 $FF $B/bench --dtypes fp8 --variants default,moe-persist-0 --prefill-only
  run kb-decode 90 $FF $B/bench --dtypes fp8 --variants default,moe-persist-0 --batches 128,256 --ctx 512 --decode-only --steps 16
  [ -n "${NCU:-}" ] && env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1 timeout 120 ncu --clock-control none --kernel-name regex:moe_f8_kernel --launch-skip 6 --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' $B/bench --dtypes fp8 --variants default --prefill-only --quick > $O/ncu.txt 2>&1
  ${EXTRA:-true}
fi
grep "tok/s" $O/runs.log
cd $O && rm -rf s
