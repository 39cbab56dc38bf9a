#!/bin/bash
# ab/ (untracked when run): old_engine.py is `git show a568dba:server/engine.py`; fixes_engine.py is
# 88063e2's engine without the worker-run small calls, the engine shipped since session 45.
# Session 45, call 1: the server GPU tests on session 44's engine change, then mixed and beside
# traffic A/B against the engine before it (a568dba), both orders.
SPREAD_S=250 WORKERS=8 SPREAD="tests/server/test_engine_gpu.py tests/server/test_server_gpu.py tests/server/test_shipped_gpu.py tests/server/test_hostile.py tests/server/test_acceptors.py tests/deploy/test_drain.py" bash bench/device_stages.sh
source bench/device_env.sh >/dev/null 2>&1
rm -rf /tmp/pkgold; mkdir -p /tmp/pkgold/moegemm && cp moegemm/*.py /tmp/pkgold/moegemm/
ln -sfn $PWD/kernels /tmp/pkgold/moegemm/kernels; ln -sfn $PWD/client /tmp/pkgold/moegemm/client
cp -r server /tmp/pkgold/moegemm/server && cp ab/old_engine.py /tmp/pkgold/moegemm/server/engine.py
O="old:PYTHONPATH=/tmp/pkgold:/tmp/site"; N="new:PYTHONPATH=/tmp/pkg:/tmp/site"
for R in fwd rev; do
  if [ $R = fwd ]; then V="$O,$N"; else V="$N,$O"; fi
  timeout 130 python3 -P bench/bench_service.py --servers "" --no-deepseek --no-load --variants "$V" \
    --only-m mixed,beside --duration 2 --port $([ $R = fwd ] && echo 18600 || echo 18700) --out $OUT/$R.json > $OUT/$R.log 2>&1
  echo "$R rc=$? $(el)"; grep "^median" $OUT/$R.log | cut -c8-70,200-420
done
