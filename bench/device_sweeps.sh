#!/bin/bash
# Several tile sweeps in one device call (carry .whl/server). $SWEEPS names a file of lines
#   name <TAB> seconds <TAB> --match cases <TAB> --sweep-vary fields (empty: candidate_configs)
# each run as bench_kernels.py --sweep --no-peers (the table's tile through the service graph and
# the public launch, its variants through the public launch) -> sweep_<name>.json, then printed
# per case by sweep_summary.py (the best variants against the table's tile).
source bench/device_env.sh
while IFS=$'\t' read -r name secs match vary; do
  [ -z "$name" ] || [ "${name:0:1}" = "#" ] && continue
  timeout -k 5 "$secs" python3 -P bench/bench_kernels.py --sweep --no-peers --budget-s $(( secs - 30 )) \
    --match "$match" --sweep-vary "$vary" --json "$OUT/sweep_$name.json" > "$OUT/sweep_$name.log" 2>&1
  echo "sweep $name rc=$? $(el)"; tail -2 "$OUT/sweep_$name.log" | cut -c1-300
  python3 bench/sweep_summary.py "$OUT/sweep_$name.json" --top ${TOP:-3} 2>&1 | cut -c1-220
done < "$SWEEPS"
true
