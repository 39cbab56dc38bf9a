"""Print the sweep of a bench_kernels.py JSON as one line per (shape, config): us, floor/us, error, same bits.

    python bench/v7_summary.py results/kernels_v7_sweep.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

rows = json.loads(Path(sys.argv[1]).read_text())["rows"]
for r in rows:
    print(f"{r['name']}  floor {r['floor_us']:.1f}  table {r['ours_config']} {r['ours_us']:.1f} "
          f"err {r['ours_rel_err']:.2e} finite {r['ours_finite']}")
    for key, v in r.get("sweep_us", {}).items():
        if isinstance(v, list):
            print(f"   {key:<40} {v[0]:>8.1f} {r['floor_us'] / v[0]:>6.2f}  err {v[1]:.2e}  same {v[2]}")
        else:
            print(f"   {key:<40} {v}")
