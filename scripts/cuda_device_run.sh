#!/usr/bin/env bash
# One call on a GPU machine: build the CUDA backend's tests and benchmark, run them, keep logs.
# The device image has nvcc but not the project's other dependencies, so this compiles only what
# the CUDA tests and benchmark need, with nvcc and g++ directly (nlohmann/json headers and the
# GoogleTest sources come from .devdeps/, made by `scripts/cuda_device_run.sh --deps` here).
#
#   scripts/cuda_device_run.sh --deps            # on the development machine, once
#   OUT=/tmp/out scripts/cuda_device_run.sh      # on the GPU machine (device tool: carry .devdeps)
# Environment: TESTS (gtest filter, default all CUDA tests; "none" to skip), BENCH_ARGS (for
# dsv3_cuda_bench; "none" to skip), SANITIZE=1 (compute-sanitizer memcheck over the op tests),
# ALT_NVFLAGS (build the kernels a second time with these nvcc flags as bench_alt and run BENCH_ARGS on
# both, alternating ALT_ROUNDS times with ALT_ARGS if given), ALT_SRC (... or from the CUDA backend (.cu and .cc) of this copy of src/, e.g.
# an untracked alt/src carried along), ALT2_NVFLAGS / ALT2_SRC (a third build, bench_alt2, in the same rounds), LT_ARGS (run dsv3_cublaslt_bench with them), CLI=1 (also build `dsv3` with the bench command; CLI=full: every command, the server included) and CLI_ARGS (run it, e.g. "bench --device cuda ...").
# MPI=1: build with the MPI world (OpenMPI carried in .devdeps/mpi.tar.xz, unpacked there) so that
# `mpirun -np N $B/dsv3 ...` runs ranks across the machine's GPUs.
# OLD_TREE=DIR (another checkout, e.g. an untracked copy of main carried along: built with its own copy of
# this script in the background, its benchmark run alternately with this tree's, OLD_ROUNDS times, with OLD_ARGS,
# default BENCH_ARGS), JOBS (parallel compiles, default all cores).
# NCU=<kernel regex> (Nsight Compute; NCU_ARGS, NCU_SKIP, NCU_COUNT, NCU_EXTRA, NCU_STALLS=1), PACK=0 (do not
# pack $OUT into all.tgz when it holds more than 8 files).
# ENV_AB="SET|SET|..." (each SET space-separated VAR=VALUE words, "-" for none; a first word @alt or
# @alt2 runs that build's benchmark instead of the main one): the benchmark with ENV_ARGS (default:
# one token's decode, FP8 and bf16) under each setting in turn, ENV_ROUNDS times (default 3), then
# scripts/ab_table.py's table (runtime options and builds A/B in one table).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
DEPS=$ROOT/.devdeps

