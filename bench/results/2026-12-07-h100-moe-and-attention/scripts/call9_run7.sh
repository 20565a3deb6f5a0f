#!/bin/bash
set -u
O=$OUT; B=/tmp/dsv3_cuda_build; D=$B/dsv3
export DSV3_TOKENIZER_DIR=$PWD/.devdeps/tokenizer
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
git log --oneline -1 > $O/tree.txt; git status --short >> $O/tree.txt; git diff >> $O/tree.txt
OUT=$O/s CLI=full BENCH_ARGS=none PACK=0 TESTS='*Cuda*' TEST_TIMEOUT=240 bash scripts/cuda_device_run.sh > $O/suite.log 2>&1
cp $O/s/summary.txt $O/suite_summary.txt; cp $O/s/tests.log $O/tests.log 2>/dev/null
grep "tests rc\|build done" $O/suite_summary.txt; grep "PASSED\|FAILED" $O/tests.log | head -5
grep "_fast:" $O/tests.log | head -20
S="$D bench --device cuda --synthetic 16B --vocab 102400 --input-len 512 --output-len 256"
for m in fast base; do E=""; [ $m = fast ] && E="DSV3_CUDA_FAST=1"
  env $E timeout 40 $B/bench --dtypes fp8,bf16 --variants profile --profile --batches 1,8 --ctx 512 --decode-only --steps 32 > $O/prof_$m.log 2>&1
  grep "decode b\|mla.attn" $O/prof_$m.log
  env $E DSV3_CUDA_FP8_GEMM=1 timeout 40 $S --dtype fp8 --concurrency 1 --requests 1 > $O/sv1_$m.log 2>&1; grep "one request" $O/sv1_$m.log
  env $E timeout 40 $S --dtype bf16 --concurrency 1 --requests 1 > $O/sv1_bf16_$m.log 2>&1; grep "one request" $O/sv1_bf16_$m.log
done
env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1 timeout 60 $S --dtype fp8 --concurrency 64 --requests 64 > $O/sv64.log 2>&1; grep "Output token thr" $O/sv64.log
env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1 timeout 60 $S --dtype fp8 --concurrency 256 --requests 256 > $O/sv256.log 2>&1; grep "Output token thr" $O/sv256.log
rm -rf $O/s
