#!/bin/bash
# Session 48, call 3 (never ran: no machine came, then the device budget was spent): the GPU paths through the backends' run after the operand checks became
# one (kernels/_backend.check_operands): the triton backend, the Gluon kernels, the server's
# graphs, expert sets and the shipped server process.
SPREAD_S=230 WORKERS=10 SPREAD="tests/kernels/test_triton.py tests/kernels/test_triton_service.py \
tests/kernels/test_gluon_gemm.py tests/server/test_ffn_gpu.py tests/server/test_engine_gpu.py \
tests/server/test_experts_gpu.py tests/server/test_server_gpu.py tests/server/test_moe_token_gpu.py \
tests/server/test_shipped_gpu.py" bash bench/device_stages.sh
