#!/bin/bash
# An A/B of this checkout (main) against a variant: this checkout with $AB_CARRY's files laid over
# a copy of it at /tmp/ab_variant (carry that folder: only the changed files travel). From both,
# alternating (main, variant, main, variant), each a fresh process on fresh data, at most $AB_S
# seconds each (default 110): AB_TOOL=kernels (default) bench_kernels.py --match $AB_MATCH
# --no-peers, or AB_TOOL=gap gap_gluon.py --match $AB_MATCH (the service graph's parts apart)
# -> ab_{main,variant}_{1,2}.json; then per case the medians of main and the variant for each
# figure (kernels: service, public; gap: its columns) and the geomean of main/variant service.
R0=$PWD
V=/tmp/ab_variant; rm -rf $V; mkdir -p $V
tar -c --exclude=./.carry --exclude=./.whl . | tar -x -C $V; cp -r "$AB_CARRY"/. $V/; ln -sfn $R0/.whl $V/.whl
S=${AB_S:-110}
for round in 1 2; do
  for v in main variant; do
    d=$R0; [ $v = variant ] && d=$V
    if [ "${AB_TOOL:-kernels}" = gap ]; then
      run=(bench/gap_gluon.py --match "$AB_MATCH" --budget-s $(( S - 30 )) --out "$OUT/ab_${v}_$round.json")
    else
      run=(bench/bench_kernels.py --match "$AB_MATCH" --no-peers --json "$OUT/ab_${v}_$round.json")
    fi
    (cd $d && source bench/device_env.sh > /dev/null && timeout -k 5 $S python3 -P "${run[@]}" \
      > "$OUT/ab_${v}_$round.log" 2>&1
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
                figures = row.get("us") or {"service": row["service_us"], "public": row["public_us"]}
                for key, us in figures.items():
                    runs.setdefault(row["name"], {}).setdefault(key, {}).setdefault(v, []).append(us)
ratios = []
for name, keys in runs.items():
    cells = []
    for key, vs in keys.items():
        if len(vs) < 2: continue
        m, h = statistics.median(vs["main"]), statistics.median(vs["variant"])
        cells.append(f"{key} {m:.2f}/{h:.2f} ({m / h:.3f}x)")
        if key == "service": ratios.append(m / h)
    print(f"{name:48s} main/variant " + "  ".join(cells))
if ratios:
    print("geomean main/variant service", round(statistics.geometric_mean(ratios), 4), len(ratios))
PY
true
