#!/bin/bash
# Session 51, call 4 (any card, ~250 s): the GPU tests of the review's mends (06404b0): graphs
# replayed on static buffers only, a new family's buffers published with its graphs, the
# release between batches; the service path's bits against the public entry.
nvidia-smi --query-gpu=name --format=csv,noheader
source bench/device_env.sh >/dev/null 2>&1
timeout 200 python3 -P -m pytest -q -p no:cacheprovider -n 8 --timeout 190 -rfE \
  tests/server/test_engine_gpu.py tests/server/test_ffn_gpu.py tests/kernels/test_triton_service.py 2>&1 | tail -15
