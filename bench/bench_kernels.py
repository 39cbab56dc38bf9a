"""Kernel benchmark: our triton grouped FP8 GEMM against the peers and the floor, on one GPU.

    python bench/bench_kernels.py [--json OUT.json] [--sweep] [--only seed|real|deepseek]

Every time is a CUDA-graph replay median (``triton.testing.do_bench_cudagraph``)
on fresh random data. Ours is timed through the service path: a ``GraphPool``
as the server builds it, its graph for the call's bucket captured, and the
pool's GEMM launcher (``run_gemm``: the weights by address, over the whole
bucket) timed as the graph runs it (``ours_us``, what floor/ours uses); the
whole graph body (row checks and regrouping, GEMM, scatter back:
``service_graph_us``) and the public ``run`` (``public_us``) beside it; the
service output must equal the public one bit for bit. Shapes: the seed table
(G = 8, even split), the real-model set (``--only real``: the 8 models of
``../shared/bench/real_models.json``, w13 and w2, decode and prefill token
counts, top-k distinct experts per token by Zipf-like popularity whose
exponent per model is drawn in [0.5, 1.2] with a fixed seed) and, on request,
DeepSeek-V3-like layers (``--only deepseek``). Peers in the same run: ``torch._scaled_grouped_mm`` (rowwise scales, a coarser recipe, cost only),
a per-group loop of blockwise ``torch._scaled_mm``, and the CUTLASS op
``torch.ops.mslk.f8f8bf16_groupwise_grouped`` (mslk-cuda 1.1.0) when importable.
The floor is ``max(bytes / copy bandwidth, flops / FP8 dense rate)``, both
ceilings measured at the start of the run. ``--sweep`` also times the
table's neighbours (public entry). Never collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing
from moegemm.kernels import reference_float64
from moegemm.kernels import triton_kernel as tk
from moegemm.kernels.quant import quantize_activations, quantize_weights
from moegemm.kernels.testing import rel_error

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
SEED_JSON = Path(__file__).resolve().parents[2] / "shared" / "bench" / "seed_shapes.json"
SEED_SHAPES = [
    (32, 1280, 8192), (128, 1280, 8192), (1024, 2048, 7168), (16384, 2048, 7168),
    (1024, 7168, 2304), (16384, 7168, 2304), (32, 7168, 8192), (128, 7168, 8192),
    (1, 8192, 1024), (128, 8192, 1024), (32, 8192, 3584), (128, 8192, 3584),
    (32, 13312, 6656), (128, 13312, 6656), (32, 13312, 16384), (128, 13312, 16384),
    (32, 16384, 6656), (128, 16384, 6656),
]
# DeepSeek-V3 MoE: 256 experts, top-8 routing; tokens 32 (decode), 512, 4096 (prefill).
DEEPSEEK_SHAPES = [(t * 8, n, k) for n, k in ((4096, 7168), (7168, 2048)) for t in (32, 512, 4096)]


def even_split(m: int, g: int) -> torch.Tensor:
    base, extra = divmod(m, g)
    return torch.tensor([base + (1 if i < extra else 0) for i in range(g)], dtype=torch.int64)


def skewed_split(m: int, g: int, seed: int = 0) -> torch.Tensor:
    """Zipf-like expert popularity: a few hot experts, a long tail, some empty."""
    gen = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, g + 1, dtype=torch.float64) ** 1.1
    popularity = popularity[torch.randperm(g, generator=gen)]
    picks = torch.multinomial(popularity, m, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=g).to(torch.int64)


def make_inputs(m: int, n: int, k: int, g: int, sizes: torch.Tensor, gen: torch.Generator):
    """Fresh random bf16 activations and their SPEC 1.1 quantization; weights per group."""
    x = torch.randn((m, k), generator=gen, device=DEV).to(torch.bfloat16)
    xq, x_scale = quantize_activations(x, FP8) if m else (
        torch.empty((0, k), dtype=FP8, device=DEV), torch.empty((0, k // 128), device=DEV))
    wq = torch.empty((g, n, k), dtype=FP8, device=DEV)
    w_scale = torch.empty((g, k // 128, n // 128), dtype=torch.float32, device=DEV)
    for i in range(g):
        w = torch.randn((n, k), generator=gen, device=DEV) * math.exp(float(torch.randn(())))
        wq[i], w_scale[i] = quantize_weights(w, FP8)
    return x, (xq, wq, x_scale, w_scale, sizes.to(DEV))


def bench(fn, rep: int = 20) -> float:
    """Microseconds per call: median of CUDA-graph replays."""
    return 1e3 * float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written) and dense FP8 tensorwise-scaled matmul rate."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    copy_us = bench(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device=DEV).to(FP8)
    b = torch.randn(8192, 8192, device=DEV).to(FP8).t()
    one = torch.ones((), device=DEV)
    mm_us = bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return {"copy_TBps": 2 * (2 << 30) / copy_us / 1e6, "fp8_TFLOPs": 2 * 8192**3 / mm_us / 1e6}


# The floor's ceilings, as in ../shared/bench/seed_shapes.json, so figures compare across runs;
# the ceilings measured in each run are recorded beside them.
FLOOR_CEILINGS = {"copy_TBps": 4.27, "fp8_TFLOPs": 1290.0}


def floor_us(m, n, k, sizes, ceilings=FLOOR_CEILINGS) -> float:
    """max(bytes / copy bandwidth, flops / FP8 rate); bytes = M*K + active*N*K + 2*M*N."""
    active = int((sizes > 0).sum())
    bytes_moved = m * k + active * n * k + 2 * m * n
    return max(bytes_moved / ceilings["copy_TBps"] / 1e6, 2 * m * n * k / ceilings["fp8_TFLOPs"] / 1e6)


# ---- peers ---------------------------------------------------------------------------------

def peer_rowwise_grouped(x, problem):
    xq, wq, _, _, sizes = problem
    g, n, _ = wq.shape
    scale_a = torch.rand(xq.shape[0], device=DEV) + 0.5
    scale_b = torch.rand(g, n, device=DEV) + 0.5
    offs = torch.cumsum(sizes, 0).to(torch.int32)
    return lambda: torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), scale_a, scale_b, offs=offs,
                                            out_dtype=torch.bfloat16)


def peer_blockwise_loop(x, problem):
    xq, wq, x_scale, w_scale, sizes = problem
    bounds, start = [], 0
    for i, rows in enumerate(sizes.tolist()):
        if rows:
            bounds.append((i, start, start + rows))
        start += rows
    out = torch.empty((xq.shape[0], wq.shape[1]), dtype=torch.bfloat16, device=DEV)
    # The blockwise path wants M-major activation scales; try the weight-scale layouts in turn.
    calls = []
    for i, lo, hi in bounds:
        sa = x_scale[lo:hi].t().contiguous().t()
        calls.append((xq[lo:hi], wq[i].t(), sa, w_scale[i], out[lo:hi]))
    layouts = (lambda s: s, lambda s: s.t().contiguous().t())
    for fix in layouts:
        try:
            a, b, sa, sb, o = calls[0]
            o.copy_(torch._scaled_mm(a, b, sa, fix(sb), out_dtype=torch.bfloat16))
            calls = [(a, b, sa, fix(sb), o) for a, b, sa, sb, o in calls]
            break
        except RuntimeError as exc:
            err = exc
    else:
        raise err

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
    "torch_scaled_grouped_mm_rowwise": peer_rowwise_grouped,
    "torch_scaled_mm_blockwise_per_group_loop": peer_blockwise_loop,
    "mslk_cutlass_f8f8bf16_groupwise_grouped": peer_mslk_cutlass,
}


def sweep_configs(m, n, k, g):
    """The table's neighbours for ``--sweep``: the other prefill schedules at prefill sizes,
    other token tiles and the pair at decode sizes (bench/NOTES.md, v11)."""
    T = tk.TileConfig
    default = tk.default_config(m, n, k, g)
    ef = "evict_first"
    if m / g > 48:
        found = [T("prefill_tma", 64, 128, 4, 4), T("prefill_tma", 64, 128, 4, 4, group_tiles_m=8),
                 T("prefill_tma", 128, 128, 8, 3), T("prefill_tma", 128, 128, 8, 4, group_tiles_m=8),
                 T("prefill_pair", 128, 128, 8, 3, group_tiles_m=8),
                 T("persistent_ws", 128, 128, 4, 2, group_tiles_m=8),
                 T("persistent_ws", 128, 256, 4, 2, group_tiles_m=8),
                 T("persistent_ws", 128, 256, 4, 3, group_tiles_m=8, lead_tile=True)]
    else:
        tt = default.block_m
        found = [T("decode_pair", tt, 128, 4, 3, evict_w=ef), T("decode", min(64, 2 * tt), 128, 4, 3, evict_w=ef),
                 T("decode", tt, 64, 4, 3, evict_w=ef)]
    return [c for c in dict.fromkeys(found) if c.fits(n, g) and c != default]


# ---- the service path -----------------------------------------------------------------------

def service_setup(problem, bucket):
    """A GraphPool as the server builds it (triton backend, weights by address), with
    the call's bucket captured: (pool, family, graph). The call's rows are in the
    pool's buffers and its sizes, order and weight addresses in the graph's words."""
    from moegemm.kernels import get_backend
    from moegemm.server._graphs import Family, GraphPool

    xq, wq, x_scale, w_scale, sizes = problem
    g, n, k = wq.shape
    pool = GraphPool(get_backend(DEV, "triton"), bucket)
    family = Family(g, n, k, quantize=False)
    bufs = pool.buffers(family)
    m = xq.shape[0]
    bufs.x[:m].copy_(xq)
    bufs.x_scale[:m].copy_(x_scale)
    pool.capture(family, wq, w_scale, only=[bucket])
    assert pool.run_table is not None, "the address launcher failed its self-check"
    assert pool.launch(family, wq, w_scale, sizes.cpu().numpy()) == "graph"
    return pool, family, pool.graph(family, bucket, wq, w_scale)


def run_shape(name, m, n, k, g, sizes, sweep, peers, gen, log, problem=None, x=None) -> dict:
    """One case: ours through the service path (the pool's captured graph for the bucket,
    its GEMM node timed alone and the whole graph body), the public function beside it,
    the sweep and the peers."""
    if problem is None:
        x, problem = make_inputs(m, n, k, g, sizes, gen)
    bucket = 1 << max(0, (m - 1).bit_length())
    row = {"name": name, "m": m, "n": n, "k": k, "g": g, "bucket": bucket,
           "active_groups": int((sizes > 0).sum()),
           "floor_us": floor_us(m, n, k, sizes), "peers_us": {}, "errors": {}}
    default = tk.default_config(m, n, k, g)
    # Ours, public entry: poisoned output, then the float64 check where it is affordable.
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    tk.run(*problem, out)
    row["ours_finite"] = bool(torch.isfinite(out).all())
    if m * n * k * (2 if m > 4096 else 1) <= (1 << 38):
        row["ours_rel_err"] = rel_error(out, reference_float64(*problem))
    row["ours_config"] = default.key()
    row["public_us"] = bench(lambda: tk.run(*problem, out))
    # Ours, service path.
    pool, family, _ = service_setup(problem, bucket)
    bufs = pool.buffers(family)
    torch.cuda.synchronize()
    row["service_same_bits_as_public"] = bool(torch.equal(bufs.out(bucket)[:m], out))
    xq_b, xs_b = bufs.x[:bucket], bufs.x_scale[:bucket]
    out_b = torch.empty((bucket, n), dtype=torch.bfloat16, device=DEV)

    def gemm():
        return pool.run_gemm(xq_b, xs_b, bufs.m_sizes, out_b, addresses=bufs.addresses,
                             wq=problem[1], w_scale=problem[3])

    row["ours_us"] = bench(gemm)
    row["service_graph_us"] = bench(lambda: pool._body(family, bucket, problem[1], problem[3]))
    pool = bufs = xq_b = xs_b = out_b = None  # free the pool's buffers before the sweep
    if sweep:
        row["sweep_us"] = {}
        for cfg in sweep_configs(m, n, k, g):
            try:
                out.fill_(float("nan"))
                tk.launch(*problem, out, config=cfg)
                first = out.clone()
                finite = bool(torch.isfinite(first).all())
                t = bench(lambda cfg=cfg: tk.launch(*problem, out, config=cfg), rep=10)
                out.fill_(float("nan"))
                tk.launch(*problem, out, config=cfg)
                row["sweep_us"][cfg.key()] = (round(t, 2), finite, bool(torch.equal(out, first)))
            except Exception as exc:  # noqa: BLE001  keep sweeping past one bad candidate
                row["sweep_us"][cfg.key()] = repr(exc)[:200]
    for peer, build in PEERS.items() if peers else ():
        try:
            fn = build(x, problem)
            fn()
            row["peers_us"][peer] = bench(fn)
        except Exception as exc:  # noqa: BLE001  a peer that cannot run this shape is reported, not fatal
            row["peers_us"][peer] = None
            row["errors"][peer] = repr(exc)[:300]
    measured = [v for v in row["peers_us"].values() if v]
    row["best_peer_us"] = min(measured) if measured else None
    row["floor_over_ours"] = row["floor_us"] / row["ours_us"]
    log(row)
    return row


# ---- the real-model set -------------------------------------------------------------------------

# A copy beside this file (the device machine has no ../shared), else the shared one.
REAL_JSON = next(p for p in (Path(__file__).resolve().parent / "real_models.json",
                             Path(__file__).resolve().parents[2] / "shared" / "bench" / "real_models.json")
                 if p.exists() or p.name == "real_models.json" and "shared" in p.parts)
REAL_SEED = 0


def real_routing(tokens: int, g: int, top_k: int, exponent: float, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert: each token to ``top_k`` distinct experts drawn by Zipf-like popularity
    (``1 / rank^exponent``, experts in random order)."""
    popularity = 1.0 / torch.arange(1, g + 1, dtype=torch.float64) ** exponent
    popularity = popularity[torch.randperm(g, generator=gen)]
    picks = torch.multinomial(popularity.expand(tokens, g), top_k, replacement=False, generator=gen)
    return torch.bincount(picks.flatten(), minlength=g).to(torch.int64)


