#!/bin/bash
set -u
O=$OUT; B=/tmp/dsv3_cuda_build; D=$B/dsv3
export DSV3_TOKENIZER_DIR=$PWD/.devdeps/tokenizer
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
git log --oneline -1 > $O/tree.txt; git status --short >> $O/tree.txt; git diff >> $O/tree.txt
OUT=$O/s CLI=full BENCH_ARGS=none PACK=0 TESTS='*Cuda*' TEST_TIMEOUT=240 bash scripts/cuda_device_run.sh > $O/suite.log 2>&1
cp $O/s/summary.txt $O/suite_summary.txt; cp $O/s/tests.log $O/tests.log 2>/dev/null
grep "tests rc\|build done" $O/suite_summary.txt; grep "PASSED\|FAILED" $O/tests.log | head -5
env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1 timeout 60 $B/bench --dtypes fp8 --variants default,moe-tiles-0 --batches 48,64,96,128 --ctx 512 --decode-only --steps 16 > $O/tiles_after.log 2>&1
grep "decode b" $O/tiles_after.log
S="$D bench --device cuda --synthetic 16B --vocab 102400 --input-len 512 --output-len 256"
env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1 timeout 60 $S --dtype fp8 --concurrency 64,128 > $O/sv_64_128.log 2>&1; grep "Output token thr\|Maximum request\|concurrency" $O/sv_64_128.log | head
rm -rf $O/s
