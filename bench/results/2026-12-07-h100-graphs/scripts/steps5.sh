# sourced by run1.sh after the suite ran without the persistent MoE kernel's test
timeout 90 $B/tests --gtest_filter='*PersistentFp8Moe*' > $O/persist.log 2>&1; prc=$?
echo "== persist test rc=$prc" >> $O/runs.log; tail -5 $O/persist.log >> $O/runs.log
if [ $prc != 0 ]; then
  sed -i 's/opt_.tune.moe_persist && T.tmaps/false \&\& T.tmaps/' src/backend/cuda/cuda_moe.cc
  OUT=$O/s2 CLI=full BENCH_ARGS=none PACK=0 TESTS=none bash scripts/cuda_device_run.sh > $O/rebuild.log 2>&1
  echo "== rebuilt with moe_persist off rc=$?" >> $O/runs.log; rm -rf $O/s2
fi
run ab-graphs 100 $FF $B/bench --dtypes fp8 --variants graphs-16,default --batches 64,256 --ctx 512 --decode-only --steps 16
run ab-moe 100 $FF $B/bench --dtypes fp8 --variants moe-persist-0,default --batches 256 --ctx 512 --steps 16
for c in 1 64 256; do run sv$c-fp8 45 $FF $S --dtype fp8 --concurrency $c --requests $c; done
run sv256-fp8-nog 45 $FF DSV3_CUDA_GRAPH=0 $S --dtype fp8 --concurrency 256 --requests 256
for c in 1 64 256; do run sv$c-bf16 45 env DSV3_CUDA_FAST=1 $S --dtype bf16 --concurrency $c --requests $c; done
run prof-fp8 60 $FF $B/bench --dtypes fp8 --variants profile --profile --batches 256 --ctx 512 --steps 16
