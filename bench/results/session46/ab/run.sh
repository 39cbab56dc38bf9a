#!/bin/bash
# ab/ (untracked when run): mark_engine.py is the shipped engine with small calls marked waiting at
# submit (two lines in Engine.submit: a small call appended to the loop's list while the device is
# held sets _loop_waiting, so the worker starts no batch before the loop's drain); cap_engine.py is
# the shipped engine whose loop drain runs at most AB_LOOP_CAP rows (at least one call) and puts the
# rest at the head of the worker's queue. Session 46: engines A/B on mixed and beside traffic, no
# tracer, 2 rounds, both orders.
source bench/device_env.sh >/dev/null 2>&1
for e in mark cap; do
  P=/tmp/pkg$e; rm -rf $P; mkdir -p $P/moegemm && cp moegemm/*.py $P/moegemm/
  ln -sfn $PWD/kernels $P/moegemm/kernels; ln -sfn $PWD/client $P/moegemm/client
  cp -r server $P/moegemm/server && cp ab/${e}_engine.py $P/moegemm/server/engine.py
done
N="new:PYTHONPATH=/tmp/pkg:/tmp/site"; M="mark:PYTHONPATH=/tmp/pkgmark:/tmp/site"
C="cap256:PYTHONPATH=/tmp/pkgcap:/tmp/site;AB_LOOP_CAP=256"; D="cap1024:PYTHONPATH=/tmp/pkgcap:/tmp/site;AB_LOOP_CAP=1024"
for R in fwd rev; do
  if [ $R = fwd ]; then V="$N,$M,$C,$D"; else V="$D,$C,$M,$N"; fi
  timeout ${AB_T:-250} python3 -P bench/bench_service.py --servers "" --no-deepseek --no-load --variants "$V" \
    --only-m mixed,beside --duration 2 --rounds 2 --port $([ $R = fwd ] && echo 18600 || echo 18700) --out $OUT/$R.json > $OUT/$R.log 2>&1
  echo "$R rc=$? $(el)"; grep "^median" $OUT/$R.log | cut -c8-70,200-420
done
