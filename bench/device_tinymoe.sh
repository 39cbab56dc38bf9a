#!/bin/bash
# Issue 17's one-token moe in two kernels (tinymoe8), one device call, < 240 s warm:
#   1. GPU tests: the one-token body == the grouped path bit for bit, the expert tests,
#      the activation kernel's (its helpers are shared now)              -> gpu_tests.log
#   2. profile_moe.py, Qwen3-30B-A3B and DeepSeek-V3 at 1 and 16 tokens: the moe graph's
#      kernels summed against the two grouped GEMMs alone                 -> moe_steps.json
#   3. tinymoe_tiles.py: the two kernels' weight tiles, time and bits     -> tinymoe_tiles.json
# Run from the checkout's root or a carried copy's; carry .whl/server and .whl/test.
# Writes under $OUT; a short table last. Time limits (s): TESTS_S, PROF_S, TILES_S.
source bench/device_env.sh
timeout -k 5 ${TESTS_S:-115} python3 -P -m pytest -q -p no:cacheprovider -m "not slow" \
  --timeout 105 -rfE --durations=8 -n ${WORKERS:-4} --dist loadfile \
  tests/server/test_moe_token_gpu.py tests/server/test_ffn_gpu.py tests/server/test_experts_gpu.py \
  tests/kernels/test_triton_act.py > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? $(el)"; tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
timeout -k 5 ${PROF_S:-70} python3 -P bench/profile_moe.py --models qwen3-30b-a3b,deepseek-v3 \
  --tokens 1,16 --reps 15 --out "$OUT/moe_steps.json" > "$OUT/moe_steps.log" 2>&1
echo "profile rc=$? $(el)"; grep -v "^{" "$OUT/moe_steps.log" | tail -3 | cut -c1-300
timeout -k 5 ${TILES_S:-30} python3 -P bench/tinymoe_tiles.py --out "$OUT/tinymoe_tiles.json" \
  > "$OUT/tinymoe_tiles.log" 2>&1
echo "tiles rc=$? $(el)"; grep -v "^{" "$OUT/tinymoe_tiles.log" | tail -3 | cut -c1-300
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
print(f"{'model':15} {'T':>3} {'kernels':>8} {'gemms alone':>11} {'ratio':>6} {'moe':>7} {'per kernel (us)'}")
try:
    for r in json.load(open(f"{out}/moe_steps.json"))["rows"]:
        print(f"{r['model']:15} {r['tokens']:>3} {r.get('kernels_sum_us', '-'):>8} "
              f"{r.get('gemm_kernels_alone_us', '-'):>11} {r.get('kernels_over_gemm_kernels', '-'):>6} "
              f"{r['moe_us']:>7} {r.get('per_kernel_us')}")
except Exception as exc:
    print("no profile:", exc)
try:
    for r in json.load(open(f"{out}/tinymoe_tiles.json"))["rows"]:
        print(r["model"], "up", r["up_tile"], r["up_us"], "shipped" if r["up_shipped"] else "",
              "| down", r["down_tile"], r["down_us"], "shipped" if r["down_shipped"] else "",
              "| same bits", r["same_bits"])
except Exception as exc:
    print("no tiles:", exc)
PY
true
