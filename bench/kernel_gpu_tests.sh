# Sourced by the vN_run.sh scripts: the kernel GPU tests selected by $TESTS (a pytest -k
# expression), within what is left of $TOTAL_S seconds, and their summary. Writes $OUT/pytest.log.
timeout -k 5 $((${TOTAL_S:-225} - SECONDS)) python3 -P -m pytest -q -p no:cacheprovider tests/kernels/test_triton.py \
    -k "${TESTS}" > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -12
