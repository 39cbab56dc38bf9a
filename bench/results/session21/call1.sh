source bench/device_env.sh >/dev/null 2>&1
timeout -k 5 170 python3 -P -m pytest -q -p no:cacheprovider -x --timeout 160 -rfE tests/kernels/test_gluon_gemm.py -k "claim or ragged or second_half or graph or outside" > $OUT/gluon_tests.log 2>&1
echo "tests rc=$? $(el)"; tail -5 $OUT/gluon_tests.log
M="DeepSeek-V3 w13 prefill t8192,DeepSeek-V3 w2 prefill t8192,Kimi-K2 w13 prefill t8192,Kimi-K2 w2 prefill t8192,GLM-4.5 w13 prefill t8192,GLM-4.5 w2 prefill t8192,Qwen3-235B-A22B w13 prefill t8192,Qwen3-30B-A3B w2 prefill t8192,Qwen3-30B-A3B w2 prefill t2048,Qwen3-235B-A22B w13 prefill t2048,Kimi-K2 w13 prefill t2048,seed m16384 n2048,Mixtral-8x7B w13 prefill t2048"
timeout -k 5 390 python3 -P bench/kernel_ab.py --base .carry/s21/shipped.py --variant dynsdh=.carry/s21/dynsdh.py --variant dynstore=.carry/s21/dynstore.py --variant dynstoresdh=.carry/s21/dynstoresdh.py --variant sdh=.carry/s21/sdh.py --forms public --rounds 2 --match "$M" --json $OUT/ab.json > $OUT/ab.log 2>&1
echo "ab rc=$? $(el)"; grep -v "^WARN" $OUT/ab.log | tail -20 | sed -E 's/gluon_ws(_store)?_m128_n256_w4_s3_g8//; s/  +/ /g' | cut -c1-400
