#!/bin/bash
# The sixth session's verification call (device): every GPU test of the merged code (kernels,
# engine, expert sets, the shipped server), the moe bench through a real server, the kernel
# benchmark (seed + real sets through the service graph, peers in the same run) and the
# service benchmark's quick points. Run from the repository root with .whl/server and
# .whl/mslk carried; writes under $OUT. Time limits (s): TESTS_S, MOE_S, KERN_S, SERV_S.
R=$PWD; mkdir -p /tmp/pkg/moegemm && cp moegemm/*.py /tmp/pkg/moegemm/
for d in kernels server client; do ln -sfn $R/$d /tmp/pkg/moegemm/$d; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/server/*.whl .whl/mslk/*.whl
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
if [ -z "$SKIP_TESTS" ]; then
timeout -k 5 ${TESTS_S:-230} python3 -P -m pytest -q -p no:cacheprovider -m "not slow" --timeout 120 --durations=10 \
  tests/server/test_shipped_gpu.py tests/server/test_engine_gpu.py tests/server/test_staging.py \
  tests/server/test_server_gpu.py tests/server/test_ffn_gpu.py tests/server/test_experts_gpu.py \
  tests/server/test_prologue.py tests/server/test_http_body.py tests/kernels/test_triton_service.py \
  tests/kernels/test_triton_act.py tests/kernels/test_quant_devices.py tests/kernels/test_reference.py \
  tests/kernels/test_triton.py ${EXTRA_TESTS} > "$OUT/gpu_tests.log" 2>&1
echo "pytest rc=$? $(el)"; tail -2 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
fi
if [ -z "$SKIP_MOE" ]; then
  W=/tmp/moe_weights; mkdir -p $W
  MOEGEMM_MAX_BUCKET_M=2048 MOEGEMM_MOE_TOP_K=8 python3 -P -m moegemm.cli serve --device cuda \
    --port 18700 --weights-dir $W --no-demo > "$OUT/moe_server.log" 2>&1 &
  SP=$!
  for i in $(seq 1 120); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:18700/v1/health/ready', timeout=1)" \
      >/dev/null 2>&1 && break; sleep 0.5; done
  timeout -k 5 ${MOE_S:-80} python3 -P bench/bench_moe.py --server http://127.0.0.1:18700 \
    --weights-dir $W --reps ${MOE_REPS:-12} --out "$OUT/moe_server.json" > "$OUT/moe.log" 2>&1
  echo "moe bench rc=$? $(el)"; grep -v "^ " "$OUT/moe.log" | tail -10
  kill $SP; wait $SP 2>/dev/null; rm -rf $W
fi
if [ -z "$SKIP_KERN" ]; then
  timeout -k 5 ${KERN_S:-150} python3 -P bench/bench_kernels.py --budget-s $(( ${KERN_S:-150} - 20 )) \
    --json "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  echo "kernel bench rc=$? $(el)"; tail -1 "$OUT/kernels.log" | cut -c1-1500
fi
if [ -z "$SKIP_SERV" ]; then
  timeout -k 5 ${SERV_S:-150} python3 -P bench/bench_service.py --quick --no-deepseek --servers default \
    --budget-s $(( ${SERV_S:-150} - 40 )) --duration 1.0 --out "$OUT/service.json" > "$OUT/service.log" 2>&1
  echo "service bench rc=$? $(el)"; grep -v "^ " "$OUT/service.log" | grep -v "^median" | tail -16
fi
