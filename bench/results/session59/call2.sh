#!/bin/bash
# Session 59, call 2 (timeout_s 170, any card; carry .whl/server and .whl/mslk).
# 1. The yield hints on the promotion FFMAs (bench/sass_yield.py, DeepGEMM's SASS idea in our own
#    form) against the binaries ptxas made, on every case whose table tile is persistent (Gluon
#    128 x 256, Triton persistent_ws/tma), in the public function's launch (compiled ahead in
#    12 processes; the service form differs by where the words come from); the same bits
#    asserted; CUDA-graph replay medians, six rules and the base alternating over 4 rounds.
#    Prediction: 0-5 % on the prefill cases (DeepGEMM reports 10 %+ on some shapes; our tensor
#    pipe is ~72 % busy at the power cap's clock, session 22), nothing on the bytes-bound ones.
# 2. With WITH_BENCH=1 (timeout_s 420), the full kernel bench with the pass shipped
#    (bench/prepared/sass_yield_ship.patch applied here: rule 9/16 on the Gluon kernels):
#    every case's error against the reference, the service's bits against the public
#    function's, the peers in the same run.
source bench/device_env.sh
timeout -k 5 145 python3 -P bench/sass_ab.py --json "$OUT/sass_ab.json" > "$OUT/sass_ab.log" 2>&1
echo "sass_ab rc=$? $(el)"; tail -50 "$OUT/sass_ab.log" | cut -c1-230
if [ -n "$WITH_BENCH" ]; then  # timeout_s 420
  git apply bench/prepared/sass_yield_ship.patch 2>/dev/null || patch -p1 < bench/prepared/sass_yield_ship.patch
  rm -rf ~/.triton/cache  # the A/B's binaries were made without the pass
  KERN_S=190 bash bench/device_stages.sh 2>&1 | grep -v "^NVIDIA\|^$" | tail -3
fi
