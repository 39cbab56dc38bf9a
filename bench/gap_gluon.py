"""Issue 15: why the service graph is slower than the public entry on the Gluon cases, measured apart.

    python bench/gap_gluon.py --out gap.json [--budget-s 85] [--cases 6] [--list]

v16 (``results/kernels_v16_session8.json``, in ``results/archive_sessions_1-22.tar.xz``): on the ``gluon_ws`` cases (many-expert
prefill) the service graph took 2-23 % longer than the public ``grouped_gemm`` on the
same shape and data (Qwen3-30B w2 t8192: 340 vs 277 us), bit for bit the same output.
For the cases of that JSON with the largest service/public ratio (Qwen3-30B w2 t8192
and a w13 case always among them), each on the data ``bench_kernels.py`` builds (its
routing model, fresh random rows), this times:

- ``public``: ``grouped_gemm``'s kernel (``triton_kernel.run``), a graph of several
  calls (``bench_kernels.time_us``, as the bench times it); ``public_1``: a graph of one
  call replayed back to back (``time_replays_us``, as the bench times the service);
- ``service``: the server's graph for the bucket (``bench_kernels.service_graph``: the
  check kernel, then the GEMM by address, its store through the row map), as the bench
  times it; ``service_old_check``: the same graph with the check kernel of v16 (one
  program per row; a copy below); ``body_multi``: the graph's body, several calls in one
  graph (the replay method apart from what runs);
- ``addressed``: ``run_addressed`` alone (weights and activations by address, no row map);
  ``rowmap_identity`` / ``rowmap_perm``: with ``out_rows`` (the graph's identity map with
  its stride 2, and a permutation, as a merged call's);
- ``check`` / ``check_old``: the check kernel alone, regroup word 0 (a lone call) and
  1 (``*_copy``: a merged call's regroup);
- ``kernels``: the service graph's kernels and their device times (torch profiler, median
  of a few replays), so nothing else in the graph hides.

Every time is a median over CUDA-graph replays (no L2 flush between them: the bench's
policy). Bits: public == service == service_old_check == addressed == both row maps
(the permuted one put back in order). Prints one table; writes everything to --out.
Needs an NVIDIA GPU; ``--list`` (no GPU) prints the chosen cases and tiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
V16_JSON = HERE / "results" / "kernels_v16_session8.json"
V18_JSON = HERE / "results" / "kernels_v18_session11.json"  # --match picks from it
ALWAYS = ("real Qwen3-30B-A3B w2 prefill t8192 g128",)


# ---- the cases ------------------------------------------------------------------------------

def pick_cases(count: int, match: str = "") -> list[dict]:
    """The ``count`` gluon_ws cases of the v16 JSON with the largest service/public ratio,
    ALWAYS and at least one w13 case among them, as ``bench_kernels.real_cases`` builds them;
    ``match`` (comma-separated): the real cases whose name contains one of these instead, with
    their v18 figures (session 11: the store form's service graph 8-10 % slower than its public
    launch at K = 5120 only)."""
    import bench_kernels as bk

    if match:
        ref = {r["name"]: r for r in json.loads(V18_JSON.read_text())["rows"]}
        cases = [dict(c) for c in bk.real_cases() if any(p in c["name"] for p in match.split(","))]
        for case in cases:
            r = ref[case["name"]]
            case["v16"] = {"service_us": r["service_us"], "public_us": r["public_us"]}  # the reference run's
        return cases
    rows = [r for r in json.loads(V16_JSON.read_text())["rows"] if r["config"].startswith("gluon_ws")]
    rows.sort(key=lambda r: -r["service_us"] / r["public_us"])
    chosen = [r["name"] for r in rows if r["name"] in ALWAYS]
    for r in rows:
        if len(chosen) >= count - 1:
            break
        if r["name"] not in chosen:
            chosen.append(r["name"])
    w13 = next(r["name"] for r in rows if " w13 " in r["name"])
    extra = w13 if not any(" w13 " in n for n in chosen) else next(
        r["name"] for r in rows if r["name"] not in chosen)
    chosen.append(extra)
    v16 = {r["name"]: r for r in rows}
    by_name = {c["name"]: c for c in bk.real_cases()}
    cases = []
    for name in chosen:
        case = dict(by_name[name])
        case["v16"] = {"service_us": v16[name]["service_us"], "public_us": v16[name]["public_us"]}
        cases.append(case)
    return cases


# ---- the check kernel of v16 (one program per row), the A/B peer of the shipped one ----------

def old_check_and_gather():
    """v16's ``_triton_prologue.check_and_gather`` (one 4-warp program per row), for fp8 rows
    with scales; same arguments."""
    import triton
    import triton.language as tl

    @triton.jit
    def _old_check_gather(x_ptr, xs_ptr, gather_ptr, xg_ptr, xsg_ptr, flags_ptr, regroup_ptr, gather_stride,
                          K: tl.constexpr, KB: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        src = tl.load(gather_ptr + row * gather_stride).to(tl.int64)
        copy = tl.load(regroup_ptr) != 0
        if copy:
            for k0 in tl.static_range(0, K, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                inside = offs < K
                tl.store(xg_ptr + row * K + offs, tl.load(x_ptr + src * K + offs, mask=inside), mask=inside)
        offs = tl.arange(0, BLOCK_S)
        inside = offs < KB
        scale = tl.load(xs_ptr + src * KB + offs, mask=inside, other=1.0)
        tl.store(xsg_ptr + row * KB + offs, scale, mask=inside & copy)
        good = (scale > 0.0) & (scale <= 3.4028234663852886e38)
        tl.store(flags_ptr + src, (tl.max((~good).to(tl.int32), axis=0) << 1).to(tl.int8))

    def check(x, x_scale, gather, x_out, scale_out, flags, *, regroup=None):
        rows, K = x.shape
        assert x_scale is not None and regroup is not None and x.element_size() == 1
        KB = x_scale.shape[1]
        _old_check_gather[(rows,)](x.view(torch.uint8), x_scale, gather, x_out.view(torch.uint8), scale_out,
                                   flags, regroup, gather.stride(0), K=K, KB=KB,
                                   BLOCK_K=min(4096, triton.next_power_of_2(K)),
                                   BLOCK_S=triton.next_power_of_2(KB), num_warps=4)
    return check


# ---- compiling ahead --------------------------------------------------------------------------

def _compile_form(job) -> str:
    """Compile one GEMM launch form into Triton's cache (a worker process; nothing launched)."""
    from moegemm.kernels import triton_kernel as tk

    cfg, m, n, k, g, form = job
    dev = torch.device("cuda")
    try:
        xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
        xs = torch.empty((m, k // 128), dtype=torch.float32, device=dev)
        out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
        sizes = torch.zeros(g, dtype=torch.int64, device=dev)
        words = torch.zeros(4, dtype=torch.int64, device=dev)
        rows = torch.zeros((m, 2), dtype=torch.int64, device=dev)[:, 1]
        if form == "public":
            w = torch.empty(16, dtype=torch.float8_e4m3fn, device=dev)
            ws = torch.empty(16, dtype=torch.float32, device=dev)
            plan = tk.launch_plan(xq, w, xs, ws, sizes, out, n, g, cfg, False)
        else:
            plan = tk.launch_plan(xq, words[:2], xs, words[:2], sizes, out, n, g, cfg, True, words[2:],
                                  rows if form == "service" else None)
        kernel, grid, args, consts = plan
        kernel.warmup(*args, grid=grid, **consts)
        return ""
    except Exception as exc:  # noqa: BLE001  reported; the run compiles it again (and fails there)
        return f"{form} {cfg.key()} m{m} n{n} k{k} g{g}: {exc!r}"[:300]


def compile_ahead(cases, workers: int) -> list[str]:
    import multiprocessing

    import bench_kernels as bk
    from moegemm.kernels import triton_kernel as tk

    jobs = {(cfg, m, n, k, g, "service" if service else "public")
            for cfg, m, n, k, g, service in bk.compile_jobs(cases, False)}
    for c in cases:  # run_addressed without the row map (variant "addressed")
        bucket = bk.bucket_of(c["m"])
        jobs.add((tk.default_config(bucket, c["n"], c["k"], c["g"]), bk._stand_in_rows(bucket), c["n"], c["k"],
                  c["g"], "nomap"))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [e for e in pool.map(_compile_form, sorted(jobs, key=repr), chunksize=1) if e]


# ---- timing helpers ---------------------------------------------------------------------------

def graph_kernels(graph, reps: int = 5) -> dict:
    """Every device activity of one replay of ``graph`` (kernels, memsets, copies): name ->
    median device us over ``reps`` replays, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    named: dict[str, list[float]] = {}
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        for evt in prof.events():
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            t = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            named.setdefault(evt.name[:70], []).append(t)
    return {name: round(statistics.median(ts), 1) for name, ts in named.items()}


def service_graph(problem, bucket, check=None):
    """``bench_kernels.service_graph``, with ``check`` in place of the pool's check kernel
    when given: (pool, bufs, family, graph)."""
    import bench_kernels as bk
    from moegemm.kernels import get_backend
    from moegemm.server._graphs import Family, GraphPool

    xq, wq, x_scale, w_scale, sizes = problem
    g, n, k = wq.shape
    pool = GraphPool(get_backend(bk.DEV, "triton"), bucket)
    if check is not None:
        pool.check_and_gather = check
    family = Family(g, n, k, quantize=False)
    bufs = pool.buffers(family)
    m = xq.shape[0]
    pool.capture(family, wq, w_scale, only=[bucket])
    assert pool.run_table is not None, "the address launcher failed its self-check"
    bufs.result.fill_(0xFF)
    bufs.x[:m].copy_(xq)
    bufs.x_scale[:m].copy_(x_scale)
    assert pool.launch(family, wq, w_scale, sizes.cpu().numpy()) == "graph"
    torch.cuda.synchronize()
    return pool, bufs, family, pool.graph(family, bucket, wq, w_scale)


# ---- one case -----------------------------------------------------------------------------------

def run_case(case, problem, old_check) -> dict:
    import bench_kernels as bk
    from bench_moe import capture
    from moegemm.kernels import triton_kernel as tk

    dev = bk.DEV
    m, n, k, g = case["m"], case["n"], case["k"], case["g"]
    xq, wq, x_scale, w_scale, sizes = problem
    bucket = bk.bucket_of(m)
    row = {"name": case["name"], "m": m, "n": n, "k": k, "g": g, "bucket": bucket, "v16": case["v16"],
           "config_public": tk.default_config(m, n, k, g).key(),
           "config_service": tk.default_config(bucket, n, k, g).key(), "us": {}, "bits": {}}
    us, bits = row["us"], row["bits"]

    public = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
    tk.run(*problem, public)
    us["public"] = bk.time_us(lambda: tk.run(*problem, public))
    us["public_1"] = bk.time_replays_us(capture(lambda: tk.run(*problem, public)))
    torch.cuda.synchronize()

    pool, bufs, family, graph = service_graph(problem, bucket)
    bits["service"] = bool(torch.equal(bufs.out(bucket)[:m], public))
    us["service"] = bk.time_replays_us(graph)
    row["kernels_service"] = graph_kernels(graph)
    us["body_multi"] = bk.time_us(lambda: pool._body(family, bucket, wq, w_scale, merged=False))

    # The GEMM alone, as the graph launches it: by address, the rows where they arrived.
    xb, xsb = bufs.x[:bucket], bufs.x_scale[:bucket]
    gather, _ = bufs.order(bucket)  # the graph's identity map (stride 2)
    out = torch.full((bucket, n), float("nan"), dtype=torch.bfloat16, device=dev)

    def addressed(out_rows=None):
        return lambda: tk.run_addressed(xb, bufs.addresses, xsb, bufs.m_sizes, out, groups=g,
                                        inputs=bufs.inputs, out_rows=out_rows)

    for name, out_rows in (("addressed", None), ("rowmap_identity", gather)):
        fn = addressed(out_rows)
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        bits[name] = bool(torch.equal(out[:m], public))
        us[name] = bk.time_us(fn)
    # Session 11 (v21): on the store-warp tile at K = 4096-5120 (w13) ``addressed`` was 5-10 %
    # slower than ``public`` and ``rowmap_identity`` faster than ``addressed``. Apart: the public
    # kernel on the service's buffers; the weights by address only; the rows by address only.
    cfg = tk.default_config(bucket, n, k, g)
    w_words = bufs.addresses
    x_words = bufs.inputs
    for name, fn in (
            ("public_on_buffers", lambda: tk._launch(xb, wq, xsb, w_scale, bufs.m_sizes, out, n, g, cfg, addrs=False)),
            ("weights_by_address", lambda: tk._launch(xb, w_words, xsb, w_words, bufs.m_sizes, out, n, g, cfg,
                                                      addrs=True)),
            ("rows_by_address", lambda: tk._launch(xb, wq, xsb, w_scale, bufs.m_sizes, out, n, g, cfg, addrs=False,
                                                   x_words=x_words))):
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        bits[name] = bool(torch.equal(out[:m], public))
        us[name] = bk.time_us(fn)
    # A permutation with the meta's stride 2, as a merged call's gather: row r stored at perm[r].
    pairs = torch.zeros((bucket, 2), dtype=torch.int64, device=dev)
    perm = torch.randperm(bucket, device=dev)
    pairs[:, 0] = perm
    fn = addressed(pairs[:, 0])
    out.fill_(float("nan"))
    fn()
    torch.cuda.synchronize()
    bits["rowmap_perm"] = bool(torch.equal(out.index_select(0, perm)[:m], public))
    us["rowmap_perm"] = bk.time_us(fn)
    del out, pairs

    # The check kernel alone: the shipped one and v16's, a lone call (word 0) and a merged one (1).
    word = torch.zeros(1, dtype=torch.int64, device=dev)
    flags = bufs.flags(bucket)
    for name, check in (("check", pool.check_and_gather), ("check_old", old_check)):
        for suffix, value in (("", 0), ("_copy", 1)):
            word.fill_(value)
            us[name + suffix] = bk.time_us(
                lambda check=check: check(xb, xsb, gather, bufs.xg[:bucket], bufs.xsg[:bucket], flags,
                                          regroup=word))
    del pool, bufs, graph
    torch.cuda.synchronize()

    pool, bufs, family, graph = service_graph(problem, bucket, check=old_check)
    bits["service_old_check"] = bool(torch.equal(bufs.out(bucket)[:m], public))
    us["service_old_check"] = bk.time_replays_us(graph)
    row["kernels_service_old_check"] = graph_kernels(graph)
    del pool, bufs, graph
    torch.cuda.synchronize()
    row["us"] = {key: round(v, 1) for key, v in us.items()}
    return row


COLUMNS = ("public", "public_1", "service", "service_old_check", "body_multi", "addressed", "public_on_buffers",
           "weights_by_address", "rows_by_address", "rowmap_identity", "rowmap_perm", "check", "check_old",
           "check_copy", "check_old_copy")
SHORT = {"public": "public", "public_1": "pub_1", "service": "service", "service_old_check": "svc_oldchk",
         "body_multi": "body_x", "addressed": "addr", "public_on_buffers": "pub_bufs",
         "weights_by_address": "w_addr", "rows_by_address": "x_addr", "rowmap_identity": "map_id", "rowmap_perm": "map_perm",
         "check": "check", "check_old": "chk_old", "check_copy": "chk_cp", "check_old_copy": "chkold_cp"}


def print_table(rows) -> None:
    print(f"{'case':<44}" + "".join(f"{SHORT[c]:>11}" for c in COLUMNS) + "  bits")
    for r in rows:
        cells = "".join(f"{r['us'][c]:>11.1f}" if c in r["us"] else f"{'-':>11}" for c in COLUMNS)
        print(f"{r['name'][5:49]:<44}{cells}  {'T' if all(r['bits'].values()) else r['bits']}")
    print("v16: " + "; ".join(f"{r['name'][5:]}: service {r['v16']['service_us']} public {r['v16']['public_us']}"
                              for r in rows))


def warm_up(seconds: float = 3.0) -> float:
    """Keep the GPU busy for ``seconds`` before anything is timed. On a freshly started machine
    (idle clocks 345 MHz) this script's one-token figures came out up to 60 % above the full
    bench's for the same cases (session 13, call 7); the clocks are the likely cause, not
    checked. Returns the seconds spent."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        for _ in range(20):
            a = torch.tanh(a @ a)
        torch.cuda.synchronize()
    return round(time.monotonic() - started, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write every figure here (after every case)")
    parser.add_argument("--cases", type=int, default=6, help="how many Gluon cases (largest v16 gaps first)")
    parser.add_argument("--budget-s", type=float, default=85.0, help="start no case after this many seconds")
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--match", default="", help="these real cases instead (names containing one of these, "
                        "comma-separated), against their v18 figures")
    parser.add_argument("--list", action="store_true", help="print the cases and their tiles, run nothing (no GPU)")
    args = parser.parse_args()
    started = time.monotonic()
    cases = pick_cases(args.cases, args.match)
    if args.list:
        import bench_kernels as bk
        from moegemm.kernels import triton_kernel as tk

        for c in cases:
            bucket = bk.bucket_of(c["m"])
            print(c["name"], "m", c["m"], "bucket", bucket, "active", int((c["sizes"] > 0).sum()),
                  "max group", int(c["sizes"].max()), tk.default_config(bucket, c["n"], c["k"], c["g"]).key(),
                  c["v16"])
        return
    if not torch.cuda.is_available() or torch.version.hip:
        sys.exit("gap_gluon.py needs an NVIDIA CUDA GPU (the gluon_ws tile is sm_90); none here. "
                 "--list prints the cases without one.")
    import bench_kernels as bk

    failed = compile_ahead(cases, args.workers)
    print(f"compiled ahead in {time.monotonic() - started:.0f} s; failures: {failed}", flush=True)
    gen = torch.Generator(device=bk.DEV)
    gen.manual_seed(int(time.time()))
    old_check = old_check_and_gather()
    warm_s = warm_up()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "compile_failures": failed,
            "warm_up_s": warm_s}
    rows = []
    for case in cases:
        if time.monotonic() - started > args.budget_s:
            meta["stopped_early"] = f"budget reached before {case['name']}"
            break
        wq, w_scale = bk.random_weights(case["g"], case["n"], case["k"], gen)
        _, xq, x_scale = bk.random_activations(case["m"], case["k"], gen)
        problem = (xq, wq, x_scale, w_scale, case["sizes"].to(bk.DEV))
        row = run_case(case, problem, old_check)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            args.out.write_text(json.dumps({"meta": dict(meta, partial=True), "rows": rows}, indent=1))
        del wq, w_scale, xq, x_scale, problem
    meta["wall_s"] = round(time.monotonic() - started, 1)
    print_table(rows)
    print(json.dumps(meta))
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