if [ "${1:-}" = "--deps" ]; then
  rm -rf "$DEPS" && mkdir -p "$DEPS/include" "$DEPS/gtest"
  cp -r /usr/include/nlohmann "$DEPS/include/"
  cp -r /usr/src/googletest/googletest/include /usr/src/googletest/googletest/src "$DEPS/gtest/"
  # CLI=full (the whole dsv3 binary, server included): cpp-httplib (a compiled library in Debian, built with
  # OpenSSL, zlib and brotli), PCRE2, their headers, and the chat page CMake generates (from build-nc/ or build/).
  mkdir -p "$DEPS/server/include/x86_64-linux-gnu" "$DEPS/server/lib" "$DEPS/server/gen/server"
  cp -r /usr/include/httplib.h /usr/include/pcre2.h /usr/include/openssl /usr/include/brotli /usr/include/zlib.h \
    /usr/include/zconf.h "$DEPS/server/include/"
  cp -r /usr/include/x86_64-linux-gnu/openssl "$DEPS/server/include/x86_64-linux-gnu/"
  for l in cpp-httplib.so.0.11 pcre2-8.so.0 ssl.so.3 crypto.so.3 z.so.1 brotlidec.so.1 brotlienc.so.1 brotlicommon.so.1; do
    cp -L /usr/lib/x86_64-linux-gnu/lib$l "$DEPS/server/lib/"
  done
  page=$(ls build-nc/generated/server/chat_page_html.h build/generated/server/chat_page_html.h 2>/dev/null | head -1)
  [ -n "$page" ] && cp "$page" "$DEPS/server/gen/server/" || echo "no generated chat page: build dsv3 here first (CLI=full needs it)"
  # The DeepSeek-V3 tokenizer (dsv3 synth writes it beside the weights; the device cannot fetch it):
  # DSV3_TOKENIZER_DIR=.devdeps/tokenizer there.
  tok=${DSV3_TOKENIZER_DIR:-$HOME/.cache/dsv3/tokenizer/deepseek-v3}
  [ -f "$tok/tokenizer.json" ] && cp -r "$tok" "$DEPS/tokenizer" || echo "no tokenizer in $tok: run scripts/fetch_tokenizer.sh"
  # OpenMPI's runtime and headers (Debian's 4.1 with PMIx), for `mpirun` on a machine with several GPUs (MPI=1
  # there): its files at their own absolute paths, unpacked there beside the image's own without replacing any.
  # Only what the shared-memory launch on one host needs; components that want absent libraries (InfiniBand,
  # UCX, libfabric) are skipped there quietly.
  L=/usr/lib/x86_64-linux-gnu
  if [ -f "$L/libmpi.so.40" ] && [ -x /usr/bin/orterun ]; then
    stage=$(mktemp -d)
    tar -cf - $L/openmpi $L/pmix2 /usr/share/openmpi /etc/openmpi /usr/bin/orterun /usr/bin/orted \
      $(ls $L/libmpi.so.40* $L/libopen-pal.so.40* $L/libopen-rte.so.40* $L/libmca_common_*.so.* $L/libpmix.so.2* \
           $L/libhwloc.so.15* $L/libevent_core-2.1.so.7* $L/libevent_pthreads-2.1.so.7* $L/libmunge.so.2* \
           $L/libnl-3.so.200* $L/libnl-route-3.so.200*) 2>/dev/null | tar -xf - -C "$stage"
    ln -s orterun "$stage/usr/bin/mpirun"
    tar -cJf "$DEPS/mpi.tar.xz" -C "$stage" usr etc && rm -rf "$stage"
  else
    echo "no OpenMPI here (apt-get install openmpi-bin libopenmpi-dev): MPI=1 will not work on the device"
  fi
  grep -qx '/.devdeps/' .git/info/exclude 2>/dev/null || echo '/.devdeps/' >> .git/info/exclude
  exit 0
fi

OUT=${OUT:-/tmp/dsv3_out}
mkdir -p "$OUT"
B=/tmp/dsv3_cuda_build
mkdir -p "$B/obj"
export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }

if [ -n "${OLD_TREE:-}" ]; then  # (the A/B's other tree builds in the background meanwhile: see OLD_TREE below)
  cp -r "$DEPS" "$OLD_TREE/.devdeps" 2>/dev/null
  sed -i 's#B=/tmp/dsv3_cuda_build#B=/tmp/dsv3_old_build#' "$OLD_TREE/scripts/cuda_device_run.sh"
  (cd "$OLD_TREE" && OUT=/tmp/old_out TESTS=none BENCH_ARGS=none JOBS=8 bash scripts/cuda_device_run.sh > "$OUT/old_build.log" 2>&1) &
  OLD_PID=$!
fi
log "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.txt" 2>&1
cat "$OUT/nvidia-smi.txt" | tee -a "$OUT/summary.txt"
nvcc --version | tail -1 | tee -a "$OUT/summary.txt"
g++ --version | head -1 | tee -a "$OUT/summary.txt"

# NCCL (the collectives of several GPU ranks) where the toolkit, the system or a Python wheel has it,
# as CMake finds it.
NCCL_DEF=; NCCL_LIB=; NCCL_INC=
for d in /usr/local/cuda /usr $(ls -d /usr/local/lib/python3*/dist-packages/nvidia/nccl /usr/lib/python3*/dist-packages/nvidia/nccl 2>/dev/null); do
  lib=$(ls "$d"/lib/libnccl.so* "$d"/lib64/libnccl.so* "$d"/lib/x86_64-linux-gnu/libnccl.so* 2>/dev/null | head -1)
  if [ -f "$d/include/nccl.h" ] && [ -n "$lib" ]; then
    NCCL_DEF=-DDSV3_HAVE_NCCL; NCCL_INC=-I$d/include; NCCL_LIB="$lib -Wl,-rpath,$(dirname "$lib")"; break
  fi
