"""Issue 15: the Gluon prefill kernel's variants against ``gluon_ws`` on the real many-expert prefill cases.

    python bench/gluon11.py --out gluon11.json [--budget-s 230] [--workers 12] [--list]

``gluon_ws`` runs the many-expert prefill shapes at 0.56-0.72 of their floor where K is
small (a tile costs ~7.86 ns x K + 1.75 us, v17). ``kernels/_gluon_gemm.py`` has two
variants that took work off the tensor cores' path between tiles: ``gluon_ws_handoff``
(the producer hands the consumers each tile's coordinates; measured in session 10, call 3,
and deleted) and ``gluon_ws_store`` (that, and the epilogue in two store warps fed through
shared memory; the table's schedule at K <= 5120 since). For the 24 prefill cases
of ``real_models.json`` at G >= 64 (``bench_kernels.real_cases``: w13 and w2, 2048 and
8192 tokens, the repo's routing model), each on fresh random weights and rows:

- every schedule is compiled first, in parallel worker processes (Triton's disk cache);
- bits: each variant's output == ``gluon_ws``'s (NaN-poisoned outputs, compared as
  integers), and ``gluon_ws``'s worst relative error against float64 on three groups;
- time: one CUDA graph per schedule of several public launches (about 1 ms a replay), the
  schedules' replays interleaved round by round (the order rotating), median per launch.
  Fresh data per case, so no case starts with the last one's operands in L2; within a case
  the replays follow each other as in ``bench_kernels.time_us``.

Prints floor / time per case and schedule and the geomeans (all cases, w2, w13);
``shipped`` names the schedule the table picks for the case (the two Llama-4 t2048 cases
are decode tiles there, timed here with the Gluon tile all the same). Writes everything to
--out after every case. Needs an NVIDIA Hopper GPU; ``--list`` prints the cases without one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SCHEDULES = ("gluon_ws", "gluon_ws_store")  # gluon_ws_handoff was measured (session 10, call 3) and deleted


def tile(schedule: str):
    from moegemm.kernels import triton_kernel as tk

    return tk.TileConfig(schedule, 128, 256, 4, 3, group_tiles_m=8)


def cases() -> list[dict]:
    """The real prefill cases at G >= 64, w2 first (small K: where the variants should matter)."""
    import bench_kernels as bk

    found = [c for c in bk.real_cases() if " prefill " in c["name"] and c["g"] >= 64]
    return sorted(found, key=lambda c: " w13 " in c["name"])  # stable: the file's order within each


# ---- compiling ahead --------------------------------------------------------------------------

def _compile(job) -> str:
    """Compile one schedule's public launch for one shape class into Triton's cache (a worker)."""
    from moegemm.kernels import triton_kernel as tk

    schedule, m, n, k, g = job
    dev = torch.device("cuda")
    try:
        xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
        xs = torch.empty((m, k // 128), dtype=torch.float32, device=dev)
        out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
        w = torch.empty(16, dtype=torch.float8_e4m3fn, device=dev)
        ws = torch.empty(16, dtype=torch.float32, device=dev)
        sizes = torch.zeros(g, dtype=torch.int64, device=dev)
        kernel, grid, args, consts = tk.launch_plan(xq, w, xs, ws, sizes, out, n, g, tile(schedule), False)
        kernel.warmup(*args, grid=grid, **consts)
        return ""
    except Exception as exc:  # noqa: BLE001  reported; the run compiles it again (and fails there)
        return f"{schedule} m{m} n{n} k{k} g{g}: {exc!r}"[:300]


def compile_ahead(found: list[dict], workers: int) -> list[str]:
    """One job per compiled kernel: Triton specialises on G's power of two (G_POW2) and on
    the integer arguments' divisibility by 16 (and == 1)."""
    import multiprocessing

    from moegemm.kernels import triton_kernel as tk

    jobs = {}
    for c in found:
        m, n, k, g = c["m"], c["n"], c["k"], c["g"]
        ints = (m, n, k, g, n * k, k // 128, (k // 128) * (n // 128), n // 128)
        for schedule in SCHEDULES:
            key = (schedule, max(16, tk._next_pow2(g)), tuple((v == 1, v % 16 == 0) for v in ints))
            jobs.setdefault(key, (schedule, m, n, k, g))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [e for e in pool.map(_compile, list(jobs.values()), chunksize=1) if e]


# ---- timing -----------------------------------------------------------------------------------

def _graph(fn, calls: int):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    return graph


def interleaved_us(fns: dict, budget_ms: float = 40.0) -> dict:
    """Microseconds per launch of each of ``fns``: a graph of several launches each, replays
    interleaved round by round (order rotating), median over rounds."""
    names = list(fns)
    first = fns[names[0]]
    first()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    first()
    end.record()
    end.synchronize()
    est = max(start.elapsed_time(end), 1e-3)  # ms
    calls = max(1, min(100, int(1.0 / est)))
    graphs = {name: _graph(fn, calls) for name, fn in fns.items()}
    rounds = max(5, min(25, int(budget_ms / (est * calls * len(names)))))
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[name].replay()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b) * 1e3 / calls)
    return {name: round(statistics.median(ts), 2) for name, ts in times.items()} | {"_calls": calls,
                                                                                     "_rounds": rounds}


# ---- one case -----------------------------------------------------------------------------------

