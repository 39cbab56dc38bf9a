#!/bin/bash
# Session 52, call 2 (~230 s with a start, any card): call 1's GPU tests alone (session 51's
# review mends, never run on a GPU), for a budget too small for the bench. Carry .whl/server.
nvidia-smi --query-gpu=name --format=csv,noheader
SPREAD_S=165 WORKERS=8 SPREAD="tests/server/test_engine_gpu.py tests/server/test_ffn_gpu.py tests/kernels/test_triton_service.py" \
  exec bash bench/device_stages.sh
