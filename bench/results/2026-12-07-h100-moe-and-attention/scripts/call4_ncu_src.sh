B=/tmp/dsv3_cuda_build
env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1 timeout 150 ncu --clock-control none --kernel-name regex:moe_f8_kernel --launch-skip 6 --launch-count 1 --section SourceCounters --section WarpStateStats --page source --print-source sass --csv $B/bench --dtypes fp8 --variants default --prefill-only --quick > $OUT/ncu_src.csv 2> $OUT/ncu_src.err
echo "ncu_src rc=$?"; wc -c $OUT/ncu_src.csv; head -c 600 $OUT/ncu_src.csv; tail -5 $OUT/ncu_src.err
