grep -i "slower GEMM form\|persistent\|PersistentMoe" $O/tests.log | head -14 >> $O/runs.log
tail -4 $O/tests.log >> $O/runs.log
FB="env DSV3_CUDA_FAST=1"
for p in 1x1024 4x512 8x512 16x512; do
  run bf16-prefill-$p 45 $FB $B/bench --dtypes bf16 --variants moe-persist-0,bf16-persist-0,default --prefill-only --prefill $p
done
run bf16-decode 40 $FB $B/bench --dtypes bf16 --variants moe-persist-0,default --batches 64,256 --ctx 512 --steps 16 --decode-only
for i in $(seq 60); do [ -f /tmp/mo.done ] && break; sleep 1; done
grep "build done" /tmp/mo/summary.txt >> $O/runs.log
SM="/tmp/dsv3_main_build/dsv3 bench --device cuda --synthetic 16B --vocab 102400 --input-len 512 --output-len 256"
for c in 256 64; do
  run work-sv$c-bf16 35 $FB $S --dtype bf16 --concurrency $c --requests $c; run main-sv$c-bf16 35 $FB $SM --dtype bf16 --concurrency $c --requests $c
done
run work-sv256-fp8 35 $FF $S --dtype fp8 --concurrency 256 --requests 256; run main-sv256-fp8 35 $FF $SM --dtype fp8 --concurrency 256 --requests 256
run ncu-b256 90 $FF ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip 3000 --launch-count 600 $B/bench --dtypes fp8 --variants nograph --batches 256 --ctx 16 --decode-only --steps 12
