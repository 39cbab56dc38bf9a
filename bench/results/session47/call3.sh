#!/bin/bash
# Session 47, call 3: on an H200 the full bench (issue 15's figures of record) and the alternated
# sweep on the weakest rows of each class; on any other card nothing (H100 figures of the same
# code exist: sessions 43-46).
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "not an H200: nothing run"; exit 0
fi
KERN_S=320 SWEEP_S=230 SWEEP_MATCH="seed m1 ,seed m32 n1280,seed m1024,seed m128 n8192 k1024,Kimi-K2 w13 prefill t8192,Qwen3-30B-A3B w2 prefill t8192,Mixtral-8x7B w2 decode t256" \
  bash bench/device_stages.sh
