# call 2 of 2026-12-08: the many-token attention (rows per warp, table a tile ahead, four score
# chains) and the fast q absorption (bf16 q, one MMA) against main; MoE tiles or the persistent
# kernel at 32-96 tokens; per-kernel times after.
grep -i "tc many\|QAbsorption\|ManyToken\|MlaLongRun" $O/tests.log | head -40 >> $O/runs.log
tail -4 $O/tests.log >> $O/runs.log
FB="env DSV3_CUDA_FAST=1"
for i in $(seq 60); do [ -f /tmp/mo.done ] && break; sleep 1; done
grep "build done" /tmp/mo/summary.txt >> $O/runs.log
MB=/tmp/dsv3_main_build/bench
run work-dec-fp8 40 $FF $B/bench --dtypes fp8 --variants default --batches 64,256 --ctx 512 --decode-only --steps 16
run main-dec-fp8 40 $FF $MB --dtypes fp8 --variants default --batches 64,256 --ctx 512 --decode-only --steps 16
run work-dec-bf16 40 $FB $B/bench --dtypes bf16 --variants default --batches 64,256 --ctx 512 --decode-only --steps 16
run main-dec-bf16 40 $FB $MB --dtypes bf16 --variants default --batches 64,256 --ctx 512 --decode-only --steps 16
run tiles-fp8 50 $FF $B/bench --dtypes fp8 --variants default,moe-tiles-0 --batches 32,48,64,96 --ctx 512 --decode-only --steps 16
SM="/tmp/dsv3_main_build/dsv3 bench --device cuda --synthetic 16B --vocab 102400 --input-len 512 --output-len 256"
for c in 256 64; do
  run work-sv$c-fp8 35 $FF $S --dtype fp8 --concurrency $c --requests $c; run main-sv$c-fp8 35 $FF $SM --dtype fp8 --concurrency $c --requests $c
done
run work-sv256-bf16 35 $FB $S --dtype bf16 --concurrency 256 --requests 256; run main-sv256-bf16 35 $FB $SM --dtype bf16 --concurrency 256 --requests 256
NCM="gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
run ncu-decode-b256 70 $FF ncu --clock-control none --profile-from-start off --metrics $NCM --csv --log-file $O/ncu_decode_b256.csv $B/bench --dtypes fp8 --variants nograph --batches 256 --ctx 512 --decode-only --steps 2
run ncu-decode-b64 50 $FF ncu --clock-control none --profile-from-start off --metrics $NCM --csv --kernel-name regex:'many_tc|prep_qabs|values_reduce' --log-file $O/ncu_decode_b64.csv $B/bench --dtypes fp8 --variants nograph --batches 64 --ctx 512 --decode-only --steps 2
run ncu-qabs-b256 40 $FF ncu --clock-control none --profile-from-start off --set full --kernel-name regex:prep_qabs --launch-count 1 --log-file $O/ncu_qabs_b256.txt $B/bench --dtypes fp8 --variants nograph --batches 256 --ctx 512 --decode-only --steps 2
