grep -i "slower GEMM form\|persistent\|PersistentMoe" $O/tests.log | head -14 >> $O/runs.log
tail -4 $O/tests.log >> $O/runs.log
grep -h "spill\|stack frame" $B/obj/*kernels_moe_persist.cu.o.log | sort | uniq -c | head >> $O/runs.log
run ab-moe-fp8 80 $FF $B/bench --dtypes fp8 --variants moe-persist-0,default --batches 64,256 --ctx 512 --steps 16
run ab-moe-bf16 80 env DSV3_CUDA_FAST=1 $B/bench --dtypes bf16 --variants moe-persist-0,default --batches 64,256 --ctx 512 --steps 16
for i in $(seq 60); do [ -f /tmp/mo.done ] && break; sleep 1; done
grep "build done" /tmp/mo/summary.txt >> $O/runs.log
SM="/tmp/dsv3_main_build/dsv3 bench --device cuda --synthetic 16B --vocab 102400 --input-len 512 --output-len 256"
for c in 256 64; do
  run work-sv$c-fp8 35 $FF $S --dtype fp8 --concurrency $c --requests $c; run main-sv$c-fp8 35 $FF $SM --dtype fp8 --concurrency $c --requests $c
  run work-sv$c-bf16 35 env DSV3_CUDA_FAST=1 $S --dtype bf16 --concurrency $c --requests $c; run main-sv$c-bf16 35 env DSV3_CUDA_FAST=1 $SM --dtype bf16 --concurrency $c --requests $c
done
run prof-16x512-fp8 45 $FF $B/bench --dtypes fp8 --variants profile --profile --prefill-only --prefill 16x512
run prof-16x512-bf16 45 env DSV3_CUDA_FAST=1 $B/bench --dtypes bf16 --variants profile --profile --prefill-only --prefill 16x512
