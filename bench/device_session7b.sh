#!/bin/bash
# The seventh session's measuring calls (device). Stages, each run when its time limit is set:
#   TESTS_S  GPU tests ($TESTS, pytest-xdist workers, one file each)
#   KERN_S   bench_kernels.py, seed + real through the service graph, peers  -> kernels.json
#   SWEEP_S  bench_kernels.py --sweep over real decode t1/t16 (public entry)  -> sweep.json
#   PROF_S   profile_moe.py (a moe graph's steps)                            -> moe_steps.json
#   MOEK_S   bench_moe.py kernel side                                          -> moe_kernels.json
# Carry .whl (server, mslk, test wheels). Writes under $OUT.
source bench/device_env.sh
if [ -n "$TESTS_S" ]; then
  timeout -k 5 $TESTS_S python3 -P -m pytest -q -p no:cacheprovider -m "not slow" --timeout 200 -rfE \
    --durations=5 -n ${WORKERS:-6} --dist loadfile $TESTS > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$? $(el)"; tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
fi
if [ -n "$KERN_S" ]; then
  timeout -k 5 $KERN_S python3 -P bench/bench_kernels.py --budget-s $(( KERN_S - 25 )) \
    --json "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  echo "kernel bench rc=$? $(el)"; tail -1 "$OUT/kernels.log" | cut -c1-1200
fi
if [ -n "$SWEEP_S" ]; then
  timeout -k 5 $SWEEP_S python3 -P bench/bench_kernels.py --only real --match "${SWEEP_MATCH:-decode t1 g,decode t16 g}" \
    --sweep --no-peers --budget-s $(( SWEEP_S - 25 )) --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
  echo "sweep rc=$? $(el)"
fi
if [ -n "$PROF_S" ]; then
  timeout -k 5 $PROF_S python3 -P bench/profile_moe.py ${PROF_MODELS:+--models $PROF_MODELS} --reps 20 --out "$OUT/moe_steps.json" > "$OUT/moe_steps.log" 2>&1
  echo "profile rc=$? $(el)"; tail -8 "$OUT/moe_steps.log" | cut -c1-400
fi
if [ -n "$MOEK_S" ]; then
  timeout -k 5 $MOEK_S python3 -P bench/bench_moe.py --reps 20 --out "$OUT/moe_kernels.json" > "$OUT/moe_kernels.log" 2>&1
  echo "moe kernels rc=$? $(el)"; tail -8 "$OUT/moe_kernels.log" | cut -c1-400
fi
true
