source bench/device_env.sh >/dev/null 2>&1
M="DeepSeek-V3 w13 prefill t8192,Kimi-K2 w13 prefill t8192,Mixtral-8x7B w13 prefill t2048,Mixtral-8x22B w2 prefill t2048,seed m16384 n2048,seed m1024 n7168,DeepSeek-V3 w2 prefill t8192,Qwen3-30B-A3B w2 prefill t8192,GLM-4.5 w2 prefill t8192,Llama-4-Maverick w2 prefill t8192"
timeout -k 5 280 python3 -P bench/bench_kernels.py --no-peers --sweep --sweep-vary "num_stages=3,4;group_tiles_m=4,8,16" --match "$M" --json $OUT/sweep.json > $OUT/sweep.log 2>&1
echo "sweep rc=$? $(el)"
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/sweep.json"))
for r in d["rows"]:
    s = " ".join(f"{k.replace('gluon_ws','').replace('_m128_n256_w4','')}={v[0] if isinstance(v, list) else v}" for k, v in r.get("sweep_us", {}).items())
    print(r["name"][:40], r["config"].replace("_m128_n256_w4", ""), r["public_us"], s[:400])
PY
