"""Kernel benchmark: our triton grouped FP8 GEMM against the peers and the floor, on one GPU.

    python bench/bench_kernels.py [--json OUT.json] [--sweep] [--only seed|deepseek]

Every time is a CUDA-graph replay median (``triton.testing.do_bench_cudagraph``)
on fresh random data. Shapes: the seed table (G = 8, even split, from
``../shared/bench/seed_shapes.json`` when present) and DeepSeek-V3-like layers
(G = 256, N=4096/K=7168 and N=7168/K=2048, skewed routing). Peers in the same
run: ``torch._scaled_grouped_mm`` (rowwise scales, a coarser recipe, cost only),
a per-group loop of blockwise ``torch._scaled_mm``, and the CUTLASS op
``torch.ops.mslk.f8f8bf16_groupwise_grouped`` (mslk-cuda 1.1.0) when importable.
The floor is ``max(bytes / copy bandwidth, flops / FP8 dense rate)``, both
ceilings measured at the start of the run. ``--sweep`` also times every
candidate tile configuration of ours. Never collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
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


def variant_configs(default):
    """The table's choice with the scale prefetch at 0, 2 and 4 K blocks, and close neighbours."""
    base = [default]
    if default.preload_scales:
        base.append(replace(default, preload_scales=False, num_stages=3))
        base.append(replace(default, preload_scales=False, num_stages=3, block_n=128))
    elif not default.swap_ab:
        base.append(tk.TileConfig(128, 128, False, 8, 4))
    found = []
    for cfg in base:
        for pf in (0, 2, 4):
            variant = replace(cfg, prefetch_scales=0 if cfg.preload_scales else pf)
            if variant not in found:
                found.append(variant)
    return found


