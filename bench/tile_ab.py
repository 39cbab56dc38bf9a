"""The table's tile against the same tile with some fields changed, in one process, on the same
data: the same bits asserted, then both timed, alternating.

    python bench/tile_ab.py --vary group_tiles_m=16 [--forms svc,public] [--rounds 3] [--match a,b]

For each matching case (``bench_kernels.matching_cases``) the table's tile and the varied one are
launched as ``triton_kernel.launch_plan`` plans them in each form (``bench_kernels.form_plan``:
``public``, ``svc``, ``map``), timed as ``bench_kernels.time_us`` (CUDA-graph replay medians),
base and variant alternating for ``--rounds`` rounds; printed per case: the median of each and
base over variant, then the geometric mean. Never collected by pytest.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk

CASES = ("DeepSeek-V3 w13 prefill,DeepSeek-V3 w2 prefill,Kimi-K2 w13 prefill,Kimi-K2 w2 prefill,GLM-4.5 w13 prefill,"
         "GLM-4.5 w2 prefill,Qwen3-235B-A22B w13 prefill,Qwen3-235B-A22B w2 prefill,Qwen3-30B-A3B w2 prefill,"
         "Qwen3-30B-A3B w13 prefill,seed m16384 n2048,seed m16384 n7168,seed m1024 n7168,Mixtral-8x7B w13 prefill,"
         "Mixtral-8x7B w2 prefill,Llama-4-Maverick w2 prefill,Llama-4-Maverick w13 prefill,Mixtral-8x22B w2 prefill,"
         "Mixtral-8x22B w13 prefill")


def main() -> None:
    import triton
    from moegemm.kernels import triton_kernel as tk

    parser = argparse.ArgumentParser()
    parser.add_argument("--vary", required=True, help="field=value[;field=value]")
    parser.add_argument("--forms", default="svc")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--match", default=CASES)
    parser.add_argument("--gluon-only", action="store_true", help="only cases whose table tile is a Gluon one")
    args = parser.parse_args()
    triton.set_allocator(tk._tma_scratch)
    changes = {field: values[0] for field, values in bk.parse_vary(args.vary).items()}
    gen = torch.Generator(device=bk.DEV).manual_seed(11)
    ratios = {form: [] for form in args.forms.split(",")}
    for case in bk.matching_cases(args.match):
        base = tk.default_config(case["m"], case["n"], case["k"], case["g"])
        if args.gluon_only and base.schedule not in tk.GLUON_SCHEDULES:
            continue
        variant = replace(base, **changes)
        ops = bk.case_operands(case, gen)
        line = f"{case['name']:46s} {base.key():36s} floor {bk.floor_us(case['m'], case['n'], case['k'], case['sizes']):8.1f}"
        for form, found in ratios.items():
            outs = {name: torch.full((case["m"], case["n"]), float("nan"), dtype=torch.bfloat16, device=bk.DEV)
                    for name in ("base", "variant")}
            launches = {name: bk.bound_launch(bk.form_plan(form, ops, outs[name], config))
                        for name, config in (("base", base), ("variant", variant))}
            same = torch.equal(outs["base"].view(torch.int16), outs["variant"].view(torch.int16))
            runs = bk.alternating_runs(launches, args.rounds)
            b, v = statistics.median(runs["base"]), statistics.median(runs["variant"])
            found.append(b / v)
            line += f"  {form} {b:8.1f} / {v:8.1f} = {b / v:.3f}{'' if same else ' BITS DIFFER'}"
        print(line, flush=True)
        del ops
        torch.cuda.empty_cache()
    for form, rs in ratios.items():
        if rs:
            print(f"geomean base/variant {form} {bk.ratio_summary(rs)}")


if __name__ == "__main__":
    main()
