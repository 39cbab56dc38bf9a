"""Do the TMA tiles lose to the weights' row-major layout? The table's TMA tile (``persistent_tma``,
``gluon_ws``, ``gluon_ws_store``) on plain ``[G, N, K]`` weights against the same kernel reading
``[G, N/R, K/128, R, 128]`` (each R x 128 block one contiguous stretch: ``W_TILED=R``, R = 128
and, where N % 256 == 0, 256), on the same data, the same bits asserted.

    patch -p1 < bench/prepared/tiled_layout_kernels.patch   # every kernel's W_TILED (not applied on main;
                                                            # session 25's runs used tiled_tma.patch, its TMA part)
    python bench/tiled_tma.py [--json OUT.json] [--match a,b] [--extra gluon_ws]
    ncu --profile-from-start off --clock-control none --section ... python bench/tiled_tma.py --ncu --match a,b

Why: a TMA box of the plain layout is 128 or 256 rows of 128 bytes, K bytes apart, so every
128-byte piece the tile reads lies in a DRAM page of its own; ``read_ceiling.py`` read 84 MB in
35.9 us as such pieces and in 23.1 us as contiguous stretches (session 16). Session 16 measured
the decode tile (pointer loads) on tile-contiguous weights (1.00-1.11x), never the TMA tiles,
which carry the prefill cases and Mixtral at 256 tokens; and every prefill launch runs at the
board's power cap (session 22), of which HBM's page openings are a part. Public launches timed
as ``bench_kernels.time_us`` (a graph of back-to-back launches, median over replays), plain and
tiled alternating. ``--extra``: also these schedules (128 x 256 Gluon tiles) where N % 256 == 0.
Never collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk

TMA = ("persistent_tma", "gluon_ws", "gluon_ws_store")


def tiled(wq: torch.Tensor, rows: int) -> torch.Tensor:
    """``[G, N, K]`` as ``[G, N/rows, K/128, rows, 128]`` (contiguous), seen as ``[G, N, K]`` again."""
    g, n, k = wq.shape
    return wq.view(g, n // rows, rows, k // 128, 128).permute(0, 1, 3, 2, 4).contiguous().view(g, n, k)


def main() -> None:
    import triton
    from moegemm.kernels import triton_kernel as tk

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--match", default="")
    parser.add_argument("--extra", default="", help="schedules timed too, e.g. gluon_ws")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ncu", action="store_true", help="each layout's launch once, after a warm-up, "
                        "between cudaProfilerStart/Stop (for Nsight Compute's counters), no timing")
    args = parser.parse_args()
    triton.set_allocator(tk._tma_scratch)
    cases = bk.matching_cases(args.match) if args.match else bk.seed_cases() + bk.real_cases()
    extra = [s for s in args.extra.split(",") if s]
    gen = torch.Generator(device=bk.DEV).manual_seed(25)
    rows, ratios = [], {}
    for case in cases:
        m, n, k, g = case["m"], case["n"], case["k"], case["g"]
        table = tk.default_config(m, n, k, g)
        if table.schedule not in TMA:
            continue
        configs = [table] + [c for c in (tk.TileConfig(s, 128, 256, 4, 3, group_tiles_m=8) for s in extra)
                             if c != table and c.fits(n, g)]
        ops = bk.case_operands(case, gen)
        layouts = {"plain": (ops["wq"], 0), "t128": (tiled(ops["wq"], 128), 128)}
        if n % 256 == 0:
            layouts["t256"] = (tiled(ops["wq"], 256), 256)
        for config in configs:
            outs, fns = {}, {}
            for layout, (w, box) in layouts.items():
                outs[layout] = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=bk.DEV)
                kernel, grid, largs, consts = bk.form_plan("public", ops, outs[layout], config)
                plan = (kernel, grid, (largs[0], w) + tuple(largs[2:]), consts)
                fns[layout] = bk.bound_launch(plan, W_TILED=box)
            same = all(torch.equal(outs["plain"].view(torch.int16), o.view(torch.int16)) for o in outs.values())
            if args.ncu:
                for layout, fn in fns.items():
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStart()
                    fn()
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStop()
                    print(f"profiled {case['name']} {config.key()} {layout} bits {'=' if same else 'DIFFER'}",
                          flush=True)
                continue
            times = bk.alternating_runs(fns, args.rounds)
            row = {"name": case["name"], "config": config.key(), "table": config == table,
                   "floor_us": bk.floor_us(m, n, k, case["sizes"]), "runs": times, "same_bits": same}
            line = f"{case['name'][:44]:44s} {config.key():36s} floor {row['floor_us']:7.1f}"
            for layout in layouts:
                row[f"{layout}_us"] = statistics.median(times[layout])
                line += f"  {layout} {row[f'{layout}_us']:7.1f}"
            for layout in list(layouts)[1:]:
                row[f"plain_over_{layout}"] = row["plain_us"] / row[f"{layout}_us"]
                line += f"  {layout} {row[f'plain_over_{layout}']:.3f}x"
                if config == table:
                    ratios.setdefault(layout, []).append(row[f"plain_over_{layout}"])
            rows.append(row)
            print(line + f"  bits {'=' if same else 'DIFFER'}", flush=True)
        del ops, layouts
        torch.cuda.empty_cache()
    for layout, rs in ratios.items():
        print(f"geomean plain/{layout} (table tiles) {bk.ratio_summary(rs)}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
