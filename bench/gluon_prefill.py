"""Device bench of the Gluon prefill kernel (``kernels/_gluon_gemm.py``, issue 15, exploratory).

    python bench/gluon_prefill.py --phase check --json OUT/check.json [--resume]
    python bench/gluon_prefill.py --phase time --check-json OUT/check.json --json OUT/time.json [--resume]

``check``: every variant of ``sm90_compile.GLUON_VARIANTS`` on ragged groups
with empty ones (G = 8, 128, 256; M up to 65536; an odd K-block count; a
float32 output), NaN-poisoned outputs, against the float64 oracle (whole, or
the first, largest and last groups where the oracle is slow) and against the
shipped ``grouped_gemm``'s output on every row; one problem also replayed from
a CUDA graph, which must equal eager bit for bit. The JSON is rewritten after
every variant, and a variant is marked ``started`` before it runs; a variant
that raises ends the process (a CUDA fault spoils the context). ``--resume``
keeps the finished variants of an earlier run, marks the one left ``started``
(it hung or crashed) failed, and checks the rest (``device_gluon.sh`` does).

``time``: the real prefill cases of ``real_models.json`` with G >= 128 (t2048,
t8192; routing as ``bench_kernels.real_cases``) plus seed m16384 n2048 k7168:
the shipped path (``moegemm.kernels.grouped_gemm`` at its default tile) and
every variant that passed ``check``, timed as ``bench_kernels.time_us`` times
the peers (medians of CUDA-graph replays of ~1 ms, fresh random data; every
case moves far more than the 50 MB L2), floor/time beside each, and each
variant's output against the shipped output on every row. Never collected by
pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402
from sm90_compile import GLUON_VARIANTS  # noqa: E402

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn


def _err(exc: BaseException, width: int = 300) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1][:width] if lines else ''}"


def _write(path: str, data) -> None:
    Path(path).write_text(json.dumps(data, indent=1))


def _shipped(problem, out):
    from moegemm.kernels import grouped_gemm

    return grouped_gemm(*problem, out=out)


def _gluon(problem, out, variant):
    from moegemm.kernels import _gluon_gemm as gg

    return gg.launch(*problem, out, **variant)


# ---- check ------------------------------------------------------------------------------------

def _watchdog(seconds: float, what: str) -> threading.Timer:
    """End the process if ``what`` runs past ``seconds`` (a kernel that never finishes blocks
    the synchronize forever); the JSON written so far stays."""
    def fire():
        print(f"watchdog: {what} ran past {seconds:.0f} s; ending the process", flush=True)
        os._exit(4)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


CHECKS = [  # (name, m, n, k, g, out dtype, whole oracle)
    ("g1 m128 n256 k128 (smallest)", 128, 256, 128, 1, torch.bfloat16, True),
    ("g8 m3000 n768 k1024", 3000, 768, 1024, 8, torch.bfloat16, True),
    ("g8 m1000 n256 k1152 (odd K blocks)", 1000, 256, 1152, 8, torch.bfloat16, True),
    ("g128 m16384 n512 k2048", 16384, 512, 2048, 128, torch.bfloat16, True),
    ("g256 m65536 n256 k7168", 65536, 256, 7168, 256, torch.bfloat16, False),
    ("g384 m8192 n512 k1536 f32 out", 8192, 512, 1536, 384, torch.float32, True),
]


def _check_problems():
    from moegemm.kernels import reference_float64
    from moegemm.kernels.testing import random_problem

    gen = torch.Generator(device=DEV).manual_seed(1234)
    torch.manual_seed(1234)
    found = []
    for name, m, n, k, g, dtype, whole in CHECKS:
        p = random_problem(m, n, k, g, device=DEV, generator=gen)
        problem = p.args()
        ref = reference_float64(*problem) if whole else None
        shipped = _shipped(problem, torch.full((m, n), float("nan"), dtype=dtype, device=DEV)).clone()
        found.append((name, problem, dtype, ref, shipped))
    torch.cuda.synchronize()
    return found


def check_variant(variant, problems) -> dict:
    from moegemm.kernels.testing import SPEC_TOLERANCE, rel_error

    rows = []
    ok = True
    for name, problem, dtype, ref, shipped in problems:
        print(f"  {name}", flush=True)  # the log names the problem a hang stopped at
        m, n = problem[0].shape[0], problem[1].shape[1]
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
        _gluon(problem, out, variant)
        torch.cuda.synchronize()
        nan_rows = int(out.isnan().any(dim=1).sum())
        err = rel_error(out, ref) if ref is not None else bk.spot_error(problem, out)
        vs_shipped = rel_error(out, shipped)
        good = nan_rows == 0 and err <= SPEC_TOLERANCE and vs_shipped <= 2e-3
        ok &= good
        rows.append({"problem": name, "nan_rows": nan_rows, "err_vs_f64": err, "err_vs_shipped": vs_shipped,
                     "identical_to_shipped": bool(torch.equal(out, shipped)), "ok": good})
    # Graph replay == eager, bit for bit (the g128 problem).
    name, problem, dtype, _, _ = next((p for p in problems if p[0].startswith("g128")), problems[-1])
    m, n = problem[0].shape[0], problem[1].shape[1]
    eager = _gluon(problem, torch.empty((m, n), dtype=dtype, device=DEV), variant).clone()
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _gluon(problem, out, variant)  # this stream's tile tables exist before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _gluon(problem, out, variant)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    same = bool(torch.equal(out.view(torch.int16), eager.view(torch.int16)))
    ok &= same
    return {"ok": ok, "graph_equals_eager": same, "problems": rows}


def phase_check(args) -> None:
    result = {"variants": {}}
    if args.resume and Path(args.json).exists():
        result = json.loads(Path(args.json).read_text())
        for found in result["variants"].values():
            if found.pop("started", False):
                found["error"] = "hung or crashed the process (a later run resumed past it)"
    todo = [name for name in GLUON_VARIANTS if name not in result["variants"]]
    if not todo:
        return
    t0 = time.time()
    problems = _check_problems()
    result["problems_s"] = round(time.time() - t0, 1)
    for name in todo:
        result["variants"][name] = {"ok": False, "started": True}
        _write(args.json, result)
        print(f"check {name} ...", flush=True)
        t1 = time.time()
        watchdog = _watchdog(args.variant_s, f"check {name}")
        try:
            found = check_variant(GLUON_VARIANTS[name], problems)
        except Exception as exc:  # noqa: BLE001  recorded; the process ends (the context may be spoilt)
            found = {"ok": False, "error": _err(exc)}
        watchdog.cancel()
        found["seconds"] = round(time.time() - t1, 1)
        result["variants"][name] = found
        _write(args.json, result)
        print(f"check {name}: {'ok' if found['ok'] else 'FAILED'} "
              f"{json.dumps(found.get('problems', found.get('error')))[:600]}", flush=True)
        if "error" in found:
            sys.exit(3)


# ---- time -------------------------------------------------------------------------------------

def timing_cases() -> list[dict]:
    """Real prefill at G >= 128, t8192 before t2048 of each weight set (the compute-bound case
    first, should the budget run out), then the seed case."""
    cases = [c for c in bk.real_cases() if " prefill " in c["name"] and c["g"] >= 128]
    cases.sort(key=lambda c: (c["weights"], -c["m"]))
    cases += [c for c in bk.seed_cases() if c["name"] == "seed m16384 n2048 k7168 g8"]
    return cases


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||_F / ||b||_F on the device (the outputs are too big to move to the host per case)."""
    a, b = a.float(), b.float()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def phase_time(args) -> None:
    checked = json.loads(Path(args.check_json).read_text())["variants"]
    variants = {name: v for name, v in GLUON_VARIANTS.items() if checked.get(name, {}).get("ok")}
    result = {"ceilings": bk.FLOOR_CEILINGS, "variants": {n: GLUON_VARIANTS[n] for n in variants},
              "left_out": sorted(set(GLUON_VARIANTS) - set(variants)), "rows": [], "hung": []}
    if args.resume and Path(args.json).exists():
        result = json.loads(Path(args.json).read_text())
        if result.pop("current", None):
            result["hung"].append(result.get("last_started"))
    done = {r["case"] for r in result["rows"]} | set(result["hung"])
    gen = torch.Generator(device=DEV).manual_seed(7)
    cases = [c for c in timing_cases() if c["name"] not in done]
    weights_for, weights = None, None
    deadline = time.time() + args.budget_s
    for case in cases:
        if time.time() > deadline:
            result["stopped"] = f"budget reached before {case['name']}"
            break
        result["current"] = result["last_started"] = case["name"]
        _write(args.json, result)
        m, n, k, g, sizes = case["m"], case["n"], case["k"], case["g"], case["sizes"]
        if weights_for != case["weights"]:
            weights = None
            torch.cuda.empty_cache()
            weights = bk.random_weights(g, n, k, gen)
            weights_for = case["weights"]
        _, xq, xs = bk.random_activations(m, k, gen)
        problem = (xq, weights[0], xs, weights[1], sizes.to(DEV))
        floor = bk.floor_us(m, n, k, sizes)
        row = {"case": case["name"], "m": m, "n": n, "k": k, "g": g, "floor_us": round(floor, 1)}
        shipped_out = torch.empty((m, n), dtype=torch.bfloat16, device=DEV)
        watchdog = _watchdog(args.case_s, case["name"])
        try:
            us = bk.time_us(lambda: _shipped(problem, shipped_out))
            row["shipped_us"] = round(us, 1)
            row["shipped_floor_ratio"] = round(floor / us, 3)
            row["shipped_tflops"] = round(2 * m * n * k / us / 1e6, 1)
            row["shipped_err_vs_f64"] = bk.spot_error(problem, shipped_out)
        except Exception as exc:  # noqa: BLE001
            row["shipped_error"] = _err(exc, 200)
        for name, variant in variants.items():
            out = torch.empty((m, n), dtype=torch.bfloat16, device=DEV)
            try:
                us = bk.time_us(lambda: _gluon(problem, out, variant))
                row[f"{name}_us"] = round(us, 1)
                row[f"{name}_floor_ratio"] = round(floor / us, 3)
                row[f"{name}_tflops"] = round(2 * m * n * k / us / 1e6, 1)
                if "shipped_us" in row:
                    row[f"{name}_vs_shipped"] = _rel_diff(out, shipped_out)
                    row[f"{name}_identical"] = bool(torch.equal(out, shipped_out))
            except Exception as exc:  # noqa: BLE001
                row[f"{name}_error"] = _err(exc, 200)
        watchdog.cancel()
        result["rows"].append(row)
        result.pop("current")
        _write(args.json, result)
        best = min(((row[f"{v}_us"], v) for v in variants if f"{v}_us" in row), default=(None, None))
        print(f"{case['name']:<44} floor {floor:8.1f} shipped {row.get('shipped_us', float('nan')):8.1f} "
              f"({row.get('shipped_floor_ratio', 0):.3f})  best gluon {best[1]} {best[0]} "
              f"({floor / best[0] if best[0] else 0:.3f})", flush=True)
    _summarize(result, variants)
    _write(args.json, result)


