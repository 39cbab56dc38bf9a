"""Kernel benchmark: what a service call costs, against the peers and the floor, on one GPU.

    python bench/bench_kernels.py [--json OUT.json] [--only seed|real] [--match a,b] [--sweep]
                                  [--no-peers] [--budget-s S]

Ours is the server's captured graph for the call's bucket (``service_us``):
a ``GraphPool`` as the server builds it (triton backend, weights by address),
the call's rows in its buffers, the graph replayed as ``Executor`` replays it
(a lone call's: the GEMM checking the rows itself, or the check kernel before a
``persistent_ws`` GEMM; the output stored in the callers' order: everything the
graph does). Its output must equal the public ``grouped_gemm``'s bit for
bit (``public_us`` beside it: the public function alone, graph-captured).
Peers in the same run: MSLK's CUTLASS kernel (``mslk-cuda`` 1.1.0, when
importable), ``torch._scaled_grouped_mm`` (rowwise scales, a coarser recipe,
cost only) and a per-group loop of blockwise ``torch._scaled_mm``. The floor
is ``max(bytes / 4.27 TB/s, 2 M N K / 1290 TFLOP/s)`` with bytes = M K +
(groups with rows) N K + 2 M N (the ceilings of the seed table; the run's own
copy and FP8 rates are recorded beside). Every time is a median over CUDA
graph replays on fresh random data. ``--sweep`` also times other tiles of the
table's neighbourhood through the public entry, in alternated rounds with the table's own
tile (``sweep_table_us``). Never collected by pytest.

Speed (the whole seed + real sets with peers in one device call): every kernel
the run will launch is compiled first, in parallel worker processes
(``kernel.warmup`` into Triton's on-disk cache); the weights are made on the
device in a few large ops; each form of a case (public, service, each peer) is timed over
about 10 ms of replays in each of ``ROUNDS`` rounds, the order reversed every other round, and
its figure is the median of the rounds (``rounds_us`` keeps them all).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
SEED_SHAPES = [
    (32, 1280, 8192), (128, 1280, 8192), (1024, 2048, 7168), (16384, 2048, 7168),
    (1024, 7168, 2304), (16384, 7168, 2304), (32, 7168, 8192), (128, 7168, 8192),
    (1, 8192, 1024), (128, 8192, 1024), (32, 8192, 3584), (128, 8192, 3584),
    (32, 13312, 6656), (128, 13312, 6656), (32, 13312, 16384), (128, 13312, 16384),
    (32, 16384, 6656), (128, 16384, 6656),
]
# A copy beside this file (the device machine has no ../shared).
REAL_JSON = Path(__file__).resolve().parent / "real_models.json"
REAL_SEED = 0
FLOOR_CEILINGS = {"copy_TBps": 4.27, "fp8_TFLOPs": 1290.0}
ROUNDS = 4  # timings of each form per case (run_case)
FLOOR_DEVICE = "H200"  # the board those ceilings are: floor/time elsewhere is no issue-15 figure


# ---- the cases ------------------------------------------------------------------------------

def even_split(m: int, g: int) -> torch.Tensor:
    base, extra = divmod(m, g)
    return torch.tensor([base + (1 if i < extra else 0) for i in range(g)], dtype=torch.int64)


def real_routing(tokens: int, g: int, top_k: int, exponent: float, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert: each token to ``top_k`` distinct experts drawn by Zipf-like popularity
    (``1 / rank^exponent``, experts in random order)."""
    popularity = 1.0 / torch.arange(1, g + 1, dtype=torch.float64) ** exponent
    popularity = popularity[torch.randperm(g, generator=gen)]
    picks = torch.multinomial(popularity.expand(tokens, g), top_k, replacement=False, generator=gen)
    return torch.bincount(picks.flatten(), minlength=g).to(torch.int64)


def real_cases() -> list[dict]:
    """Every case of real_models.json; the routing exponent of each model drawn in [0.5, 1.2]
    with a fixed seed (the same routing in every run)."""
    spec = json.loads(REAL_JSON.read_text())
    gen = torch.Generator().manual_seed(REAL_SEED)
    cases = []
    for model in spec["models"]:
        exponent = 0.5 + 0.7 * float(torch.rand((), generator=gen, dtype=torch.float64))
        g, top_k = model["G"], model["top_k"]
        for matrix, n, k in (("w13", 2 * model["moe_intermediate"], model["hidden"]),
                             ("w2", model["hidden"], model["moe_intermediate"])):
            for phase in ("decode", "prefill"):
                for tokens in spec["tokens"][phase]:
                    sizes = real_routing(tokens, g, top_k, exponent, gen)
                    name = f"real {model['model'].split(' ')[0]} {matrix} {phase} t{tokens} g{g}"
                    cases.append({"name": name, "weights": (model["model"], matrix), "m": tokens * top_k,
                                  "n": n, "k": k, "g": g, "sizes": sizes})
    return cases


