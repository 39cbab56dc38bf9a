"""The table's tile against the same tile with an experiment's constexpr set (a patch from
``bench/prepared/`` applied), on the same data: the same bits asserted, then timed alternating.

    python bench/const_ab.py --const PF=0,4,8 [--schedules gluon_ws,gluon_ws_store] [--extra gluon_ws]
                             [--tile num_stages=2] [--match a,b] [--rounds 3] [--json OUT.json]

For each case (all seed and real cases, or ``--match``) whose table tile is one of
``--schedules``, the tile is launched as its public entry with each value of the constexpr (the
first value is the base: the shipped code's), timed as ``bench_kernels.time_us`` (a CUDA graph of
back-to-back launches, median over replays, fresh random data), all values alternating for
``--rounds`` rounds. ``--extra``: also these 128 x 256 Gluon schedules where they fit and the table
runs another. Printed per case: each value's median and base over it; then the geometric mean per
value over the table's tiles. Never collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk


def main() -> None:
    import triton
    from moegemm.kernels import triton_kernel as tk

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--const", required=True, help="NAME=base,v1,v2")
    parser.add_argument("--schedules", default="gluon_ws,gluon_ws_store")
    parser.add_argument("--extra", default="")
    parser.add_argument("--match", default="")
    parser.add_argument("--tile", default="", help="the tile's fields for the non-base values, "
                        "e.g. num_stages=2 (as --sweep-vary's syntax, one value each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    triton.set_allocator(tk._tma_scratch)
    name, values = next(iter(bk.parse_vary(args.const).items()))
    tile = {field: vals[0] for field, vals in bk.parse_vary(args.tile).items()}
    schedules = args.schedules.split(",")
    extra = [s for s in args.extra.split(",") if s]
    cases = bk.matching_cases(args.match) if args.match else bk.seed_cases() + bk.real_cases()
    gen = torch.Generator(device=bk.DEV).manual_seed(26)
    rows, ratios = [], {}
    for case in cases:
        m, n, k, g = case["m"], case["n"], case["k"], case["g"]
        table = tk.default_config(m, n, k, g)
        configs = [table] if table.schedule in schedules else []
        configs += [c for c in (tk.TileConfig(s, 128, 256, 4, 3, group_tiles_m=8) for s in extra)
                    if c != table and c.fits(n, g)]
        if not configs:
            continue
        ops = bk.case_operands(case, gen)
        for config in configs:
            outs, fns = {}, {}
            for value in values:
                outs[value] = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=bk.DEV)
                cfg = config if value == values[0] else replace(config, **tile)
                fns[value] = bk.bound_launch(bk.form_plan("public", ops, outs[value], cfg), **{name: value})
            base = outs[values[0]].view(torch.int16)
            same = all(torch.equal(base, o.view(torch.int16)) for o in outs.values())
            times = bk.alternating_runs(fns, args.rounds)
            med = {v: statistics.median(t) for v, t in times.items()}
            row = {"name": case["name"], "config": config.key(), "table": config == table,
                   "floor_us": bk.floor_us(m, n, k, case["sizes"]), "runs": {str(v): t for v, t in times.items()},
                   "us": {str(v): t for v, t in med.items()}, "same_bits": same}
            rows.append(row)
            line = f"{case['name'][:44]:44s} {config.key():36s} floor {row['floor_us']:7.1f}"
            for v in values:
                line += f"  {name}={v} {med[v]:7.1f}"
            for v in values[1:]:
                line += f"  {med[values[0]] / med[v]:.3f}x"
                if config == table:
                    ratios.setdefault(v, []).append(med[values[0]] / med[v])
            print(line + f"  bits {'=' if same else 'DIFFER'}", flush=True)
        del ops
        torch.cuda.empty_cache()
    for v, rs in ratios.items():
        print(f"geomean base/{name}={v} (table tiles) {bk.ratio_summary(rs)}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "const": name, "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
