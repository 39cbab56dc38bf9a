#!/bin/bash
# v7 (bench/NOTES.md), one device call: the prefill sweep, then the round-2 GPU tests, then a summary.
# Run from the repository root after the package preamble; writes under $OUT.
timeout -k 5 ${BENCH_S:-120} python3 -P bench/bench_kernels.py ${ONLY:+--only $ONLY} --no-peers --sweep v7 \
    --match "${MATCH:-m16384 n2048,m16384 n7168,m1024 n7168,m1024 n2048}" \
    --json "$OUT/kernels_v7_sweep.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
TESTS="${TESTS:-round2 or split_k}" . bench/kernel_gpu_tests.sh
python3 -P bench/v7_summary.py "$OUT/kernels_v7_sweep.json"
