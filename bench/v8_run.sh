#!/bin/bash
# v8 (bench/NOTES.md), one device call: the persistent prefill sweep, then the v8 GPU tests, then a summary.
# Run from the repository root after the package preamble; writes under $OUT.
timeout -k 5 ${BENCH_S:-140} python3 -P bench/bench_kernels.py ${ONLY:+--only $ONLY} ${PEERS---no-peers} \
    ${SWEEP:+--sweep $SWEEP} --match "${MATCH:-seed m1024 n2048,seed m16384 n2048,seed m1024 n7168,seed m16384 n7168}" \
    --json "$OUT/kernels_v8.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
TESTS="${TESTS:-pst or persistent}" . bench/kernel_gpu_tests.sh
python3 -P bench/v7_summary.py "$OUT/kernels_v8.json"
grep -v '^{' "$OUT/bench.log" | tail -24
