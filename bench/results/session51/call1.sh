#!/bin/bash
# Session 51, call 1. On an H200: the full bench on the shipped code (issue 15's figures of
# record; session 50's call4.sh, which never found an H200). On any other card: the GPU tests
# of session 50's last server changes (the loader's jobs as futures, the stop's bounded wait,
# the compile children's parent check, the early SIGTERM handler), and the expert sets' eager batches on
# buffers of their own size (session 51). Carry .whl/server and .whl/mslk.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  KERN_S=330 exec bash bench/device_stages.sh
fi
SPREAD_S=400 WORKERS=10 SPREAD="tests/server/test_engine_gpu.py tests/server/test_shipped_gpu.py tests/server/test_experts_gpu.py tests/server/test_ffn_gpu.py \
tests/server/test_ahead_gpu.py tests/server/test_server_gpu.py" exec bash bench/device_stages.sh
