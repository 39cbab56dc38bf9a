#!/bin/bash
# One device call for the service (bench/SERVICE_NOTES.md): the package preamble,
# the GPU tests, the layer-by-layer diagnosis, then the quick service benchmark
# with the variants in $VARIANTS. Writes under $OUT. Run from the repository root.
# HEAD_KERNELS=1: use the committed kernels carried in .whl/head (another engineer
# may be editing kernels/ in the same tree).
if [ -n "$HEAD_KERNELS" ]; then cp .whl/head/*.py kernels/; fi
R=$PWD; mkdir -p /tmp/pkg/moegemm && cp moegemm/*.py /tmp/pkg/moegemm/
for d in kernels server client; do ln -sfn $R/$d /tmp/pkg/moegemm/$d; done
# .whl/cuda: cuda-bindings (the engine's driver copies; without it they fall back to torch's)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/server/*.whl \
  $(ls .whl/cuda/*.whl 2>/dev/null)
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONSAFEPATH=1
if [ -n "${TESTS-tests/server/test_engine_gpu.py tests/server/test_shipped_gpu.py tests/server/test_staging.py tests/server/test_server_gpu.py}" ]; then
  timeout -k 5 ${TESTS_S:-150} python3 -P -m pytest -q -p no:cacheprovider -x \
    ${TESTS-tests/server/test_engine_gpu.py tests/server/test_shipped_gpu.py tests/server/test_staging.py tests/server/test_server_gpu.py} \
    > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; tail -3 "$OUT/pytest.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head
fi
if [ -n "$KTESTS" ]; then  # kernel GPU tests, e.g. KTESTS="tests/kernels/test_triton.py -k weight_table"
  timeout -k 5 ${KTESTS_S:-200} python3 -P -m pytest -q -p no:cacheprovider $KTESTS > "$OUT/pytest_kernels.log" 2>&1
  echo "kernel pytest rc=$?"; tail -2 "$OUT/pytest_kernels.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_kernels.log" | head
fi
if [ -n "$PROFILE" ]; then  # py-spy on the server under load (carry .whl/tools)
  python3 -m pip install -q --no-index --no-deps --target /tmp/spy .whl/tools/py_spy*.whl
  PATH=/tmp/spy/bin:$PATH timeout -k 5 ${PROFILE_S:-120} python3 -P bench/profile_service.py \
    --out "$OUT/profile" $PROFILE > "$OUT/profile.log" 2>&1
  echo "profile rc=$?"; head -60 "$OUT/profile/profile.txt"
fi
if [ -n "$DIAG" ]; then
  timeout -k 5 ${DIAG_S:-100} python3 -P bench/diag_service.py $DIAG_ARGS > "$OUT/diag.log" 2>&1
  echo "diag rc=$?"; grep -E "p50|POST" "$OUT/diag.log"
fi
if [ -n "$TRACE" ]; then  # the lone call's timeline, e.g. TRACE="--variants default --calls 300"
  timeout -k 5 ${TRACE_S:-150} python3 -P bench/trace_service.py $TRACE --out "$OUT/${NAME:-service}_trace.json" \
    > "$OUT/trace.log" 2>&1
  echo "trace rc=$?"; grep -v "^floor" "$OUT/trace.log" | grep -E "^ |p50" | head -70
fi
timeout -k 5 ${BENCH_S:-300} python3 -P bench/bench_service.py ${QUICK---quick} ${NO_DS---no-deepseek} \
  --servers ${SERVERS:-default,merge_off} --variants "$VARIANTS" --budget-s ${BUDGET_S:-240} \
  --out "$OUT/${NAME:-service_quick}.json" ${BENCH_ARGS} > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; cat "$OUT/bench.log" | grep -v "^ " | tail -40
