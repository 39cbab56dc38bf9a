#!/bin/bash
# The seventh session's last device call: the GPU tests of everything changed since call 3 (in
# pytest-xdist workers, one file each), the moe graph's steps and kernel sums, the check-order
# experiment, and the service bench's quick points. Carry .whl. Writes under $OUT.
source bench/device_env.sh
timeout -k 5 ${TESTS_S:-190} python3 -P -m pytest -q -p no:cacheprovider -m "not slow" --timeout 180 -rfE --durations=5 \
  -n ${WORKERS:-10} --dist loadfile tests/server/test_ffn_gpu.py tests/server/test_experts_gpu.py \
  tests/kernels/test_triton_service.py tests/server/test_ahead_gpu.py tests/server/test_engine_gpu.py \
  tests/server/test_shipped_gpu.py tests/server/test_server_gpu.py tests/server/test_prologue.py \
  tests/kernels/test_triton_act.py tests/server/test_staging.py tests/server/test_http_body.py ${EXTRA_TESTS} \
  > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? $(el)"; tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
timeout -k 5 ${PROF_S:-60} python3 -P bench/profile_moe.py --reps 20 --out "$OUT/moe_steps.json" > "$OUT/moe_steps.log" 2>&1
echo "profile rc=$? $(el)"
python3 - "$OUT/moe_steps.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["model"], r["tokens"], "moe", r["moe_us"], "kern", r.get("kernels_sum_us"), "gemm", r.get("gemm_kernels_us"),
          "ratio", r.get("kernels_over_gemm_kernels"), "route_quant", r.get("route_quant_us"))
PY
timeout -k 5 ${SERV_S:-170} python3 -P bench/bench_service.py --quick --no-deepseek --servers default \
  --budget-s $(( ${SERV_S:-170} - 40 )) --duration 1.0 --out "$OUT/service.json" > "$OUT/service.log" 2>&1
echo "service bench rc=$? $(el)"; grep -v "^ " "$OUT/service.log" | grep -v "^median" | tail -14 | cut -c1-400
timeout -k 5 ${EXP_S:-75} python3 -P bench/exp_check_order.py --json "$OUT/exp_check_order.json" > "$OUT/exp.log" 2>&1
echo "experiment rc=$? $(el)"; cut -c1-300 "$OUT/exp.log" | grep "^{" 
true
