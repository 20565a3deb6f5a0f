#!/usr/bin/env bash
# The README's first command: installs what is missing, builds dsv3, fetches the tokenizer,
# synthesises the tiny random-weight model (real tokenizer, FP8 weights) and generates on it.
# Extra arguments go to `dsv3 generate` (e.g. --prompt "..." --max-new-tokens 64).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
./scripts/setup.sh >/dev/null
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C build -j"${DSV3_JOBS:-2}" dsv3
model="${DSV3_CACHE:-$HOME/.cache/dsv3}/models/tiny-fp8"
if [ ! -f "$model/config.json" ]; then
  mkdir -p "$(dirname "$model")"
  ./build/dsv3 synth --shape tiny --dtype fp8 --out "$model" --seed 1
fi
./build/dsv3 inspect --model "$model" | head -3
if [ $# -eq 0 ]; then set -- --prompt "Explain mixture-of-experts in one sentence." --max-new-tokens 32; fi
exec ./build/dsv3 generate --model "$model" "$@"
