source bench/device_env.sh >/dev/null 2>&1
timeout -k 5 200 python3 -P -m pytest -q -p no:cacheprovider --timeout 190 -rfE tests/kernels/test_reference.py > $OUT/reference_tests.log 2>&1
echo "tests rc=$? $(el)"; tail -4 $OUT/reference_tests.log
timeout -k 5 300 python3 -P bench/power_clock.py --seconds 3 --bands 16,8 --match "DeepSeek-V3 w13 prefill t8192,Kimi-K2 w13 prefill t8192,DeepSeek-V3 w2 prefill t8192" > $OUT/power_bands.log 2>&1
echo "power rc=$? $(el)"; grep -v "^WARN" $OUT/power_bands.log | tail -12 | sed -E 's/  +/ /g'
