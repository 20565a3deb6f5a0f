set -u
O=$OUT
OUT=$O/b MPI=1 CLI=full BENCH_ARGS=none PACK=0 TESTS=none JOBS=16 bash scripts/cuda_device_run.sh > $O/build.log 2>&1
grep "MPI\|NCCL\|build done" $O/b/summary.txt
export OMPI_MCA_plm=isolated OMPI_MCA_mca_base_component_show_load_errors=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
B=/tmp/dsv3_cuda_build; D=$B/dsv3; G=tests/data/golden/models/v3_fp8
which mpirun; ls /usr/bin/ssh 2>&1
for np in 1 2; do timeout 60 mpirun --oversubscribe --bind-to none -np $np $D logits --model $G/hf --calls $G/golden.safetensors --out /tmp/cpu$np.st --threads 1 --backend cpu > $O/cpu$np.log 2>&1; echo "cpu np=$np rc=$?"; tail -3 $O/cpu$np.log; done
timeout 60 mpirun --bind-to none -np 1 $D logits --model $G/hf --calls $G/golden.safetensors --out /tmp/cuda1.st --backend cuda > $O/cuda1.log 2>&1; echo "cuda np=1 rc=$?"; tail -3 $O/cuda1.log
timeout 60 mpirun --bind-to none -np 2 $D logits --model $G/hf --calls $G/golden.safetensors --out /tmp/cuda2.st --backend cuda > $O/cuda2.log 2>&1; echo "cuda np=2 on one GPU rc=$?"; tail -5 $O/cuda2.log
python3 - <<'PY'
from safetensors.numpy import load_file
import numpy as np
a = load_file('/tmp/cpu1.st')
for other in ['/tmp/cpu2.st', '/tmp/cuda1.st']:
    try:
        b = load_file(other)
    except Exception as e:
        print(other, 'unreadable', e); continue
    worst = max(float(np.linalg.norm(b[k] - a[k]) / np.linalg.norm(a[k])) for k in a)
    print(other, 'vs cpu np=1: worst relative L2', worst, 'over', len(a), 'calls')
PY
export DSV3_CUDA_FAST=1 DSV3_CUDA_FP8_GEMM=1
timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name regex:'^(?!fill).*' --launch-skip 1200 --launch-count 700 $B/bench --dtypes fp8 --variants nograph --batches 256 --ctx 16 --decode-only --steps 8 > $O/ncu_b256.csv 2> $O/ncu_b256.err; echo "ncu rc=$?"
