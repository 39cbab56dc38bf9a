#!/bin/bash
# Session 13, call 1. Stages, each run when its time limit is set (carry .whl/server; the A/B also
# .carry/maphoist, the decode kernels with the row map loaded before the K loop):
#   SWEEP_S  bench_kernels.py --sweep --no-peers on $SWEEP_MATCH, tiles $SWEEP_KEYS -> sweep.json
#   AB_S     this checkout (main) against main + .carry/maphoist, alternating (main, hoist, main,
#            hoist), bench_kernels.py --match $AB_MATCH --no-peers, each a fresh process -> ab_*.json
R0=$PWD
source bench/device_env.sh
if [ -n "$SWEEP_S" ]; then
  timeout -k 5 $SWEEP_S python3 -P bench/bench_kernels.py --sweep --no-peers --budget-s $(( SWEEP_S - 30 )) \
    --match "$SWEEP_MATCH" --sweep-keys "$SWEEP_KEYS" --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
  echo "sweep rc=$? $(el)"; grep -v "^{" "$OUT/sweep.log" | tail -80 | cut -c1-220
fi
if [ -n "$AB_S" ]; then
  B=/tmp/maphoist_checkout; rm -rf $B; mkdir -p $B
  tar -c --exclude=./.carry --exclude=./.whl . | tar -x -C $B; cp -r .carry/maphoist/. $B/; ln -sfn $R0/.whl $B/.whl
  for round in 1 2; do
    for v in main hoist; do
      d=$R0; [ $v = hoist ] && d=$B
      (cd $d && source bench/device_env.sh > /dev/null && timeout -k 5 $AB_S python3 -P bench/bench_kernels.py \
        --match "$AB_MATCH" --no-peers --json "$OUT/ab_${v}_$round.json" > "$OUT/ab_${v}_$round.log" 2>&1
       echo "$v round $round rc=$? $(el)")
    done
  done
  python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1]); runs = {}
for v in ("main", "hoist"):
    for r in (1, 2):
        p = out / f"ab_{v}_{r}.json"
        if p.exists():
            for row in json.loads(p.read_text())["rows"]:
                runs.setdefault(row["name"], {}).setdefault(v, []).append((row["service_us"], row["public_us"]))
ratios = []
for name, vs in runs.items():
    if len(vs) < 2: continue
    m = statistics.median(s for s, _ in vs["main"]); h = statistics.median(s for s, _ in vs["hoist"])
    pm = statistics.median(p for _, p in vs["main"]); ph = statistics.median(p for _, p in vs["hoist"])
    ratios.append(m / h)
    print(f"{name:48s} service main {m:7.2f} hoist {h:7.2f} ({m / h:5.3f}x)  public main {pm:7.2f} hoist {ph:7.2f}")
if ratios:
    print("geomean main/hoist service", round(statistics.geometric_mean(ratios), 4), len(ratios))
PY
fi
true
