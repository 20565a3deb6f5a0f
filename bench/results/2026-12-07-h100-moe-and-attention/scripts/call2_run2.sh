#!/bin/bash
# device call 2: build; the persistent FP8 MoE kernel's twin test; whole CUDA suite; A/B benches
set -u
O=$OUT; B=/tmp/dsv3_cuda_build; D=$B/dsv3
export DSV3_TOKENIZER_DIR=$PWD/.devdeps/tokenizer
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
T0=$(date +%s)
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
git log --oneline -1 > $O/tree.txt; git status --short >> $O/tree.txt
OUT=$O/s CLI=full BENCH_ARGS=none PACK=0 TESTS=none bash scripts/cuda_device_run.sh > $O/build.log 2>&1
grep -A3 "moe_f8_kernel" $B/obj/src_backend_cuda_kernels_moe_f8.cu.o.log > $O/ptxas_mf8.txt 2>/dev/null
[ -x $B/tests ] || { echo "no tests binary"; tail -40 $O/build.log; exit 1; }
echo "== twin" ; timeout 120 $B/tests --gtest_filter='*PersistentFp8*:*Fp8GemmMode*' > $O/twin.log 2>&1; echo "twin rc=$?" | tee -a $O/twin.log
grep "persistent fp8\|fp8 gemm moe\|OK \]\|FAILED" $O/twin.log
run() { local name=$1 t=$2; shift 2; local l=$(left); [ $l -lt 15 ] && { echo "skip $name" >> $O/runs.log; return; }; [ $t -gt $l ] && t=$l
  echo "== $(date +%T) $name: $*" >> $O/runs.log; timeout $t "$@" >> $O/runs.log 2>&1; echo "rc=$?" >> $O/runs.log; }
if grep -q "twin rc=0" $O/twin.log; then
  timeout 200 $B/tests --gtest_filter='*Cuda*' > $O/suite.log 2>&1; echo "suite rc=$?" | tee -a $O/suite.log; tail -3 $O/suite.log
  FF="env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1"; F8="env DSV3_CUDA_FP8_GEMM=1"
  S="$D bench --device cuda --synthetic 16B --vocab 102400"
  run kb-prefill 90 $FF $B/bench --dtypes fp8 --variants default,moe-persist-0 --prefill-only
  run kb-decode 90 $FF $B/bench --dtypes fp8 --variants default,moe-persist-0 --batches 64,128,256 --ctx 512 --decode-only --steps 16
  run sv256-fast 60 $FF $S --input-len 512 --output-len 256 --dtype fp8 --concurrency 256 --requests 256
  run sv64-fast 60 $FF $S --input-len 512 --output-len 256 --dtype fp8 --concurrency 64 --requests 64
  run prof-prefill 50 $FF $B/bench --dtypes fp8 --variants profile --profile --prefill-only
  run prof-b1-fast 40 env DSV3_CUDA_FAST=1 $B/bench --dtypes fp8 --variants profile --profile --batches 1 --ctx 512 --decode-only --steps 32
  run prof-b1-base 40 $B/bench --dtypes fp8 --variants profile --profile --batches 1 --ctx 512 --decode-only --steps 32
  run sv256-4k 60 $FF $S --input-len 512 --output-len 256 --dtype fp8 --concurrency 256 --requests 256 --max-step-tokens 4096
  run kb-tiles 60 $FF $B/bench --dtypes fp8 --variants default,moe-tiles-0,moe-tiles-8 --batches 48,96,128 --ctx 512 --decode-only --steps 16
fi
cd $O && rm -rf s
