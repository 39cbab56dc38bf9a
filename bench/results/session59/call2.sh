#!/bin/bash
# Session 59, call 2 (timeout_s 330, any card): the yield hints on the promotion FFMAs
# (bench/sass_yield.py, DeepGEMM's SASS idea in our own form) against the shipped binaries, on
# every case whose table tile is persistent (Gluon 128 x 256, Triton persistent_ws/tma), in
# the server's lone-call form; the same bits asserted; CUDA-graph replay medians, five
# variants and the base alternating over 4 rounds. Prediction: 0-5 % on the prefill cases
# (DeepGEMM reports 10 %+ on some shapes; our tensor pipe is ~72 % busy at the power cap's
# clock, session 22), nothing on the bytes-bound ones.
source bench/device_env.sh
timeout -k 5 300 python3 -P bench/sass_ab.py --json "$OUT/sass_ab.json" > "$OUT/sass_ab.log" 2>&1
echo "sass_ab rc=$? $(el)"; tail -60 "$OUT/sass_ab.log"
