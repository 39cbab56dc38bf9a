#!/bin/bash
# Session 49, call 4 (little device budget left after nine tries found no machine): the GPU
# paths through the triton backend's run since the single operand check (commit 9dd65a0):
# the Triton and Gluon kernel files and the service path's bits against the public entry.
SPREAD_S=170 WORKERS=10 SPREAD="tests/kernels/test_triton.py tests/kernels/test_triton_service.py \
tests/kernels/test_gluon_gemm.py tests/kernels/test_operands.py" bash bench/device_stages.sh
