# call 1 of 2026-12-08: grouped wkv_b expansion A/B (same binary: mla-group-1 = each run alone),
# per-kernel times of one decode step (ncu, profiler range), the many-token attention kernel in full,
# serving A/B against main's build.
grep -i "MlaLongRun\|slower GEMM form" $O/tests.log | head -8 >> $O/runs.log
tail -4 $O/tests.log >> $O/runs.log
FB="env DSV3_CUDA_FAST=1"
run fp8-prefill-16x512 60 $FF $B/bench --dtypes fp8 --variants mla-group-1,default --prefill-only --prefill 16x512
run bf16-prefill-16x512 60 $FB $B/bench --dtypes bf16 --variants mla-group-1,default --prefill-only --prefill 16x512
NCM="gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
for b in 256 64; do
  run ncu-decode-b$b 80 $FF ncu --clock-control none --profile-from-start off --metrics $NCM --csv --log-file $O/ncu_decode_b$b.csv $B/bench --dtypes fp8 --variants nograph --batches $b --ctx 512 --decode-only --steps 2
done
run ncu-attn-b256 60 $FF ncu --clock-control none --profile-from-start off --set full --kernel-name regex:many_tc --launch-count 1 --log-file $O/ncu_attn_b256.txt $B/bench --dtypes fp8 --variants nograph --batches 256 --ctx 512 --decode-only --steps 2
for i in $(seq 60); do [ -f /tmp/mo.done ] && break; sleep 1; done
grep "build done" /tmp/mo/summary.txt >> $O/runs.log
SM="/tmp/dsv3_main_build/dsv3 bench --device cuda --synthetic 16B --vocab 102400 --input-len 512 --output-len 256"
run work-sv256-fp8 35 $FF $S --dtype fp8 --concurrency 256 --requests 256; run main-sv256-fp8 35 $FF $SM --dtype fp8 --concurrency 256 --requests 256
run work-sv256-bf16 35 $FB $S --dtype bf16 --concurrency 256 --requests 256; run main-sv256-bf16 35 $FB $SM --dtype bf16 --concurrency 256 --requests 256