def real_cases():
    """(name, model, matrix, tokens, m, n, k, g, sizes) for every case of real_models.json;
    the routing exponent of each model drawn in [0.5, 1.2] with a fixed seed."""
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
                    cases.append((name, model["model"], matrix, tokens, tokens * top_k, n, k, g, sizes))
    return cases


def random_weights(g: int, n: int, k: int, gen: torch.Generator):
    """Random fp8 weights with log-normal block scales, made on the device in chunks (fast)."""
    wq = torch.empty((g, n, k), dtype=FP8, device=DEV)
    for lo in range(0, g, 8):
        hi = min(g, lo + 8)
        wq[lo:hi] = (torch.randn((hi - lo, n, k), generator=gen, device=DEV) * 64).to(FP8)
    w_scale = torch.exp(torch.randn((g, k // 128, n // 128), generator=gen, device=DEV)) / 256
    return wq, w_scale


def print_table(rows, file=sys.stdout):
    peers = list(PEERS)
    short = {"torch_scaled_grouped_mm_rowwise": "rowwise", "torch_scaled_mm_blockwise_per_group_loop":
             "blk_loop", "mslk_cutlass_f8f8bf16_groupwise_grouped": "mslk_cutl"}
    head = (f"{'shape':<44}{'floor':>8}{'ours':>8}{'fl/ours':>8}{'public':>8}{'graph':>8}"
            + "".join(f"{short[p]:>10}" for p in peers))
    print(head + f"{'best':>8}  same  config", file=file)
    for r in rows:
        cells = "".join(f"{r['peers_us'][p]:>10.1f}" if r["peers_us"].get(p) else f"{'-':>10}"
                        for p in peers)
        print(f"{r['name']:<44}{r['floor_us']:>8.1f}{r['ours_us']:>8.1f}{r['floor_over_ours']:>8.2f}"
              f"{r['public_us']:>8.1f}{r['service_graph_us']:>8.1f}"
              f"{cells}{r['best_peer_us'] or float('nan'):>8.1f}  {str(r['service_same_bits_as_public'])[0]}"
              f"  {r['ours_config']}", file=file)


def summarize(rows, prefix) -> dict:
    """Geomean floor/ours, the worst prefill case and the cases slower than a peer, for one set."""
    got = [r for r in rows if r["name"].startswith(prefix)]
    if not got:
        return {}
    slower = [r["name"] for r in got if r["best_peer_us"] and r["ours_us"] >= r["best_peer_us"]]
    prefill = [r for r in got if "prefill" in r["name"] or r["m"] >= 16384]
    return {"cases": len(got),
            "geomean_floor_over_ours": math.exp(sum(math.log(r["floor_over_ours"]) for r in got) / len(got)),
            "geomean_floor_over_public": math.exp(sum(math.log(r["floor_us"] / r["public_us"]) for r in got)
                                                  / len(got)),
            "worst_prefill": min(((r["floor_over_ours"], r["name"]) for r in prefill), default=None),
            "slower_than_a_peer": slower,
            "all_service_bits_equal_public": all(r["service_same_bits_as_public"] for r in got)}


def main() -> None:
    """Measure the ceilings, then every shape; print the table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--sweep", action="store_true", help="also time the table's neighbours (public entry)")
    parser.add_argument("--no-peers", action="store_true", help="time ours only")
    parser.add_argument("--match", default="", help="only shapes whose name contains one of these (comma-separated)")
    parser.add_argument("--only", choices=("seed", "real", "deepseek"))
    args = parser.parse_args()

    gen = torch.Generator(device=DEV)
    gen.manual_seed(int(time.time()))
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings['copy_TBps']:.2f} TB/s, fp8 {ceilings['fp8_TFLOPs']:.0f} TFLOP/s",
          flush=True)
    patterns = args.match.split(",")
    rows = []

    def done(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:  # after every shape, so a run cut short still leaves its figures
            args.json.write_text(json.dumps({"summary": {"partial": True}, "rows": rows}, indent=1))

    shapes = []
    if args.only in (None, "seed"):
        shapes += [(f"seed m{m} n{n} k{k} g8", m, n, k, 8, even_split(m, 8)) for m, n, k in SEED_SHAPES]
    if args.only == "deepseek":
        shapes += [(f"dsv3 m{m} n{n} k{k} g256 skew", m, n, k, 256, skewed_split(m, 256))
                   for m, n, k in DEEPSEEK_SHAPES]
    for name, m, n, k, g, sizes in shapes:
        if any(p in name for p in patterns):
            run_shape(name, m, n, k, g, sizes, args.sweep, not args.no_peers, gen, done)
    if args.only in (None, "real"):
        # Weights once per (model, matrix); fresh activations per case.
        weights = {}
        for name, model, matrix, tokens, m, n, k, g, sizes in real_cases():
            if not any(p in name for p in patterns):
                continue
            if (model, matrix) not in weights:
                weights.clear()
                torch.cuda.empty_cache()
                weights[(model, matrix)] = random_weights(g, n, k, gen)
            wq, w_scale = weights[(model, matrix)]
            x = torch.randn((m, k), generator=gen, device=DEV).to(torch.bfloat16)
            xq, x_scale = quantize_activations(x, FP8)
            row_sizes = sizes
            run_shape(name, m, n, k, g, row_sizes, args.sweep, not args.no_peers, gen, done,
                      problem=(xq, wq, x_scale, w_scale, sizes.to(DEV)), x=x)
    summary = {"measured_ceilings": ceilings, "floor_ceilings": FLOOR_CEILINGS, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "triton": triton.__version__,
               "seed": summarize(rows, "seed"), "real": summarize(rows, "real")}
    print_table(rows)
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
