#!/bin/bash
# The next session's second call (timeout_s 420; carry .whl/server and .whl/mslk):
# bench/moe_bucket.py on DeepSeek-V3 (never run: sessions 57-58 had no device time left or
# none lent): a moe call of 8192 tokens at top-8 through the expert executor at the default
# bucket against 8192, the load's captures and the memory held against the room check's
# estimate. On an H200 whose first call ran the bench, the GPU suites of call1.sh run first
# (NO_BENCH=1), then moe_bucket with what is left.
source bench/device_env.sh
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  TESTS=$(sed -n 's/^export TESTS="\(.*\)"$/\1/p' bench/results/session58/call1.sh)
  timeout -k 5 240 python3 -P -m pytest -q -p no:cacheprovider -m "not slow" --timeout 200 -rfE \
    -n 12 --dist loadfile $TESTS > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$? $(el)"; tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
fi
timeout -k 5 $(( 405 - $(date +%s) + T0 )) python3 -P bench/moe_bucket.py --models deepseek-v3 --tokens 8192 --reps 5 > "$OUT/moe_bucket.log" 2>&1
echo "moe_bucket rc=$? $(el)"; tail -8 "$OUT/moe_bucket.log"
