#!/bin/bash
# One device call for issue 17's closing work (expert calls through the engine's one
# entry): the expert GPU tests, one moe call vs the router's two-call way through a real
# server, the shipped server's expert test, then the graphs' kernels vs the two GEMMs.
# Writes under $OUT. Run from the carried copy's root (the wheels at ../../.whl).
# Time limits (s): TESTS_S, MOE_S, KERNELS_S, SHIPPED_S.
R=$PWD; mkdir -p /tmp/pkg/moegemm && cp moegemm/*.py /tmp/pkg/moegemm/
for d in kernels server client; do ln -sfn $R/$d /tmp/pkg/moegemm/$d; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../../.whl/server/*.whl
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
# The bench server: what `moegemm serve` runs, with the buckets the bench's calls use
# (256 tokens x top-8 = 2048 rows) and top-8's moe graphs only: fewer graphs to capture
# at load, the same graphs and tiles for these calls as at the defaults.
W=/tmp/moe_weights; mkdir -p $W
MOEGEMM_MAX_BUCKET_M=2048 MOEGEMM_MOE_TOP_K=8 python3 -P -m moegemm.cli serve --device cuda \
  --port 18700 --weights-dir $W --no-demo > "$OUT/moe_server.log" 2>&1 &
SP=$!
timeout -k 5 ${TESTS_S:-60} python3 -P -m pytest -q -p no:cacheprovider \
  tests/server/test_ffn_gpu.py tests/server/test_experts_gpu.py tests/kernels/test_triton_act.py \
  > "$OUT/pytest_experts.log" 2>&1
echo "pytest (experts) rc=$?"; tail -2 "$OUT/pytest_experts.log"
grep -E "^(FAILED|ERROR)" "$OUT/pytest_experts.log" | head -20
for i in $(seq 1 60); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:18700/v1/health/ready', timeout=1)" \
    >/dev/null 2>&1 && break; sleep 0.5; done
timeout -k 5 ${MOE_S:-85} python3 -P bench/bench_moe.py --server http://127.0.0.1:18700 \
  --weights-dir $W --reps ${MOE_REPS:-15} --out "$OUT/moe_server_h200_v2.json" > "$OUT/moe.log" 2>&1
echo "moe bench rc=$?"; grep -v "^ " "$OUT/moe.log" | tail -4
kill $SP; wait $SP 2>/dev/null; rm -rf $W
grep -E "captured|ready|Traceback|Error" "$OUT/moe_server.log" | tail -8
timeout -k 5 ${SHIPPED_S:-40} python3 -P -m pytest -q -p no:cacheprovider \
  tests/server/test_shipped_gpu.py -k "${SHIPPED_K:-expert_calls}" > "$OUT/pytest_shipped.log" 2>&1
echo "pytest (shipped) rc=$?"; tail -2 "$OUT/pytest_shipped.log"
grep -E "^(FAILED|ERROR)" "$OUT/pytest_shipped.log" | head -10
timeout -k 5 ${KERNELS_S:-25} python3 -P bench/bench_moe.py --reps 30 \
  --out "$OUT/moe_kernels_h200_v2.json" > "$OUT/moe_kernels.log" 2>&1
echo "kernel bench rc=$?"
python3 - "$OUT" <<'EOF'
import json, sys
for name in ("moe_server_h200_v2.json", "moe_kernels_h200_v2.json"):
    try:
        rows = json.load(open(f"{sys.argv[1]}/{name}"))["rows"]
    except Exception as exc:  # noqa: BLE001
        print(name, "missing:", exc); continue
    for r in rows:
        keys = ("moe_us", "two_calls_us", "moe_over_two_calls") if "two_calls_us" in r else \
            ("moe_us", "ffn_us", "gemms_us", "moe_over_gemms")
        print(name[:10], r["model"][:8], r["tokens"], *(f"{k}={r[k]}" for k in keys))
EOF
