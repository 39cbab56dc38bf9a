#!/bin/bash
# Session 58, call 1 (timeout_s 420; carry .whl/server and .whl/mslk). On an H200 the full
# kernel bench on the shipped code (bench/device_call.sh; sessions 43-57 got none); on another
# card session 57's second call: the GPU suites in full, then bench/moe_bucket.py on DeepSeek-V3.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  export TESTS="tests/server/test_shipped_gpu.py"
  exec bash bench/device_call.sh
fi
exec bash bench/results/session57/call2.sh
