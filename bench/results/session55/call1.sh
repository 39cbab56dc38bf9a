#!/bin/bash
# Session 55, call 1 (timeout_s 420). On an H200: the full kernel bench on the shipped code
# (issue 15's figures of record; sessions 43-54 got no H200). On another card: the GPU suites
# that session 55's changes touch (the client's writable answers; the float64 FFN oracle's
# single rounding, which the ffn/moe GPU tests compare against)
# with the shipped server's suites. TESTS_S (default 360 s) bounds the tests: with less budget,
# set it lower and timeout_s about 60 s above it. Carry .whl/server, .whl/mslk.
nvidia-smi --query-gpu=name --format=csv,noheader
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ -z "$NO_BENCH" ]; then
  export KERN_S=330
else
  export TESTS_S=${TESTS_S:-360} WORKERS=12 TEST_TIMEOUT=240
  export TESTS="tests/server/test_server_gpu.py tests/server/test_shipped_gpu.py tests/server/test_ffn_gpu.py tests/server/test_experts_gpu.py tests/server/test_moe_token_gpu.py tests/server/test_engine_gpu.py tests/kernels/test_triton_act.py tests/kernels/test_ffn_reference.py tests/server/test_api.py tests/client"
fi
exec bash bench/device_stages.sh
