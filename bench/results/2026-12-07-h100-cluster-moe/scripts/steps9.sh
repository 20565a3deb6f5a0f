grep -i "slower GEMM form\|persistent fp8 moe\|PersistentFp8Moe" $O/tests.log | head -14 >> $O/runs.log
tail -4 $O/tests.log >> $O/runs.log
run ab-moe 60 $FF $B/bench --dtypes fp8 --variants moe-persist-0,default --batches 64,256 --ctx 512 --steps 16
for i in $(seq 60); do [ -f /tmp/mo.done ] && break; sleep 1; done
grep "build done" /tmp/mo/summary.txt >> $O/runs.log
SM="/tmp/dsv3_main_build/dsv3 bench --device cuda --synthetic 16B --vocab 102400 --input-len 512 --output-len 256"
for c in 256 64; do run work-sv$c-fp8 35 $FF $S --dtype fp8 --concurrency $c --requests $c; run main-sv$c-fp8 35 $FF $SM --dtype fp8 --concurrency $c --requests $c; done
run work-sv1-fp8 30 $FF $S --dtype fp8 --concurrency 1 --requests 1
