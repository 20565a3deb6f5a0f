# call 3 of 2026-12-08: the tree to land (grouped expansion, many-token attention, q absorption by
# 16-token items with bf16 q in fast mode, moe_tiles_fp8gemm 5) against main's build: decode steps,
# the serving bars, per-kernel times of the attention and the absorption.
grep -i "tc many\|QAbsorption\|ManyToken\|MlaLongRun\|Failure\|Expected\|actual" $O/tests.log | head -40 >> $O/runs.log
tail -4 $O/tests.log >> $O/runs.log
FB="env DSV3_CUDA_FAST=1"
for i in $(seq 60); do [ -f /tmp/mo.done ] && break; sleep 1; done
grep "build done" /tmp/mo/summary.txt >> $O/runs.log
MB=/tmp/dsv3_main_build/bench
run work-dec-fp8 40 $FF $B/bench --dtypes fp8 --variants default --batches 64,256 --ctx 512 --decode-only --steps 16
run main-dec-fp8 40 $FF $MB --dtypes fp8 --variants default --batches 64,256 --ctx 512 --decode-only --steps 16
run work-dec-bf16 40 $FB $B/bench --dtypes bf16 --variants default --batches 64,256 --ctx 512 --decode-only --steps 16
run main-dec-bf16 40 $FB $MB --dtypes bf16 --variants default --batches 64,256 --ctx 512 --decode-only --steps 16
SM="/tmp/dsv3_main_build/dsv3 bench --device cuda --synthetic 16B --vocab 102400 --input-len 512 --output-len 256"
for c in 256 64; do
  run work-sv$c-fp8 35 $FF $S --dtype fp8 --concurrency $c --requests $c; run main-sv$c-fp8 35 $FF $SM --dtype fp8 --concurrency $c --requests $c
  run work-sv$c-bf16 35 $FB $S --dtype bf16 --concurrency $c --requests $c; run main-sv$c-bf16 35 $FB $SM --dtype bf16 --concurrency $c --requests $c
done
run work-sv1-fp8 35 $FF $S --dtype fp8 --concurrency 1 --requests 1 --output-len 128
run work-sv1-bf16 35 $FB $S --dtype bf16 --concurrency 1 --requests 1 --output-len 128
NCM="gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
for b in 256 64; do
  run ncu-decode-b$b 40 $FF ncu --clock-control none --profile-from-start off --metrics $NCM --csv --kernel-name regex:'many_tc|prep_qabs|values_reduce|moe_persist|tcv_moe' --log-file $O/ncu_decode_b$b.csv $B/bench --dtypes fp8 --variants nograph --batches $b --ctx 512 --decode-only --steps 2
done
