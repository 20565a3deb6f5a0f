#!/usr/bin/env bash
# The README's test command: installs what is missing, builds, runs the whole suite under ctest,
# then (unless DSV3_QUICK=1) the same suite under ASan+UBSan and each libFuzzer target for a
# bounded time.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
./scripts/setup.sh >/dev/null
jobs="${DSV3_JOBS:-2}"
export DSV3_TOKENIZER_DIR="${DSV3_TOKENIZER_DIR:-$(./scripts/fetch_tokenizer.sh)}"

echo "== build (release) =="
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C build -j"$jobs"
echo "== tests (release) =="
(cd build && ctest --output-on-failure -j"$jobs")

if [ "${DSV3_QUICK:-0}" != "1" ]; then
  echo "== build (ASan+UBSan) =="
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS="-O1" \
        -DDSV3_SANITIZE=ON -DDSV3_CUDA=OFF >/dev/null
  ninja -C build-asan -j"$jobs"
  echo "== tests (ASan+UBSan) =="
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j"$jobs" -LE slow)

  echo "== fuzz (libFuzzer, bounded) =="
  cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
        -DDSV3_FUZZ=ON -DDSV3_TESTS=OFF -DDSV3_CUDA=OFF >/dev/null
  ninja -C build-fuzz -j"$jobs"
  for f in build-fuzz/*_fuzz; do
    [ -x "$f" ] || continue
    name="$(basename "$f")"
    corpus="fuzz/corpus/${name%_fuzz}"
    work="$(mktemp -d)"
    [ -d "$corpus" ] && cp -r "$corpus/." "$work/"
    echo "-- $name (${DSV3_FUZZ_SECONDS:-60}s)"
    "$f" -max_total_time="${DSV3_FUZZ_SECONDS:-60}" -print_final_stats=1 "$work" 2>&1 | tail -3
    rm -rf "$work"
  done
fi
echo "== all tests passed =="
