#!/bin/bash
# Issue 15 (branch gluon11): gluon_ws and its two variants (gluon_ws_handoff, gluon_ws_store) on the 24 real
# many-expert prefill cases, bits against gluon_ws and interleaved CUDA-graph times (bench/gluon11.py ->
# $OUT/gluon11.json and gluon11.log); under 300 s on one H200, compiling included. With TESTS_S set, then the
# Gluon GPU tests (gluon_ws and the variants, tests/kernels/test_gluon_gemm.py -> $OUT/gluon11_tests.log).
#   run(command="cd .carry/gluon11 && bash bench/device_gluon11.sh", carry=[".carry/gluon11", ".whl/server"])
source bench/device_env.sh
timeout -k 5 ${BENCH_S:-270} python3 -P bench/gluon11.py --out "$OUT/gluon11.json" --budget-s ${BUDGET_S:-200} \
  > "$OUT/gluon11.log" 2>&1
echo "gluon11 rc=$? $(el)"; grep -v '^{' "$OUT/gluon11.log" | tail -40 | cut -c1-300
if [ -n "$TESTS_S" ]; then
  timeout -k 5 $TESTS_S python3 -P -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_gluon_gemm.py \
    > "$OUT/gluon11_tests.log" 2>&1
  echo "tests rc=$? $(el)"; tail -1 "$OUT/gluon11_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gluon11_tests.log" | head -20
fi
