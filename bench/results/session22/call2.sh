source bench/device_env.sh >/dev/null 2>&1
timeout -k 5 120 python3 -P -m pytest -q -p no:cacheprovider -x --timeout 110 -n 4 -rfE tests/kernels/test_gluon_gemm.py > $OUT/gluon_tests.log 2>&1
echo "tests rc=$? $(el)"; tail -4 $OUT/gluon_tests.log
M="DeepSeek-V3 w13 prefill,DeepSeek-V3 w2 prefill,Kimi-K2 w13 prefill,Kimi-K2 w2 prefill,GLM-4.5 w13 prefill,GLM-4.5 w2 prefill,Qwen3-235B-A22B w13 prefill,Qwen3-235B-A22B w2 prefill,Qwen3-30B-A3B w2 prefill,Qwen3-30B-A3B w13 prefill,seed m16384 n2048,Mixtral-8x7B w13 prefill t2048,Llama-4-Maverick w2 prefill t8192,Llama-4-Maverick w13 prefill t8192,Mixtral-8x22B w2 prefill t2048"
timeout -k 5 420 python3 -P bench/kernel_ab.py --base .carry/s22/base_gluon_gemm.py --forms svc,map --rounds 2 --match "$M" --json $OUT/ab.json > $OUT/ab.log 2>&1
echo "ab rc=$? $(el)"; grep -v "^WARN" $OUT/ab.log | tail -28 | sed -E 's/gluon_ws(_store)?_m128_n256_w4_s3_g8//; s/  +/ /g' | cut -c1-300
