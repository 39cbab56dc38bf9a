#!/bin/bash
# Session 58, call 5 (timeout_s 300): moe_bucket again, each bucket in a process of its own and
# the set's making's cached blocks emptied before the load's baseline (call 2's second bucket
# counted the first's buffers and pool; its baselines counted the set's making's cache); the
# default bucket twice, the second with Triton's disk cache warm: the load's captures alone.
source bench/device_env.sh
timeout -k 5 280 python3 -P bench/moe_bucket.py --models deepseek-v3 --tokens 8192 --reps 5 \
  --buckets 65536,8192,65536 > "$OUT/moe_bucket.log" 2>&1
echo "moe_bucket rc=$? $(el)"; tail -8 "$OUT/moe_bucket.log"
