#!/bin/bash
# Session 31, call 1: the PDL experiment on lone prefill graphs (bench/exp_pdl.py), then the
# prepared decode patches' A/B (bench/device_decode_ab.sh) in the forms public and lone.
#   run(command="bash bench/device_s31.sh", carry=[".whl/server"])
source bench/device_env.sh
timeout -k 5 ${PDL_S:-170} python3 -P bench/exp_pdl.py --json "$OUT/exp_pdl.json" > "$OUT/exp_pdl.log" 2>&1
echo "exp_pdl rc=$? $(el)"; grep -E "^geomean|Error" "$OUT/exp_pdl.log" | tail -12
AB_S=${AB_S:-370} AB_FORMS=${AB_FORMS:-public,lone} bash bench/device_decode_ab.sh
