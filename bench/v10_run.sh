#!/bin/bash
# v10 (bench/NOTES.md), one device call: the bench (a sweep and/or the seed set with peers), then
# the GPU tests, then a summary. Run from the repository root after the package preamble of
# bench/NOTES.md; writes under $OUT. Knobs: BENCH_S, TOTAL_S, MATCH, SWEEP, PEERS ("" = with
# peers), ONLY, TESTS (a pytest -k expression; empty skips the tests), NAME (the JSON's name).
timeout -k 5 ${BENCH_S:-150} python3 -P bench/bench_kernels.py ${ONLY:+--only $ONLY} ${PEERS---no-peers} \
    ${SWEEP:+--sweep $SWEEP} --match "${MATCH:-seed}" \
    --json "$OUT/${NAME:-kernels_v10}.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
if [ -n "${TESTS}" ]; then . bench/kernel_gpu_tests.sh; fi
python3 -P bench/v7_summary.py "$OUT/${NAME:-kernels_v10}.json"
grep -v '^{' "$OUT/bench.log" | tail -24
