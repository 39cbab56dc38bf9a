#!/bin/bash
# Session 47, call 6: the GPU server tests on the final code (the call 2 set; error renderer, names, body decoding) (uploads through
# msgspec schemas, the client's answers through decode_tensors): every load path on a GPU
# (pinned bodies, both upload forms, expert sets), the shipped server process, hostile clients.
SPREAD_S=300 WORKERS=8 SPREAD="tests/server/test_server_gpu.py tests/server/test_shipped_gpu.py \
tests/server/test_experts_gpu.py tests/server/test_engine_gpu.py tests/server/test_hostile.py \
tests/server/test_acceptors.py tests/deploy/test_drain.py" bash bench/device_stages.sh