done
echo "NCCL: ${NCCL_LIB:-none found}" | tee -a "$OUT/summary.txt"
# MPI=1: OpenMPI from .devdeps/mpi.tar.xz (unpacked into / where the machine lacks it), the MPI world in the
# build (src/dist/mpi_comm.cc), and mpirun set up for one host as root (no ssh; absent optional components quiet).
MPI_DEF=; MPI_SRC=; MPI_LIB=
if [ "${MPI:-0}" = 1 ]; then
  tar -xJf "$DEPS/mpi.tar.xz" -C / --skip-old-files --keep-directory-symlink || { echo "MPI=1: no usable $DEPS/mpi.tar.xz"; exit 1; }
  export OMPI_MCA_plm=isolated OMPI_MCA_mca_base_component_show_load_errors=0
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  MPI_DEF="-DDSV3_HAVE_MPI -I/usr/lib/x86_64-linux-gnu/openmpi/include"
  MPI_SRC=src/dist/mpi_comm.cc
  MPI_LIB="-L/usr/lib/x86_64-linux-gnu/openmpi/lib -lmpi"
  echo "MPI: $(mpirun --version 2>&1 | head -1)" | tee -a "$OUT/summary.txt"
fi
CXXFLAGS="-std=c++20 -O2 -g -DDSV3_HAVE_CUDA $NCCL_DEF $NCCL_INC $MPI_DEF -I$ROOT/src -I$DEPS/include -I$DEPS/gtest/include -I/usr/local/cuda/include"
NVFLAGS="-std=c++17 -O3 -lineinfo -DDSV3_HAVE_CUDA -I$ROOT/src -gencode=arch=compute_90a,code=sm_90a -Xptxas -v"
CUDA_CC=$(ls src/backend/cuda/*.cc | { if [ -n "$NCCL_DEF" ]; then cat; else grep -v '/nccl\.cc$'; fi; })
SRCS="src/core/*.cc src/io/mmap_file.cc src/io/safetensors.cc src/io/safetensors_writer.cc src/io/checkpoint.cc src/model/*.cc
      src/backend/backend.cc src/backend/host_weights.cc src/backend/ref/*.cc $CUDA_CC src/dist/comm.cc $MPI_SRC src/runtime/*.cc"
log "build"
t0=$(date +%s)
JOBS=${JOBS:-$(nproc)}
rm -f "$B"/FAILED_*
compile() {  # src obj compiler flags...  (in the background, at most JOBS at once)
  local src=$1 obj=$2
  shift 2
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  ( "$@" -c "$src" -o "$obj" > "$obj.log" 2>&1 || { echo "FAILED $src"; cat "$obj.log"; touch "$B/FAILED_$(basename "$obj")"; } ) &
}
for s in src/backend/cuda/*.cu; do compile "$s" "$B/obj/$(echo "$s" | tr / _).o" nvcc $NVFLAGS; done
for s in $SRCS; do compile "$s" "$B/obj/$(echo "$s" | tr / _).o" g++ $CXXFLAGS; done
compile "$DEPS/gtest/src/gtest-all.cc" "$B/gtest-all.o" g++ -std=c++17 -O2 -I$DEPS/gtest/include -I$DEPS/gtest
compile "$DEPS/gtest/src/gtest_main.cc" "$B/gtest_main.o" g++ -std=c++17 -O2 -I$DEPS/gtest/include
BIN_DEF=; [ "${CLI:-0}" = full ] && BIN_DEF="-DDSV3_BINARY=\"$B/dsv3\""  # (the tests of the dsv3 command too)
compile tests/cuda_backend_test.cc "$B/test.o" g++ $CXXFLAGS -Itests "-DDSV3_TEST_DATA=\"$ROOT/tests/data\"" $BIN_DEF
compile tests/cuda_attention_test.cc "$B/test_attn.o" g++ $CXXFLAGS -Itests "-DDSV3_TEST_DATA=\"$ROOT/tests/data\"" $BIN_DEF
compile tests/cuda_model_test.cc "$B/test_model.o" g++ $CXXFLAGS -Itests "-DDSV3_TEST_DATA=\"$ROOT/tests/data\"" $BIN_DEF
compile tests/cuda_nccl_test.cc "$B/test_nccl.o" g++ $CXXFLAGS -Itests
compile bench/cuda_bench.cc "$B/bench.o" g++ $CXXFLAGS -Ibench
compile bench/cublaslt_fp8_bench.cc "$B/ltbench.o" g++ $CXXFLAGS -Ibench
if [ "${CLI:-0}" = 1 ]; then  # the dsv3 binary with the bench command only (for --device cuda)
  mkdir -p "$B/cli"
  for s in src/backend/registry.cc src/backend/cpu/*.cc src/tools/main.cc src/tools/cmd_bench.cc src/tools/model_options.cc \
           src/tools/bench_model.cc src/tools/bench_serving.cc src/tools/serving_report.cc; do
    compile "$s" "$B/cli/$(echo "$s" | tr / _).o" g++ $CXXFLAGS
  done
elif [ "${CLI:-0}" = full ]; then  # the whole dsv3 binary: every command, the HTTP server among them
  mkdir -p "$B/cli"
  SD=$DEPS/server
  for s in src/backend/registry.cc src/backend/cpu/*.cc src/tools/*.cc src/server/*.cc src/text/*.cc; do
    compile "$s" "$B/cli/$(echo "$s" | tr / _).o" g++ $CXXFLAGS -I$SD/include -I$SD/include/x86_64-linux-gnu -I$SD/gen \
      -DCPPHTTPLIB_OPENSSL_SUPPORT -DCPPHTTPLIB_ZLIB_SUPPORT -DCPPHTTPLIB_BROTLI_SUPPORT
  done
  CLI_LIBS="$(ls $SD/lib/*) -Wl,-rpath,$SD/lib"
fi
# A second or third build for A/B runs (bench_alt, bench_alt2): the kernels with more nvcc flags,
# or from a source tree of its own, which then also builds the backend's host code (it calls the
# kernels' entry points) and the benchmark against its headers (CudaOptions may differ); other
# headers must be the same.  alt_build NAME SRC_TREE NVCC_FLAGS
alt_build() {
  local name=$1 tree=$2 flags=$3 asrc=${2:-src}
  mkdir -p "$B/obj_$name"
  for s in $asrc/backend/cuda/*.cu; do compile "$s" "$B/obj_$name/$(basename "$s").o" nvcc -I$ROOT/$asrc $NVFLAGS $flags; done
  if [ -n "$tree" ]; then
    for s in $asrc/backend/cuda/*.cc; do compile "$s" "$B/obj_$name/$(basename "$s").o" g++ -I$ROOT/$asrc $CXXFLAGS; done
    compile bench/cuda_bench.cc "$B/bench_$name.o" g++ -I$ROOT/$asrc $CXXFLAGS -Ibench
  fi
}
ALT=${ALT_NVFLAGS:-}${ALT_SRC:-}
[ -n "$ALT" ] && alt_build alt "${ALT_SRC:-}" "${ALT_NVFLAGS:-}"
ALT2=${ALT2_NVFLAGS:-}${ALT2_SRC:-}
[ -n "$ALT2" ] && alt_build alt2 "${ALT2_SRC:-}" "${ALT2_NVFLAGS:-}"
wait
fail=0
ls "$B"/FAILED_* > /dev/null 2>&1 && fail=1
cat $B/obj/*.cu.o.log > "$OUT/ptxas.txt" 2>/dev/null
LIBS="-L/usr/local/cuda/lib64 -lcublas -lcublasLt -lcudart $NCCL_LIB $MPI_LIB -lpthread"
# Links bench_NAME: the main build's objects but its kernels (with a source tree of its own, but
# the CUDA backend's host code and the benchmark as well), and NAME's.  alt_link NAME SRC_TREE
alt_link() {
  local main=bench.o
  [ -n "$2" ] && main=bench_$1.o
  g++ -o "$B/bench_$1" "$B/$main" $(ls $B/obj/*.o | grep -v '\.cu\.o$' | { if [ -n "$2" ]; then grep -v 'src_backend_cuda_'; else cat; fi; }) \
    $B/obj_$1/*.o $LIBS
}
if [ $fail = 0 ]; then
  g++ -o "$B/tests" "$B/test.o" "$B/test_attn.o" "$B/test_model.o" "$B/test_nccl.o" $B/obj/*.o "$B/gtest-all.o" "$B/gtest_main.o" $LIBS || fail=1
  g++ -o "$B/bench" "$B/bench.o" $B/obj/*.o $LIBS || fail=1
  g++ -o "$B/ltbench" "$B/ltbench.o" $B/obj/*.o $LIBS || fail=1
  if [ -n "$ALT" ]; then alt_link alt "${ALT_SRC:-}" || fail=1; fi
  if [ -n "$ALT2" ]; then alt_link alt2 "${ALT2_SRC:-}" || fail=1; fi
  if [ "${CLI:-0}" != 0 ]; then g++ -o "$B/dsv3" $B/cli/*.o $B/obj/*.o $LIBS ${CLI_LIBS:-} || fail=1; fi
fi
log "build done in $(( $(date +%s) - t0 )) s, fail=$fail"
[ $fail = 0 ] || exit 1

TESTS=${TESTS:-*Cuda*}
if [ "$TESTS" != none ]; then
  log "tests $TESTS"
  timeout ${TEST_TIMEOUT:-240} "$B/tests" --gtest_filter="$TESTS" > "$OUT/tests.log" 2>&1
  log "tests rc=$?"
  grep -E "^\[  (PASSED|FAILED) |FAILED  \]|tests? from .* ran" "$OUT/tests.log" | tail -40 | tee -a "$OUT/summary.txt"
  grep -E "rows, max" "$OUT/tests.log" | tee -a "$OUT/summary.txt" | head -40
fi
BENCH_ARGS=${BENCH_ARGS:-}
if [ "$BENCH_ARGS" != none ]; then
  log "bench $BENCH_ARGS"
  timeout ${BENCH_TIMEOUT:-200} "$B/bench" --json "$OUT/bench.json" $BENCH_ARGS > "$OUT/bench.log" 2>&1
  log "bench rc=$?"
  cat "$OUT/bench.log" | tee -a "$OUT/summary.txt"
  if [ -n "$ALT" ]; then  # A/B: alternate the two builds, ALT_ROUNDS times each
    for r in $(seq 1 ${ALT_ROUNDS:-2}); do
      for v in bench_alt $([ -n "$ALT2" ] && echo bench_alt2) bench; do
        what=$ALT; [ $v = bench ] && what=default; [ $v = bench_alt2 ] && what=$ALT2
        log "$v ($what) round $r: ${ALT_ARGS:-$BENCH_ARGS}"
        timeout ${BENCH_TIMEOUT:-200} "$B/$v" ${ALT_ARGS:-$BENCH_ARGS} > "$OUT/ab_${v}_$r.log" 2>&1
        grep -E "tok/s" "$OUT/ab_${v}_$r.log" | tee -a "$OUT/summary.txt"
      done
    done
  fi
fi
if [ -n "${OLD_TREE:-}" ]; then  # A/B against another tree's dsv3_cuda_bench (e.g. main before a change, in an
  # untracked folder carried along): built with that tree's own device script, run alternately with this one,
  # OLD_ROUNDS times, with OLD_ARGS (default BENCH_ARGS)
  wait $OLD_PID
  log "old tree $OLD_TREE built: rc=$? ($(grep 'build done' /tmp/old_out/summary.txt 2>/dev/null))"
  for r in $(seq 1 ${OLD_ROUNDS:-2}); do
    for v in old new; do
      bin=$B/bench; [ $v = old ] && bin=/tmp/dsv3_old_build/bench
      log "A/B $v round $r: ${OLD_ARGS:-$BENCH_ARGS}"
      timeout ${BENCH_TIMEOUT:-200} "$bin" ${OLD_ARGS:-$BENCH_ARGS} > "$OUT/ab_${v}_$r.log" 2>&1
      grep -E "tok/s" "$OUT/ab_${v}_$r.log" | tee -a "$OUT/summary.txt"
    done
  done
fi
if [ -n "${ENV_AB:-}" ]; then  # e.g. ENV_AB="-|DSV3_CUDA_PDL=0|DSV3_CUDA_GRAPH=0 DSV3_CUDA_PDL=0|@alt"
  EARGS=${ENV_ARGS:---dtypes fp8,bf16 --decode-only --batches 1 --variants default}
  IFS='|' read -r -a SETS <<< "$ENV_AB"
  for r in $(seq 1 ${ENV_ROUNDS:-3}); do
    for set in "${SETS[@]}"; do
      set=$(echo $set)  # (trimmed)
      printf '\n== %s setting %s round %s\n' "$(date +%T)" "$set" "$r" >> "$OUT/env_ab.log"  # (own line)
      vars=(); [ "$set" != - ] && read -r -a vars <<< "$set"
      bin=bench
      case "${vars[0]:-}" in @*) bin=bench_${vars[0]#@}; vars=("${vars[@]:1}") ;; esac
      env ${vars[@]+"${vars[@]}"} timeout ${BENCH_TIMEOUT:-200} "$B/$bin" $EARGS >> "$OUT/env_ab.log" 2>&1
      rc=$?; [ $rc = 0 ] || { printf '\n' >> "$OUT/env_ab.log"; log "env A/B: setting '$set' round $r exited $rc"; }
    done
  done
  log "env A/B: $EARGS (min / median / max over ${ENV_ROUNDS:-3} rounds)"
  if command -v python3 > /dev/null; then python3 scripts/ab_table.py "$OUT/env_ab.log" | tee -a "$OUT/summary.txt"
  else grep -E "setting|tok/s" "$OUT/env_ab.log" | tee -a "$OUT/summary.txt"; fi
fi
if [ -n "${LT_ARGS:-}" ]; then  # e.g. LT_ARGS="--reps 50": dsv3_cublaslt_bench
  log "cublaslt bench $LT_ARGS"
  timeout 200 "$B/ltbench" $LT_ARGS > "$OUT/cublaslt.log" 2>&1
  log "cublaslt bench rc=$?"
  cat "$OUT/cublaslt.log" | tee -a "$OUT/summary.txt"
fi
if [ -n "${CLI_ARGS:-}" ]; then  # e.g. CLI=1 CLI_ARGS="bench --device cuda --model DIR"
  log "dsv3 $CLI_ARGS"
  timeout 200 "$B/dsv3" $CLI_ARGS > "$OUT/cli.log" 2>&1
  log "dsv3 rc=$?"
  cat "$OUT/cli.log" | tee -a "$OUT/summary.txt"
fi
if [ "${SANITIZE:-0}" = 1 ]; then
  log "compute-sanitizer memcheck over the op tests"
  timeout 240 compute-sanitizer --tool memcheck --print-limit 20 "$B/tests" --gtest_filter='CudaOps.*' \
    > "$OUT/memcheck.log" 2>&1
  log "memcheck rc=$?"
  tail -25 "$OUT/memcheck.log" | tee -a "$OUT/summary.txt"
fi
if [ -n "${NCU:-}" ]; then  # e.g. NCU="moe_gemv|gemv_kernel" : one decode-step instance of each (bench args: NCU_ARGS; more ncu flags: NCU_EXTRA; NCU_STALLS=1: cycles per instruction by stall reason)
  log "ncu $NCU"
  [ "${NCU_STALLS:-0}" = 1 ] && NCU_EXTRA="${NCU_EXTRA:-} --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
  timeout ${NCU_TIMEOUT:-200} ncu --clock-control none --kernel-name "regex:${NCU}" --launch-skip ${NCU_SKIP:-300} \
    --launch-count ${NCU_COUNT:-6} --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis ${NCU_EXTRA:-} \
    "$B/bench" ${NCU_ARGS:---dtypes bf16 --quick --steps 8} > "$OUT/ncu.txt" 2>&1
  log "ncu rc=$?"
  grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Stall|L2 Hit|Mem Busy|Max Bandwidth" "$OUT/ncu.txt" | head -150 | tee -a "$OUT/summary.txt"
  grep -E "issue_stalled" "$OUT/ncu.txt" | awk '$NF + 0 >= 0.05' | tee -a "$OUT/summary.txt"
fi
log "end"
# The device tool brings back only a few files from $OUT: past 8 of them, everything goes into one
# all.tgz (PACK=0 keeps them as they are).
if [ "${PACK:-1}" = 1 ] && [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf all.tgz --exclude=all.tgz -- * && find . -maxdepth 1 -type f ! -name all.tgz -delete)
fi
