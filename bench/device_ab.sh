#!/bin/bash
# An A/B of this checkout (main) against a variant: this checkout with $AB_CARRY's files laid over
# a copy of it (carry that folder: only the changed files travel). bench_kernels.py --match
# $AB_MATCH --no-peers from both, alternating (main, variant, main, variant), each a fresh process
# on fresh data, at most $AB_S seconds each (default 110) -> ab_{main,variant}_{1,2}.json; then the
# service (and public) medians per case and the geomean of main/variant service times.
R0=$PWD
V=/tmp/ab_variant; rm -rf $V; mkdir -p $V
tar -c --exclude=./.carry --exclude=./.whl . | tar -x -C $V; cp -r "$AB_CARRY"/. $V/; ln -sfn $R0/.whl $V/.whl
for round in 1 2; do
  for v in main variant; do
    d=$R0; [ $v = variant ] && d=$V
    (cd $d && source bench/device_env.sh > /dev/null && timeout -k 5 ${AB_S:-110} python3 -P bench/bench_kernels.py \
      --match "$AB_MATCH" --no-peers --json "$OUT/ab_${v}_$round.json" > "$OUT/ab_${v}_$round.log" 2>&1
     echo "$v round $round rc=$? $(el)")
  done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1]); runs = {}
for v in ("main", "variant"):
    for r in (1, 2):
        p = out / f"ab_{v}_{r}.json"
        if p.exists():
            for row in json.loads(p.read_text())["rows"]:
                runs.setdefault(row["name"], {}).setdefault(v, []).append((row["service_us"], row["public_us"]))
ratios = []
for name, vs in runs.items():
    if len(vs) < 2: continue
    m = statistics.median(s for s, _ in vs["main"]); h = statistics.median(s for s, _ in vs["variant"])
    pm = statistics.median(p for _, p in vs["main"]); ph = statistics.median(p for _, p in vs["variant"])
    ratios.append(m / h)
    print(f"{name:48s} service main {m:7.2f} variant {h:7.2f} ({m / h:5.3f}x)  public main {pm:7.2f} variant {ph:7.2f}")
if ratios:
    print("geomean main/variant service", round(statistics.geometric_mean(ratios), 4), len(ratios))
PY
true
