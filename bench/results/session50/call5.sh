#!/bin/bash
# Session 50, call 5 (what ~530 s of budget holds with a machine's start). On an H200: the
# seed shapes of the full bench alone (issue 15's seed figure on the shipped code). On any
# other card: the GPU tests of the engine's loads and stop after the review's mends (the
# loader's jobs as futures, the stop's bounded wait), the shipped server process included.
# Carry .whl/server and .whl/mslk.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  KERN_ONLY=seed KERN_S=200 exec bash bench/device_stages.sh
fi
SPREAD_S=230 WORKERS=10 SPREAD="tests/server/test_engine_gpu.py tests/server/test_shipped_gpu.py \
tests/server/test_ahead_gpu.py tests/server/test_server_gpu.py" exec bash bench/device_stages.sh
