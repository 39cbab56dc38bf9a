#!/bin/bash
# Session 52, call 1 (~580 s). Any card: the GPU tests of session 51's review mends that never
# ran on a GPU (06404b0, fed0395: graphs replayed on their family's static buffers only, a new
# family's buffers published with its graphs, a shape released between batches; the service
# path's bits against the public entry). On an H200, then the full bench on the shipped code
# (issue 15's figures of record). Carry .whl/server and .whl/mslk.
nvidia-smi --query-gpu=name --format=csv,noheader
export SPREAD_S=190 WORKERS=8 SPREAD="tests/server/test_engine_gpu.py tests/server/test_ffn_gpu.py tests/kernels/test_triton_service.py"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  export KERN_S=330
fi
exec bash bench/device_stages.sh
