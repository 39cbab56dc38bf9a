#!/bin/bash
# v11 (bench/NOTES.md), one device call: the bench through the service path (a sweep and/or
# a set with peers), then GPU tests. Run from the repository root after the package preamble
# of bench/NOTES.md; writes under $OUT. Knobs: BENCH_S, TOTAL_S, ONLY (seed|real), MATCH,
# SWEEP (non-empty: --sweep), PEERS ("" = with peers), NAME, TESTS (pytest args; empty: none).
export PYTHONUNBUFFERED=1
timeout -k 5 ${BENCH_S:-130} python3 -P bench/bench_kernels.py ${ONLY:+--only $ONLY} ${PEERS---no-peers} \
    ${SWEEP:+--sweep} --match "${MATCH:-}" --json "$OUT/${NAME:-kernels_v11}.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
if [ -n "${TESTS}" ]; then
    left=$(( ${TOTAL_S:-225} - SECONDS ))
    timeout -k 5 $left python3 -P -m pytest -q -p no:cacheprovider $TESTS > "$OUT/pytest.log" 2>&1
    echo "pytest rc=$?"; tail -5 "$OUT/pytest.log"
fi
grep -v '^{' "$OUT/bench.log" | tail -40
