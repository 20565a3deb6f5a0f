grep -E "persistent fp8|FAILED" $O/tests.log | head -8 >> $O/runs.log
run ab1 120 $FF $B/bench --dtypes fp8 --variants default,moe-persist-0 --batches 256 --ctx 512 --steps 16
echo "== ncu" >> $O/runs.log
for v in default moe-persist-0; do
timeout 150 env DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1 ncu --clock-control none --kernel-name "regex:moe_f8_kernel|tc_gemm_kernel" --launch-skip 0 --launch-count 40 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.sum $B/bench --dtypes fp8 --variants $v --prefill-only --steps 4 > $O/ncu_$v.txt 2>&1
grep -E "moe_f8_kernel|tc_gemm_kernel<128, 32, 1, 0, 0, 1, 1, 1>|gpu__time|dram__|lts__" $O/ncu_$v.txt | head -60 >> $O/runs.log
done
