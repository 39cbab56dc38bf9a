#!/bin/bash
# Sourced by the device scripts: the package from this checkout at /tmp/pkg, the carried wheels
# (.whl/server, .whl/mslk, .whl/test; at ../../.whl from a carried copy) at /tmp/site, and an
# elapsed-time helper.
R=$PWD; mkdir -p /tmp/pkg/moegemm && cp moegemm/*.py /tmp/pkg/moegemm/
for d in kernels server client; do ln -sfn $R/$d /tmp/pkg/moegemm/$d; done
W=.whl; [ -d $W ] || W=../../.whl  # the checkout's root, or a carried copy (.carry/<name>)
# Only the wheels carried (a missing one would fail the whole install).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls $W/server/*.whl $W/mslk/*.whl $W/test/*.whl 2>/dev/null)
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
