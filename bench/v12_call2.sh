#!/bin/bash
# v12 call 2 (device): the whole benchmark (seed + real sets, every case through the server's
# captured graph, the peers in the same run), then the GPU tests call 1 failed or did not reach.
# Run from the carried copy's root with .whl/server and .whl/mslk carried.
R=$PWD; mkdir -p /tmp/pkg/moegemm && cp moegemm/*.py /tmp/pkg/moegemm/ &&
for d in kernels server client; do ln -sfn $R/$d /tmp/pkg/moegemm/$d; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../../.whl/server/*.whl ../../.whl/mslk/*.whl
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
START=$(date +%s)
timeout 215 python3 bench/bench_kernels.py --budget-s 190 --json $OUT/kernels_v12.json > $OUT/kernels_v12.log 2>&1
echo "bench rc=$? at $(( $(date +%s) - START )) s"
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_service.py tests/kernels/test_triton.py \
  -m "not slow" -k "merged or pick_one_tile or (float32 and persistent_tma) or (service_path and 30000)" \
  > $OUT/kernels_v12_call2_pytest.log 2>&1
echo "pytest rc=$? at $(( $(date +%s) - START )) s"
tail -4 $OUT/kernels_v12_call2_pytest.log
grep -A200 "^case " $OUT/kernels_v12.log | cut -c1-150
tail -1 $OUT/kernels_v12.log | cut -c1-3000
