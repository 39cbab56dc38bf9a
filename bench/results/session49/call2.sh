#!/bin/bash
# Session 49, call 2 (after call 1 found no machine five times): on an H200 the full bench
# (issue 15's figures of record, no sweep) and then the operand-check GPU tests; on any other
# card those tests alone (session 48's call 3).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  KERN_S=300 SPREAD_S=220 WORKERS=10 SPREAD="tests/kernels/test_triton.py tests/kernels/test_triton_service.py \
tests/kernels/test_gluon_gemm.py tests/server/test_ffn_gpu.py tests/server/test_engine_gpu.py \
tests/server/test_experts_gpu.py tests/server/test_server_gpu.py tests/server/test_moe_token_gpu.py \
tests/server/test_shipped_gpu.py" exec bash bench/device_stages.sh
fi
exec bash bench/results/session48/call3.sh
