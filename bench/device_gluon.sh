#!/bin/bash
# Device: the Gluon prefill kernel (kernels/_gluon_gemm.py) checked and timed against the shipped path
# (bench/gluon_prefill.py). Run from the carried copy's root, carrying it and the server wheels:
#   cd .carry/gluon && bash bench/device_gluon.sh          (WHL=<dir of the wheels>, default ../../.whl)
# Writes gluon_check.json/.log and gluon_time.json/.log under $OUT; ends inside ~235 s. Each phase is
# resumed past a variant or case that hangs or crashes (a watchdog ends the process; the JSON stays).
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
R=$PWD; mkdir -p /tmp/pkg/moegemm && cp moegemm/*.py /tmp/pkg/moegemm/
for d in kernels server client; do ln -sfn $R/$d /tmp/pkg/moegemm/$d; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ${WHL:-../../.whl}/server/*.whl 2>/dev/null
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
for run in 1 2 3; do
  left=$(( 140 - $(el) )); [ $left -lt 15 ] && break
  timeout -k 5 $left python3 -P bench/gluon_prefill.py --phase check --resume --json "$OUT/gluon_check.json" \
    >> "$OUT/gluon_check.log" 2>&1
  rc=$?; echo "check run $run rc=$rc [$(el) s]"
  [ $rc -eq 0 ] && break
done
grep -E "^(check |watchdog)" "$OUT/gluon_check.log" | cut -c1-300
for run in 1 2; do
  left=$(( 228 - $(el) )); [ $left -lt 20 ] && break
  timeout -k 5 $left python3 -P bench/gluon_prefill.py --phase time --resume --check-json "$OUT/gluon_check.json" \
    --budget-s $(( left - 25 )) --json "$OUT/gluon_time.json" >> "$OUT/gluon_time.log" 2>&1
  rc=$?; echo "time run $run rc=$rc [$(el) s]"
  [ $rc -eq 0 ] && break
done
tail -42 "$OUT/gluon_time.log" | cut -c1-220
