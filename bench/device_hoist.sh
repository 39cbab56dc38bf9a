#!/bin/bash
# decode_hoist_words A/B (session 12): this checkout (main) against its carried copy .carry/hoist
# (bench/prepared/decode_hoist_words.patch applied), the real one-token and 16-token decode rows
# and the seed's one-row case, service graph and public launch, no peers; the two checkouts'
# runs alternate (main, hoist, main, hoist), each a fresh process on fresh data. Then, from main,
# gap_gluon.py on the store tile at K = 4096-5120 and on two one-token cases when GAP_S is set.
R0=$PWD
for round in 1 2; do
  for v in main hoist; do
    d=$R0; [ $v = hoist ] && d=$R0/.carry/hoist
    (cd $d && source bench/device_env.sh > /dev/null && timeout -k 5 ${DEC_S:-110} python3 -P bench/bench_kernels.py \
      --match "decode t1 g,decode t16 g,seed m1 " --no-peers --json "$OUT/dec_${v}_$round.json" \
      > "$OUT/dec_${v}_$round.log" 2>&1; echo "$v round $round rc=$? $(el)")
  done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1]); runs = {}
for v in ("main", "hoist"):
    for r in (1, 2):
        p = out / f"dec_{v}_{r}.json"
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
if [ -n "$GAP_S" ]; then
  source bench/device_env.sh > /dev/null
  timeout -k 5 $GAP_S python3 -P bench/gap_gluon.py --match "$GAP_MATCH" --budget-s $(( GAP_S - 30 )) \
    --out "$OUT/gap.json" > "$OUT/gap.log" 2>&1
  echo "gap rc=$? $(el)"; grep -v "^{" "$OUT/gap.log" | tail -30 | cut -c1-300
fi
true
