"""The table's tile from this checkout against the same kernel from another copy of its module
(``--base``: a copy of ``kernels/_gluon_gemm.py`` or ``kernels/_triton_gemm.py``, e.g. the shipped
one), in one process, on the same data: the same bits asserted, then both timed.

    python bench/kernel_ab.py --base .carry/base16/kernels/_gluon_gemm.py [--variant NAME=PATH ...]
                              [--forms public,svc] [--json OUT] [--match a,b]

For each case whose table tile is a kernel of that module (named as the copy's file), both
kernels are launched as ``triton_kernel.launch_plan`` plans them, in two forms: ``public``
(plain pointers, the public function) and ``svc`` (activations and weights by address, stored
in place); ``--forms`` may add ``map`` (the same through an identity row map: the server's
merged calls) and ``lone`` (a lone call's graph: the rows' check inside, through the row map on
a decode tile, in place on a persistent one; its flags are compared as well as the output; a
base copy whose kernel takes no flags writes none, and differs). Timed as ``bench_kernels.time_us`` (median over CUDA-graph
replays of back-to-back launches), base and new alternating, ``--rounds`` rounds (2). ``--variant``: more
copies of the module, timed beside them (the ratios are base over each). Never collected by
pytest.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk

CASES = ("Qwen3-30B-A3B w2 prefill,Qwen3-30B-A3B w13 prefill,Qwen3-235B-A22B w2 prefill t2048,"
         "Qwen3-235B-A22B w13 prefill t2048,DeepSeek-V3 w2 prefill,DeepSeek-V3 w13 prefill,Kimi-K2 w2 prefill t8192,"
         "Kimi-K2 w13 prefill t8192,GLM-4.5 w2 prefill t8192,GLM-4.5 w13 prefill t2048,seed m16384 ,"
         "Llama-4-Maverick w13 prefill t8192,Mixtral-8x7B w13 prefill t2048,Mixtral-8x22B w2 prefill t2048")


def load_base(path: Path, name: str):
    """``path`` imported as a module of the ``moegemm.kernels`` package (its relative imports)."""
    spec = importlib.util.spec_from_file_location(f"moegemm.kernels.{path.stem}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    from moegemm.kernels import triton_kernel as tk

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--match", default=CASES)
    parser.add_argument("--variant", action="append", default=[], help="NAME=PATH: another copy, timed too")
    parser.add_argument("--forms", default="public,svc")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    modules = {"base": load_base(args.base, "base"), "new": None}
    for spec in args.variant:
        name, path = spec.split("=", 1)
        modules[name] = load_base(Path(path), name)
    form_names = args.forms.split(",")
    gen = torch.Generator(device=bk.DEV).manual_seed(171)
    triton.set_allocator(tk._tma_scratch)
    rows = []
    for case in bk.matching_cases(args.match):
        m, n, k, g = case["m"], case["n"], case["k"], case["g"]
        config = tk.default_config(m, n, k, g)
        if tk.SCHEDULES[config.schedule].fn.__module__.rsplit(".", 1)[-1] != args.base.stem:
            continue
        ops = bk.case_operands(case, gen)
        fns, outs, flags = {}, {}, {}
        forms = [f for f in form_names if f != "lone" or config.checks_rows]
        for form in forms:
            for which, module in modules.items():
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=bk.DEV)
                plan = bk.form_plan(form, ops, out, config)
                kernel = None if module is None else getattr(module, plan[0].__name__)
                # An older build taking SKIP_DEAD_HALF (sessions 20-21) gets its table's rule (r <= 64).
                older = {"SKIP_DEAD_HALF": m // g <= 64} if kernel and "SKIP_DEAD_HALF" in kernel.arg_names else {}
                fns[f"{form} {which}"], outs[f"{form} {which}"] = bk.bound_launch(plan, kernel, **older), out
                # The rows' check (the lone form): its flags are compared too.
                flags[f"{form} {which}"] = [a for a in plan[2] if isinstance(a, torch.Tensor)
                                            and a.dtype == torch.int8]
        ref = outs[f"{form_names[0]} base"].view(torch.int16)
        same = {f: torch.equal(o.view(torch.int16), ref)
                   and all(torch.equal(a, b) for a, b in zip(flags[f], flags[f"{f.split()[0]} base"], strict=True))
                for f, o in outs.items()}
        times = bk.alternating_runs(fns, args.rounds)
        us = {f: statistics.median(t) for f, t in times.items()}
        row = {"name": case["name"], "config": config.key(), "floor_us": bk.floor_us(m, n, k, case["sizes"]),
               "us": us, "same_bits": same,
               "base_over": {f"{form} {w}": us[f"{form} base"] / us[f"{form} {w}"] for form in forms
                             for w in modules if w != "base"}}
        rows.append(row)
        print(f"{case['name']:44s} {config.key():34s} floor {row['floor_us']:8.1f}  "
              + "  ".join(f"{f} {u:8.1f}" for f, u in us.items())
              + "  base/ " + " ".join(f"{f} {v:.3f}" for f, v in row["base_over"].items())
              + "  bits differ: " + (",".join(f for f, v in same.items() if not v) or "none"), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    for key in dict.fromkeys(key for r in rows for key in r["base_over"]):
        ratios = [r["base_over"][key] for r in rows if key in r["base_over"]]
        print(f"geomean base/({key}) {statistics.geometric_mean(ratios):.4f} over {len(ratios)}")


if __name__ == "__main__":
    main()
