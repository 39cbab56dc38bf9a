#!/bin/bash
# The staged device call (named device_session9.sh until session 32). Stages, each run when its time
# limit is set; carry .whl/server (and .whl/mslk for the kernel bench's MSLK peer):
#   TESTS_S  GPU tests ($TESTS, pytest-xdist workers, one file each; MARK, default "not slow") -> gpu_tests.log
#   SPREAD_S GPU tests ($SPREAD, spread test by test over the workers: files of many kernels) -> gpu_spread.log
#   SERV_S   bench_service.py quick points, default server ($SERV_ARGS: more options) -> service.json
#   OVH_S    overhead_gpu.py: a lone call's batch, host-side variants       -> overhead_gpu.json
#   PROF_S   profile_moe.py ($PROF_MODELS, $PROF_TOKENS)                     -> moe_steps.json
#   TILE_S   tinymoe_tiles.py: the one-token moe kernels' weight tiles    -> tinymoe_tiles.json
#   TRACE_S  trace_service.py: a lone call's timeline, client and server   -> trace.json
#   KERN_S   bench_kernels.py, seed + real through the service graph, peers  -> kernels.json
#            (KERN_ONLY=seed or real: that set alone)
#   SWEEP_S  bench_kernels.py --sweep --no-peers on the cases matching $SWEEP_MATCH (tiles: $SWEEP_KEYS;
#            or the table's tile with the fields of $SWEEP_VARY changed, e.g. "split_k=1,2;num_stages=4,8") -> sweep.json
#   GAP_S    gap_gluon.py --match $GAP_MATCH: the service graph's parts apart  -> gap.json
#   READ_S   read_ceiling.py: one kernel reading 10-940 MB, by size             -> read_ceiling.json
#   AB_S     kernel_ab.py --base $AB_BASE on $AB_MATCH ($AB_FORMS, $AB_ROUNDS rounds) -> ab.json
source bench/device_env.sh
if [ -n "$AB_S" ]; then
  timeout -k 5 $AB_S python3 -P bench/kernel_ab.py --base "$AB_BASE" --match "$AB_MATCH" \
    --forms ${AB_FORMS:-public,svc} --rounds ${AB_ROUNDS:-4} --json "$OUT/ab.json" > "$OUT/ab.log" 2>&1
  echo "kernel A/B rc=$? $(el)"; grep -v "^ " "$OUT/ab.log" | cut -c1-40,80-110,200-330 | tail -45
fi
if [ -n "$TESTS_S" ]; then
  timeout -k 5 $TESTS_S python3 -P -m pytest -q -p no:cacheprovider -m "${MARK:-not slow}" --timeout ${TEST_TIMEOUT:-200} -rfE \
    --durations=5 -n ${WORKERS:-6} --dist loadfile $TESTS > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$? $(el)"; tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
fi
if [ -n "$SPREAD_S" ]; then
  timeout -k 5 $SPREAD_S python3 -P -m pytest -q -p no:cacheprovider -m "${MARK:-not slow}" --timeout ${TEST_TIMEOUT:-200} -rfE \
    --durations=5 -n ${WORKERS:-6} --dist load $SPREAD > "$OUT/gpu_spread.log" 2>&1
  echo "spread tests rc=$? $(el)"; tail -1 "$OUT/gpu_spread.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_spread.log" | head -20
fi
if [ -n "$OVH_S" ]; then
  timeout -k 5 $OVH_S python3 -P bench/overhead_gpu.py --json "$OUT/overhead_gpu.json" > "$OUT/overhead_gpu.log" 2>&1
  echo "overhead_gpu rc=$? $(el)"; tail -22 "$OUT/overhead_gpu.log" | cut -c1-200
fi
if [ -n "$PROF_S" ]; then
  timeout -k 5 $PROF_S python3 -P bench/profile_moe.py ${PROF_MODELS:+--models $PROF_MODELS} \
    ${PROF_TOKENS:+--tokens $PROF_TOKENS} --reps 20 --out "$OUT/moe_steps.json" > "$OUT/moe_steps.log" 2>&1
  echo "profile rc=$? $(el)"
  python3 - "$OUT/moe_steps.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["model"], r["tokens"], "moe", r["moe_us"], "kern", r.get("kernels_sum_us"), "gemm", r.get("gemm_kernels_us"),
          "ratio", r.get("kernels_over_gemm_kernels"), r.get("per_kernel_us"))
PY
fi
if [ -n "$TILE_S" ]; then
  timeout -k 5 $TILE_S python3 -P bench/tinymoe_tiles.py --out "$OUT/tinymoe_tiles.json" > "$OUT/tinymoe_tiles.log" 2>&1
  echo "tiles rc=$? $(el)"; tail -8 "$OUT/tinymoe_tiles.log" | cut -c1-300
fi
if [ -n "$TRACE_S" ]; then
  timeout -k 5 $TRACE_S python3 -P bench/trace_service.py --out "$OUT/trace.json" --ms ${TRACE_MS:-1,128} \
    --variants ${TRACE_VARIANTS:-default} --calls ${TRACE_CALLS:-400} > "$OUT/trace.log" 2>&1
  echo "trace rc=$? $(el)"; grep -v "^ *step" "$OUT/trace.log" | tail -40 | cut -c1-300; grep "^ *step" "$OUT/trace.log" | tail -40
fi
if [ -n "$KERN_S" ]; then
  timeout -k 5 $KERN_S python3 -P bench/bench_kernels.py --budget-s $(( KERN_S - 25 )) \
    ${KERN_ONLY:+--only $KERN_ONLY} --json "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  echo "kernel bench rc=$? $(el)"; tail -1 "$OUT/kernels.log" | cut -c1-1500
fi
if [ -n "$SWEEP_S" ]; then
  timeout -k 5 $SWEEP_S python3 -P bench/bench_kernels.py --sweep --no-peers --budget-s $(( SWEEP_S - 30 )) \
    --match "$SWEEP_MATCH" --sweep-keys "$SWEEP_KEYS" --sweep-vary "$SWEEP_VARY" --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
  echo "sweep rc=$? $(el)"; grep -v "^{" "$OUT/sweep.log" | tail -40 | cut -c1-300
fi
if [ -n "$GAP_S" ]; then
  timeout -k 5 $GAP_S python3 -P bench/gap_gluon.py --match "$GAP_MATCH" --budget-s $(( GAP_S - 30 )) \
    --out "$OUT/gap.json" > "$OUT/gap.log" 2>&1
  echo "gap rc=$? $(el)"; grep -v "^{" "$OUT/gap.log" | tail -12 | cut -c1-300
fi
if [ -n "$READ_S" ]; then
  timeout -k 5 $READ_S python3 -P bench/read_ceiling.py --json "$OUT/read_ceiling.json" > "$OUT/read_ceiling.log" 2>&1
  echo "read ceiling rc=$? $(el)"; tail -9 "$OUT/read_ceiling.log" | cut -c1-300
fi
if [ -n "$SERV_S" ]; then
  timeout -k 5 $SERV_S python3 -P bench/bench_service.py --quick --no-deepseek --servers default \
    --budget-s $(( SERV_S - 40 )) --duration 1.0 $SERV_ARGS --out "$OUT/service.json" > "$OUT/service.log" 2>&1
  echo "service bench rc=$? $(el)"; grep -v "^ " "$OUT/service.log" | grep -v "^median" | tail -14 | cut -c1-400
fi
true
