#!/bin/bash
# Session 57, call 1 (timeout_s 560): what session 56's default bucket bought. The gemm kernels
# of one launch against the old 8192-row chunks (bench/chunked_calls.py), then a moe call's
# executor path, load and memory at the default bucket against 8192 (bench/moe_bucket.py).
source bench/device_env.sh
timeout -k 5 200 python3 -P bench/chunked_calls.py --match "DeepSeek-V3 w13 prefill t8192,Kimi-K2 w13 prefill t8192,Qwen3-30B-A3B w2 prefill t8192,Mixtral-8x7B w13 prefill t8192" > "$OUT/chunked.log" 2>&1
echo "chunked_calls rc=$? $(el)"; cat "$OUT/chunked.log" | tail -12
timeout -k 5 320 python3 -P bench/moe_bucket.py > "$OUT/moe_bucket.log" 2>&1
echo "moe_bucket rc=$? $(el)"; cat "$OUT/moe_bucket.log" | tail -20
