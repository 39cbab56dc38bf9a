#!/bin/bash
# Session 44 engine A/B (not committed): old = HEAD's engine, c = the drain scheduled directly,
# b = the working tree (c + the worker runs the small calls that waited for its batch).
source bench/device_env.sh >/dev/null 2>&1
for v in old c; do
  rm -rf /tmp/pkg$v; mkdir -p /tmp/pkg$v/moegemm && cp moegemm/*.py /tmp/pkg$v/moegemm/
  ln -sfn $PWD/kernels /tmp/pkg$v/moegemm/kernels; ln -sfn $PWD/client /tmp/pkg$v/moegemm/client
  cp -r server /tmp/pkg$v/moegemm/server && cp ab/${v}_engine.py /tmp/pkg$v/moegemm/server/engine.py
done
O=old:PYTHONPATH=/tmp/pkgold:/tmp/site; C=c:PYTHONPATH=/tmp/pkgc:/tmp/site; B=b:PYTHONPATH=/tmp/pkg:/tmp/site
run() {
  timeout 280 python3 -P bench/bench_service.py --servers "" --no-deepseek --no-load --variants "$1" \
    --only-m beside,mixed,1,128 --rounds 2 --duration 1.0 --budget-s 250 --port $3 --out $OUT/$2.json > $OUT/$2.log 2>&1
  echo "$2 rc=$? $(el)"; grep "^median" $OUT/$2.log | cut -c8-70,200-420
}
run "$O,$C,$B" fwd 18600
run "$B,$C,$O" rev 18700
