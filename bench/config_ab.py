"""The table's tile against its neighbours, on the same data, in the form a server's lone call
launches (``lone``: the rows' check inside, the row map on a decode tile), rounds alternated and
reversed: a sweep's single timings drift 5-10 % between runs on the few-expert decode class
(session 35), too much to choose a tile from.

    python bench/config_ab.py --match "seed m32 n1280,..." --vary "split_k=1,2;num_stages=3,6" \
                              [--rounds 6] [--json OUT]

Each variant is the table's tile with the fields of ``--vary`` changed (those that fit), its
output checked against a float64 spot reference (SPEC 1's 5e-3) before it is timed. Never
collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk


def main() -> None:
    from moegemm.kernels import triton_kernel as tk

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", required=True)
    parser.add_argument("--vary", required=True)
    parser.add_argument("--rounds", type=int, default=6, help="even: each order runs as often")
    parser.add_argument("--form", default="lone", choices=("public", "svc", "map", "lone"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.rounds < 2 or args.rounds % 2:
        parser.error("--rounds must be even and at least 2 (alternating_runs reverses every other round)")
    triton.set_allocator(tk._tma_scratch)
    vary = bk.parse_vary(args.vary)
    gen = torch.Generator(device=bk.DEV)
    gen.manual_seed(35)
    rows = []
    for case in bk.matching_cases(args.match):
        m, n, k, g = case["m"], case["n"], case["k"], case["g"]
        bucket = bk.bucket_of(m)
        table = tk.default_config(bucket, n, k, g)
        ops = bk.case_operands(case, gen)
        problem = (ops["xq"], ops["wq"], ops["x_scale"], ops["w_scale"], ops["sizes"])
        row = {"name": case["name"], "table": table.key(), "floor_us": bk.floor_us(m, n, k, case["sizes"]),
               "errors": {}, "us": {}}
        launches = {}
        for cfg in [table] + [c for c in bk.varied_configs(table, vary, n, g) if c != table]:
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=bk.DEV)
            try:
                plan = bk.form_plan(args.form, ops, out, cfg)
                launch = bk.bound_launch(plan)
                err = bk.spot_error(problem, out)
                if not (torch.isfinite(out).all() and err <= 5e-3):
                    raise AssertionError(f"rel err {err:.2e} or not finite")
                launches[cfg.key()] = launch
            except Exception as exc:  # noqa: BLE001  one variant's failure is a result
                row["errors"][cfg.key()] = f"{type(exc).__name__}: {str(exc)[:200]}"
        runs = bk.alternating_runs(launches, args.rounds)
        row["us"] = {key: round(statistics.median(v), 2) for key, v in runs.items()}
        row["spread"] = {key: round((max(v) - min(v)) / statistics.median(v), 3) for key, v in runs.items()}
        base = row["us"].get(table.key())  # None where the table's own tile failed (see errors)
        ranked = sorted(row["us"].items(), key=lambda kv: kv[1])
        print(f"{case['name']:<44} floor {row['floor_us']:6.1f}  table {table.key()} {base}", flush=True)
        for key, us in ranked[:6]:
            ratio = f"{base / us:.3f}x" if base else "-"
            print(f"    {key:<44} {us:7.2f}  {ratio}  spread {row['spread'][key]}", flush=True)
        for key, error in row["errors"].items():
            print(f"    {key:<44} failed: {error}", flush=True)
        rows.append(row)
        del ops, launches
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
