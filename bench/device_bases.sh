#!/bin/bash
# Session 12: the Gluon consumers' scale bases loaded per tile (branch bases; its changed files in .carry/bases) against
# main, on the store tile's cases: gap_gluon.py --match $GAP_MATCH from both checkouts, alternating
# (main, bases, main, bases), then (KERN_S set) bench_kernels.py in full from .carry/bases.
R0=$PWD
# The bases checkout: this one with .carry/bases's files laid over it (only the changed files travel).
B=/tmp/bases_checkout; rm -rf $B; mkdir -p $B
tar -c --exclude=./.carry --exclude=./.whl . | tar -x -C $B; cp -r .carry/bases/. $B/; ln -sfn $R0/.whl $B/.whl
for round in 1 2; do
  for v in main bases; do
    d=$R0; [ $v = bases ] && d=$B
    (cd $d && source bench/device_env.sh > /dev/null && timeout -k 5 ${GAP_S:-100} python3 -P bench/gap_gluon.py \
      --match "$GAP_MATCH" --budget-s $(( ${GAP_S:-100} - 30 )) --out "$OUT/gap_${v}_$round.json" \
      > "$OUT/gap_${v}_$round.log" 2>&1; echo "$v round $round rc=$? $(el)")
  done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1]); got = {}
for v in ("main", "bases"):
    for r in (1, 2):
        p = out / f"gap_{v}_{r}.json"
        if p.exists():
            for row in json.loads(p.read_text())["rows"]:
                for key, us in row["us"].items():
                    got.setdefault((row["name"], key), {}).setdefault(v, []).append(us)
keys = ("public", "service", "addressed", "weights_by_address", "rowmap_identity")
names = sorted({n for n, _ in got})
for name in names:
    cells = []
    for key in keys:
        vs = got.get((name, key), {})
        if len(vs) == 2:
            m, b = statistics.median(vs["main"]), statistics.median(vs["bases"])
            cells.append(f"{key} {m:.0f}/{b:.0f} ({m / b:.3f}x)")
    print(f"{name:44s} " + "  ".join(cells))
PY
if [ -n "$KERN_S" ]; then
  cd $B && KERN_S=$KERN_S bash bench/device_session9.sh
fi
true
