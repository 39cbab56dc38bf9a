#!/bin/bash
# Branch decode12's device call, run from its carried copy (.carry/decode12): the decode tiles
# as shipped, at 4 and 5 stages, and with their scale products preloaded at 3-5 stages, on
# every real decode case and the seed decode shapes (bench/decode_sweep.py: CUDA-graph replay
# medians, variants interleaved, bits against the shipped tile; the weight sets in a child
# process, restarted past a set it dies on), then the GPU bit test of the variant and, when
# TESTS_S is set, the GPU kernel tests and the one-token moe tests.
source bench/device_env.sh
timeout -k 5 ${SWEEP_S:-215} python3 -P bench/decode_sweep.py --budget-s ${BUDGET_S:-165} \
  --out "$OUT/decode_sweep.json" > "$OUT/decode_sweep.log" 2>&1
echo "sweep rc=$? $(el)"; grep -v "^ *$" "$OUT/decode_sweep.log" | cut -c1-330 | tail -60
timeout -k 5 ${BITS_S:-50} python3 -P -m pytest -q -p no:cacheprovider -rfE -x \
  tests/kernels/test_decode_preload_gpu.py > "$OUT/preload_bits.log" 2>&1
echo "bits rc=$? $(el)"; tail -1 "$OUT/preload_bits.log"; grep -E "^(FAILED|ERROR)" "$OUT/preload_bits.log" | head
if [ -n "$TESTS_S" ]; then
  timeout -k 5 $TESTS_S python3 -P -m pytest -q -p no:cacheprovider -rfE -m "not slow" \
    tests/kernels/test_triton.py tests/kernels/test_triton_tiles.py tests/server/test_moe_token_gpu.py \
    > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$? $(el)"; tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
fi
true
