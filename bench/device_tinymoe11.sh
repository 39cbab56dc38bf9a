#!/bin/bash
# Branch tinymoe11's device call, run from its carried copy (.carry/tinymoe11; the device run's
# root holds the shipped checkout): the one-token kernels against the shipped ones at
# Qwen3-30B and DeepSeek-V3 t1 (profiler kernel times, L2 flushed; bits checked against the
# shipped kernels), then, each when its time limit is set:
#   TESTS_S  the one-token GPU tests (bits against the grouped path, flags)  -> gpu_tests.log
#   PROF_S   profile_moe.py at t1: the ratio against the grouped GEMMs        -> moe_steps.json
source bench/device_env.sh
timeout -k 5 ${CMP_S:-100} python3 -P bench/tinymoe_compare.py --base ../../kernels/_triton_moe_token.py \
  --out "$OUT/tinymoe_compare.json" > "$OUT/tinymoe_compare.log" 2>&1
echo "compare rc=$? $(el)"; cut -c1-260 "$OUT/tinymoe_compare.log" | grep -v "^ *$" | tail -24
if [ -n "$TESTS_S" ]; then
  timeout -k 5 $TESTS_S python3 -P -m pytest -q -p no:cacheprovider -rfE \
    tests/server/test_moe_token_gpu.py > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$? $(el)"; tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
fi
if [ -n "$PROF_S" ]; then
  timeout -k 5 $PROF_S python3 -P bench/profile_moe.py --models qwen3-30b-a3b,deepseek-v3 --tokens 1 \
    --reps 20 --out "$OUT/moe_steps.json" > "$OUT/moe_steps.log" 2>&1
  echo "profile rc=$? $(el)"
  python3 - "$OUT/moe_steps.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["model"], r["tokens"], "kern", r.get("kernels_sum_us"), "gemm", r.get("gemm_kernels_alone_us"),
          "ratio", r.get("kernels_over_gemm_kernels"), r.get("per_kernel_us"))
PY
fi
true
