grep -i "slower GEMM form\|persistent fp8 moe" $O/tests.log | head -8 >> $O/runs.log
tail -4 $O/tests.log >> $O/runs.log
for c in 256 64; do run sv$c-bf16 30 env DSV3_CUDA_FAST=1 $S --dtype bf16 --concurrency $c --requests $c; done
for pc in off on; do run prefix-$pc-fp8 30 $FF $S --dtype fp8 --concurrency 64 --requests 64 --shared-prefix 2000 --prefix-cache $pc; done
run prof-prefill 40 $FF $B/bench --dtypes fp8 --variants profile --profile --prefill-only
run prof-b256 40 $FF $B/bench --dtypes fp8 --variants profile --profile --batches 256 --ctx 512 --decode-only --steps 8