def seed_cases() -> list[dict]:
    return [{"name": f"seed m{m} n{n} k{k} g8", "weights": ("seed", m, n, k), "m": m, "n": n, "k": k,
             "g": 8, "sizes": even_split(m, 8)} for m, n, k in SEED_SHAPES]


def matching_cases(match: str) -> list[dict]:
    """The seed and real cases whose name, followed by a space, contains one of the comma-separated
    ``match`` patterns (a trailing space in a pattern ends it at a word: ``"seed m1 "``)."""
    wanted = [p for p in match.split(",") if p]
    return [c for c in seed_cases() + real_cases() if any(w in c["name"] + " " for w in wanted)]


def bucket_of(m: int) -> int:
    """The graph bucket the server at its defaults runs an ``m``-row call in (one launch)."""
    from moegemm.server.config import Settings

    bucket = 1 << max(0, (m - 1).bit_length())
    largest = Settings().max_bucket_m
    if bucket > largest:
        # The server would run it in chunks of its largest bucket: a graph it never builds
        # times nothing it serves (sessions up to 55 timed such graphs for 26 cases; the
        # default bucket was 8192 then).
        raise ValueError(f"{m} rows are past the server's largest bucket ({largest}): it runs them in chunks")
    return bucket


def floor_us(m, n, k, sizes, ceilings=FLOOR_CEILINGS) -> float:
    """max(bytes / copy bandwidth, flops / FP8 rate); bytes = M*K + active*N*K + 2*M*N."""
    active = int((sizes > 0).sum())
    bytes_moved = m * k + active * n * k + 2 * m * n
    return max(bytes_moved / ceilings["copy_TBps"] / 1e6, 2 * m * n * k / ceilings["fp8_TFLOPs"] / 1e6)


SWEEP_KEYS: list[str] = []  # --sweep-keys: only neighbours whose key contains one of these
SWEEP_VARY: dict[str, list] = {}  # --sweep-vary: the table's tile with these fields changed instead


def parse_vary(text: str) -> dict[str, list]:
    """``"group_tiles_m=4,16;evict_w=,evict_first"`` -> ``{"group_tiles_m": [4, 16], "evict_w": ["", "evict_first"]}``."""
    def value(v: str):
        return int(v) if v.lstrip("-").isdigit() else {"true": True, "false": False}.get(v.lower(), v)

    found = {}
    for part in filter(None, text.split(";")):
        field, _, values = part.partition("=")
        found[field.strip()] = [value(v.strip()) for v in values.split(",")]
    return found


def varied_configs(config, vary: dict[str, list], n: int, g: int) -> list:
    """``config`` with each combination of ``vary``'s fields changed (:func:`parse_vary`), those
    that fit, once each."""
    import dataclasses
    import itertools

    fields = list(vary)
    found = [dataclasses.replace(config, **dict(zip(fields, combo)))
             for combo in itertools.product(*(vary[f] for f in fields))]
    return [c for c in dict.fromkeys(found) if c.fits(n, g)]


def sweep_configs(m, n, k, g):
    """The table's neighbours for ``--sweep`` (public entry): ``candidate_configs`` but the
    table's own choice (and, with ``--sweep-keys``, only those whose key matches). With
    ``--sweep-vary``, the table's tile with each combination of the given fields changed
    (those that fit), instead of ``candidate_configs``."""
    from moegemm.kernels import triton_kernel as tk

    default = tk.default_config(m, n, k, g)
    if SWEEP_VARY:
        found = varied_configs(default, SWEEP_VARY, n, g)
    else:
        found = tk.candidate_configs(m, n, k, g)
    return [c for c in found
            if c != default and (not SWEEP_KEYS or any(part in c.key() for part in SWEEP_KEYS))]


# ---- compiling ahead --------------------------------------------------------------------------

