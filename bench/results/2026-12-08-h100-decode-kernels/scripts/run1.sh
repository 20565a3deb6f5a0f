#!/bin/bash
set -u
O=$OUT; B=/tmp/dsv3_cuda_build; D=$B/dsv3
export DSV3_TOKENIZER_DIR=$PWD/.devdeps/tokenizer
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.memory --format=csv > $O/nvidia-smi.txt
git log --oneline -1 > $O/tree.txt; git status --short >> $O/tree.txt
OUT=$O/s CLI=full BENCH_ARGS=none PACK=0 TESTS=${TESTS:-none} TEST_TIMEOUT=${TEST_TIMEOUT:-200} bash scripts/cuda_device_run.sh > $O/suite.log 2>&1
cp $O/s/summary.txt $O/suite_summary.txt; cp $O/s/tests.log $O/tests.log 2>/dev/null
grep "tests rc\|build done" $O/suite_summary.txt
run() { local name=$1 t=$2; shift 2; local l=$(left); [ $l -lt 15 ] && { echo "skip $name" >> $O/runs.log; return; }; [ $t -gt $l ] && t=$l
  echo "== $(date +%T) $name: $*" >> $O/runs.log; timeout $t "$@" >> $O/runs.log 2>&1; echo "rc=$?" >> $O/runs.log; }
FF="env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1"
S="$D bench --device cuda --synthetic 16B --vocab 102400 --input-len 512 --output-len 256"
. bench/tmp_run/${STEPS:-steps1.sh}
grep "^== \|Output token thr\|one request\|ttft (ms)\|p99 itl\|steps with\|decode-only steps\|decode b\|prefill 1024\|profile over\|moe.experts\|mla.attn1\|rc=" $O/runs.log
cd $O && rm -rf s
