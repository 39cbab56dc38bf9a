"""The table's tile against the same tile with some fields changed, on the same data, in the
forms a launch takes, rounds alternated and reversed: a sweep's single timings drift 5-10 % between
runs on the few-expert decode class (session 35), too much to choose a tile from.

    python bench/config_ab.py --match "seed m32 n1280,..." --vary "split_k=1,2;num_stages=3,6" \
                              [--forms lone,public] [--rounds 6] [--json OUT]

Each variant is the table's tile with the fields of ``--vary`` changed (those that fit), launched in
each of ``--forms`` (``bench_kernels.form_plan``: ``public``, ``svc``, ``map``, ``lone``, the form a
server's lone call launches), its output checked against a float64 spot reference (SPEC 1's 5e-3)
before it is timed; ``same_bits`` says whether it gives the table tile's bits in that form (a change
of schedule fields alone should; a change of split or tile shape reorders the sums). Never
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
    parser.add_argument("--forms", default="lone", help="comma list of public, svc, map, lone")
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
               "errors": {}, "us": {}, "same_bits": {}}
        launches, table_out = {}, {}
        for form in args.forms.split(","):
            for cfg in [table] + [c for c in bk.varied_configs(table, vary, n, g) if c != table]:
                name = f"{form} {cfg.key()}"
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=bk.DEV)
                try:
                    launch = bk.bound_launch(bk.form_plan(form, ops, out, cfg))
                    err = bk.spot_error(problem, out)
                    if not (torch.isfinite(out).all() and err <= 5e-3):
                        raise AssertionError(f"rel err {err:.2e} or not finite")
                    launches[name] = launch
                except Exception as exc:  # noqa: BLE001  one variant's failure is a result
                    row["errors"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    continue
                if cfg == table:  # the table's tile comes first in each form
                    table_out[form] = out
                ref = table_out.get(form)  # None where the table's tile failed
                row["same_bits"][name] = None if ref is None else torch.equal(out.view(torch.int16), ref.view(torch.int16))
        runs = bk.alternating_runs(launches, args.rounds)
        row["us"] = {name: round(statistics.median(v), 2) for name, v in runs.items()}
        row["spread"] = {name: round((max(v) - min(v)) / statistics.median(v), 3) for name, v in runs.items()}
        print(f"{case['name']:<44} floor {row['floor_us']:6.1f}  table {table.key()}", flush=True)
        for form in args.forms.split(","):
            base = row["us"].get(f"{form} {table.key()}")  # None where the table's tile failed (errors)
            ranked = sorted((kv for kv in row["us"].items() if kv[0].startswith(f"{form} ")), key=lambda kv: kv[1])
            for name, us in ranked[:6]:
                ratio = f"{base / us:.3f}x" if base else "-"
                bits = {True: "", False: "  other bits", None: "  no table bits"}[row["same_bits"][name]]
                print(f"    {name:<50} {us:7.2f}  {ratio}  spread {row['spread'][name]}{bits}", flush=True)
        for name, error in row["errors"].items():
            print(f"    {name:<50} failed: {error}", flush=True)
        rows.append(row)
        del ops, launches, table_out
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
