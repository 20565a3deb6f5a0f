# main's tree (an untracked copy in bench/tmp_run/mt: `git archive main`, tests/data left out) built in
# the background while run1.sh builds and tests this tree; STEPS names the steps file (call 1:
# steps9.sh, call 3: steps10.sh)
M=bench/tmp_run/mt; ln -s $PWD/tests/data $M/tests/data; cp -r .devdeps $M/
sed -i 's#B=/tmp/dsv3_cuda_build#B=/tmp/dsv3_main_build#' $M/scripts/cuda_device_run.sh
(cd $M && OUT=/tmp/mo CLI=full BENCH_ARGS=none PACK=0 TESTS=none JOBS=8 bash scripts/cuda_device_run.sh > /tmp/mo.log 2>&1; touch /tmp/mo.done) &
JOBS=8 BUDGET=${BUDGET:-450} STEPS=${STEPS:-steps17.sh} TESTS='*' bash bench/tmp_run/run1.sh > /dev/null
