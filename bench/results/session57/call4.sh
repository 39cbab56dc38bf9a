#!/bin/bash
# Session 57, the lean call (timeout_s 300; most of the budget went to failed starts): the GPU
# suites of this session's changes, then bench/chunked_calls.py on two cases.
source bench/device_env.sh
TESTS="tests/server/test_prologue.py tests/server/test_ffn_gpu.py tests/server/test_engine_gpu.py tests/server/test_experts_gpu.py tests/server/test_shipped_gpu.py tests/server/test_moe_token_gpu.py"
timeout -k 5 185 python3 -P -m pytest -q -p no:cacheprovider -m "not slow" --timeout 180 -rfE \
  -n 12 --dist loadfile $TESTS > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? $(el)"; tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
grep -E "^E  .*(assert|grown|Error)" "$OUT/gpu_tests.log" | head -12
timeout -k 5 $(( 285 - $(date +%s) + T0 )) python3 -P bench/chunked_calls.py --match "Kimi-K2 w13 prefill t8192,DeepSeek-V3 w13 prefill t8192" > "$OUT/chunked.log" 2>&1
echo "chunked_calls rc=$? $(el)"; tail -4 "$OUT/chunked.log"
