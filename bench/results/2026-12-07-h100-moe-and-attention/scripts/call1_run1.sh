#!/bin/bash
# device call 1: build + whole CUDA suite (router change in the tree) + measurements
set -u
O=$OUT; B=/tmp/dsv3_cuda_build; D=$B/dsv3
export DSV3_TOKENIZER_DIR=$PWD/.devdeps/tokenizer
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
T0=$(date +%s)
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
git log --oneline -1 > $O/tree.txt; git status --short >> $O/tree.txt; git diff >> $O/tree.txt
OUT=$O/s CLI=full BENCH_ARGS=none PACK=0 TESTS="${TESTS:-*Cuda*}" TEST_TIMEOUT=240 bash scripts/cuda_device_run.sh > $O/suite.log 2>&1
cp $O/s/summary.txt $O/suite_summary.txt; cp $O/s/tests.log $O/tests.log 2>/dev/null; cp $O/s/nvidia-smi.txt $O/ 2>/dev/null
grep -i "worst token\|tc many" $O/tests.log | head -40 > $O/tc_err.txt
cp $B/obj/src_backend_cuda_kernels_tc.cu.o.log $O/ptxas_tc.txt 2>/dev/null; cp $B/obj/src_backend_cuda_kernels_tcgemv.cu.o.log $O/ptxas_tcgemv.txt 2>/dev/null
run() { local name=$1 t=$2; shift 2; local l=$(left); [ $l -lt 15 ] && { echo "skip $name" >> $O/runs.log; return; }; [ $t -gt $l ] && t=$l
  echo "== $(date +%T) $name: $*" >> $O/runs.log; timeout $t "$@" >> $O/runs.log 2>&1; echo "rc=$?" >> $O/runs.log; }
[ -x $D ] || exit 1
S="$D bench --device cuda --synthetic 16B --vocab 102400"
F8="env DSV3_CUDA_FP8_GEMM=1"; FF="env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1"
run sv1-base 40 $F8 $S --input-len 512 --output-len 256 --dtype fp8 --concurrency 1 --requests 1
run genb1-base 40 $F8 $S --dtype fp8 --batch 1 --prompt 512 --decode-ctx 512 --gen 256
run sv1-fast 40 $FF $S --input-len 512 --output-len 256 --dtype fp8 --concurrency 1 --requests 1
run genb1-fast 40 $FF $S --dtype fp8 --batch 1 --prompt 512 --decode-ctx 512 --gen 256
run kb-tiles 60 $FF $B/bench --dtypes fp8 --variants default,moe-tiles-0,moe-tiles-8 --batches 32,64,128 --ctx 512 --decode-only --steps 16
run sv64-fast 60 $FF $S --input-len 512 --output-len 256 --dtype fp8 --concurrency 64 --requests 64
run sv256-fast 60 $FF $S --input-len 512 --output-len 256 --dtype fp8 --concurrency 256 --requests 256
run sv256-fast-4k 60 $FF $S --input-len 512 --output-len 256 --dtype fp8 --concurrency 256 --requests 256 --max-step-tokens 4096
run prof-prefill 50 $FF $B/bench --dtypes fp8 --variants profile --profile --prefill-only
echo "== $(date +%T) ncu" >> $O/runs.log
[ $(left) -gt 110 ] && env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1 timeout 95 ncu --clock-control none --kernel-name regex:tc_gemm_kernel --launch-skip 60 --launch-count 10 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' $B/bench --dtypes fp8 --variants default --prefill-only --quick > $O/ncu.txt 2>&1
run sv64-bf16-fast 60 env DSV3_CUDA_FAST=1 $S --input-len 512 --output-len 256 --dtype bf16 --concurrency 64 --requests 64
run sv256-bf16-fast 60 env DSV3_CUDA_FAST=1 $S --input-len 512 --output-len 256 --dtype bf16 --concurrency 256 --requests 256
run prof-fast 40 $FF $B/bench --dtypes fp8 --variants profile --profile --batches 64,256 --ctx 512 --decode-only --steps 8
cd $O && tar czf all.tgz s && rm -rf s
