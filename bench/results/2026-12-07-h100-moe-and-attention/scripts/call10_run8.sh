#!/bin/bash
set -u
O=$OUT; B=/tmp/dsv3_cuda_build
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
git log --oneline -1 > $O/tree.txt; git status --short >> $O/tree.txt
OUT=$O/s CLI=0 BENCH_ARGS=none PACK=0 TESTS=none bash scripts/cuda_device_run.sh > $O/build.log 2>&1
grep "build done" $O/s/summary.txt
A="--variants default,moe-tiles-8,moe-tiles-0 --batches 48,64,80,96,128 --ctx 512 --decode-only --steps 16"
env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1 timeout 100 $B/bench --dtypes fp8 $A > $O/tiles_fast_fp8gemm.log 2>&1
env DSV3_CUDA_FP8_GEMM=1 timeout 100 $B/bench --dtypes fp8 $A > $O/tiles_fp8gemm.log 2>&1
timeout 100 $B/bench --dtypes fp8 $A > $O/tiles_plain.log 2>&1
env DSV3_CUDA_FAST=1 timeout 100 $B/bench --dtypes fp8 $A > $O/tiles_fast.log 2>&1
for f in $O/tiles_*.log; do echo "== $f"; grep "decode b" $f | awk '{print $3, $4, $6}'; done
rm -rf $O/s
