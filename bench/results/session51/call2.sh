#!/bin/bash
# Session 51, call 2 (any card): the GPU tests of this session's server changes: expert-set
# batches of unprepared families on buffers of their own size, a shape's graphs and buffers
# released with its last set (GraphPool._body takes its buffers), and session 50's (the
# loader's jobs as futures, the stop's bounded wait, the compile children's parent check,
# the early SIGTERM handler), the shipped server process included. Carry .whl/server.
nvidia-smi --query-gpu=name --format=csv,noheader
SPREAD_S=420 WORKERS=10 SPREAD="tests/server/test_engine_gpu.py tests/server/test_ffn_gpu.py \
tests/server/test_experts_gpu.py tests/server/test_shipped_gpu.py tests/server/test_server_gpu.py \
tests/server/test_ahead_gpu.py tests/kernels/test_triton_service.py" exec bash bench/device_stages.sh