def run_case(case: dict, gen: torch.Generator) -> dict:
    import bench_kernels as bk
    from moegemm.kernels import triton_kernel as tk

    m, n, k, g = case["m"], case["n"], case["k"], case["g"]
    wq, w_scale = bk.random_weights(g, n, k, gen)
    _, xq, x_scale = bk.random_activations(m, k, gen)
    sizes = case["sizes"].to(bk.DEV)
    problem = (xq, wq, x_scale, w_scale, sizes)
    outs = {}
    for schedule in SCHEDULES:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=bk.DEV)
        tk.launch(*problem, out, tile(schedule))
        outs[schedule] = out
    torch.cuda.synchronize()
    want = outs["gluon_ws"].view(torch.int16)
    row = {"name": case["name"], "m": m, "n": n, "k": k, "g": g, "active": int((case["sizes"] > 0).sum()),
           "shipped": tk.default_config(m, n, k, g).key(), "floor_us": round(bk.floor_us(m, n, k, case["sizes"]), 1),
           "bits_equal": {s: bool(torch.equal(outs[s].view(torch.int16), want)) for s in SCHEDULES[1:]},
           "gluon_ws_all_rows_written": not bool(outs["gluon_ws"].isnan().any()),
           "gluon_ws_spot_error": bk.spot_error(problem, outs["gluon_ws"])}
    fns = {s: (lambda s=s: tk.launch(*problem, outs[s], tile(s))) for s in SCHEDULES}
    us = interleaved_us(fns)
    row["calls_per_graph"], row["rounds"] = us.pop("_calls"), us.pop("_rounds")
    row["us"] = us
    row["floor_over_time"] = {s: round(row["floor_us"] / us[s], 4) for s in SCHEDULES}
    row["speedup_vs_gluon_ws"] = {s: round(us["gluon_ws"] / us[s], 4) for s in SCHEDULES[1:]}
    return row


def geomean(values) -> float:
    values = list(values)
    return round(math.exp(sum(math.log(v) for v in values) / len(values)), 4) if values else float("nan")


def summarize(rows) -> dict:
    found = {}
    for label, pick in (("all", lambda r: True), ("w2", lambda r: " w2 " in r["name"]),
                        ("w13", lambda r: " w13 " in r["name"])):
        chosen = [r for r in rows if pick(r)]
        found[label] = {"cases": len(chosen),
                        "floor_over_time": {s: geomean(r["floor_over_time"][s] for r in chosen) for s in SCHEDULES},
                        "speedup_vs_gluon_ws": {s: geomean(r["speedup_vs_gluon_ws"][s] for r in chosen)
                                                for s in SCHEDULES[1:]}}
    found["all_bits_equal"] = all(all(r["bits_equal"].values()) for r in rows)
    return found


def print_table(rows, summary) -> None:
    print(f"{'case':<40}{'floor':>8}" + "".join(f"{s:>18}" for s in SCHEDULES) + "  bits")
    for r in rows:
        cells = "".join(f"{r['us'][s]:>9.1f} ({r['floor_over_time'][s]:.3f})" for s in SCHEDULES)
        print(f"{r['name'][5:45]:<40}{r['floor_us']:>8.1f}{cells}  "
              f"{'T' if all(r['bits_equal'].values()) else r['bits_equal']}")
    for label in ("all", "w2", "w13"):
        s = summary[label]
        print(f"geomean floor/time {label} ({s['cases']}): "
              + ", ".join(f"{k} {v}" for k, v in s["floor_over_time"].items())
              + "; speedup vs gluon_ws: " + ", ".join(f"{k} {v}" for k, v in s["speedup_vs_gluon_ws"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write every figure here (after every case)")
    parser.add_argument("--budget-s", type=float, default=230.0, help="start no case after this many seconds")
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--list", action="store_true", help="print the cases, run nothing (no GPU)")
    args = parser.parse_args()
    started = time.monotonic()
    found = cases()
    if args.list:
        from moegemm.kernels import triton_kernel as tk

        for c in found:
            print(c["name"], "m", c["m"], "n", c["n"], "k", c["k"], "active", int((c["sizes"] > 0).sum()),
                  "shipped", tk.default_config(c["m"], c["n"], c["k"], c["g"]).key())
        return
    if not torch.cuda.is_available() or torch.version.hip:
        sys.exit("gluon11.py needs an NVIDIA Hopper GPU (the Gluon kernels are sm_90); --list runs without one")
    import bench_kernels as bk

    failed = compile_ahead(found, args.workers)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "compile_failures": failed,
            "compile_s": round(time.monotonic() - started, 1), "floor_ceilings": bk.FLOOR_CEILINGS}
    print(f"compiled ahead in {meta['compile_s']} s; failures: {failed}", flush=True)
    gen = torch.Generator(device=bk.DEV)
    gen.manual_seed(int(time.time()))
    rows = []
    for case in found:
        if time.monotonic() - started > args.budget_s:
            meta["stopped_early"] = f"budget reached before {case['name']}"
            break
        row = run_case(case, gen)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            args.out.write_text(json.dumps({"meta": dict(meta, partial=True), "rows": rows}, indent=1))
        torch.cuda.empty_cache()
    meta["wall_s"] = round(time.monotonic() - started, 1)
    summary = summarize(rows)
    print_table(rows, summary)
    print(json.dumps(meta))
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
