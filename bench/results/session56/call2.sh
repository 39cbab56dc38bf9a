#!/bin/bash
# Session 56, call 2 (timeout_s 450). (1) The shipped server at the new default largest bucket
# (65536): its GPU suite (a 20000-row call one graph replay with the public bits), beside the
# server, expert and service-table suites. (2) The 256 x 128 gluon_ws tile (two 128-row
# consumers on one weight tile, uncommitted): its GPU tests, then the sweep against the table's
# tile on the cases whose groups hold 65-256 rows or whose tiles leave a partial last round
# (public entry, alternated rounds, same data).
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
export TESTS="tests/server/test_shipped_gpu.py tests/server/test_server_gpu.py tests/server/test_experts_gpu.py tests/kernels/test_triton_service.py"
export TESTS_S=${TESTS_S:-190} WORKERS=8 TEST_TIMEOUT=180
export SPREAD="tests/kernels/test_gluon_gemm.py -k m256" SPREAD_S=${SPREAD_S:-80}
export SWEEP_S=${SWEEP_S:-130} SWEEP_KEYS=gluon_ws_m256
export SWEEP_MATCH="Mixtral-8x7B w2 decode t256,Mixtral-8x22B w2 decode t256,Mixtral-8x7B w13 decode t256,Mixtral-8x22B w13 decode t256,seed m1024 n7168"
exec bash bench/device_stages.sh
