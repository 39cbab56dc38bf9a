#!/bin/bash
# One device call that checks and measures what ships (the fifth session's final run):
# the GPU tests of the server, engine, copies, expert FFN and kernels it runs; the moe
# call against the router's two-call way through a real server; the service benchmark's
# quick points with issue 16's. Writes under $OUT. Run from the repository root, carrying
# .whl/server. Knobs: TESTS_S, MOE_S, BENCH_S (time limits), SKIP_MOE, SKIP_BENCH.
R=$PWD; mkdir -p /tmp/pkg/moegemm && cp moegemm/*.py /tmp/pkg/moegemm/
for d in kernels server client; do ln -sfn $R/$d /tmp/pkg/moegemm/$d; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/server/*.whl
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
timeout -k 5 ${TESTS_S:-170} python3 -P -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/server/test_shipped_gpu.py tests/server/test_engine_gpu.py tests/server/test_staging.py \
  tests/server/test_server_gpu.py tests/server/test_ffn_gpu.py tests/server/test_experts_gpu.py \
  tests/kernels/test_triton_act.py tests/kernels/test_quant_devices.py ${EXTRA_TESTS} \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -3 "$OUT/pytest.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
if [ -z "$SKIP_MOE" ]; then
  W=/tmp/moe_weights; mkdir -p $W
  python3 -P -m moegemm.cli serve --device cuda --port 18700 --weights-dir $W --no-demo \
    > "$OUT/moe_server.log" 2>&1 &
  SP=$!
  for i in $(seq 1 240); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:18700/v1/health/ready', timeout=1)" \
      >/dev/null 2>&1 && break; sleep 0.5; done
  timeout -k 5 ${MOE_S:-130} python3 -P bench/bench_moe.py --server http://127.0.0.1:18700 \
    --weights-dir $W --reps ${MOE_REPS:-15} --out "$OUT/moe_server_h200.json" > "$OUT/moe.log" 2>&1
  echo "moe bench rc=$?"; grep -v "^ " "$OUT/moe.log" | tail -12
  kill $SP; wait $SP 2>/dev/null; rm -rf $W
fi
if [ -z "$SKIP_BENCH" ]; then
  timeout -k 5 ${BENCH_S:-200} python3 -P bench/bench_service.py --quick --no-deepseek \
    --servers ${SERVERS:-default} --budget-s ${BUDGET_S:-110} --duration ${DURATION:-1.0} \
    --out "$OUT/service_h200_v6.json" ${BENCH_ARGS} > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -v "^ " "$OUT/bench.log" | tail -30
fi
