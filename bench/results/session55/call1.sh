#!/bin/bash
# Session 55, call 1 (timeout_s 420; bench/device_call.sh). On an H200: the full kernel bench
# (sessions 43-55 got no H200). On another card: the GPU suites that session 55's changes touch
# (the client's writable answers; the float64 FFN oracle's single rounding, which the ffn/moe
# GPU tests compare against) with the shipped server's suites.
export TESTS="tests/server/test_server_gpu.py tests/server/test_shipped_gpu.py tests/server/test_ffn_gpu.py tests/server/test_experts_gpu.py tests/server/test_moe_token_gpu.py tests/server/test_engine_gpu.py tests/kernels/test_triton_act.py tests/kernels/test_ffn_reference.py tests/server/test_api.py tests/client"
exec bash bench/device_call.sh
