#!/bin/bash
# Session 59, call 1 (timeout_s 420; carry .whl/server and .whl/mslk). On an H200 the full
# kernel bench on the shipped code (bench/device_call.sh; sessions 43-58 got none): issue 15's
# figures and the service's bits against the public function's on all 114 cases. On another
# card session 58's call 5 again: the DeepSeek-V3 expert-set load's peak against the room
# check's estimate as counted since 1409def (prediction: 13.07 GiB against 13.15 at 65536 rows,
# 1.68 against 1.77 at 8192).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash bench/device_call.sh
fi
exec bash bench/results/session58/call5.sh
