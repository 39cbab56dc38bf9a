"""Print a sweep JSON (bench_kernels.py --sweep) per case: the table's tile, its public time, and the
neighbours from fastest, with their time over the table's.

    python bench/sweep_summary.py sweep.json [--top 6]
"""
import argparse
import json
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("path")
parser.add_argument("--top", type=int, default=6)
args = parser.parse_args()
for row in json.loads(Path(args.path).read_text())["rows"]:
    base = row["public_us"]
    cells = []
    timed = [(v[0], k, v[1]) for k, v in row.get("sweep_us", {}).items() if isinstance(v, list)]
    for us, key, ok in sorted(timed)[: args.top]:
        cells.append(f"{key.replace('_g1_ef', '').replace('decode', 'd')} {us:.1f} ({base / us:.2f}x){'' if ok else ' BAD'}")
    failed = [k for k, v in row.get("sweep_us", {}).items() if not isinstance(v, list)]
    print(f"{row['name'][:40]:40s} fl {row['floor_us']:.1f} table {row['config'][:34]} {base:.1f} svc {row['service_us']:.1f}")
    print("    " + " | ".join(cells) + (f"  failed: {failed}" if failed else ""))
