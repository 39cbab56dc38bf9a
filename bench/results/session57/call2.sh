#!/bin/bash
# Session 57, call 2: the GPU suites the moe buffers' change touches (check_and_gather's rows
# from its gather; a moe family's x holds its tokens) with the shipped server's suite.
export TESTS="tests/server/test_prologue.py tests/server/test_ffn_gpu.py tests/server/test_moe_token_gpu.py tests/server/test_experts_gpu.py tests/server/test_shipped_gpu.py tests/server/test_engine_gpu.py tests/server/test_server_gpu.py"
export NO_BENCH=1 TESTS_S=${TESTS_S:-360}
exec bash bench/device_call.sh
