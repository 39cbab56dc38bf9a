#!/bin/bash
# The next session's first call (timeout_s 420; carry .whl/server and .whl/mslk): session 57's
# GPU suites in full (on an H100 they ran out of device time after 80 passed, none failed),
# then bench/moe_bucket.py on DeepSeek-V3 (a moe call of 8192 tokens at top-8 through the expert
# executor at the default bucket against 8192; the load's captures and the memory held).
source bench/device_env.sh
TESTS="tests/server/test_engine_gpu.py tests/server/test_experts_gpu.py tests/server/test_shipped_gpu.py tests/server/test_server_gpu.py tests/server/test_ffn_gpu.py tests/server/test_prologue.py"
timeout -k 5 240 python3 -P -m pytest -q -p no:cacheprovider -m "not slow" --timeout 200 -rfE \
  -n 12 --dist loadfile $TESTS > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? $(el)"; tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
timeout -k 5 $(( 405 - $(date +%s) + T0 )) python3 -P bench/moe_bucket.py --models deepseek-v3 --tokens 8192 --reps 5 > "$OUT/moe_bucket.log" 2>&1
echo "moe_bucket rc=$? $(el)"; tail -8 "$OUT/moe_bucket.log"
