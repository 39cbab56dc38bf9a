#!/bin/bash
# Branch decode11's device call, run from its carried copy (.carry/decode11): the decode tiles
# as shipped against their K loop with every load staged (the scales too) at 3-6 stages, on
# every real decode case and the seed decode shapes (bench/decode_sweep.py: CUDA-graph replay
# medians, variants interleaved, bits against the shipped tile), then, when TESTS_S is set,
# the GPU kernel tests and the one-token moe tests (their bits rest on the decode tiles').
source bench/device_env.sh
timeout -k 5 ${SWEEP_S:-285} python3 -P bench/decode_sweep.py --budget-s ${BUDGET_S:-215} \
  --out "$OUT/decode_sweep.json" > "$OUT/decode_sweep.log" 2>&1
echo "sweep rc=$? $(el)"; grep -v "^ *$" "$OUT/decode_sweep.log" | cut -c1-330 | tail -60
if [ -n "$TESTS_S" ]; then
  timeout -k 5 $TESTS_S python3 -P -m pytest -q -p no:cacheprovider -rfE -m "not slow" \
    tests/kernels/test_triton.py tests/kernels/test_triton_tiles.py tests/server/test_moe_token_gpu.py \
    > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$? $(el)"; tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
fi
true
