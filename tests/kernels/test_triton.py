"""The triton backend against the float64 oracle, on an NVIDIA Hopper GPU.

Skipped cleanly where there is no CUDA device of compute capability 9.0 or
no triton. Every check draws fresh random data and poisons the output with NaN
first, so a row the kernel skips fails the finiteness check.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.version.hip:
    pytest.skip("needs an NVIDIA CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs compute capability 9.0 (Hopper)", allow_module_level=True)
pytest.importorskip("triton")

from moegemm.kernels import grouped_gemm, reference_float64
from moegemm.kernels import triton_kernel as tk
from moegemm.kernels._backend import weight_addresses
from moegemm.kernels.quant import quantize_activations, quantize_weights
from moegemm.kernels.testing import (
    SPEC_TOLERANCE,
    poisoned_out,
    random_m_sizes,
    rel_error,
)

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
# The seed table's shapes (../shared/bench/seed_shapes.json), all with G = 8.
SEED_SHAPES = [
    (32, 1280, 8192), (128, 1280, 8192), (1024, 2048, 7168), (16384, 2048, 7168),
    (1024, 7168, 2304), (16384, 7168, 2304), (32, 7168, 8192), (128, 7168, 8192),
    (1, 8192, 1024), (128, 8192, 1024), (32, 8192, 3584), (128, 8192, 3584),
    (32, 13312, 6656), (128, 13312, 6656), (32, 13312, 16384), (128, 13312, 16384),
    (32, 16384, 6656), (128, 16384, 6656),
]


def _blockwise(shape, block, gen):
    """Gaussian values times a log-normal magnitude per block, built on the GPU."""
    blocks = [s // b for s, b in zip(shape, block)]
    mag = torch.exp(torch.randn(blocks, generator=gen, device=DEV))
    for dim, b in enumerate(block):
        mag = mag.repeat_interleave(b, dim=dim)
    return torch.randn(shape, generator=gen, device=DEV) * mag


def make_problem(m, n, k, g, m_sizes, gen):
    """Fresh quantized inputs on the GPU (SPEC 1.1 quantizers), weights group by group."""
    xq = torch.empty((m, k), dtype=FP8, device=DEV)
    x_scale = torch.empty((m, k // 128), dtype=torch.float32, device=DEV)
    for lo in range(0, m, 1 << 15):
        hi = min(m, lo + (1 << 15))
        xq[lo:hi], x_scale[lo:hi] = quantize_activations(_blockwise((hi - lo, k), (1, 128), gen), FP8)
    wq = torch.empty((g, n, k), dtype=FP8, device=DEV)
    w_scale = torch.empty((g, k // 128, n // 128), dtype=torch.float32, device=DEV)
    for i in range(g):
        wq[i], w_scale[i] = quantize_weights(_blockwise((n, k), (128, 128), gen), FP8)
    return xq, wq, x_scale, w_scale, m_sizes.to(device=DEV, dtype=torch.int64)


def check(problem, out, rows=slice(None)):
    """SPEC accuracy bound and finiteness of ``out[rows]`` against the float64 oracle."""
    ref = reference_float64(*problem)[rows]
    got = out[rows]
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    if got.numel():
        err = rel_error(got, ref)
        assert err <= SPEC_TOLERANCE, f"relative error {err:.2e} > {SPEC_TOLERANCE}"


def run(problem, config=None):
    xq, wq = problem[0], problem[1]
    out = poisoned_out(xq.shape[0], wq.shape[1], DEV)
    if config is None:
        tk.run(*problem, out)
    else:
        tk.launch(*problem, out, config=config)
    torch.cuda.synchronize()
    return out


@pytest.fixture
def gen():
    g = torch.Generator(device=DEV)
    g.manual_seed(torch.seed() % (1 << 62))  # fresh data on every run
    return g


def test_create_reports_the_seam():
    backend = tk.create(DEV)
    assert (backend.name, backend.fp8_dtype, backend.weight_layout, backend.capture_safe) == (
        "triton", FP8, "plain", True)


@pytest.mark.parametrize("g", [1, 8, 64, 256])
@pytest.mark.parametrize("m", [0, 1, 7, 83, 1335, 16384])
def test_ragged_groups_match_reference(m, g, gen):
    n, k = (256, 512) if m * g < 16384 * 64 else (128, 256)
    sizes = random_m_sizes(g, m)
    problem = make_problem(m, n, k, g, sizes, gen)
    check(problem, run(problem))


@pytest.mark.parametrize("config", tk.candidate_configs(1024, 1280, 1024, 8) + tk.candidate_configs(64, 1280, 1024, 8),
                         ids=lambda c: c.key())
def test_every_candidate_config(config, gen):
    sizes = torch.tensor([0, 301, 1, 0, 77, 500, 17, 128])
    problem = make_problem(int(sizes.sum()), 1280, 1024, 8, sizes, gen)
    check(problem, run(problem, config))


def even_split(m, g):
    base, extra = divmod(m, g)
    return torch.tensor([base + (1 if i < extra else 0) for i in range(g)])


@pytest.mark.slow
@pytest.mark.parametrize("m,n,k", SEED_SHAPES)
def test_seed_shapes(m, n, k, gen):
    problem = make_problem(m, n, k, 8, even_split(m, 8), gen)
    check(problem, run(problem))


@pytest.mark.slow
def test_weights_past_2_31_elements(gen):
    # 48 x 7168 x 7168 = 2.47e9 weight elements; rows only in low and high groups.
    g, n, k = 48, 7168, 7168
    assert g * n * k >= 2**31
    sizes = torch.zeros(g, dtype=torch.int64)
    sizes[0], sizes[g // 2], sizes[g - 1] = 5, 40, 83
    problem = make_problem(int(sizes.sum()), n, k, g, sizes, gen)
    check(problem, run(problem))


@pytest.mark.slow
def test_activations_past_2_31_elements(gen):
    # 262400 x 8192 = 2.15e9 activation elements; check the first and last rows.
    g, n, k, m = 4, 256, 8192, 262400
    assert m * k >= 2**31
    sizes = torch.tensor([1000, m // 2, 0, m - 1000 - m // 2])
    problem = make_problem(m, n, k, g, sizes, gen)
    out = run(problem)
    xq, wq, xs, ws, _ = problem
    tail = 3000
    tail_problem = (xq[m - tail:], wq, xs[m - tail:], ws, torch.tensor([0, 0, 0, tail], device=DEV))
    check(tail_problem, out[m - tail:])
    head_problem = (xq[:1000], wq, xs[:1000], ws, torch.tensor([1000, 0, 0, 0], device=DEV))
    check(head_problem, out[:1000])


@pytest.mark.parametrize("m,g", [(83, 8), (1335, 64), (4096, 8)])
def test_graph_replay_matches_eager_on_new_data(m, g, gen):
    n, k = 512, 1024
    problem = make_problem(m, n, k, g, random_m_sizes(g, m), gen)
    out = poisoned_out(m, n, DEV)
    tk.run(*problem, out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.run(*problem, out)
    # New data and a new split in the same buffers: the graph must follow them.
    fresh = make_problem(m, n, k, g, random_m_sizes(g, m), gen)
    for dst, src in zip(problem, fresh):
        dst.copy_(src)
    out.fill_(math.nan)
    graph.replay()
    eager = run(problem)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    check(problem, out)


def test_addressed_graph_follows_a_swapped_weight_set(gen):
    m, n, k, g = 300, 512, 1024, 8
    sizes = random_m_sizes(g, m)
    first = make_problem(m, n, k, g, sizes, gen)
    second = make_problem(m, n, k, g, sizes, gen)
    xq, _, x_scale, _, m_sizes = first
    words = torch.tensor(weight_addresses(first[1], first[3]), device=DEV)
    out = poisoned_out(m, n, DEV)
    tk.run_addressed(xq, words, x_scale, m_sizes, out, groups=g)  # compile outside the capture
    torch.cuda.synchronize()
    assert torch.equal(out, run(first))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.run_addressed(xq, words, x_scale, m_sizes, out, groups=g)
    # Point the captured graph at the second weight set: only the two words change.
    words.copy_(torch.tensor(weight_addresses(second[1], second[3])))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    swapped = (xq, second[1], x_scale, second[3], m_sizes)
    assert torch.equal(out, run(swapped))
    check(swapped, out)


# Every schedule on ragged groups with empty ones. K = 1280 is 10 K blocks: uneven
# split ranges (sk3: 4, 4, 2; sk8: 2, 2, 2, 2, 2, 0, 0, 0) and five even pairs;
# K = 1152 (9 blocks) leaves an odd block for the paired loops. Split-K and preloading
# are the single-block decode tile's only (TileConfig.fits).
T = tk.TileConfig
SCHEDULE_CONFIGS = [
    T("decode", 16, 128, 4, 3, evict_w="evict_first"),
    T("decode", 64, 128, 4, 3, evict_w="evict_first"),
    T("decode", 16, 128, 4, 3, split_k=3, evict_w="evict_first"),
    T("decode", 32, 128, 4, 3, split_k=8, evict_w="evict_first"),
    T("decode", 16, 64, 4, 3, split_k=4, evict_w="evict_first"),
    T("decode_pair", 16, 128, 4, 3, evict_w="evict_first"),
    T("decode_pair", 16, 128, 8, 3, evict_w="evict_first"),
    T("decode_pair", 16, 64, 8, 3, evict_w="evict_first"),
    T("decode", 16, 128, 8, 3, evict_w="evict_first"),
    T("decode", 16, 128, 4, 3, split_k=4, evict_w="evict_first", group_tiles_m=8, preload=True),
    T("decode_pair", 16, 128, 4, 3, evict_w="evict_first", group_tiles_m=8),
    T("persistent_tma", 64, 128, 4, 4, group_tiles_m=8, per_sm=2),
    T("persistent_tma", 64, 128, 4, 3, per_sm=2),
    T("persistent_tma", 128, 128, 8, 4, group_tiles_m=8),
    T("gluon_ws", 128, 256, 4, 3, group_tiles_m=8),
    T("persistent_ws", 128, 128, 4, 2, group_tiles_m=8),
]


@pytest.mark.parametrize("k", [1280, 1152])
@pytest.mark.parametrize("config", SCHEDULE_CONFIGS, ids=lambda c: c.key())
def test_every_schedule_matches_reference_and_repeats(config, k, gen):
    sizes = torch.tensor([0, 301, 1, 0, 77, 500, 17, 128])
    problem = make_problem(int(sizes.sum()), 1280, k, 8, sizes, gen)
    first = run(problem, config)
    check(problem, first)
    # Again on the same workspace: split-K counters were reset by the last split of
    # every tile and the reduction order is fixed, so the bits repeat; by address too.
    assert torch.equal(run(problem, config), first)
    xq, wq, x_scale, w_scale, m_sizes = problem
    out = poisoned_out(xq.shape[0], 1280, DEV)
    words = torch.tensor(weight_addresses(wq, w_scale), device=DEV)
    tk._launch(xq, words, x_scale, words, m_sizes, out, 1280, 8, config, addrs=True)
    assert torch.equal(out, first)


_PLAIN = [getattr(c, "values", (c,))[0] for c in SCHEDULE_CONFIGS]


@pytest.mark.parametrize("config", [
    T("decode", 16, 128, 4, 3, evict_w="evict_first", preload=True),
    T("decode", 16, 128, 4, 3, split_k=4, evict_w="evict_first", preload=True),
    T("decode", 32, 128, 4, 3, split_k=3, evict_w="evict_first"),
    T("decode_pair", 16, 128, 4, 3, evict_w="evict_first")],
    ids=lambda c: c.key())
def test_decode_bands_change_only_the_order(config, gen):
    """Bands of row tiles per weight tile (the table's decode tiles at G < 64 from 16 rows a
    group) walk the same tiles in another order: the same bits, with a hot expert of several
    token tiles, empty groups and a last band shorter than the others (split-K tiles too)."""
    sizes = torch.tensor([45, 0, 13, 6, 29, 0, 3, 8, 70, 1, 0])
    m, n, k, g = int(sizes.sum()), 1280, 1280, 11
    problem = make_problem(m, n, k, g, sizes, gen)
    plain = run(problem, config)
    check(problem, plain)
    for band in (2, 8, 64):
        assert torch.equal(run(problem, replace(config, group_tiles_m=band)), plain)


@pytest.mark.parametrize("config", [c for c in SCHEDULE_CONFIGS if not hasattr(c, "values")],
                         ids=lambda c: c.key())
def test_every_schedule_stores_float32_when_out_is_float32(config, gen):
    """A float32 out gets the float32 sum unrounded (the expert FFN's h), direct and by
    address; rounded to bf16 it is the bf16 output bit for bit, which is unchanged."""
    sizes = torch.tensor([0, 301, 1, 0, 77, 500, 17, 128])
    m, n, k, g = int(sizes.sum()), 1280, 1152, 8
    problem = make_problem(m, n, k, g, sizes, gen)
    wide = torch.full((m, n), float("nan"), dtype=torch.float32, device=DEV)
    narrow = run(problem, tk.tile_for_out(config, wide))  # the tile a float32 out runs
    tk.launch(*problem, wide, config=config)
    xq, wq, x_scale, w_scale, m_sizes = problem
    by_address = torch.full_like(wide, float("nan"))
    words = torch.tensor(weight_addresses(wq, w_scale), device=DEV)
    tk._launch(xq, words, x_scale, words, m_sizes, by_address, n, g, config, addrs=True)
    torch.cuda.synchronize()
    assert torch.isfinite(wide).all(), "unwritten (NaN-poisoned) float32 output"
    assert torch.equal(by_address, wide)
    assert torch.equal(wide.to(torch.bfloat16), narrow)
    assert not torch.equal(wide, narrow.float())  # really float32, not bf16 widened
    # (the FP8 MMA's own accumulation error stays; the bf16 rounding is what goes)
    ref = reference_float64(*problem)
    assert rel_error(wide, ref) < rel_error(narrow, ref)


def test_public_function_takes_a_float32_out(gen):
    """grouped_gemm(out=float32) on the GPU: the sum unrounded; the default stays bf16."""
    sizes = torch.tensor([3, 0, 60, 1])
    problem = make_problem(64, 512, 1024, 4, sizes, gen)
    assert tk.default_config(64, 512, 1024, 4).schedule != "persistent_ws"  # one tile for both
    narrow = grouped_gemm(*problem)
    assert narrow.dtype == torch.bfloat16
    wide = torch.full((64, 512), float("nan"), dtype=torch.float32, device=DEV)
    assert grouped_gemm(*problem, out=wide) is wide
    assert torch.equal(wide.to(torch.bfloat16), narrow)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        tk.run(*problem, torch.empty((64, 512), dtype=torch.float16, device=DEV))


@pytest.mark.parametrize("config", [c for c in _PLAIN if c.split_k > 1] + [
    T("persistent_ws", 128, 128, 4, 2, group_tiles_m=8),
    T("persistent_tma", 64, 128, 4, 4, group_tiles_m=8, per_sm=2),
    T("gluon_ws", 128, 256, 4, 3, group_tiles_m=8)],
    ids=lambda c: c.key())
def test_split_k_and_persistent_graph_replay_matches_eager_on_new_data(config, gen):
    m, n, k, g = 700, 512, 2048, 8
    problem = make_problem(m, n, k, g, random_m_sizes(g, m), gen)
    out = poisoned_out(m, n, DEV)
    tk.launch(*problem, out, config=config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.launch(*problem, out, config=config)
    for _ in range(2):  # twice: the replay leaves the workspace clean for the next
        fresh = make_problem(m, n, k, g, random_m_sizes(g, m), gen)
        for dst, src in zip(problem, fresh):
            dst.copy_(src)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(problem, config))
        check(problem, out)


# The persistent tiles with more tiles than programs (each program walks several,
# across group boundaries, with empty groups and surplus row tiles), up to G = 384
# (the warp-specialised tiles up to their G limit).
_PERSISTENT = [
    T("persistent_ws", 128, 128, 4, 2, group_tiles_m=8), T("persistent_ws", 128, 128, 4, 2),
    T("persistent_tma", 64, 128, 4, 4, group_tiles_m=8, per_sm=2),
    T("persistent_tma", 128, 128, 8, 4, group_tiles_m=8), T("persistent_tma", 64, 128, 4, 4, per_sm=2),
    T("gluon_ws", 128, 256, 4, 3, group_tiles_m=8), T("gluon_ws", 128, 256, 4, 4),
]


@pytest.mark.parametrize("config,g", [(c, g) for c in _PERSISTENT for g in (8, 64, 384) if c.fits(2048, g)],
                         ids=lambda v: v.key() if hasattr(v, "key") else f"g{v}")
def test_persistent_tiles_walk_more_tiles_than_programs(config, g, gen):
    m, n, k = 6000, 2048, 1152
    sizes = random_m_sizes(g, m)
    sizes[1] = 0
    sizes[0] += m - int(sizes.sum())
    problem = make_problem(m, n, k, g, sizes, gen)
    tiles = tk.row_tile_bound(m, g, config.block_m) * (n // config.block_n)
    assert tiles > torch.cuda.get_device_properties(DEV).multi_processor_count
    first = run(problem, config)
    check(problem, first)
    assert torch.equal(run(problem, config), first)


# Sizes the kernels must survive without a store past M or into another group:
# sums past M, negative sizes, sizes past int32. Guard rows after M stay poisoned.
BAD_SIZES = [
    [300, 300, 300, 0, 0, 0, 0, 0],           # sums to 900 > M
    [-5, 40, 2**40, 7, 0, 0, 0, 9],            # negative, far past int32
    [2**62, 2**62, 2**62, 2**62, 1, 1, 1, 1],  # the int64 sum wraps
]


@pytest.mark.parametrize("sizes", BAD_SIZES)
@pytest.mark.parametrize("config", _PLAIN, ids=lambda c: c.key())
def test_sizes_past_m_never_store_past_m(sizes, config, gen):
    m, n, k, g, guard = 200, 256, 512, 8, 64
    problem = make_problem(m, n, k, g, torch.zeros(g, dtype=torch.int64), gen)
    xq, wq, x_scale, w_scale, _ = problem
    m_sizes = torch.tensor(sizes, dtype=torch.int64, device=DEV)
    full = poisoned_out(m + guard, n, DEV)
    tk.launch(xq, wq, x_scale, w_scale, m_sizes, full[:m], config=config)
    torch.cuda.synchronize()
    assert torch.isnan(full[m:]).all(), "a store past row M"
    # The rows that exist belong to the clamped groups: group g owns
    # [min(prefix_g, M), min(prefix_g + max(size_g, 0), M)), each checked alone.
    lo = 0
    for group, size in enumerate(sizes):
        hi = min(m, lo + min(max(size, 0), m))
        if hi > lo:
            part = (xq[lo:hi], wq[group:group + 1], x_scale[lo:hi], w_scale[group:group + 1],
                    torch.tensor([hi - lo], device=DEV))
            check(part, full[lo:hi])
        lo = hi
