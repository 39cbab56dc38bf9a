#!/bin/bash
# Session 31, one device call for the rows' check inside the persistent tiles (a lone prefill
# call's graph as one kernel): the GPU tests of the kernels and of the shipped server process,
# the lone prefill graph's A/B (bench/exp_pdl.py: serial check + GEMM, the GEMM with the check
# inside, the GEMM alone), then the full bench through the server's graphs.
#   run(command="bash bench/device_checked_inside.sh", carry=[".whl/server", ".whl/mslk"])
# The change is bench/prepared/checked_inside_persistent.patch (kernels, server, its GPU tests),
# applied here to the device's copy of the checkout first (not yet in the shipped code: written in
# session 31, when the device stopped lending before it could run). Adopt it if all passes and the
# A/B gains: git apply it in the checkout and commit it with these results.
git apply bench/prepared/checked_inside_persistent.patch 2>/dev/null \
  || patch -s -p1 < bench/prepared/checked_inside_persistent.patch || { echo "the patch did not apply"; exit 1; }
source bench/device_env.sh
timeout -k 5 ${TESTS_S:-290} python3 -P -m pytest -q -p no:cacheprovider -m "not slow" --timeout 200 -rfE \
  --durations=5 -n ${WORKERS:-8} --dist load tests/kernels/test_triton_service.py tests/kernels/test_triton.py \
  tests/server/test_engine_gpu.py tests/server/test_server_gpu.py tests/server/test_shipped_gpu.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? $(el)"; tail -3 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
timeout -k 5 ${AB_S:-80} python3 -P bench/exp_pdl.py --forms serial,inside,gemm \
  --match "seed m1024 ,Qwen3-30B-A3B w2 prefill,Qwen3-30B-A3B w13 prefill t2048,Qwen3-235B-A22B w2 prefill t2048,Mixtral-8x7B w2 decode t256,Llama-4-Maverick w2 prefill t2048,GLM-4.5 w2 prefill t2048" \
  --json "$OUT/checked_inside.json" > "$OUT/checked_inside.log" 2>&1
echo "A/B rc=$? $(el)"; grep -E "^geomean|Error" "$OUT/checked_inside.log" | tail -8
KERN_S=${KERN_S:-135} bash bench/device_stages.sh 2>&1 | grep -v "^WARNING: Target"
