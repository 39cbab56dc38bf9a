#!/bin/bash
# Ninth session, call 3: main's one-token prefetch sweep and GPU tests, the 1-row path profiled,
# then branch gap9 (carried at .carry/gap9): its service-vs-public gap script and GPU tests.
TESTS="tests/server/test_moe_token_gpu.py" TESTS_S=120 WORKERS=1 TILE_S=120 TILE_SWEEP=prefetch \
  TRACE_S=120 TRACE_VARIANTS=profile TRACE_MS=1 bash bench/device_session9.sh
(
  cd .carry/gap9 && R=$PWD && rm -rf /tmp/pkg && mkdir -p /tmp/pkg/moegemm && cp moegemm/*.py /tmp/pkg/moegemm/
  for d in kernels server client; do ln -sfn $R/$d /tmp/pkg/moegemm/$d; done
  export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
  timeout 110 python3 bench/gap_gluon.py --out $OUT/gap_gluon_h200.json --budget-s 70 > $OUT/gap_gluon_h200.log 2>&1
  echo "gap rc=$?"; tail -30 $OUT/gap_gluon_h200.log | cut -c1-250
  timeout 120 python3 -P -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests/server/test_prologue.py tests/kernels/test_gluon_gemm.py > $OUT/gap_tests.log 2>&1
  echo "gap tests rc=$?"; tail -3 $OUT/gap_tests.log; grep -E "^(FAILED|ERROR)" $OUT/gap_tests.log | head
)
