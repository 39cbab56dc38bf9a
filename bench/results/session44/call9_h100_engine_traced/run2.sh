#!/bin/bash
source bench/device_env.sh >/dev/null 2>&1
rm -rf /tmp/pkgold; mkdir -p /tmp/pkgold/moegemm && cp moegemm/*.py /tmp/pkgold/moegemm/
ln -sfn $PWD/kernels /tmp/pkgold/moegemm/kernels; ln -sfn $PWD/client /tmp/pkgold/moegemm/client
cp -r server /tmp/pkgold/moegemm/server && cp ab/old_engine.py /tmp/pkgold/moegemm/server/engine.py
T=$PWD/bench/results/session44/tracer
O="old:PYTHONPATH=$T:/tmp/pkgold:/tmp/site;MOEGEMM_TRACE_OUT=$OUT/trace_old_\$R.jsonl"
N="new:PYTHONPATH=$T:/tmp/pkg:/tmp/site;MOEGEMM_TRACE_OUT=$OUT/trace_new_\$R.jsonl"
for R in fwd rev; do
  if [ $R = fwd ]; then V="${O//\$R/$R},${N//\$R/$R}"; else V="${N//\$R/$R},${O//\$R/$R}"; fi
  timeout 200 python3 -P bench/bench_service.py --servers "" --no-deepseek --no-load --variants "$V" \
    --only-m beside --duration 3 --port $([ $R = fwd ] && echo 18600 || echo 18700) --out $OUT/$R.json > $OUT/$R.log 2>&1
  echo "$R rc=$? $(el)"; grep "^median" $OUT/$R.log | cut -c8-70,200-420
  for v in old new; do echo "== $R $v"; python3 $T/analyse.py $OUT/trace_${v}_$R.jsonl | sed -n '/beside/,$p' | grep -v "n=    0"; gzip $OUT/trace_${v}_$R.jsonl; done
done
