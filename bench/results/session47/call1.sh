#!/bin/bash
# Session 47, call 1: on an H200 the full bench (issue 15's figures of record); on any other card
# the two GPU test files that import the oracle moved in session 46 (not yet run on a GPU since).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  KERN_S=330 bash bench/device_stages.sh; exit
fi
SPREAD_S=400 WORKERS=8 SPREAD="tests/server/test_experts_gpu.py tests/server/test_moe_token_gpu.py" \
  bash bench/device_stages.sh
