#!/bin/bash
set -u
O=$OUT; B=/tmp/dsv3_cuda_build; D=$B/dsv3
export DSV3_TOKENIZER_DIR=$PWD/.devdeps/tokenizer
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
T0=$(date +%s)
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
git log --oneline -1 > $O/tree.txt; git status --short >> $O/tree.txt; git diff >> $O/tree.txt
OUT=$O/s CLI=full BENCH_ARGS=none PACK=0 TESTS='*Cuda*' TEST_TIMEOUT=240 bash scripts/cuda_device_run.sh > $O/suite.log 2>&1
cp $O/s/summary.txt $O/suite_summary.txt; cp $O/s/tests.log $O/tests.log 2>/dev/null
grep "tests rc\|build done" $O/suite_summary.txt; grep "PASSED\|FAILED" $O/tests.log | head -5
grep "_fast:" $O/tests.log | head -20
run() { local name=$1 t=$2; shift 2; local l=$(left); [ $l -lt 15 ] && { echo "skip $name" >> $O/runs.log; return; }; [ $t -gt $l ] && t=$l
  echo "== $(date +%T) $name: $*" >> $O/runs.log; timeout $t "$@" >> $O/runs.log 2>&1; echo "rc=$?" >> $O/runs.log; }
FF="env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1"
S="$D bench --device cuda --synthetic 16B --vocab 102400 --input-len 512 --output-len 256 --dtype fp8"
run prof-b1-fast 40 env DSV3_CUDA_FAST=1 $B/bench --dtypes fp8 --variants profile --profile --batches 1 --ctx 512 --decode-only --steps 32
run prof-b1-base 40 $B/bench --dtypes fp8 --variants profile --profile --batches 1 --ctx 512 --decode-only --steps 32
run sv1-fast 40 $FF $S --concurrency 1 --requests 1
run sv1-base 40 env DSV3_CUDA_FP8_GEMM=1 $S --concurrency 1 --requests 1
for c in 256 64; do for m in 2048 4096 8192; do
  run sv$c-m$m 60 $FF $S --concurrency $c --requests $c --max-step-tokens $m
done; done
grep "^== \|Output token thr\|one request\|ttft (ms)\|p99 itl\|steps with\|decode-only steps\|decode b1\|mla.attn1" $O/runs.log
cd $O && rm -rf s
