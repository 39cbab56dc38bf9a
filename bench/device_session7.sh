#!/bin/bash
# The seventh session's device call: the GPU tests (first, serially, the ones the last session
# could not verify: the shipped server module in its order, the split-K workspace test, the
# executor test; then every other GPU test file in parallel pytest workers, one file per
# worker), then optional benches (MOE/KERN/SERV as in device_session6.sh).
# Carry .whl (server, mslk, test wheels). Writes under $OUT.
source bench/device_env.sh
if [ -z "$SKIP_FIRST" ]; then
timeout -k 5 ${FIRST_S:-200} python3 -P -m pytest -q -p no:cacheprovider -m "not slow" --timeout 150 -rfE --durations=8 \
  tests/server/test_shipped_gpu.py tests/kernels/test_triton_service.py tests/server/test_prologue.py ${FIRST_EXTRA} \
  > "$OUT/gpu_first.log" 2>&1
echo "first rc=$? $(el)"; tail -2 "$OUT/gpu_first.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_first.log" | head -20
fi
if [ -z "$SKIP_REST" ]; then
timeout -k 5 ${REST_S:-300} python3 -P -m pytest -q -p no:cacheprovider -m "not slow" --timeout 200 -rfE --durations=8 \
  -n ${WORKERS:-6} --dist loadfile \
  tests/server/test_engine_gpu.py tests/server/test_staging.py \
  tests/server/test_server_gpu.py tests/server/test_ffn_gpu.py tests/server/test_experts_gpu.py \
  tests/server/test_http_body.py tests/kernels/test_triton_act.py tests/kernels/test_quant_devices.py \
  tests/kernels/test_reference.py tests/kernels/test_triton.py ${REST_EXTRA} > "$OUT/gpu_rest.log" 2>&1
echo "rest rc=$? $(el)"; tail -2 "$OUT/gpu_rest.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_rest.log" | head -20
fi
[ -n "$THEN" ] && SKIP_TESTS=1 bash bench/device_session6.sh
