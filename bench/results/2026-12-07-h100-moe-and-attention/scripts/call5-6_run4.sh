#!/bin/bash
set -u
O=$OUT; B=/tmp/dsv3_cuda_build
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1
OUT=$O/s CLI=0 BENCH_ARGS="${BA:---dtypes fp8 --variants default,moe-persist-0 --prefill-only}" PACK=0 TESTS=none ALT_ROUNDS=2 bash scripts/cuda_device_run.sh > $O/build.log 2>&1
grep -A3 "moe_f8_kernel" $B/obj/src_backend_cuda_kernels_moe_f8.cu.o.log > $O/ptxas_mf8.txt 2>/dev/null
cat $O/ptxas_mf8.txt | grep "spill\|Used"
timeout 120 $B/tests --gtest_filter='*PersistentFp8*' > $O/twin.log 2>&1; echo "twin rc=$?" | tee -a $O/twin.log
grep "persistent fp8\|FAILED" $O/twin.log
grep "tok/s\|round\|bench" $O/s/summary.txt
${EXTRA:-true}
cp $O/s/summary.txt $O/; rm -rf $O/s
