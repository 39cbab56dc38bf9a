#!/bin/bash
# v12 call 1 (device): the sweep of the many-expert prefill tiles (public entry, no peers) on the
# real prefill cases and the seed's M >= 1024 shapes, each case's service graph beside; then the
# GPU tests of the new schedule and the service path. Run from the carried copy's root.
R=$PWD; mkdir -p /tmp/pkg/moegemm && cp moegemm/*.py /tmp/pkg/moegemm/ &&
for d in kernels server client; do ln -sfn $R/$d /tmp/pkg/moegemm/$d; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../../.whl/server/*.whl
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt 2>&1
START=$(date +%s)
timeout 130 python3 bench/bench_kernels.py --only real --match prefill --sweep --no-peers --budget-s 110 \
  --json $OUT/kernels_v12_call1_sweep_real.json > $OUT/sweep_real.log 2>&1
echo "real sweep rc=$? at $(( $(date +%s) - START )) s"
timeout 45 python3 bench/bench_kernels.py --only seed --match "seed m16384,seed m1024" --sweep --no-peers \
  --json $OUT/kernels_v12_call1_sweep_seed.json > $OUT/sweep_seed.log 2>&1
echo "seed sweep rc=$? at $(( $(date +%s) - START )) s"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_service.py tests/kernels/test_triton.py \
  -m "not slow" -k "service or persistent_tma" > $OUT/kernels_v12_call1_pytest.log 2>&1
echo "pytest rc=$? at $(( $(date +%s) - START )) s"
tail -3 $OUT/kernels_v12_call1_pytest.log
python3 - <<'PY'
import json, os
for f in ("kernels_v12_call1_sweep_real.json", "kernels_v12_call1_sweep_seed.json"):
    try:
        d = json.load(open(os.path.join(os.environ["OUT"], f)))
    except Exception as e:
        print(f, e); continue
    for r in d["rows"]:
        sw = {k.replace("persistent_", "p").replace("prefill_", "pf"): (v[0] if isinstance(v, list) else "ERR") for k, v in r.get("sweep_us", {}).items()}
        print(f"{r['name'][5:40]:<36} fl{r['floor_us']:7.0f} pub{r['public_us']:7.0f} svc{r['service_us']:7.0f} {r['floor_over_service']:.2f} {str(r['service_same_bits_as_public'])[0]} {r['config'].replace('persistent_','p')} {sw}")
PY
