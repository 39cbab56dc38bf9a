#!/bin/bash
# ab/ (untracked when run): old_engine.py is `git show a568dba:server/engine.py`; fixes_engine.py is
# 88063e2's engine without the worker-run small calls, the engine shipped since session 45.
# Session 45, call 3: the server GPU tests on the final engine (session 44's worker-run small
# calls taken out again), then A/B on one-row, mixed and beside traffic, 2 rounds, both orders:
# final (this tree), old (a568dba's engine), acc8 (final, 8 acceptors), gil200 (final, a 200 us
# GIL switch interval).
SPREAD_S=250 WORKERS=8 SPREAD="tests/server/test_engine_gpu.py tests/server/test_server_gpu.py tests/server/test_shipped_gpu.py tests/server/test_hostile.py tests/server/test_acceptors.py tests/deploy/test_drain.py" bash bench/device_stages.sh
source bench/device_env.sh >/dev/null 2>&1
P=/tmp/pkgold; rm -rf $P; mkdir -p $P/moegemm && cp moegemm/*.py $P/moegemm/
ln -sfn $PWD/kernels $P/moegemm/kernels; ln -sfn $PWD/client $P/moegemm/client
cp -r server $P/moegemm/server && cp ab/old_engine.py $P/moegemm/server/engine.py
O="old:PYTHONPATH=/tmp/pkgold:/tmp/site"; N="final:PYTHONPATH=/tmp/pkg:/tmp/site"
A="acc8:PYTHONPATH=/tmp/pkg:/tmp/site;MOEGEMM_ACCEPTORS=8"; G="gil200:PYTHONPATH=/tmp/pkg:/tmp/site;MOEGEMM_GIL_SWITCH_US=200"
for R in fwd rev; do
  if [ $R = fwd ]; then V="$O,$N,$A,$G"; else V="$G,$A,$N,$O"; fi
  timeout 190 python3 -P bench/bench_service.py --servers "" --no-deepseek --no-load --variants "$V" \
    --only-m 1,mixed,beside --duration 2 --rounds 2 --port $([ $R = fwd ] && echo 18600 || echo 18700) --out $OUT/$R.json > $OUT/$R.log 2>&1
  echo "$R rc=$? $(el)"; grep "^median" $OUT/$R.log | cut -c8-70,200-420
done
