#!/bin/bash
# One device call for the prepared decode patches (bench/NOTES.md, session 30): the shipped
# kernels/_triton_gemm.py against copies with each patch applied and with both, in one process
# on the same data (bench/kernel_ab.py: same bits and flags asserted, CUDA-graph replay medians,
# rounds in alternated order), in the forms a server graph launches the decode tiles.
#   AB_S      time limit of the A/B (default 480: 4 modules x 3 forms compile per tile)
#   AB_MATCH  the cases (default: the one- to 64-token decode cases and the seed's decode shapes,
#             long-K ones included, where the flags patch costs registers)
#   AB_FORMS  (default public,map,lone)   AB_ROUNDS (default 4)
# Writes $OUT/decode_ab.json and $OUT/decode_ab.log. No carry needed beyond .whl/server.
#   run(command="bash bench/device_decode_ab.sh", carry=[".whl/server"])
source bench/device_env.sh
V=/tmp/decode_variants
rm -rf $V
for d in base flags lookup both; do mkdir -p $V/$d/kernels && cp kernels/_triton_gemm.py $V/$d/kernels/; done
apply() {  # apply <patch> <dir>: the patch's kernels/_triton_gemm.py part onto the copy in <dir>
  # (its tests are for the checkout); git apply works outside a repository, else patch(1).
  python3 -c 'import sys; t = open(sys.argv[1]).read().split("diff --git ")
print("".join("diff --git " + p for p in t if p.startswith("a/kernels/_triton_gemm.py")), end="")' "$1" > $2.patch
  (cd $2 && { git apply ../$(basename $2).patch 2>/dev/null || patch -s -p1 < ../$(basename $2).patch; })
}
apply bench/prepared/decode_flags_after_loop.patch $V/flags &&
apply bench/prepared/decode_lookup_one_pass.patch $V/lookup &&
apply bench/prepared/decode_flags_after_loop.patch $V/both &&
apply bench/prepared/decode_lookup_one_pass.patch $V/both || { echo "a patch did not apply"; exit 1; }
MATCH=${AB_MATCH:-"decode t1 ,decode t16 ,decode t64 ,seed m1 ,seed m32 ,seed m128 "}
timeout -k 5 ${AB_S:-480} python3 -P bench/kernel_ab.py --base $V/base/kernels/_triton_gemm.py --match "$MATCH" \
  --variant flags=$V/flags/kernels/_triton_gemm.py --variant lookup=$V/lookup/kernels/_triton_gemm.py \
  --variant both=$V/both/kernels/_triton_gemm.py --forms ${AB_FORMS:-public,map,lone} --rounds ${AB_ROUNDS:-4} \
  --json "$OUT/decode_ab.json" > "$OUT/decode_ab.log" 2>&1
echo "decode A/B rc=$? $(el)"; grep -E "^geomean|bits differ: [^n]" "$OUT/decode_ab.log" | tail -30