def round2_configs(m, n, k, g):
    """v5 (bench/NOTES.md): split-K, paired K blocks, TMA and warp specialisation against the table."""
    T = tk.TileConfig
    rows_per_group = max(1, m // max(g, 1))
    if rows_per_group <= 48:
        tt = tk.default_config(m, n, k, g).block_m
        return [tk.default_config(m, n, k, g)] + [T(tt, 64, True, 4, 4, evict_w="evict_first", preload_scales=True, scale_chunk=8, split_k=s)
                for s in (2, 4)] + [T(tt, 128, True, 4, 3, evict_w="evict_first", split_k=s) for s in (2, 4, 8)] + [
                T(tt, 64, True, 4, 3, evict_w="evict_first", split_k=4)]
    found = [tk.default_config(m, n, k, g), T(64, 128, False, 4, 2, dot_pair=True), T(128, 128, False, 8, 4),
             T(128, 128, False, 8, 2, dot_pair=True), T(128, 128, False, 8, 3, dot_pair=True),
             T(128, 128, False, 4, 4, tma=True, warp_spec=True), T(128, 128, False, 4, 3, tma=True, warp_spec=True),
             T(64, 128, False, 4, 4, tma=True, warp_spec=True), T(64, 128, False, 4, 4, tma=True),
             T(128, 128, False, 8, 4, tma=True)]
    if m <= 2048 and k >= 4096:
        found += [T(64, 128, False, 4, 4, split_k=2), T(128, 128, False, 8, 4, split_k=2)]
    if m > 2048:
        found += [T(64, 128, False, 4, 4, group_tiles_m=8), T(128, 128, False, 8, 3, group_tiles_m=8, dot_pair=True),
                  T(128, 128, False, 4, 4, group_tiles_m=8, tma=True, warp_spec=True)]
    return found


def v7_configs(m, n, k, g):
    """v7 (bench/NOTES.md): the table against v6's choice, the warp-specialised pairs and the pair with scales ahead."""
    T = tk.TileConfig
    rows_per_group = max(1, m // max(g, 1))
    if rows_per_group <= 48:
        return [tk.default_config(m, n, k, g)]
    v6 = (T(128, 128, False, 8, 3, 8 if n <= 4096 else 1, dot_pair=True) if rows_per_group > 1024
          else T(64, 128, False, 4, 4, tma=True))
    found = [tk.default_config(m, n, k, g), v6,
             T(128, 128, False, 8, 3, 8 if n <= 4096 else 1, dot_pair=True, scale_ahead=True),
             T(128, 128, False, 4, 2, 8, dot_pair=True, tma=True, warp_spec=True),
             T(128, 128, False, 4, 2, 8, dot_pair=True, tma=True, warp_spec=True, locate_chunk=1),
             T(128, 128, False, 4, 2, 1, dot_pair=True, tma=True, warp_spec=True),
             T(128, 128, False, 4, 4, 8, tma=True, warp_spec=True)]
    return list(dict.fromkeys(found))


def v8_configs(m, n, k, g):
    """v8 (bench/NOTES.md): the persistent warp-specialised tiles against the table (prefill only)."""
    T = tk.TileConfig
    rows_per_group = max(1, m // max(g, 1))
    if rows_per_group <= 48:
        return []
    ws = {"tma": True, "warp_spec": True, "persistent": True}
    if os.environ.get("V8_ROUND") == "1":
        found = [tk.default_config(m, n, k, g),
                 T(128, 128, False, 4, 2, 8, dot_pair=True, **ws),
                 T(128, 128, False, 4, 2, 1, dot_pair=True, **ws),
                 T(128, 128, False, 4, 4, 8, **ws),
                 T(128, 128, False, 4, 6, 8, **ws),
                 T(128, 256, False, 4, 3, 8, **ws),
                 T(128, 256, False, 4, 4, 8, **ws),
                 T(128, 128, False, 4, 3, 8, dot_pair=True, **ws),
                 T(128, 128, False, 8, 3, 8, dot_pair=True, tma=True, persistent=True)]
    else:  # round 2: the 256-wide tile in 115 KB, the NaN column against shared memory size, wider bands
        found = [T(128, 256, False, 4, 2, 8, **ws),
                 T(128, 128, False, 4, 3, 8, **ws),
                 T(128, 128, False, 4, 5, 8, **ws),
                 T(128, 128, False, 4, 2, 16, dot_pair=True, **ws)]
    return [c for c in dict.fromkeys(found) if c.fits(n)]


def v9_configs(m, n, k, g):
    """v9 (bench/NOTES.md): decode tiles with more programs per active expert, scales a pair ahead, split-K."""
    T = tk.TileConfig
    rows_per_group = max(1, m // max(g, 1))
    if rows_per_group > 48:
        return []
    tt = tk.default_config(m, n, k, g).block_m
    ef = {"evict_w": "evict_first"}
    ah = {"dot_pair": True, "scale_ahead": True}
    found = [tk.default_config(m, n, k, g),
             T(tt, 128, True, 4, 3, **ef, **ah), T(tt, 64, True, 4, 3, **ef, **ah)]
    if min(g, m) * n // 128 < 132:  # few weight tiles: one active expert (m1) or narrow N
        found += [T(tt, 64, True, 4, 3, **ef), T(tt, 64, True, 4, 4, **ef, **ah)]
        for split in ((2, 4) if k < 4096 else (2, 4, 8)):
            found += [T(tt, 64, True, 4, 3, split_k=split, **ef), T(tt, 64, True, 4, 3, split_k=split, **ef, **ah),
                      T(tt, 128, True, 4, 3, split_k=split, **ef, **ah)]
        if k < 4096:
            found += [T(tt, 64, True, 4, 8, **ef), T(tt, 64, True, 4, 4, preload_scales=True, scale_chunk=8, **ef),
                      T(tt, 64, True, 4, 4, preload_scales=True, scale_chunk=8, split_k=2, **ef)]
        else:
            found += [T(tt, 64, True, 4, 3, preload_scales=True, scale_chunk=16, split_k=4, **ef)]
    return [c for c in dict.fromkeys(found) if c.fits(n)]


def v9b_configs(m, n, k, g):
    """v9 call 2: v8's table choice beside the new table (decode), the lead-tile workaround (prefill)."""
    T = tk.TileConfig
    rows_per_group = max(1, m // max(g, 1))
    if rows_per_group <= 48:
        tt = tk.default_config(m, n, k, g).block_m
        if min(g, m) * n // 128 < 132 and k >= 4096:
            return [T(tt, 64, True, 4, 3, evict_w="evict_first", split_k=4)]
        return [T(tt, 128, True, 4, 3, evict_w="evict_first")]
    if m < 4096:
        return []
    ws = {"tma": True, "warp_spec": True, "persistent": True, "lead_tile": True}
    found = [T(128, 256, False, 4, 3, 8, **ws), T(128, 128, False, 4, 3, 8, dot_pair=True, **ws)]
    return [c for c in found if c.fits(n)]


def v9c_configs(m, n, k, g):
    """v9 call 3: v8's 2-stage 256-wide tile beside the 3-stage lead tile; shorter pipelines for K = 1024."""
    T = tk.TileConfig
    ef, ah = {"evict_w": "evict_first"}, {"dot_pair": True, "scale_ahead": True}
    ws = {"tma": True, "warp_spec": True, "persistent": True}
    if k == 1024 and m / g <= 48:
        return [T(16, 128, True, 4, 2, **ef, **ah), T(16, 128, True, 4, 4, **ef, **ah),
                T(16, 64, True, 4, 2, **ef, **ah), T(16, 128, True, 4, 3, **ef)]
    if m / g >= 128 and n % 256 == 0:
        return [T(128, 256, False, 4, 2, 8, **ws), T(128, 256, False, 4, 3, 8, lead_tile=True, **ws)]
    return []


def v10_configs(m, n, k, g):
    """v10 call 1 (bench/NOTES.md): the weakest seed shapes' neighbours of the v9 table."""
    T = tk.TileConfig
    ef, ah = {"evict_w": "evict_first"}, {"dot_pair": True, "scale_ahead": True}
    ws = {"tma": True, "warp_spec": True, "persistent": True}
    if m / g > 48:
        if m / g > 256:
            return []
        found = [T(128, 128, False, 4, 3, 8, dot_pair=True, lead_tile=True, **ws)]
        if n % 256 == 0 and (m // 128) * (n // 256) >= 132:
            found.append(T(128, 256, False, 4, 3, 8, lead_tile=True, **ws))
    elif k == 1024 and m < g:  # one active expert: every K block in flight, more warps to issue them
        found = [T(16, 128, True, 4, 4, **ef, **ah), T(16, 128, True, 8, 4, **ef, **ah),
                 T(16, 128, True, 8, 3, **ef, **ah)]
    elif k == 1024:  # 512 weight tiles of 128 rows
        found = [T(16, 128, True, 8, 3, **ef), T(16, 128, True, 4, 2, **ef), T(16, 256, True, 8, 3, **ef)]
    elif n == 1280:
        # 2 stages (41 KB): 5 programs per SM, so 480 or 640 programs are all resident.
        found = [T(16, 64, True, 4, 2, split_k=3, **ef, **ah), T(16, 64, True, 4, 2, split_k=4, **ef, **ah)]
    else:
        found = []
    return [c for c in dict.fromkeys(found) if c.fits(n) and c != tk.default_config(m, n, k, g)]


def v10b_configs(m, n, k, g):
    """v10 call 2: the v9 table's choice beside each shape whose choice v10 changed, and
    8 warps on other decode shapes (beside the table only: measured, not yet in it)."""
    T = tk.TileConfig
    ef, ah = {"evict_w": "evict_first"}, {"dot_pair": True, "scale_ahead": True}
    default = tk.default_config(m, n, k, g)
    found = []
    if (m, n, k, g) == (1, 8192, 1024, 8):
        found.append(T(16, 128, True, 4, 3, **ef, **ah))  # v9's choice
    elif m / g <= 48 and n == 1280:
        found += [replace(default, num_warps=8), T(16, 128, True, 8, 3, split_k=2, **ef, **ah)]
    elif m / g <= 48 and m == 32 and n in (7168, 8192, 13312):
        found.append(replace(default, num_warps=8))
    return [c for c in dict.fromkeys(found) if c.fits(n) and c != default]


# ---- one shape -----------------------------------------------------------------------------

def run_shape(name, m, n, k, g, sizes, sweep, peers, gen, log) -> dict:
    x, problem = make_inputs(m, n, k, g, sizes, gen)
    row = {"name": name, "m": m, "n": n, "k": k, "g": g, "active_groups": int((sizes > 0).sum()),
           "floor_us": floor_us(m, n, k, sizes), "peers_us": {}, "errors": {}}
    default = tk.default_config(m, n, k, g)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    tk.launch(*problem, out, config=default)
    ref = reference_float64(*problem)
    row["ours_rel_err"] = rel_error(out, ref)
    row["ours_finite"] = bool(torch.isfinite(out).all())
    row["ours_config"] = default.key()
    row["ours_us"] = bench(lambda: tk.launch(*problem, out, config=default))
    if sweep:
        row["sweep_us"] = {}
        configs = {"all": tk.candidate_configs, "round2": round2_configs, "v7": v7_configs,
                    "v8": v8_configs, "v9": v9_configs, "v9b": v9b_configs,
                    "v9c": v9c_configs, "v10": v10_configs,
                    "v10b": v10b_configs}.get(
            sweep, lambda *_: variant_configs(default))(m, n, k, g)
        for cfg in configs:
            try:
                out.fill_(float("nan"))
                tk.launch(*problem, out, config=cfg)
                # On the GPU: copying a 16384 x 7168 float64 reference to the host per config costs seconds.
                err = float(torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref))
                first = out.clone()
                t = bench(lambda cfg=cfg: tk.launch(*problem, out, config=cfg), rep=10)
                # After hundreds of launches the same inputs give the same bits
                # (split-K: the counters reset themselves, the reduction order is fixed).
                out.fill_(float("nan"))
                tk.launch(*problem, out, config=cfg)
                same = bool(torch.equal(out, first))
                row["sweep_us"][cfg.key()] = (round(t, 2), float(f"{err:.2e}"), same)
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
    blockwise = [v for p, v in row["peers_us"].items() if v and "rowwise" not in p]
    row["best_blockwise_peer_us"] = min(blockwise) if blockwise else None
    measured = [v for v in row["peers_us"].values() if v]
    row["best_peer_us"] = min(measured) if measured else None
    row["floor_over_ours"] = row["floor_us"] / row["ours_us"]
    log(row)
    return row


def print_table(rows, file=sys.stdout):
    peers = list(PEERS)
    short = {"torch_scaled_grouped_mm_rowwise": "rowwise", "torch_scaled_mm_blockwise_per_group_loop":
             "blk_loop", "mslk_cutlass_f8f8bf16_groupwise_grouped": "mslk_cutl"}
    head = f"{'shape':<34}{'floor':>8}{'ours':>8}{'fl/ours':>8}" + "".join(f"{short[p]:>10}" for p in peers)
    print(head + f"{'best':>8}  err      config", file=file)
    for r in rows:
        cells = "".join(f"{r['peers_us'][p]:>10.1f}" if r["peers_us"].get(p) else f"{'-':>10}"
                        for p in peers)
        print(f"{r['name']:<34}{r['floor_us']:>8.1f}{r['ours_us']:>8.1f}{r['floor_over_ours']:>8.2f}"
              f"{cells}{r['best_peer_us'] or float('nan'):>8.1f}  {r['ours_rel_err']:.1e}"
              f"  {r['ours_config']}", file=file)


def main() -> None:
    """Measure the ceilings, then every shape; print the table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--sweep", choices=("all", "variants", "round2", "v7", "v8", "v9", "v9b", "v9c", "v10", "v10b"),
                        help="also time every candidate tile config, the table's choice's variants, "
                             "the v5 split-K / paired-dot variants, the v7 or the v8 prefill variants, "
                             "the v9 decode variants, v9's checks against v8 (v9b, v9c), v10's neighbours "
                             "of the weakest seed shapes or the v9 choice beside v10's (v10b)")
    parser.add_argument("--no-peers", action="store_true", help="time ours only")
    parser.add_argument("--match", default="", help="only shapes whose name contains one of these (comma-separated)")
    parser.add_argument("--only", choices=("seed", "deepseek"))
    args = parser.parse_args()

    gen = torch.Generator(device=DEV)
    gen.manual_seed(int(time.time()))
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings['copy_TBps']:.2f} TB/s, fp8 {ceilings['fp8_TFLOPs']:.0f} TFLOP/s",
          flush=True)
    shapes = []
    if args.only != "deepseek":
        shapes += [(f"seed m{m} n{n} k{k} g8", m, n, k, 8, even_split(m, 8)) for m, n, k in SEED_SHAPES]
    if args.only != "seed":
        shapes += [(f"dsv3 m{m} n{n} k{k} g256 skew", m, n, k, 256, skewed_split(m, 256))
                   for m, n, k in DEEPSEEK_SHAPES]
    patterns = args.match.split(",")
    shapes = [s for s in shapes if any(p in s[0] for p in patterns)]
    rows = []
    for name, m, n, k, g, sizes in shapes:
        rows.append(run_shape(name, m, n, k, g, sizes, args.sweep, not args.no_peers, gen,
                              lambda r: print(json.dumps(r), flush=True)))
        if args.json:  # after every shape, so a run cut short still leaves its figures
            args.json.write_text(json.dumps({"summary": {"partial": True}, "rows": rows}, indent=1))
    seed_rows = [r for r in rows if r["name"].startswith("seed")]
    summary = {"measured_ceilings": ceilings, "floor_ceilings": FLOOR_CEILINGS, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "triton": triton.__version__}
    if seed_rows:
        summary["seed_geomean_floor_over_ours"] = math.exp(
            sum(math.log(r["floor_over_ours"]) for r in seed_rows) / len(seed_rows))
        summary["seed_shapes_ours_beats_best_peer"] = sum(
            1 for r in seed_rows if r["best_peer_us"] and r["ours_us"] < r["best_peer_us"])
    print_table(rows)
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
