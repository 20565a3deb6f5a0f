grep -i "slower GEMM form\|persistent fp8 moe\|PersistentFp8Moe" $O/tests.log | head -12 >> $O/runs.log
nvcc -std=c++17 -o /tmp/tmap_probe bench/tmp_run/tmap_probe.cu -lcuda > $O/probe.log 2>&1 && /tmp/tmap_probe >> $O/probe.log 2>&1
cat $O/probe.log >> $O/runs.log
for i in $(seq 60); do [ -f /tmp/mo.done ] && break; sleep 1; done
grep "build done" /tmp/mo/summary.txt >> $O/runs.log
timeout 60 /tmp/dsv3_main_build/tests --gtest_filter='*Cuda*' > $O/main_tests.log 2>&1; echo "== main tree tests rc=$?" >> $O/runs.log
tail -3 $O/main_tests.log >> $O/runs.log
run ab-moe 40 $FF $B/bench --dtypes fp8 --variants moe-persist-0,default --batches 256 --ctx 512 --steps 16
SM="/tmp/dsv3_main_build/dsv3 bench --device cuda --synthetic 16B --vocab 102400 --input-len 512 --output-len 256"
for c in 64 256; do run main-sv$c-fp8 30 $FF $SM --dtype fp8 --concurrency $c --requests $c; done
for c in 64 256; do run main-sv$c-bf16 30 env DSV3_CUDA_FAST=1 $SM --dtype bf16 --concurrency $c --requests $c; done
