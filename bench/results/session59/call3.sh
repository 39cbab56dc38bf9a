#!/bin/bash
# Session 59, call 3 (timeout_s 120, any card; carry .whl/server and .whl/mslk): call 2's A/B cut
# to what the budget left after refused starts allows: ten cases (the Gluon prefill classes,
# both schedules, G = 8 and many experts, and one Triton persistent_tma case), 4 rounds.
source bench/device_env.sh
timeout -k 5 95 python3 -P bench/sass_ab.py --rounds 4 --workers 14 --json "$OUT/sass_ab.json" \
  --match "seed m16384 n2048,DeepSeek-V3 w13 prefill t8192,DeepSeek-V3 w2 prefill t8192,Kimi-K2 w13 prefill t2048,Qwen3-235B-A22B w2 prefill t8192,GLM-4.5 w13 prefill t8192,Qwen3-30B-A3B w2 prefill t8192,Mixtral-8x7B w13 prefill t8192,Mixtral-8x22B w2 prefill t2048,Mixtral-8x7B w13 decode t256" \
  > "$OUT/sass_ab.log" 2>&1
echo "sass_ab rc=$? $(el)"; tail -30 "$OUT/sass_ab.log" | cut -c1-230
