source bench/device_env.sh >/dev/null 2>&1
python3 -c "import pynvml; print('pynvml', pynvml.__file__)"
timeout -k 5 240 python3 -P bench/power_clock.py --seconds 3 --match "seed m16384 n2048 k7168,seed m16384 n7168 k2304,DeepSeek-V3 w13 prefill t8192,Kimi-K2 w13 prefill t8192,DeepSeek-V3 w2 prefill t8192,Qwen3-30B-A3B w2 prefill t8192,Mixtral-8x22B w13 prefill t8192,seed m128 n1280 k8192,seed m128 n13312 k16384" > $OUT/power.log 2>&1
echo "power rc=$? $(el)"; grep -v "^WARN" $OUT/power.log | tail -14 | sed -E 's/  +/ /g'