def _stand_in_rows(m: int) -> int:
    """Rows with the same Triton specialisation as ``m`` (== 1, % 16 == 0, else)."""
    return m if m < 16 else (16 if m % 16 == 0 else 17)


def compile_jobs(cases, sweep: bool) -> list[tuple]:
    """(config, m, n, k, g, service) for every launch the run makes: the public entry over M
    rows, the service launch over the bucket, the pool's 64-row self-check, the sweep."""
    from moegemm.kernels import triton_kernel as tk

    jobs = set()
    for c in cases:
        m, n, k, g = c["m"], c["n"], c["k"], c["g"]
        bucket = bucket_of(m)
        jobs.add((tk.default_config(m, n, k, g), _stand_in_rows(m), n, k, g, False))
        jobs.add((tk.default_config(bucket, n, k, g), _stand_in_rows(bucket), n, k, g, True))
        jobs.add((tk.default_config(64, n, k, g), 16, n, k, g, False))
        jobs.add((tk.default_config(64, n, k, g), 16, n, k, g, True))
        if sweep:
            jobs.update((cfg, _stand_in_rows(m), n, k, g, False) for cfg in sweep_configs(m, n, k, g))
    # One job per compiled kernel: Triton specialises an int argument on == 1 and % 16 == 0.
    by_class = {}
    for job in sorted(jobs, key=repr):
        cfg, m, n, k, g, service = job
        ints = (m, n, k, g, n * k, k // 128, (k // 128) * (n // 128), n // 128)
        key = (cfg, max(16, 1 << (g - 1).bit_length()), service, min(k // 128, cfg.split_k),
               tuple((v == 1, v % 16 == 0) for v in ints))
        by_class.setdefault(key, job)
    return list(by_class.values())


def _compile_one(job) -> str:
    """Compile one launch into Triton's cache (runs in a worker process: nothing launched)."""
    from moegemm.kernels import triton_kernel as tk

    cfg, m, n, k, g, service = job
    try:
        xq = torch.empty((m, k), dtype=FP8, device=DEV)
        xs = torch.empty((m, k // 128), dtype=torch.float32, device=DEV)
        out = torch.empty((m, n), dtype=torch.bfloat16, device=DEV)
        sizes = torch.zeros(g, dtype=torch.int64, device=DEV)
        words = torch.zeros(4, dtype=torch.int64, device=DEV)
        if service:
            rows = torch.zeros((m, 2), dtype=torch.int64, device=DEV)[:, 1]
            plans = [tk.launch_plan(xq, words[:2], xs, words[:2], sizes, out, n, g, cfg, True, words[2:], rows)]
            if cfg.checks_rows:  # a lone call's graph: the rows' check inside the kernel (a decode
                # tile keeps the row map, a persistent one stores in place)
                flags = torch.empty(m, dtype=torch.int8, device=DEV)
                plans.append(tk.launch_plan(xq, words[:2], xs, words[:2], sizes, out, n, g, cfg, True, words[2:],
                                            rows if cfg.swap_ab else None, flags))
        else:
            w = torch.empty(16, dtype=FP8, device=DEV)
            ws = torch.empty(16, dtype=torch.float32, device=DEV)
            plans = [tk.launch_plan(xq, w, xs, ws, sizes, out, n, g, cfg, False)]
        for kernel, grid, args, consts in plans:
            kernel.warmup(*args, grid=grid, **consts)
        return ""
    except Exception as exc:  # noqa: BLE001  reported; the run compiles it again (and fails there)
        return f"{cfg.key()} m{m} n{n} k{k} g{g}: {exc!r}"[:300]


def compile_ahead(jobs, workers: int) -> list[str]:
    """Compile ``jobs`` in ``workers`` spawned processes; the failures."""
    import multiprocessing

    if not jobs:
        return []
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [e for e in pool.map(_compile_one, jobs, chunksize=1) if e]


# ---- timing ---------------------------------------------------------------------------------

def _event_ms(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def graph_of(fn) -> tuple[torch.cuda.CUDAGraph, int, float]:
    """``(graph, calls, ms)``: a CUDA graph of about 1 ms of back-to-back calls of ``fn`` and the
    milliseconds of one eager call, captured on a side stream that first waits for the current
    one (where the inputs are still being written)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        est = min(_event_ms(fn, 2))
        calls = max(1, min(200, int(1.0 / max(est, 1e-3))))  # about 1 ms per replay
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    return graph, calls, est


def graph_us(graph: torch.cuda.CUDAGraph, calls: int, est: float, budget_ms: float = 10.0) -> float:
    """Microseconds per call of a :func:`graph_of` graph: the median over its replays."""
    reps = max(3, min(30, int(budget_ms / max(est * calls, 1e-3))))
    times = _event_ms(graph.replay, reps)
    return 1e3 * sorted(times)[len(times) // 2] / calls


def time_us(fn, budget_ms: float = 10.0) -> float:
    """Microseconds per call of ``fn``: median over replays of a CUDA graph of several calls."""
    return graph_us(*graph_of(fn), budget_ms=budget_ms)


def alternating_runs(fns: dict, rounds: int = 2) -> dict[str, list[float]]:
    """``time_us`` of each of ``fns`` in turn, ``rounds`` times, the order reversed every other
    round: ``{name: [us of each round]}`` (:func:`alternating_timers`)."""
    return alternating_timers({name: (lambda fn=fn: time_us(fn)) for name, fn in fns.items()}, rounds)


def alternating_timers(timers: dict, rounds: int) -> dict[str, list[float]]:
    """Each of ``timers`` (calls of no arguments returning microseconds) in turn, ``rounds``
    times, the order reversed every other round: ``{name: [us of each round]}``. The clock
    drifts down as the board heats over back-to-back runs (seed m16384 n2048: 399 -> 449 us over
    five rounds, session 25), so a fixed order charges the drift to whatever runs last in every
    round; reversed, each position is first as often as last (use an even number of rounds)."""
    runs = {name: [] for name in timers}
    order = list(timers)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            runs[name].append(timers[name]())
    return runs


def ratio_summary(ratios: list[float]) -> str:
    """``"<geomean> over <count> (min <a>, max <b>)"`` of an A/B's per-case ratios."""
    mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return f"{mean:.4f} over {len(ratios)} (min {min(ratios):.3f}, max {max(ratios):.3f})"


def bound_launch(plan, kernel=None, **consts):
    """A ``triton_kernel.launch_plan`` plan as a call of no arguments (``kernel``: another build
    of the same kernel, given only the constexprs it takes; ``consts``: more constexprs),
    launched once under a device sync, so a fault names its launch."""
    planned, grid, args, plan_consts = plan
    kernel = planned if kernel is None else kernel
    # Another build (an older copy of the module) may not take an argument or a constexpr the plan
    # names (a pointer a later kernel added, e.g. ``flags_ptr``): bound by name, those are left
    # out and it runs its own code for them. Launch options (num_warps, maxnreg) are no argument
    # of either.
    named = dict(zip(planned.arg_names, args))
    given = {param.name for param in kernel.params if param.default is not inspect.Parameter.empty}
    missing = [name for name in kernel.arg_names
               if name not in named and name not in plan_consts and name not in consts and name not in given]
    if missing:
        raise ValueError(f"{kernel.fn.__name__} takes {missing}, which the plan does not give")
    args = [named[name] for name in kernel.arg_names if name in named]
    plan_consts = {name: value for name, value in dict(plan_consts, **consts).items()
                   if name in kernel.arg_names or name not in planned.arg_names}

    def launch():
        kernel[grid](*args, **plan_consts)

    launch()
    torch.cuda.synchronize()
    return launch


def case_operands(case: dict, gen: torch.Generator) -> dict:
    """A case's fresh random operands on the device: ``wq``, ``w_scale``, ``xq``, ``x_scale``, ``sizes``."""
    wq, w_scale = random_weights(case["g"], case["n"], case["k"], gen)
    _, xq, x_scale = random_activations(case["m"], case["k"], gen)
    return {"wq": wq, "w_scale": w_scale, "xq": xq, "x_scale": x_scale, "sizes": case["sizes"].to(DEV)}


def form_plan(form: str, ops: dict, out: torch.Tensor, config):
    """The launch plan of ``config`` on ``ops`` (:func:`case_operands`) into ``out`` in one of the
    forms a launch takes: ``public`` (plain pointers), ``svc`` (activations and weights by address,
    stored in place: a lone prefill call's graph in the server), ``map`` (the same through an
    identity row map: the server's merged calls) or ``lone`` (a lone call's graph: the rows'
    check inside, with the row map on a decode tile, stored in place on a persistent one)."""
    from moegemm.kernels import triton_kernel as tk
    from moegemm.kernels._backend import weight_addresses

    xq, wq, x_scale, w_scale, sizes = ops["xq"], ops["wq"], ops["x_scale"], ops["w_scale"], ops["sizes"]
    g, n, _ = wq.shape
    if form == "public":
        return tk.launch_plan(xq, wq, x_scale, w_scale, sizes, out, n, g, config, addrs=False)
    words = torch.tensor([xq.data_ptr(), x_scale.data_ptr()], dtype=torch.int64, device=DEV)
    mapped = form == "map" or (form == "lone" and config.swap_ab)
    rows = torch.arange(xq.shape[0], dtype=torch.int64, device=DEV) if mapped else None
    flags = torch.zeros(xq.shape[0], dtype=torch.int8, device=DEV) if form == "lone" else None
    table = torch.tensor(weight_addresses(wq, w_scale), device=DEV)
    return tk.launch_plan(xq, table, x_scale, w_scale, sizes, out, n, g, config,
                          addrs=True, x_words=words, out_rows=rows, flags=flags)


def time_replays_us(graph, budget_ms: float = 10.0) -> float:
    """Microseconds per replay of a captured graph (the service call), timed as the peers are:
    back-to-back replays of about 1 ms between two events, median over such runs. One replay
    timed alone would add the host's graph launch (~5-10 us) that the peers' graphs of many
    calls hide; the service's own overhead is bench_service.py's to measure."""
    graph.replay()
    est = min(_event_ms(graph.replay, 2))
    calls = max(1, min(200, int(1.0 / max(est, 1e-3))))

    def run():
        for _ in range(calls):
            graph.replay()

    reps = max(3, min(30, int(budget_ms / max(est * calls, 1e-3))))
    times = _event_ms(run, reps)
    return 1e3 * sorted(times)[len(times) // 2] / calls


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written) and dense FP8 tensorwise-scaled matmul rate."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    copy_us = time_us(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device=DEV).to(FP8)
    b = torch.randn(8192, 8192, device=DEV).to(FP8).t()
    one = torch.ones((), device=DEV)
    mm_us = time_us(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return {"copy_TBps": 2 * (1 << 30) / copy_us / 1e6, "fp8_TFLOPs": 2 * 8192**3 / mm_us / 1e6}


# ---- inputs -----------------------------------------------------------------------------------

def random_weights(g: int, n: int, k: int, gen: torch.Generator):
    """Random fp8 weights with log-normal block scales, made on the device in chunks of ~1 GB."""
    wq = torch.empty((g, n, k), dtype=FP8, device=DEV)
    step = max(1, (1 << 28) // (n * k))
    for lo in range(0, g, step):
        hi = min(g, lo + step)
        wq[lo:hi] = (torch.randn((hi - lo, n, k), generator=gen, device=DEV, dtype=torch.float16) * 64).to(FP8)
    w_scale = torch.exp(torch.randn((g, k // 128, n // 128), generator=gen, device=DEV)) / 256
    return wq, w_scale


def random_activations(m: int, k: int, gen: torch.Generator):
    """Fresh bf16 activations and their SPEC 1.1 quantization."""
    from moegemm.kernels.quant import quantize_activations

    x = torch.randn((m, k), generator=gen, device=DEV).to(torch.bfloat16)
    xq, x_scale = quantize_activations(x, FP8)
    return x, xq, x_scale


def spot_error(problem, out) -> float:
    """The worst relative error against the float64 oracle over (up to) three groups with rows:
    the first, the largest and the last (the whole oracle is too slow for 384 big groups)."""
    from moegemm.kernels import reference_float64
    from moegemm.kernels.testing import rel_error

    xq, wq, xs, ws, sizes = problem
    host = sizes.cpu().tolist()
    starts = [0]
    for s in host:
        starts.append(starts[-1] + s)
    live = [i for i, s in enumerate(host) if s]
    worst = 0.0
    for i in sorted({live[0], max(live, key=lambda j: host[j]), live[-1]}):
        a, b = starts[i], starts[i + 1]
        part = (xq[a:b], wq[i:i + 1], xs[a:b], ws[i:i + 1], torch.tensor([b - a], device=DEV))
        worst = max(worst, rel_error(out[a:b], reference_float64(*part)))
    return worst


# ---- peers ------------------------------------------------------------------------------------

def peer_rowwise_grouped(x, problem):
    xq, wq, _, _, sizes = problem
    g, n, _ = wq.shape
    scale_a = torch.rand(xq.shape[0], device=DEV) + 0.5
    scale_b = torch.rand(g, n, device=DEV) + 0.5
    offs = torch.cumsum(sizes, 0).to(torch.int32)
    return lambda: torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), scale_a, scale_b, offs=offs,
                                            out_dtype=torch.bfloat16)


def peer_blockwise_loop(x, problem):
    """One blockwise-scaled cuBLAS GEMM per group with rows (tried on the first group first:
    cuBLAS refuses some shapes, and then the peer is reported as failed at once)."""
    xq, wq, x_scale, w_scale, sizes = problem
    host = sizes.cpu().tolist()
    out = torch.empty((xq.shape[0], wq.shape[1]), dtype=torch.bfloat16, device=DEV)
    xs_cols = x_scale.t().contiguous().t()  # M-major activation scales, once for all groups
    calls, start = [], 0
    for i, rows in enumerate(host):
        if rows:
            calls.append((xq[start:start + rows], wq[i].t(), xs_cols[start:start + rows], w_scale[i],
                          out[start:start + rows]))
        start += rows
    layouts = (lambda s: s, lambda s: s.t().contiguous().t())
    for fix in layouts:
        try:
            a, b, sa, sb, o = calls[0]
            o.copy_(torch._scaled_mm(a, b, sa, fix(sb), out_dtype=torch.bfloat16))
            break
        except RuntimeError as exc:
            err = exc
    else:
        raise err
    calls = [(a, b, sa, fix(sb), o) for a, b, sa, sb, o in calls]

    def fn():
        for a, b, sa, sb, o in calls:
            o.copy_(torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16))
        return out
    return fn


def peer_mslk_cutlass(x, problem):
    import mslk  # noqa: F401  (loads the op library)
    from mslk.quantize.triton.fp8_quantize import quantize_fp8_group

    _, wq, _, w_scale, sizes = problem
    xq_m, xs_m = quantize_fp8_group(x, m_sizes=sizes)
    return lambda: torch.ops.mslk.f8f8bf16_groupwise_grouped(xq_m, wq, xs_m, w_scale, sizes)


PEERS = {
    "mslk_cutlass_f8f8bf16_groupwise_grouped": peer_mslk_cutlass,
    "torch_scaled_grouped_mm_rowwise": peer_rowwise_grouped,
    "torch_scaled_mm_blockwise_per_group_loop": peer_blockwise_loop,
}
SHORT = {"mslk_cutlass_f8f8bf16_groupwise_grouped": "mslk", "torch_scaled_grouped_mm_rowwise": "rowwise",
         "torch_scaled_mm_blockwise_per_group_loop": "blk_loop"}


# ---- one case -----------------------------------------------------------------------------------

def service_graph(problem, bucket):
    """A GraphPool as the server builds it, the call's rows in its buffers and its words
    uploaded (``launch`` as the executor runs it), the bucket's graph captured: (pool, bufs, graph)."""
    from moegemm.kernels import get_backend
    from moegemm.server._graphs import Family, GraphPool

    xq, wq, x_scale, w_scale, sizes = problem
    g, n, k = wq.shape
    pool = GraphPool(get_backend(DEV, "triton"), bucket)
    family = Family(g, n, k, quantize=False)
    bufs = pool.buffers(family)
    m = xq.shape[0]
    pool.capture(family, wq, w_scale, only=[bucket])
    assert pool.run_table is not None, "the address launcher failed its self-check"
    bufs.result.fill_(0xFF)  # NaN-poisoned output
    bufs.x[:m].copy_(xq)
    bufs.x_scale[:m].copy_(x_scale)
    assert pool.launch(family, wq, w_scale, sizes.cpu().numpy()) == "graph"
    return pool, bufs, pool.graph(family, bucket, wq, w_scale)


def run_case(case, problem, x, sweep: bool, peers: bool) -> dict:
    from moegemm.kernels import triton_kernel as tk

    m, n, k, g, sizes = case["m"], case["n"], case["k"], case["g"], case["sizes"]
    bucket = bucket_of(m)
    row = {"name": case["name"], "m": m, "n": n, "k": k, "g": g, "bucket": bucket,
           "active_groups": int((sizes > 0).sum()), "floor_us": floor_us(m, n, k, sizes),
           "config": tk.default_config(bucket, n, k, g).key(), "peers_us": {}, "errors": {}}
    public = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    tk.run(*problem, public)
    pool, bufs, graph = service_graph(problem, bucket)
    torch.cuda.synchronize()
    got = bufs.out(bucket)[:m]
    row["service_same_bits_as_public"] = bool(torch.equal(got, public))
    row["finite"] = bool(torch.isfinite(got).all())
    row["rel_err"] = spot_error(problem, got)
    timers = {"public": lambda: time_us(lambda: tk.run(*problem, public)),
              "service": lambda graph=graph: time_replays_us(graph)}
    for peer, build in PEERS.items() if peers else ():
        try:
            fn = build(x, problem)
            fn()
            timers[peer] = lambda fn=fn: time_us(fn)
        except Exception as exc:  # noqa: BLE001  a peer that cannot run this shape is reported
            row["peers_us"][peer] = None
            row["errors"][peer] = repr(exc)[:300]
    # Every form in each round, the order reversed every other round, the median of the rounds:
    # the first timing after a case's weights are made can read 15-20 % slow (t1 rows on the
    # H100, session 36 call 4), which a single timing charged to whichever form came first.
    rounds = alternating_timers(timers, ROUNDS)
    row["rounds_us"] = {name: [round(t, 2) for t in times] for name, times in rounds.items()}
    us = {name: statistics.median(times) for name, times in rounds.items()}
    row["public_us"], row["service_us"] = us.pop("public"), us.pop("service")
    row["peers_us"].update(us)
    row["floor_over_service"] = row["floor_us"] / row["service_us"]
    del pool, bufs, graph, got, timers  # the timers hold the graph
    if sweep:
        # The table's tile and each neighbour that runs, timed in the same alternated rounds
        # (``sweep_table_us``: the table's tile there): single timings of ms-long prefill cases
        # drift by 10 % within a run (Kimi-K2 w13 t8192, session 42), more than tiles differ by.
        table = tk.default_config(m, n, k, g)
        row["sweep_us"], ok = {}, {}
        graphs = {"table": graph_of(lambda: tk.launch(*problem, public, config=table))}
        for cfg in sweep_configs(m, n, k, g):
            try:
                public.fill_(float("nan"))
                tk.launch(*problem, public, config=cfg)
                torch.cuda.synchronize()
                err = spot_error(problem, public)
                ok[cfg.key()] = bool(torch.isfinite(public).all()) and err <= 5e-3
                graphs[cfg.key()] = graph_of(lambda cfg=cfg: tk.launch(*problem, public, config=cfg))
            except Exception as exc:  # noqa: BLE001  keep sweeping past one bad candidate
                row["sweep_us"][cfg.key()] = repr(exc)[:200]
        runs = alternating_timers({key: (lambda g=g: graph_us(*g, budget_ms=5.0)) for key, g in graphs.items()},
                                  ROUNDS)
        del graphs
        row["sweep_table_us"] = round(statistics.median(runs.pop("table")), 2)
        row["sweep_us"].update({key: (round(statistics.median(times), 2), ok[key]) for key, times in runs.items()})
    measured = [v for v in row["peers_us"].values() if v]
    row["best_peer_us"] = min(measured) if measured else None
    return row


# ---- the report -------------------------------------------------------------------------------

def print_table(rows, file=sys.stdout):
    head = (f"{'case':<44}{'floor':>8}{'service':>9}{'fl/svc':>7}{'public':>8}"
            + "".join(f"{SHORT[p]:>10}" for p in PEERS) + "  bits  config")
    print(head, file=file)
    for r in rows:
        cells = "".join(f"{r['peers_us'][p]:>10.1f}" if r["peers_us"].get(p) else f"{'-':>10}" for p in PEERS)
        print(f"{r['name']:<44}{r['floor_us']:>8.1f}{r['service_us']:>9.1f}{r['floor_over_service']:>7.2f}"
              f"{r['public_us']:>8.1f}{cells}  {str(r['service_same_bits_as_public'])[0]}     {r['config']}",
              file=file)
        if "sweep_table_us" in r:  # --sweep: the fastest neighbours that answer correctly
            timed = sorted((v[0], key) for key, v in r["sweep_us"].items() if isinstance(v, tuple) and v[1])
            best = ", ".join(f"{key} {us:.1f} ({r['sweep_table_us'] / us:.3f}x)" for us, key in timed[:4])
            print(f"    sweep: table {r['sweep_table_us']:.1f} us; {best or 'no neighbour ran'}", file=file)


def summarize(rows, prefix) -> dict:
    """Geomean floor/service, the worst prefill case and the cases not faster than a peer."""
    got = [r for r in rows if r["name"].startswith(prefix)]
    if not got:
        return {}

    def geo(vals):
        return math.exp(sum(math.log(v) for v in vals) / len(vals))

    prefill = [r for r in got if "prefill" in r["name"] or r["m"] >= 16384]
    decode = [r for r in got if r not in prefill]
    return {"cases": len(got),
            "geomean_floor_over_service": geo([r["floor_over_service"] for r in got]),
            "geomean_floor_over_public": geo([r["floor_us"] / r["public_us"] for r in got]),
            "geomean_prefill": geo([r["floor_over_service"] for r in prefill]) if prefill else None,
            "geomean_decode": geo([r["floor_over_service"] for r in decode]) if decode else None,
            "worst_prefill": min(((round(r["floor_over_service"], 3), r["name"]) for r in prefill), default=None),
            "prefill_below_0_75": [r["name"] for r in prefill if r["floor_over_service"] < 0.75],
            "not_faster_than_a_peer": [r["name"] for r in got
                                       if r["best_peer_us"] and r["service_us"] >= r["best_peer_us"]],
            "all_bits_equal_public": all(r["service_same_bits_as_public"] for r in got),
            "worst_rel_err": max(r["rel_err"] for r in got)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every figure here (after every case)")
    parser.add_argument("--only", choices=("seed", "real"))
    parser.add_argument("--match", default="", help="only cases whose name contains one of these (comma-separated)")
    parser.add_argument("--sweep", action="store_true", help="also time the table's neighbours (public entry)")
    parser.add_argument("--sweep-keys", default="", help="with --sweep: only the neighbours whose tile key contains "
                        "one of these (comma-separated)")
    parser.add_argument("--sweep-vary", default="", help="with --sweep: the table's tile with fields changed, e.g. "
                        "'group_tiles_m=4,16;evict_w=,evict_first' (every combination that fits)")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop starting cases after this many seconds")
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    args = parser.parse_args()
    SWEEP_KEYS[:] = [part for part in args.sweep_keys.split(",") if part]
    SWEEP_VARY.update(parse_vary(args.sweep_vary))
    import triton

    started = time.monotonic()
    cases = []
    if args.only in (None, "seed"):
        cases += seed_cases()
    if args.only in (None, "real"):
        cases += real_cases()
    patterns = args.match.split(",")
    cases = [c for c in cases if any(p in c["name"] for p in patterns)]
    failed = compile_ahead(compile_jobs(cases, args.sweep), args.workers)
    print(f"compiled ahead in {time.monotonic() - started:.0f} s; failures: {failed}", flush=True)
    gen = torch.Generator(device=DEV)
    gen.manual_seed(int(time.time()))
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings['copy_TBps']:.2f} TB/s, fp8 {ceilings['fp8_TFLOPs']:.0f} TFLOP/s", flush=True)
    rows, weights = [], {}
    device = torch.cuda.get_device_name()
    meta = {"measured_ceilings": ceilings, "floor_ceilings": FLOOR_CEILINGS, "compile_failures": failed,
            "device": device, "torch": torch.__version__, "triton": triton.__version__}
    if FLOOR_DEVICE not in device:
        meta["floors_not_this_device"] = (f"the floors are the {FLOOR_DEVICE}'s; on {device} only ratios "
                                          "within this run (service/public, against the peers) compare")
        print(f"NOTE: {meta['floors_not_this_device']}", flush=True)
    for case in cases:
        if time.monotonic() - started > args.budget_s:
            meta["stopped_early"] = f"budget reached before {case['name']}"
            break
        key = case["weights"] + (case["n"], case["k"], case["g"])
        if key not in weights:
            weights.clear()
            weights[key] = random_weights(case["g"], case["n"], case["k"], gen)
        wq, w_scale = weights[key]
        x, xq, x_scale = random_activations(case["m"], case["k"], gen)
        problem = (xq, wq, x_scale, w_scale, case["sizes"].to(DEV))
        row = run_case(case, problem, x, args.sweep, not args.no_peers)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"summary": dict(meta, partial=True), "rows": rows}, indent=1))
    summary = dict(meta, seed=summarize(rows, "seed"), real=summarize(rows, "real"),
                   wall_s=time.monotonic() - started)
    print_table(rows)
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
