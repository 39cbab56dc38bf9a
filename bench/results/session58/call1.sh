#!/bin/bash
# The next session's first call (timeout_s 420; carry .whl/server and .whl/mslk; written in
# session 58, which got no device: new loans were paused). On an H200 the full kernel bench on
# the shipped code (bench/device_call.sh; sessions 43-58 got none): issue 15's figures, and
# the service's bits against the public function's on all 114 cases, which covers session
# 58's decode_pair and address-word changes. On another card the GPU suites of sessions 57-58:
# the pair kernel's one form and the address words (kernels), the pool's seams taken from the
# backend (engine, prologue), the room check's graph memory (engine, experts, ffn), the shipped
# server. Then bench/results/session58/call2.sh.
export TESTS="tests/kernels/test_triton.py tests/kernels/test_decode_preload_gpu.py tests/kernels/test_triton_service.py tests/server/test_moe_token_gpu.py tests/server/test_engine_gpu.py tests/server/test_prologue.py tests/server/test_experts_gpu.py tests/server/test_ffn_gpu.py tests/server/test_shipped_gpu.py tests/server/test_server_gpu.py"
exec bash bench/device_call.sh
