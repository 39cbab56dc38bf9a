#!/bin/bash
# Session 57, one call for both (timeout_s 380; little device time is left after failed starts):
# the GPU suites of this session's changes (check_and_gather's rows from its gather, a moe
# family's x of its tokens, the new-shape graph memory estimate), then what session 56's
# default bucket bought (bench/chunked_calls.py, bench/moe_bucket.py on DeepSeek-V3).
source bench/device_env.sh
TESTS="tests/server/test_prologue.py tests/server/test_ffn_gpu.py tests/server/test_engine_gpu.py tests/server/test_experts_gpu.py tests/server/test_shipped_gpu.py tests/server/test_moe_token_gpu.py"
timeout -k 5 180 python3 -P -m pytest -q -p no:cacheprovider -m "not slow" --timeout 200 -rfE \
  -n 12 --dist loadfile $TESTS > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? $(el)"; tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
grep -B5 -A25 "estimate" "$OUT/gpu_tests.log" | grep -E "assert|grown|Error" | head -10
timeout -k 5 80 python3 -P bench/chunked_calls.py --match "DeepSeek-V3 w13 prefill t8192,Kimi-K2 w13 prefill t8192,Qwen3-30B-A3B w2 prefill t8192" > "$OUT/chunked.log" 2>&1
echo "chunked_calls rc=$? $(el)"; tail -5 "$OUT/chunked.log"
timeout -k 5 $(( 365 - $(date +%s) + T0 )) python3 -P bench/moe_bucket.py --models deepseek-v3 --tokens 8192 --reps 5 > "$OUT/moe_bucket.log" 2>&1
echo "moe_bucket rc=$? $(el)"; tail -8 "$OUT/moe_bucket.log"
