#!/bin/bash
# v7 (bench/NOTES.md), one device call: the prefill sweep, then the round-2 GPU tests, then a summary.
# Run from the repository root after the package preamble; writes under $OUT.
timeout -k 5 ${BENCH_S:-120} python3 -P bench/bench_kernels.py ${ONLY:+--only $ONLY} --no-peers --sweep v7 \
    --match "${MATCH:-m16384 n2048,m16384 n7168,m1024 n7168,m1024 n2048}" \
    --json "$OUT/kernels_v7_sweep.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
timeout -k 5 $((${TOTAL_S:-225} - SECONDS)) python3 -P -m pytest -q -p no:cacheprovider tests/kernels/test_triton.py \
    -k "${TESTS:-round2 or split_k}" > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -12
python3 -P bench/v7_summary.py "$OUT/kernels_v7_sweep.json"
