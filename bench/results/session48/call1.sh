#!/bin/bash
# Session 48, call 1: the GPU server tests on session 47's last three commits (packb through
# msgspec, one error renderer, error_head), never run on a GPU; on an H200 also the full bench
# (issue 15's figures of record, none since session 42).
SET="tests/server/test_server_gpu.py tests/server/test_shipped_gpu.py tests/server/test_experts_gpu.py \
tests/server/test_engine_gpu.py tests/server/test_hostile.py tests/server/test_acceptors.py tests/deploy/test_drain.py"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  SPREAD_S=230 WORKERS=8 SPREAD="$SET" KERN_S=320 bash bench/device_stages.sh
else
  SPREAD_S=300 WORKERS=8 SPREAD="$SET" bash bench/device_stages.sh
fi
