#!/bin/bash
# ab/ (untracked when run): old_engine.py is `git show a568dba:server/engine.py`; fixes_engine.py is
# 88063e2's engine without the worker-run small calls, the engine shipped since session 45.
# Session 45, call 2: engines A/B on mixed and beside traffic, no tracer, 2 rounds, both orders:
# old (a568dba), fixes (HEAD without the worker running waiting small calls), new (HEAD),
# own0 (HEAD, MOEGEMM_OWNER_CONNECTIONS=0: every connection's answers written by the acceptors).
source bench/device_env.sh >/dev/null 2>&1
for e in old fixes; do
  P=/tmp/pkg$e; rm -rf $P; mkdir -p $P/moegemm && cp moegemm/*.py $P/moegemm/
  ln -sfn $PWD/kernels $P/moegemm/kernels; ln -sfn $PWD/client $P/moegemm/client
  cp -r server $P/moegemm/server && cp ab/${e}_engine.py $P/moegemm/server/engine.py
done
O="old:PYTHONPATH=/tmp/pkgold:/tmp/site"; F="fixes:PYTHONPATH=/tmp/pkgfixes:/tmp/site"
N="new:PYTHONPATH=/tmp/pkg:/tmp/site"; Z="own0:PYTHONPATH=/tmp/pkg:/tmp/site;MOEGEMM_OWNER_CONNECTIONS=0"
for R in fwd rev; do
  if [ $R = fwd ]; then V="$O,$F,$N,$Z"; else V="$Z,$N,$F,$O"; fi
  timeout 250 python3 -P bench/bench_service.py --servers "" --no-deepseek --no-load --variants "$V" \
    --only-m mixed,beside --duration 2 --rounds 2 --port $([ $R = fwd ] && echo 18600 || echo 18700) --out $OUT/$R.json > $OUT/$R.log 2>&1
  echo "$R rc=$? $(el)"; grep "^median" $OUT/$R.log | cut -c8-70,200-420
done
