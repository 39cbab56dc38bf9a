#!/bin/bash
# Expert sets on the H200 at the server's defaults: one moe call vs the router's two-call way
# through a real `moegemm serve` (no setting changed but port and weights directory), then the
# graphs' kernels vs the two GEMMs (KERNELS_S=0: not), then (TESTS_S) GPU tests ($TESTS: the expert
# ones by default). Writes under $OUT.
# Time limits (s): MOE_S, KERNELS_S, TESTS_S. Run from the checkout's root, wheels carried.
source bench/device_env.sh
W=/tmp/moe_weights; mkdir -p $W
python3 -P -m moegemm.cli serve --device cuda --port 18700 --weights-dir $W --no-demo \
  > "$OUT/moe_server.log" 2>&1 &
SP=$!
for i in $(seq 1 240); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:18700/v1/health/ready', timeout=1)" \
    >/dev/null 2>&1 && break; sleep 0.5; done
echo "server ready $(el)"
timeout -k 5 ${MOE_S:-150} python3 -P bench/bench_moe.py --server http://127.0.0.1:18700 \
  --weights-dir $W --reps ${MOE_REPS:-15} --out "$OUT/moe_server.json" > "$OUT/moe.log" 2>&1
echo "moe bench rc=$? $(el)"; grep -v "^ " "$OUT/moe.log" | tail -4
kill $SP; wait $SP 2>/dev/null; rm -rf $W
grep -E "compiled|ready:|Traceback|Error" "$OUT/moe_server.log" | tail -8 | cut -c1-300
if [ "${KERNELS_S:-40}" != 0 ]; then
  timeout -k 5 ${KERNELS_S:-40} python3 -P bench/bench_moe.py --reps 30 \
    --out "$OUT/moe_kernels.json" > "$OUT/moe_kernels.log" 2>&1
  echo "kernel bench rc=$? $(el)"
fi
python3 - "$OUT" <<'PY'
import json, sys
for name in ("moe_server.json", "moe_kernels.json"):
    try:
        rows = json.load(open(f"{sys.argv[1]}/{name}"))["rows"]
    except Exception as exc:  # noqa: BLE001
        print(name, "missing:", exc); continue
    for r in rows:
        keys = ("load_s", "moe_us", "two_calls_us", "moe_over_two_calls") if "two_calls_us" in r else \
            ("moe_us", "ffn_us", "gemms_us", "moe_over_gemms")
        print(name[:10], r["model"][:8], r["tokens"], *(f"{k}={r.get(k)}" for k in keys))
PY
if [ -n "$TESTS_S" ]; then
  timeout -k 5 $TESTS_S python3 -P -m pytest -q -p no:cacheprovider --timeout 200 -rfE -n ${WORKERS:-8} \
    --dist load ${TESTS:-tests/server/test_ffn_gpu.py tests/server/test_experts_gpu.py} > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$? $(el)"; tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
fi
true
