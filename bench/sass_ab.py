"""The table's prefill kernels against the same binaries with yield hints on their promotion
FFMAs (``sass_yield.patch``), in one process, on the same data: the same bits asserted, then
CUDA-graph replay medians, the variants alternating (an experiment; never collected by pytest).

    python bench/sass_ab.py [--match a,b] [--forms public] [--rounds 4] [--workers 12] [--json OUT]

Each case whose table tile is a persistent schedule (Gluon or Triton) is launched as
``triton_kernel.launch_plan`` plans it (``bench_kernels.form_plan``: ``public`` is the public
function's launch, compiled ahead in ``--workers`` processes; ``svc``, a lone prefill call's graph
in the server, compiles in the run); after its first launch every binary the kernel's JIT cache holds
gets a patched copy per variant, and each variant's graph is captured with its copies in the
cache (a graph keeps the function it captured).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk
import sass_yield

# name: (first, every)
# "dg" is closest to DeepGEMM's rule (every other scale-reusing FFMA of the first 9/16 of a run,
# so each yielding one reads its scale from a cache its neighbour filled); the first 9/16 of
# each run between two other instructions here (gluon_ws: 64, then 23 + 41 around an arrive).
VARIANTS = {"d916": (9 / 16, 1), "dg": (9 / 16, 2), "all": (1.0, 1), "e2": (1.0, 2), "e4": (1.0, 4),
            "q1": (0.25, 1)}


def caches(kernel) -> list[dict]:
    return [entry[0] for entry in kernel.device_caches.values()]


def patched_copies(kernel, made: dict) -> None:
    """A patched copy per variant of each binary in ``kernel``'s JIT caches not seen yet (a
    binary with no FFMA run gets none: it runs as it is in every variant)."""
    for cache in caches(kernel):
        for key, ck in list(cache.items()):
            if (id(cache), key) in made or hasattr(ck, "result"):
                continue
            listings = sass_yield.instructions(ck.kernel)
            copies = {"base": ck}
            for name, (first, every) in VARIANTS.items():
                cubin, changed = sass_yield.patch(ck.kernel, first, every, listings=listings)
                if not changed:
                    print(f"{ck.name}: no FFMA run to patch", flush=True)
                    copies = None
                    break
                new = copy.copy(ck)
                new.asm = type(ck.asm)({**ck.asm, "cubin": cubin})
                new.kernel, new.module, new.function, new._run = cubin, None, None, None
                copies[name] = new
            if copies:
                made[(id(cache), key)] = (cache, key, copies)


def use(made: dict, variant: str) -> None:
    for cache, key, copies in made.values():
        cache[key] = copies[variant]


def main() -> None:
    from moegemm.kernels import triton_kernel as tk

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", default="seed,real")
    parser.add_argument("--forms", default="public")
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gen = torch.Generator(device=bk.DEV).manual_seed(591)
    triton.set_allocator(tk._tma_scratch)
    names = ["base", *VARIANTS]
    made: dict = {}
    rows = []
    cases = [c for c in bk.matching_cases(args.match)
             if tk.default_config(c["m"], c["n"], c["k"], c["g"]).schedule.startswith(("gluon", "persistent"))]
    # The public launches' kernels compiled ahead in parallel (bench_kernels' jobs, public only).
    jobs = [job for job in bk.compile_jobs(cases, sweep=False)
            if not job[5] and job[0].schedule.startswith(("gluon", "persistent"))]
    failed = bk.compile_ahead(jobs, args.workers)
    print(f"compiled {len(jobs)} kernels ahead, {len(failed)} failed: {failed[:3]}", flush=True)
    for case in cases:
        m, n, k, g = case["m"], case["n"], case["k"], case["g"]
        config = tk.default_config(m, n, k, g)
        ops = bk.case_operands(case, gen)
        floor = bk.floor_us(m, n, k, case["sizes"])
        for form in args.forms.split(","):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=bk.DEV)
            plan = bk.form_plan(form, ops, out, config)
            use(made, "base")
            launch = bk.bound_launch(plan)
            patched_copies(plan[0], made)
            ref = out.clone()
            graphs, same, handles = {}, {}, {}
            for name in names:
                use(made, name)
                out.fill_(float("nan"))
                launch()
                torch.cuda.synchronize()
                same[name] = torch.equal(out.view(torch.int16), ref.view(torch.int16))
                # The variant's own binary ran: the cache holds its copies, each loaded on its own.
                handles[name] = {c[name].function for _cache, _key, c in made.values() if c[name].function}
                assert all(cache[key] is c[name] for cache, key, c in made.values())
                graphs[name] = bk.graph_of(launch)
            assert all(not (handles[a] & handles[b]) for a in names for b in names if a < b), "a binary ran twice"
            use(made, "base")
            timers = {name: (lambda gr=graphs[name]: bk.graph_us(*gr)) for name in names}
            runs = bk.alternating_timers(timers, args.rounds)
            us = {name: statistics.median(t) for name, t in runs.items()}
            row = {"name": case["name"], "form": form, "config": config.key(), "floor_us": floor, "us": us,
                   "same_bits": same, "base_over": {v: us["base"] / us[v] for v in VARIANTS}}
            rows.append(row)
            print(f"{case['name']:46s} {form} {config.schedule:15s} floor {floor:8.1f} base {us['base']:8.1f} "
                  f"({floor / us['base']:.3f})  base/ " + " ".join(f"{v} {r:.3f}" for v, r in row["base_over"].items())
                  + "  bits differ: " + (",".join(v for v, s in same.items() if not s) or "none"), flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
            del graphs
        del ops
        torch.cuda.empty_cache()
    for v in VARIANTS:
        ratios = [r["base_over"][v] for r in rows]
        print(f"geomean base/{v} {bk.ratio_summary(ratios)}")
    for v in VARIANTS:
        pre = [r["base_over"][v] for r in rows if "prefill" in r["name"] or "m16384" in r["name"]]
        if pre:
            print(f"prefill geomean base/{v} {bk.ratio_summary(pre)}")


if __name__ == "__main__":
    main()
