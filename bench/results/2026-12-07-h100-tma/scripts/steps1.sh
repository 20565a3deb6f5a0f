# sourced by run1.sh (run, FF, S, B, O defined there)
run sv1-fp8 40 $FF $S --dtype fp8 --concurrency 1 --requests 1
run sv64-fp8 60 $FF $S --dtype fp8 --concurrency 64 --requests 64
run sv256-fp8 60 $FF $S --dtype fp8 --concurrency 256 --requests 256
run sv256-fp8-m8192 60 $FF $S --dtype fp8 --concurrency 256 --requests 256 --max-step-tokens 8192
run gen1-fp8 40 $FF $D bench --device cuda --synthetic 16B --vocab 102400 --dtype fp8 --batch 1 --prompt 512 --decode-ctx 512 --gen 256
run prof-fp8 120 $FF $B/bench --dtypes fp8 --variants profile --profile --batches 64,256 --ctx 512 --steps 16
run sv1-bf16 40 env DSV3_CUDA_FAST=1 $S --dtype bf16 --concurrency 1 --requests 1
run sv64-bf16 60 env DSV3_CUDA_FAST=1 $S --dtype bf16 --concurrency 64 --requests 64
run sv256-bf16 60 env DSV3_CUDA_FAST=1 $S --dtype bf16 --concurrency 256 --requests 256
run gen1-bf16 40 env DSV3_CUDA_FAST=1 $D bench --device cuda --synthetic 16B --vocab 102400 --dtype bf16 --batch 1 --prompt 512 --decode-ctx 512 --gen 256
run prof-bf16 120 env DSV3_CUDA_FAST=1 $B/bench --dtypes bf16 --variants profile --profile --batches 256 --ctx 512 --steps 16
