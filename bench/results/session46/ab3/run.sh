#!/bin/bash
# Session 46, call 6: the shipped engine (small calls marked waiting at submit) against the same
# with loop drains capped at 256 rows, the rest at the head of the worker's queue (ab/cap2_engine.py,
# variant.diff here), 4 rounds rotated.
source bench/device_env.sh >/dev/null 2>&1
P=/tmp/pkgcap; rm -rf $P; mkdir -p $P/moegemm && cp moegemm/*.py $P/moegemm/
ln -sfn $PWD/kernels $P/moegemm/kernels; ln -sfn $PWD/client $P/moegemm/client
cp -r server $P/moegemm/server && cp ab/cap2_engine.py $P/moegemm/server/engine.py
timeout 200 python3 -P bench/bench_service.py --servers "" --no-deepseek --no-load \
  --variants "shipped:PYTHONPATH=/tmp/pkg:/tmp/site,cap256:PYTHONPATH=/tmp/pkgcap:/tmp/site;AB_LOOP_CAP=256" \
  --only-m mixed,beside --duration 2 --rounds 4 --out $OUT/ab3.json > $OUT/ab3.log 2>&1
echo "ab3 rc=$? $(el)"; grep -v "^median" $OUT/ab3.log | grep "c=32" | awk '{for(i=1;i<=NF;i++){if($i=="small"){s=$(i+3)}; if($i=="calls/s"){c=$(i-1)}}; print $1, $3, s, c}'
grep "^median" $OUT/ab3.log | cut -c8-70,200-420