def _summarize(result, variants) -> None:
    import math

    rows = [r for r in result["rows"] if "shipped_us" in r]
    summary = {}
    for name in ["shipped", *variants]:
        ratios = [r[f"{name}_floor_ratio"] for r in rows if f"{name}_floor_ratio" in r]
        if ratios:
            summary[name] = {"cases": len(ratios),
                             "geomean_floor_ratio": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3),
                             "worst": min(ratios)}
    result["summary"] = summary
    print("\nvariant      cases  geomean floor/time  worst")
    for name, s in summary.items():
        print(f"{name:<12} {s['cases']:>5}  {s['geomean_floor_ratio']:>18.3f}  {s['worst']:.3f}")
    print("\ncase                                          floor_us  shipped  " + "  ".join(f"{v:>8}" for v in variants))
    for r in rows:
        cells = "  ".join(f"{r.get(f'{v}_us', float('nan')):8.1f}" for v in variants)
        print(f"{r['case']:<44} {r['floor_us']:9.1f} {r['shipped_us']:8.1f}  {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("check", "time"), required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--check-json", help="the check phase's JSON (time: only variants that passed)")
    parser.add_argument("--resume", action="store_true",
                        help="keep what --json holds (check: finished variants; time: timed cases), "
                             "and skip the variant or case left started (it hung or crashed)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="time: stop starting cases after this")
    parser.add_argument("--variant-s", type=float, default=45.0, help="check: the most one variant may take")
    parser.add_argument("--case-s", type=float, default=45.0, help="time: the most one case may take")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.phase == "check":
        phase_check(args)
    else:
        phase_time(args)


if __name__ == "__main__":
    main()
