grep -A3 "PersistentFp8MoeMatchesTwin\|Fp8GemmMode" $O/tests.log | grep "persistent\|OK\|FAILED" | head -20 >> $O/runs.log
run ab1 120 $FF $B/bench --dtypes fp8 --variants default,moe-persist-0 --batches 128,256 --ctx 512 --steps 16
run ab2 120 $FF $B/bench --dtypes fp8 --variants moe-persist-0,default --batches 128,256 --ctx 512 --steps 16
run sv256-fp8 60 $FF $S --dtype fp8 --concurrency 256 --requests 256
run sv64-fp8 60 $FF $S --dtype fp8 --concurrency 64 --requests 64
