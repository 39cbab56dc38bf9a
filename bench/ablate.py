"""Where a tile's time goes: the table's tile with parts of its work switched off, and one candidate
(the next tile's first scales loaded before a tile is staged), on the same data.

    patch -p1 < bench/prepared/ablate.patch   # the kernels' ABLATE and PREFETCH constexprs
    python bench/ablate.py [--json OUT.json] [--match a,b]

The forms (public launches unless named ``svc``: the server's lone-call form, activations and
weights by address; timed as ``bench_kernels.time_us``, median over CUDA-graph replays, two
rounds alternating):

- Gluon tiles: ``base``; ``prefetch`` (``gluon_ws_store`` only; must give ``base``'s bits);
  ``nostore`` (ABLATE 1: no global store of the output); ``noscale`` (2: no scale loads, the
  products of 1.0); ``nomma`` (4: no wgmma, the ring still filled and drained); ``loads``
  (5: neither wgmma nor store: the producer's TMA stream alone).
- decode tiles: ``base``; ``nosum`` (ABLATE 1: each split stores its own partial, no split-K
  sums); ``noscale`` (2: the preloaded scales not applied); ``bare`` (3).

The ablated forms give wrong sums: they time the rest, they are not a kernel. Never collected
by pytest.
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

CASES = ("Qwen3-30B-A3B w2 prefill t2048,Qwen3-30B-A3B w2 prefill t8192,Qwen3-30B-A3B w13 prefill t2048,"
         "Qwen3-235B-A22B w2 prefill t2048,DeepSeek-V3 w2 prefill t8192,Kimi-K2 w2 prefill t8192,"
         "GLM-4.5 w2 prefill t8192,seed m16384 n7168 ,DeepSeek-V3 w13 prefill t8192,Kimi-K2 w13 prefill t8192,"
         "seed m32 n1280 ,seed m128 n1280 ,Llama-4-Maverick w2 decode t1,Llama-4-Maverick w13 decode t1,"
         "GLM-4.5 w2 decode t1")

GLUON_FORMS = {"base": {}, "prefetch": {"PREFETCH": True}, "svc base": {}, "svc prefetch": {"PREFETCH": True},
               "nostore": {"ABLATE": 1}, "noscale": {"ABLATE": 2}, "nomma": {"ABLATE": 4}, "loads": {"ABLATE": 5}}
DECODE_FORMS = {"base": {}, "nosum": {"ABLATE": 1}, "noscale": {"ABLATE": 2}, "bare": {"ABLATE": 3}}


def main() -> None:
    from moegemm.kernels import triton_kernel as tk

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--match", default=CASES)
    args = parser.parse_args()
    gen = torch.Generator(device=bk.DEV).manual_seed(17)
    triton.set_allocator(tk._tma_scratch)
    rows = []
    for case in bk.matching_cases(args.match):
        m, n, k, g = case["m"], case["n"], case["k"], case["g"]
        config = tk.default_config(m, n, k, g)
        if config.schedule in tk.GLUON_SCHEDULES:
            forms = dict(GLUON_FORMS)
            if config.schedule != "gluon_ws_store":
                forms = {f: c for f, c in forms.items() if "prefetch" not in f}
        elif config.swap_ab:
            forms = dict(DECODE_FORMS)
            if min(config.split_k, k // 128) <= 1:
                forms = {f: c for f, c in forms.items() if f in ("base", "noscale")}
            if not config.preload:
                forms = {f: c for f, c in forms.items() if f in ("base", "nosum")}
        else:
            continue
        ops = bk.case_operands(case, gen)
        outs, fns = {}, {}
        for form, extra in forms.items():
            outs[form] = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=bk.DEV)
            plan = bk.form_plan("svc" if form.startswith("svc") else "public", ops, outs[form], config)
            fns[form] = bk.bound_launch(plan, **extra)
        same = {f: torch.equal(outs[f].view(torch.int16), outs["base"].view(torch.int16))
                for f in forms if "prefetch" in f or f == "svc base"}
        times = bk.alternating_runs(fns)
        row = {"name": case["name"], "config": config.key(), "floor_us": bk.floor_us(m, n, k, case["sizes"]),
               "us": {f: statistics.median(t) for f, t in times.items()}, "same_bits": same}
        rows.append(row)
        cells = "  ".join(f"{f} {u:.1f}" for f, u in row["us"].items())
        print(f"{case['name']:44s} {config.key():36s} floor {row['floor_us']:.1f}  {cells}  bits {same}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
