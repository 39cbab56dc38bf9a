"""Wide tail tiles in the Gluon kernels: the table's Gluon tile with them on and off, on the same
data, the same bits asserted; and, run from a checkout without them (``--plain``), the same
launches there, to compare across checkouts.

    patch -p1 < bench/prepared/gluon_wide_tails.patch   # the kernels' WIDE constexpr
    python bench/wide_tails.py [--json OUT.json] [--match a,b]
    python bench/wide_tails.py --plain ...              # from a checkout without the patch

A group's last row tile of at most 64 rows runs as 64 x 512 tiles (``_gluon_gemm._group_tiles``)
instead of 128 x 256 tiles whose bottom half is dropped. Public launches timed as
``bench_kernels.time_us`` (a graph of back-to-back launches, median over replays), on and off
alternating, two rounds; each launch first alone under a device sync, so a fault names its
form. Never collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk

CASES = ("seed m16384 n7168 ,DeepSeek-V3 w13 prefill t8192,DeepSeek-V3 w2 prefill t8192,Kimi-K2 w13 prefill t8192,"
         "Kimi-K2 w2 prefill t8192,Qwen3-30B-A3B w2 prefill t2048,GLM-4.5 w13 prefill t8192,"
         "DeepSeek-V3 w13 prefill t2048")


def main() -> None:
    from moegemm.kernels import triton_kernel as tk

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--match", default=CASES)
    parser.add_argument("--plain", action="store_true", help="a checkout without wide tiles: time its launch")
    parser.add_argument("--stages", type=int, default=0,
                        help="also time wide and full tiles at this ring depth (gluon_ws: 3 or 4)")
    args = parser.parse_args()
    cases = bk.matching_cases(args.match)
    gen = torch.Generator(device=bk.DEV).manual_seed(16)
    rows = []
    for case in cases:
        m, n, k, g = case["m"], case["n"], case["k"], case["g"]
        config = tk.default_config(m, n, k, g)
        if config.schedule not in tk.GLUON_SCHEDULES:
            continue
        ops = bk.case_operands(case, gen)
        forms = ("plain",) if args.plain else ("wide", "full")
        deeper = args.stages and args.stages != config.num_stages and config.schedule == "gluon_ws"
        if deeper:
            forms += (f"wide_s{args.stages}", f"full_s{args.stages}")
        outs, fns = {}, {}
        triton.set_allocator(tk._tma_scratch)
        for form in forms:
            outs[form] = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=bk.DEV)
            tile = replace(config, num_stages=args.stages) if "_s" in form else config
            plan = bk.form_plan("public", ops, outs[form], tile)
            extra = {} if form == "plain" else {"WIDE": form.startswith("wide")}
            fns[form] = bk.bound_launch(plan, **extra)
            print(f"  {case['name']} {form}: ran", flush=True)
        same = None
        if not args.plain:
            same = all(torch.equal(outs[f].view(torch.int16), outs["full"].view(torch.int16)) for f in forms)
        times = bk.alternating_runs(fns)
        row = {"name": case["name"], "config": config.key(), "floor_us": bk.floor_us(m, n, k, case["sizes"]),
               "us": {f: statistics.median(t) for f, t in times.items()}, "same_bits": same}
        rows.append(row)
        cells = "  ".join(f"{f} {u:8.1f}" for f, u in row["us"].items())
        ratio = f"  full/wide {row['us']['full'] / row['us']['wide']:.3f}x  bits {'=' if same else 'DIFFER'}" \
            if not args.plain else ""
        print(f"{case['name']:44s} {config.key():36s} floor {row['floor_us']:8.1f}  {cells}{ratio}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
