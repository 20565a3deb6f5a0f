#!/bin/bash
# Paired decode: --weight-memory map vs copy, AVX-512 and AVX2 tables, 3 rounds.
B=/work/main/build-nc/dsv3
for round in 1 2 3; do
  for isa in avx512 avx2; do
    for m in map copy; do
      [ $m = map ] && cat /tmp/m16/*.safetensors > /dev/null
      echo "### round $round isa $isa weight-memory $m $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
      DSV3_CPU_ISA=$isa $B bench --model /tmp/m16 --batch 1,8 --prompt 16 --gen 16 --weight-memory $m 2>&1 | grep -v '^\s*$'
    done
  done
done
