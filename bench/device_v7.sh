#!/bin/bash
# Issue 16, v7 (sixth session): one device call, from the carried checkout's root
# (.carry/service, the wheels at ../../.whl): the GPU tests of what ships, then the
# service benchmark's quick points (the load point and 32 clients of 1024-row calls
# included) on the default server. Writes under $OUT.
R=$PWD; W=${WHL:-../../.whl}
mkdir -p /tmp/pkg/moegemm && cp moegemm/*.py /tmp/pkg/moegemm/
for d in kernels server client; do ln -sfn $R/$d /tmp/pkg/moegemm/$d; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $W/server/*.whl
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c "import cuda.bindings, torch; print('cuda-bindings', cuda.bindings.__version__, 'torch', torch.__version__)"
timeout -k 5 ${TESTS_S:-100} python3 -P -m pytest -v -p no:cacheprovider --durations=8 \
  tests/server/test_shipped_gpu.py tests/server/test_engine_gpu.py tests/server/test_staging.py \
  tests/server/test_server_gpu.py > "$OUT/gpu_tests_h200_v7.log" 2>&1
echo "pytest rc=$?"; tail -2 "$OUT/gpu_tests_h200_v7.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_h200_v7.log" | head
timeout -k 5 ${BENCH_S:-150} python3 -P bench/bench_service.py --quick --no-deepseek --servers default \
  --budget-s ${BUDGET_S:-110} --duration 1.0 --out "$OUT/service_h200_v7.json" > "$OUT/service_h200_v7_bench.log" 2>&1
echo "bench rc=$?"; grep -v "^ " "$OUT/service_h200_v7_bench.log" | grep -v "^median" | tail -14
