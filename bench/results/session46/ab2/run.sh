#!/bin/bash
# Session 46, the last call: on an H200 the full bench (issue 15's figures of record); on any
# other card the engine A/B of `mark` (ab/mark_engine.py: small calls marked waiting at submit,
# ../ab/variants.diff) against the shipped engine, 4 rounds rotated (each first twice).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  KERN_S=330 bash bench/device_stages.sh; exit
fi
source bench/device_env.sh >/dev/null 2>&1
P=/tmp/pkgmark; rm -rf $P; mkdir -p $P/moegemm && cp moegemm/*.py $P/moegemm/
ln -sfn $PWD/kernels $P/moegemm/kernels; ln -sfn $PWD/client $P/moegemm/client
cp -r server $P/moegemm/server && cp ab/mark_engine.py $P/moegemm/server/engine.py
timeout 300 python3 -P bench/bench_service.py --servers "" --no-deepseek --no-load \
  --variants "new:PYTHONPATH=/tmp/pkg:/tmp/site,mark:PYTHONPATH=/tmp/pkgmark:/tmp/site" \
  --only-m mixed,beside --duration 2 --rounds 4 --out $OUT/ab2.json > $OUT/ab2.log 2>&1
echo "ab2 rc=$? $(el)"; grep -v "^median" $OUT/ab2.log | grep "c=32" | awk '{for(i=1;i<=NF;i++){if($i=="small"){s=$(i+3)}}; print $1, $3, s}'
grep "^median" $OUT/ab2.log | cut -c8-70,200-420
