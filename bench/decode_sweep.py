"""The decode tiles' loop on the H200: the shipped tile, more stages, and its scales preloaded.

    python bench/decode_sweep.py [--out sweep.json] [--budget-s 230] [--rounds 5] [--match a,b] [--list]

For every real decode case (t1/t16/t64/t256 of ``real_models.json``, the routing
``bench_kernels.real_cases`` draws) and every seed shape whose table tile is a decode
schedule: the table's tile for the call's rows (``default_config``, the public entry's
launch) as it ships, the same tile at 4 and 5 stages, and with ``preload`` (every K
block's scale products taken before the loop, ``_triton_gemm._scale_products``) at 3, 4
and 5 stages where the tile takes it (``TileConfig.fits``: the single-block tiles, not the
pairs). Each variant's output must equal the shipped tile's bit for bit (outputs
NaN-poisoned first). Times: medians of CUDA-graph replays (graphs of about 1 ms of calls,
as ``bench_kernels.time_us``), fresh random data per case, the variants interleaved over
``--rounds`` rounds. Prints floor/time per variant and the geomeans over the cases every
variant ran. Cases run worst-first (v17's service ratio) by weight set, so a budget cut
drops the ones nearest the floor.

The weight sets run in a child process that appends each case's row as it finishes; a
child that dies (an illegal address makes the CUDA context unusable) loses only the set
it was on: the next child starts at the following set and the death is recorded. Never
collected by pytest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = [("shipped", False, None), ("s4", False, 4), ("s5", False, 5),
            ("pre_s3", True, 3), ("pre_s4", True, 4), ("pre_s5", True, 5)]
"""(name, preload, num_stages): the shipped tile (None: the table's own stages) and its variants."""
V17 = Path(__file__).resolve().parent / "results" / "kernels_v17_session9.json"


def variant_config(cfg, preload: bool, stages, n: int, g: int):
    """``cfg`` as a variant of :data:`VARIANTS` runs it, or None where the tile has no such form
    (``TileConfig.fits``: a pair takes no preload)."""
    if stages is None:
        return cfg
    varied = dataclasses.replace(cfg, preload=preload, num_stages=stages)
    return varied if varied.fits(n, g) else None


def decode_cases() -> list[dict]:
    """The real decode cases and the seed shapes whose tile is a decode schedule, worst v17
    service ratio first (cases v17 lacks last)."""
    import bench_kernels as bk
    from moegemm.kernels import triton_kernel as tk

    cases = [c for c in bk.real_cases() if " decode " in c["name"]] + bk.seed_cases()
    cases = [c for c in cases if tk.default_config(c["m"], c["n"], c["k"], c["g"]).swap_ab]
    ratio = {}
    if V17.exists():
        ratio = {r["name"]: r["floor_over_service"] for r in json.loads(V17.read_text())["rows"]}
    return sorted(cases, key=lambda c: ratio.get(c["name"], 9.0))


def tile_classes() -> list[tuple]:
    """(table tile, (m, n, k, g)) once per distinct tile of the decode cases (for compiling)."""
    from moegemm.kernels import triton_kernel as tk

    seen = {}
    for c in decode_cases():
        cfg = tk.default_config(c["m"], c["n"], c["k"], c["g"])
        seen.setdefault(cfg, (c["m"], c["n"], c["k"], c["g"]))
    return list(seen.items())


def compile_jobs(cases) -> list[tuple]:
    """bench_kernels' compile jobs (public entry) for every case x variant."""
    import bench_kernels as bk
    from moegemm.kernels import triton_kernel as tk

    jobs = set()
    for c in cases:
        m, n, k, g = c["m"], c["n"], c["k"], c["g"]
        cfg = tk.default_config(m, n, k, g)
        for _, preload, stages in VARIANTS:
            varied = variant_config(cfg, preload, stages, n, g)
            if varied is not None:
                jobs.add((varied, bk._stand_in_rows(m), n, k, g, False))
    # One job per compiled kernel, as bench_kernels.compile_jobs keys them.
    by_class = {}
    for job in sorted(jobs, key=repr):
        cfg, m, n, k, g, _ = job
        ints = (m, n, k, g, n * k, k // 128, (k // 128) * (n // 128), n // 128)
        key = (cfg, max(16, 1 << (g - 1).bit_length()), min(k // 128, cfg.split_k),
               tuple((v == 1, v % 16 == 0) for v in ints))
        by_class.setdefault(key, job)
    return list(by_class.values())


def run_case(case, problem, rounds: int) -> dict:
    import bench_kernels as bk
    from moegemm.kernels import triton_kernel as tk

    m, n, k, g, sizes = case["m"], case["n"], case["k"], case["g"], case["sizes"]
    shipped = tk.default_config(m, n, k, g)
    row = {"name": case["name"], "m": m, "n": n, "k": k, "g": g, "floor_us": bk.floor_us(m, n, k, sizes),
           "config": shipped.key(), "variants": {}}
    want = None
    timed = []
    for name, preload, stages in VARIANTS:
        cfg = variant_config(shipped, preload, stages, n, g)
        if cfg is None:
            continue
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=bk.DEV)
        entry = {"config": cfg.key()}
        row["variants"][name] = entry
        try:
            tk.launch(*problem, out, config=cfg)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001  (e.g. more shared memory than an SM has)
            entry["error"] = repr(exc)[:200]
            continue
        if want is None:
            want = out.clone()
        entry["same_bits"] = bool(torch.equal(out.view(torch.int16), want.view(torch.int16)))
        graph, calls, _ = bk.graph_of(lambda cfg=cfg, out=out: tk.launch(*problem, out, config=cfg))
        # out stays referenced beside its graph: freed, its memory would go to the next
        # variant's buffers while this graph's replays still wrote it.
        timed.append((name, graph, calls, [], out))
    # Interleaved: every round replays each variant's graph a few times, in turn.
    for r in range(rounds):
        order = timed if r % 2 == 0 else timed[::-1]
        for name, graph, calls, samples, _ in order:
            samples += [1e3 * t / calls for t in bk._event_ms(graph.replay, 3)]
    for name, graph, calls, samples, _ in timed:
        us = sorted(samples)[len(samples) // 2]
        row["variants"][name].update(us=round(us, 2), floor_over=round(row["floor_us"] / us, 4))
    return row


def geomean(vals):
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def summarize(rows) -> dict:
    names = [v[0] for v in VARIANTS]
    full = [r for r in rows if all("us" in r["variants"].get(n, {}) for n in names)]
    out = {"cases_all_variants": len(full),
           "all_bits_equal": all(v.get("same_bits", True) for r in rows for v in r["variants"].values())}
    for n in names:
        out[f"geomean_{n}"] = geomean([r["variants"][n]["floor_over"] for r in full])
    best = []
    for r in rows:
        got = [v["floor_over"] for v in r["variants"].values() if "floor_over" in v]
        if got:
            best.append(max(got))
    out["geomean_best_per_case"] = geomean(best)
    # Per table tile: the variant with the best geomean over its cases (what the table would take).
    per_tile = {}
    for r in full:
        per_tile.setdefault(r["config"], []).append(r)
    out["per_tile"] = {
        cfg: {n: round(geomean([r["variants"][n]["floor_over"] for r in rs]), 4) for n in names} | {"cases": len(rs)}
        for cfg, rs in per_tile.items()}
    return out


def weight_sets(cases) -> list[list[dict]]:
    """The cases grouped by weight set, the sets in the order their worst case comes."""
    sets = {}
    for c in cases:
        sets.setdefault(c["weights"] + (c["n"], c["k"], c["g"]), []).append(c)
    return list(sets.values())


def run_sets(sets, first: int, rounds: int, lines: Path, deadline: float) -> None:
    """The child: sets ``first...`` in turn, a JSON line per case (``{"set": i}`` before each
    set, so the parent knows where a death happened); stops at ``deadline`` (epoch s)."""
    import bench_kernels as bk

    gen = torch.Generator(device=bk.DEV)
    gen.manual_seed(int(time.time()))
    with lines.open("a") as log:
        for i in range(first, len(sets)):
            if time.time() > deadline:
                return
            log.write(json.dumps({"set": i}) + "\n")
            log.flush()
            c0 = sets[i][0]
            weights = bk.random_weights(c0["g"], c0["n"], c0["k"], gen)
            for case in sets[i]:
                _, xq, x_scale = bk.random_activations(case["m"], case["k"], gen)
                problem = (xq, *weights[:1], x_scale, *weights[1:], case["sizes"].to(bk.DEV))
                row = run_case(case, problem, rounds)
                log.write(json.dumps({"row": row}) + "\n")
                log.flush()
                cells = " ".join(f"{n}={v.get('us', '-')}us/{v.get('floor_over', '-')}"
                                 f"{'' if v.get('same_bits', True) else ' BITS-DIFFER'}"
                                 for n, v in row["variants"].items())
                print(f"{row['name']:<46} floor {row['floor_us']:7.1f} {row['config']}: {cells}", flush=True)
            del weights
            torch.cuda.empty_cache()


def main() -> None:
    import subprocess

    import bench_kernels as bk

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--budget-s", type=float, default=230.0, help="start no case after this many seconds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--match", default="", help="only cases whose name contains one of these")
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--list", action="store_true", help="print the sets and cases in run order and stop")
    parser.add_argument("--child", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--lines", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    started = time.monotonic()
    cases = [c for c in decode_cases() if any(p in c["name"] for p in args.match.split(","))]
    sets = weight_sets(cases)
    if args.child >= 0:
        run_sets(sets, args.child, args.rounds, args.lines, args.deadline)
        return
    if args.list:
        from moegemm.kernels import triton_kernel as tk

        for i, same in enumerate(sets):
            for c in same:
                cfg = tk.default_config(c["m"], c["n"], c["k"], c["g"])
                print(f"set {i:2d} {c['name']:<46} m{c['m']} n{c['n']} k{c['k']} g{c['g']} {cfg.key()}")
        return
    jobs = compile_jobs(cases)
    failed = bk.compile_ahead(jobs, args.workers)
    print(f"{len(cases)} cases in {len(sets)} weight sets; {len(jobs)} compile jobs in "
          f"{time.monotonic() - started:.0f} s; failures: {failed}", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "compile_failures": failed, "variants": VARIANTS,
            "child_deaths": []}
    lines = (args.out or Path("decode_sweep.json")).with_suffix(".lines")
    lines.write_text("")
    deadline = time.time() + args.budget_s - (time.monotonic() - started)
    rows, first = [], 0
    while first < len(sets) and time.time() < deadline:
        child = subprocess.run([sys.executable, "-P", __file__, "--child", str(first), "--lines", str(lines),
                                "--deadline", str(deadline), "--rounds", str(args.rounds), "--match", args.match],
                               stderr=subprocess.PIPE, text=True, check=False)
        records = [json.loads(x) for x in lines.read_text().splitlines() if x.strip()]
        rows = [r["row"] for r in records if "row" in r]
        started_sets = [r["set"] for r in records if "set" in r]
        if child.returncode == 0:
            break
        if not started_sets or max(started_sets) < first:  # died before any set: it would again
            meta["child_deaths"].append({"set": None, "rc": child.returncode, "stderr_tail": child.stderr[-1500:]})
            print(f"child died before a set, rc {child.returncode}:\n{child.stderr[-1500:]}", flush=True)
            break
        last_set = max(started_sets)
        # The child died on set last_set: record it (its name and the child's last words) and go on.
        meta["child_deaths"].append({"set": last_set, "first_case": sets[last_set][0]["name"],
                                     "rc": child.returncode, "stderr_tail": child.stderr[-1500:]})
        print(f"child died on set {last_set} ({sets[last_set][0]['name']}), rc {child.returncode}:\n"
              f"{child.stderr[-1500:]}", flush=True)
        first = last_set + 1
    meta["cases_run"] = f"{len(rows)} of {len(cases)}"
    summary = dict(meta, **summarize(rows), wall_s=round(time.monotonic() - started, 1))
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
