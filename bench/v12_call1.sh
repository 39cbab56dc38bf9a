#!/bin/bash
# v12 call 1 (device): the sweep of the prefill tiles (public entry, no peers) on twelve real prefill
# cases and the seed's M = 16384 shapes, each case's service graph beside; then the GPU tests of the
# new schedule and the service path. Run from the carried copy's root.
R=$PWD; mkdir -p /tmp/pkg/moegemm && cp moegemm/*.py /tmp/pkg/moegemm/ &&
for d in kernels server client; do ln -sfn $R/$d /tmp/pkg/moegemm/$d; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../../.whl/server/*.whl
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt 2>&1
START=$(date +%s)
MATCH="DeepSeek-V3 w13 prefill,DeepSeek-V3 w2 prefill t8192,Kimi-K2 w13 prefill t2048,Qwen3-235B-A22B w2 prefill t8192,Qwen3-30B-A3B w2 prefill t8192,Qwen3-30B-A3B w13 prefill t2048,GLM-4.5 w13 prefill t8192,Llama-4-Maverick w13 prefill t8192,Mixtral-8x7B w13 prefill t8192,seed m16384"
timeout 100 python3 bench/bench_kernels.py --match "$MATCH" --sweep --no-peers --budget-s 85 \
  --json $OUT/kernels_v12_call1_sweep.json > $OUT/sweep.log 2>&1
echo "sweep rc=$? at $(( $(date +%s) - START )) s"
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_service.py tests/kernels/test_triton.py \
  -m "not slow" -k "service or persistent_tma" > $OUT/kernels_v12_call1_pytest.log 2>&1
echo "pytest rc=$? at $(( $(date +%s) - START )) s"
tail -3 $OUT/kernels_v12_call1_pytest.log
python3 - <<'PY'
import json, os
for f in ("kernels_v12_call1_sweep.json",):
    try:
        d = json.load(open(os.path.join(os.environ["OUT"], f)))
    except Exception as e:
        print(f, e); continue
    for r in d["rows"]:
        sw = {k.replace("persistent_", "p").replace("prefill_", "pf"): (v[0] if isinstance(v, list) else "ERR") for k, v in r.get("sweep_us", {}).items()}
        print(f"{r['name'][5:40]:<36} fl{r['floor_us']:7.0f} pub{r['public_us']:7.0f} svc{r['service_us']:7.0f} {r['floor_over_service']:.2f} {str(r['service_same_bits_as_public'])[0]} {r['config'].replace('persistent_','p')} {sw}")
PY
