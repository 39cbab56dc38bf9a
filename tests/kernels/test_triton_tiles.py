"""The triton backend's host-side logic, on the CPU: tile table, grid bound.

Needs the triton package (the ``cuda`` extra) but no GPU; no kernel is launched.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from moegemm.kernels import triton_kernel as tk
from moegemm.kernels.testing import random_m_sizes

SHAPES = [(m, n, k, g) for m in (1, 7, 83, 1335, 16384) for n, k in ((1280, 8192), (7168, 2304), (384, 512))
          for g in (1, 8, 256)]


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_row_tile_bound_covers_every_split(block_m):
    gen = torch.Generator().manual_seed(torch.seed() % (1 << 62))
    for _ in range(200):
        g = int(torch.randint(1, 300, (1,), generator=gen))
        m = int(torch.randint(0, 5000, (1,), generator=gen))
        sizes = random_m_sizes(g, m, generator=gen).tolist()
        needed = sum(-(-s // block_m) for s in sizes)
        assert needed <= tk.row_tile_bound(m, g, block_m)
    # Tight where it can be: one group, or every row alone in a group.
    assert tk.row_tile_bound(1000, 1, block_m) == -(-1000 // block_m)
    assert tk.row_tile_bound(5, 5, block_m) == 5


@pytest.mark.parametrize("m,n,k,g", SHAPES)
def test_table_and_candidates_fit_the_shape(m, n, k, g):
    default = tk.default_config(m, n, k, g)
    assert default.fits(n)
    candidates = tk.candidate_configs(m, n, k, g)
    assert candidates[0] == default
    assert len(set(candidates)) == len(candidates)
    assert all(c.fits(n) for c in candidates)


def test_decode_table_rules():
    T = tk.TileConfig
    ef = "evict_first"
    assert tk.default_config(32, 7168, 8192, 8).swap_ab
    assert not tk.default_config(16384, 7168, 2304, 8).swap_ab
    # Fewer weight tiles than SMs and long K: 16-token tiles, with weight tiles for at least
    # 60 % of the SMs (80 of 132) and the unsplit tile's scale products preloaded, unsplit
    # behind a 6-slot ring; else 128-row weight tiles split along K, the split doubled from 2
    # to 8 while the programs stay within 3 per SM (396 on 132 SMs); scale products preloaded;
    # 8 warps where the row tiles are walked one by one (band 1).
    unsplit = T("decode", 16, 128, 8, 6, evict_w=ef, preload=True)
    assert tk.default_config(32, 1280, 8192, 8) == unsplit  # 80 tiles
    assert tk.default_config(1, 16384, 5120, 128) == unsplit  # Llama-4 w13, 1 token: 128 tiles
    assert tk.default_config(128, 1280, 8192, 8) == replace(unsplit, num_warps=4, group_tiles_m=8)
    split4 = T("decode", 16, 128, 8, 3, split_k=4, evict_w=ef, preload=True)
    assert tk.default_config(2, 4096, 14336, 8) == split4  # Mixtral-8x7B w2, 1 token: 64 tiles
    assert tk.default_config(1, 5120, 8192, 128) == replace(split4, split_k=8)  # Llama-4 w2: 40 tiles
    # 96 tiles, but 128 K blocks of scale products, too many to preload: split.
    assert tk.default_config(2, 6144, 16384, 8) == split4  # Mixtral-8x22B w2, 1 token
    # 32-token tiles split, their scale products preloaded or not.
    split32 = T("decode", 32, 128, 4, 3, split_k=4, evict_w=ef, group_tiles_m=8, preload=True)
    assert tk.default_config(24 * 8, 1280, 8192, 8) == split32
    assert tk.default_config(32 * 8, 1280, 4096, 8) == split32
    # 64-token tiles unsplit (never preloaded: not measured).
    assert tk.default_config(40 * 8, 1280, 8192, 8) == T("decode", 64, 128, 4, 3, evict_w=ef, group_tiles_m=8)
    # Pairs with the scales ahead for one active expert and for K >= 2048 ...
    for m, n, k in ((32, 7168, 8192), (128, 8192, 3584)):
        cfg = tk.default_config(m, n, k, 8)
        assert (cfg.schedule, cfg.block_m, cfg.block_n, cfg.num_warps) == ("decode_pair", 16, 128, 4)
    # ... with 64-row weight tiles and 8 warps where the weight tiles are fewer than the SMs
    # and K is short (a single expert's 64 tiles become 128 programs).
    assert tk.default_config(1, 8192, 1024, 8) == T("decode_pair", 16, 64, 8, 3, evict_w=ef)
    assert tk.default_config(1, 8192, 3584, 8) == T("decode_pair", 16, 128, 4, 3, evict_w=ef)
    # Not for K = 1024 with enough tiles: the single-block tile, its scales preloaded.
    assert tk.default_config(128, 8192, 1024, 8) == T("decode", 16, 128, 4, 3, evict_w=ef, group_tiles_m=8,
                                                      preload=True)
    # At G >= 64, 16-token tiles: the 8-warp pair where the weight tiles fill at most two
    # programs per SM (264) or K >= 4096; the 8-warp single-block tile to 8 per SM; beyond,
    # the plain preloaded tile.
    pair8 = T("decode_pair", 16, 128, 8, 3, evict_w=ef)
    assert tk.default_config(8, 2048, 768, 128) == pair8  # Qwen3-30B w2, 1 token: 128 tiles
    assert tk.default_config(8, 4096, 1536, 128) == pair8  # Qwen3-235B w2, 1 token: 256 tiles
    assert tk.default_config(8, 4096, 7168, 256) == pair8  # DeepSeek-V3 w13, 1 token
    assert tk.default_config(256, 4096, 7168, 256) == pair8  # many tiles, K >= 4096
    single8 = T("decode", 16, 128, 8, 3, evict_w=ef)
    assert tk.default_config(8, 7168, 2048, 256) == single8  # DeepSeek-V3 w2, 1 token: 448 tiles
    assert tk.default_config(8, 5120, 1536, 160) == single8  # GLM-4.5 w2, 1 token: 320 tiles
    assert tk.default_config(128, 2048, 768, 128) == T("decode", 16, 128, 4, 3, evict_w=ef, preload=True)
    assert tk.default_config(2048, 4096, 7168, 256).block_m == 16
    # Preloaded only where a chunk holds at most 1024 scale products: the 32-token tile to
    # K = 4096 (32 blocks), not at K = 5120 (40 blocks, a chunk of 64); never the unsplit pairs
    # nor rule c's 8-warp tiles (the 8-warp split tiles of rule a are preloaded).
    assert tk.default_config(2048, 3072, 4096, 128) == T("decode", 32, 128, 4, 3, evict_w=ef, preload=True)
    assert tk.default_config(2048, 3072, 5120, 160) == T("decode", 32, 128, 4, 3, evict_w=ef)
    assert not any(tk.default_config(m, n, k, g).preload
                   for m, n, k, g in ((8, 2048, 768, 128), (1, 8192, 1024, 8), (128, 8192, 3584, 8),
                                      (8, 7168, 2048, 256)))


def test_decode_bands_where_hot_experts_hold_several_token_tiles():
    # G < 64 from 16 rows per group: bands of 8 row tiles per weight tile (a hot expert's
    # token tiles side by side); below it, and at G >= 64, row tile by row tile.
    for m, n, k in ((128, 28672, 4096), (128, 4096, 14336), (128, 32768, 6144), (384, 6144, 16384)):
        assert tk.default_config(m, n, k, 8).group_tiles_m == 8
    for m, n, k, g in ((16, 28672, 4096, 8), (64, 4096, 14336, 8), (2, 4096, 14336, 8),
                       (2048, 7168, 2048, 256), (2048, 3072, 4096, 128), (16, 5120, 8192, 128)):
        cfg = tk.default_config(m, n, k, g)
        assert cfg.swap_ab and cfg.group_tiles_m == 1


def test_prefill_table_rules():
    T = tk.TileConfig
    gluon = T("gluon_ws", 128, 256, 4, 3, group_tiles_m=8)
    pair = T("persistent_ws", 128, 128, 4, 2, group_tiles_m=8)
    # Even routing, >= 128 rows per group: 128 x 256 Gluon tiles where they fill the SMs ...
    assert tk.default_config(1024, 7168, 2304, 8) == gluon
    assert tk.default_config(4096, 6144, 16384, 8) == gluon  # Mixtral-8x22B w2, 2048 tokens
    # ... at any rows per group ...
    for m, n, k in ((16384, 2048, 7168), (16384, 7168, 2304)):
        assert tk.default_config(m, n, k, 8) == gluon
    # ... else the 128-wide pair (also where N is no multiple of 256).
    assert tk.default_config(1024, 2048, 7168, 8) == pair
    assert tk.default_config(16384, 1152, 7168, 8) == pair
    # Many experts (skewed routing), from 32 rows per group: the Gluon warp-specialised tile
    # (any G up to TABLE_G_MAX) where N is a multiple of 256, its store-warp form to K = 5120 ...
    store = T("gluon_ws_store", 128, 256, 4, 3, group_tiles_m=8)
    for m, n, k, g in ((32768, 4096, 7168, 256), (65 * 384, 4096, 7168, 384), (65 * 1024, 2048, 7168, 1024)):
        assert tk.default_config(m, n, k, g) == gluon
    for m, n, k, g in ((200000, 4096, 1536, 128), (16384 + 256, 7168, 2048, 256), (9000, 512, 1536, 128),
                       (65536, 3072, 5120, 160), (8192 + 128, 16384, 5120, 128)):
        assert tk.default_config(m, n, k, g) == store
    # ... at every mean rows per group from 32 (the tile skips a dead half itself).
    for m, n, k, g in ((16384, 4096, 7168, 384), (32 * 1024, 2048, 7168, 1024), (64 * 256, 4096, 7168, 256)):
        assert tk.default_config(m, n, k, g) == gluon
    for m, n, k, g in ((16384, 7168, 2048, 256), (8192, 16384, 5120, 128), (16384, 7168, 2048, 384)):
        assert tk.default_config(m, n, k, g) == store
    # ... else, and below 128 rows per group at G < 64: the persistent TMA tiles with the tile table.
    many = T("persistent_tma", 64, 128, 4, 4, group_tiles_m=8, per_sm=2)
    for m, n, k, g in ((512, 2048, 7168, 8), (16384, 1408, 2048, 128), (4000, 1408, 2048, 64),
                       (100 * 32, 4096, 7168, 32)):
        assert tk.default_config(m, n, k, g) == many
    # Below 32 rows per group at G >= 64 (and 48 below G = 64): the swapped decode tiles
    # (but see the large-expert rule below).
    assert tk.default_config(2048, 16384 + 128, 5120, 128).swap_ab
    assert tk.default_config(2048, 4096, 7168, 256).swap_ab
    assert tk.default_config(40 * 8, 1280, 8192, 8).swap_ab
    # At G >= 64 from 16 rows per group where one expert's weights pass 32 MiB (Llama-4 at
    # 2048 tokens), not for smaller experts (Qwen3 at 256 tokens), nor without N % 256 == 0.
    assert tk.default_config(2048, 16384, 5120, 128) == store
    assert tk.default_config(2048, 5120, 8192, 128) == gluon
    assert tk.default_config(2048, 3072, 4096, 128).swap_ab
    assert tk.default_config(2048, 16384 + 128, 5120, 128).swap_ab
    assert tk.default_config(1024, 16384, 5120, 128).swap_ab  # r = 8
    # The warp-specialised Triton tile: 128 x 128, 2 stages (deeper buffers: NaN column, v8/v9).
    for m, n, k, g in SHAPES:
        for cfg in [tk.default_config(m, n, k, g), *tk.candidate_configs(m, n, k, g)]:
            assert cfg.schedule != "persistent_ws" or (cfg.block_n, cfg.num_stages) == (128, 2)


def test_schedule_limits_and_keys():
    T = tk.TileConfig
    assert len({c.key() for c in (T("decode", 16, 128), T("decode_pair", 16, 128), T("decode", 16, 128, split_k=2),
                                  T("decode", 16, 128, evict_w="evict_first"))}) == 4
    assert not T("persistent_tma", 64, 128, split_k=2).fits(1280)  # split-K only on decode tiles
    assert not T("decode", 16, 256).fits(1280)
    assert not T("persistent_tma", 128, 128, 4).fits(2048)  # 128 rows: two warpgroups
    assert not T("persistent_tma", 64, 128, 4, per_sm=3).fits(2048)
    assert not T("persistent_ws", 128, 128, per_sm=2).fits(2048)
    assert not T("persistent_tma", 64, 256, 4).fits(2048)  # 256-wide: spills (v12)
    assert T("persistent_tma", 64, 128, 4, per_sm=2).fits(2048, tk.TABLE_G_MAX)
    assert not T("persistent_tma", 64, 128, 4).fits(2048, tk.TABLE_G_MAX + 1)
    assert T("persistent_ws", 128, 128, 4, 2).fits(2048)
    assert not T("persistent_ws", 128, 256, 4, 2).fits(2048)
    assert not T("persistent_ws", 128, 128, 4, 3).fits(2048)  # deeper buffers: NaN column (v8, v9)
    assert not T("persistent_ws", 128, 128, 8).fits(2048)  # 4 warps: a producer and two consumers
    # Preloaded scales: a decode-loop variant only, with a key of its own; split-K and
    # preloading on the single-block decode tile only (the pair loads its scales a pair ahead).
    assert T("decode", 16, 128, 8, 5, preload=True).fits(2048)
    assert T("decode", 16, 128, 8, 3, split_k=4, preload=True).fits(2048)
    assert T("decode_pair", 16, 128, 8, 5).fits(2048)
    assert not T("decode_pair", 16, 128, 8, 5, preload=True).fits(2048)
    assert not T("decode_pair", 16, 64, 4, 3, split_k=2).fits(2048)
    assert not T("persistent_tma", 64, 128, preload=True).fits(2048)
    assert T("decode", 16, 128, preload=True).key() != T("decode", 16, 128).key()
    assert not T("nonesuch", 64, 128).fits(2048)
    # The Gluon tile: 128 x 256, a producer warp and two consumer warpgroups, 3-4 ring slots.
    assert T("gluon_ws", 128, 256, 4, 3).fits(2048, tk.TABLE_G_MAX)
    assert not T("gluon_ws", 128, 256, 4, 3).fits(2048, tk.TABLE_G_MAX + 1)
    assert not T("gluon_ws", 128, 256, 4, 3).fits(1408)
    assert not T("gluon_ws", 128, 128, 4, 3).fits(2048)
    assert not T("gluon_ws", 64, 256, 4, 3).fits(2048)
    assert not T("gluon_ws", 128, 256, 8, 3).fits(2048)
    assert not T("gluon_ws", 128, 256, 4, 5).fits(2048)  # 5 slots: 240 KiB of shared memory
    assert not T("gluon_ws", 128, 256, 4, 3, per_sm=2).fits(2048)
    # Its store-warp form takes the same tile; it stages 64 KB beside the ring: 3 slots.
    for variant in ("gluon_ws_store",):
        assert T(variant, 128, 256, 4, 3, group_tiles_m=8).fits(2048, tk.TABLE_G_MAX)
        assert not T(variant, 128, 256, 4, 3).fits(2048, tk.TABLE_G_MAX + 1)
        assert not T(variant, 128, 256, 4, 3).fits(1408)
        assert not T(variant, 128, 128, 4, 3).fits(2048)
    assert not T("gluon_ws_store", 128, 256, 4, 4).fits(2048)  # 256 KiB
    # The persistent tile's group walk is unrolled: bounded G.
    assert T("persistent_ws", 128, 128, 4, 2).fits(2048, tk.PERSISTENT_G_MAX)
    assert not T("persistent_ws", 128, 128, 4, 2).fits(2048, tk.PERSISTENT_G_MAX + 1)


def test_the_table_schedules_refuse_more_groups_than_their_search_holds():
    """Past TABLE_G_MAX groups the tile table's unrolled search stops a step short and a
    tile would land in the group before its own: the launch is refused before anything is
    planned, for every schedule but the decode tiles (whose lookup takes any G)."""
    g = tk.TABLE_G_MAX + 1
    m, n, k = 40 * g, 256, 512
    config = tk.default_config(m, n, k, g)
    assert not config.swap_ab  # what the table picks for this many rows a group
    xq = torch.zeros((m, k), dtype=torch.float8_e4m3fn)
    xs = torch.ones((m, k // 128))
    wq = torch.zeros((g, n, k), dtype=torch.float8_e4m3fn)
    ws = torch.ones((g, k // 128, n // 128))
    sizes = torch.full((g,), 40, dtype=torch.int64)
    out = torch.empty((m, n), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"does not take N=256 with G={g} .*at most 1024 groups"):
        tk.launch_plan(xq, wq, xs, ws, sizes, out, n, g, config, addrs=False)


def test_a_tile_that_does_not_fit_is_never_launched():
    """The pair kernel takes neither split-K nor preloaded scales (the table never gives a pair
    them), persistent_ws walks at most PERSISTENT_G_MAX groups, and a tile must divide N: the
    launcher asks ``fits``, so a launch asking for any of these is refused before anything is
    planned, not run as something its key does not say."""
    m, n, k, g = 8, 256, 1152, 2
    xq = torch.zeros((m, k), dtype=torch.float8_e4m3fn)
    xs = torch.ones((m, k // 128))
    wq = torch.zeros((g, n, k), dtype=torch.float8_e4m3fn)
    ws = torch.ones((g, k // 128, n // 128))
    sizes = torch.full((g,), m // g, dtype=torch.int64)
    out = torch.empty((m, n), dtype=torch.bfloat16)
    for config in (tk.TileConfig("decode_pair", 16, 64, 4, 3, split_k=2),
                   tk.TileConfig("decode_pair", 16, 128, 4, 3, preload=True)):
        with pytest.raises(ValueError, match=r"does not take N=256 with G=2 \(TileConfig.fits"):
            tk.launch_plan(xq, wq, xs, ws, sizes, out, n, g, config, addrs=False)
    with pytest.raises(ValueError, match="does not take N=256"):  # 256 is not a multiple of 384
        tk.launch_plan(xq, wq, xs, ws, sizes, out, n, g, tk.TileConfig("decode", 16, 384, 4, 3),
                       addrs=False)
    g = tk.PERSISTENT_G_MAX + 1
    wq = torch.zeros((g, n, k), dtype=torch.float8_e4m3fn)
    ws = torch.ones((g, k // 128, n // 128))
    sizes = torch.zeros((g,), dtype=torch.int64)
    sizes[0] = m
    with pytest.raises(ValueError, match=f"does not take N=256 with G={g}"):
        tk.launch_plan(xq, wq, xs, ws, sizes, out, n, g, tk.TileConfig("persistent_ws", 128, 128, 4, 2),
                       addrs=False)


def test_split_workspace_is_cached_and_starts_clean():
    cpu = torch.device("cpu")
    parts, counts = tk._split_workspace(cpu, 37, 4, 16 * 64)
    assert parts.dtype == torch.float32 and parts.numel() == 37 * 4 * 16 * 64
    assert counts.dtype == torch.int32 and counts.numel() == 37 and int(counts.abs().sum()) == 0
    again = tk._split_workspace(cpu, 37, 4, 16 * 64)
    assert again[0] is parts and again[1] is counts
    other = tk._split_workspace(cpu, 38, 4, 16 * 64)
    assert other[0].data_ptr() != parts.data_ptr()


class _RecordingKernel:
    """Stands in for a Triton kernel: records the grid and the arguments of one launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def _launch_without_a_gpu(monkeypatch) -> None:
    """What a launch asks of the GPU, stood in for: an H100/H200's 132 SMs, no split-K
    workspace, no TMA scratch allocator."""
    monkeypatch.setattr(tk, "_sm_count", lambda device: 132)
    monkeypatch.setattr(tk, "_split_workspace", lambda *a: (None, None))
    monkeypatch.setattr(tk.triton, "set_allocator", lambda fn: None)


@pytest.mark.parametrize("m,n,k,g", [(1, 8192, 1024, 8), (32, 1280, 8192, 8), (16384, 2048, 7168, 8),
                                     (1024, 2048, 7168, 8), (32768, 4096, 7168, 256), (200000, 4096, 1536, 128),
                                     (16384, 1408, 2048, 128)])
def test_both_entries_launch_the_same_kernel_grid_and_tile(m, n, k, g, monkeypatch):
    """SPEC 3: the address entry (a server graph) and the public entry run the same kernel
    with the same tile and grid; only the weights' source differs (ADDRS)."""
    config = tk.default_config(m, n, k, g)
    kernel = _RecordingKernel()
    monkeypatch.setitem(tk.SCHEDULES, config.schedule, kernel)
    _launch_without_a_gpu(monkeypatch)
    xq = torch.zeros((m, k), dtype=torch.float8_e4m3fn)
    wq = torch.zeros((g, n, k), dtype=torch.float8_e4m3fn)
    w_scale = torch.ones((g, k // 128, n // 128))
    x_scale = torch.ones((m, k // 128))
    sizes = torch.full((g,), m // g)
    out = torch.empty((m, n), dtype=torch.bfloat16)
    tk.run(xq, wq, x_scale, w_scale, sizes, out)
    words = torch.tensor([wq.data_ptr(), w_scale.data_ptr()])
    tk.run_addressed(xq, words, x_scale, sizes, out, groups=g)
    (grid_a, args_a, kw_a), (grid_b, args_b, kw_b) = kernel.launches
    assert grid_a == grid_b == tk.grid_for(config, m, n, k, g, 132)
    assert (kw_a.pop("ADDRS"), kw_b.pop("ADDRS")) == (False, True)
    assert kw_a == kw_b
    assert args_a[1] is wq and args_b[1] is words
    same = [i for i in range(len(args_a)) if i not in (1, 3)]
    assert all(args_a[i] is args_b[i] or args_a[i] == args_b[i] for i in same)


@pytest.mark.parametrize("m,n,k,g", [(16384, 2048, 7168, 8), (16384, 7168, 2304, 8), (32, 1280, 8192, 8),
                                     (1024, 2048, 7168, 8), (4096, 1536, 7168, 8), (65536, 4096, 7168, 256)])
def test_float32_out_runs_warp_specialised_tiles_as_the_tma_prefill(m, n, k, g, monkeypatch):
    """A float32 out (the FFN's h): persistent_ws tiles run as the TMA prefill tile, grid
    and all, in both entries; other tiles (the Gluon tile too), and every bf16 launch, run as
    the table says."""
    config = tk.default_config(m, n, k, g)
    want = tk.FLOAT32_OUT_PREFILL if config.schedule == "persistent_ws" else config
    assert want.fits(n, g)
    kernels = {name: _RecordingKernel() for name in tk.SCHEDULES}
    for name, kernel in kernels.items():
        monkeypatch.setitem(tk.SCHEDULES, name, kernel)
    _launch_without_a_gpu(monkeypatch)
    xq = torch.zeros((m, k), dtype=torch.float8_e4m3fn)
    wq = torch.zeros((g, n, k), dtype=torch.float8_e4m3fn)
    w_scale, x_scale = torch.ones((g, k // 128, n // 128)), torch.ones((m, k // 128))
    sizes = torch.full((g,), m // g)
    words = torch.tensor([wq.data_ptr(), w_scale.data_ptr()])
    for dtype, tile in ((torch.float32, want), (torch.bfloat16, config)):
        out = torch.empty((m, n), dtype=dtype)
        tk.run(xq, wq, x_scale, w_scale, sizes, out)
        tk.run_addressed(xq, words, x_scale, sizes, out, groups=g)
        (grid_a, _, kw_a), (grid_b, _, kw_b) = kernels[tile.schedule].launches
        assert grid_a == grid_b == tk.grid_for(tile, m, n, k, g, 132)
        stages = "STAGES" if tile.schedule == "gluon_ws" else "num_stages"
        assert (kw_a["BLOCK_M"], kw_a["BLOCK_N"], kw_a[stages]) == (
            tile.block_m, tile.block_n, tile.num_stages) == (kw_b["BLOCK_M"], kw_b["BLOCK_N"], kw_b[stages])
        kernels[tile.schedule].launches.clear()
        assert not any(k.launches for k in kernels.values())
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        tk.run(xq, wq, x_scale, w_scale, sizes, torch.empty((m, n), dtype=torch.float16))


@pytest.mark.parametrize("m,n,k,g", [(64, 8192, 1024, 8), (16384, 7168, 2304, 8), (32768, 4096, 7168, 256),
                                     (16384, 1408, 2048, 128)])
def test_the_service_launch_differs_only_in_where_it_reads_and_stores(m, n, k, g, monkeypatch):
    """A server graph's launch (activations by address, the store through a row map) is the
    public launch's kernel, grid, tile and compile-time constants but for the three source
    flags: what is computed is the same."""
    config = tk.default_config(m, n, k, g)
    kernel = _RecordingKernel()
    monkeypatch.setitem(tk.SCHEDULES, config.schedule, kernel)
    _launch_without_a_gpu(monkeypatch)
    xq = torch.zeros((m, k), dtype=torch.float8_e4m3fn)
    wq = torch.zeros((g, n, k), dtype=torch.float8_e4m3fn)
    w_scale, x_scale = torch.ones((g, k // 128, n // 128)), torch.ones((m, k // 128))
    sizes = torch.full((g,), m // g)
    out = torch.empty((m, n), dtype=torch.bfloat16)
    tk.run(xq, wq, x_scale, w_scale, sizes, out)
    words = torch.tensor([wq.data_ptr(), w_scale.data_ptr(), xq.data_ptr(), x_scale.data_ptr()])
    pairs = torch.zeros((m, 2), dtype=torch.int64)
    tk.run_addressed(xq, words[:2], x_scale, sizes, out, groups=g, inputs=words[2:], out_rows=pairs[:, 1])
    (grid_a, args_a, kw_a), (grid_b, args_b, kw_b) = kernel.launches
    assert grid_a == grid_b
    flags = ("ADDRS", "X_WORDS", "ROW_MAP")
    assert [kw_a.pop(f) for f in flags] == [False] * 3 and [kw_b.pop(f) for f in flags] == [True] * 3
    assert kw_a == kw_b
    assert args_a[0] is xq and args_b[0] is args_b[2] and args_b[6] is not sizes
    assert args_b[-1] == 2 and args_a[-1] == 0  # the row map's stride (pairs)
    with pytest.raises(ValueError, match="out_rows"):
        tk.run_addressed(xq, words[:2], x_scale, sizes, out, groups=g, out_rows=pairs[:3, 1])


def test_tile_tables_are_per_program_and_cached(monkeypatch):
    cpu = torch.device("cpu")
    # Memory that is not zero where it comes from (torch.empty's would often be): the counters
    # must still start at zero.
    monkeypatch.setattr(tk.torch, "empty", lambda *a, **kw: torch.full(*a, 7, **kw))
    table = tk._tile_tables(cpu, 264, 256)
    # Each program's table, then the Gluon tiles' two launch counters, which start at zero.
    assert table.dtype == torch.int32 and table.numel() == 264 * 3 * 256 + 2
    assert not table[-2:].any()
    assert tk._tile_tables(cpu, 264, 256) is table
    assert tk.grid_for(tk.TileConfig("persistent_tma", 64, 128, 4, 4, per_sm=2), 65536, 4096, 7168, 256, 132) \
        == (264,)
    assert tk.grid_for(tk.TileConfig("persistent_tma", 128, 128, 8, 4), 256, 256, 512, 1, 132) == (2 * 2,)
    # The Gluon tile: one program per SM, or one per 128 x 256 tile where there are fewer.
    gluon = tk.TileConfig("gluon_ws", 128, 256, 4, 3, group_tiles_m=8)
    assert tk.grid_for(gluon, 65536, 4096, 7168, 256, 132) == (132,)
    assert tk.grid_for(gluon, 256, 512, 512, 1, 132) == (2 * 2,)


@pytest.mark.parametrize("n,k", [(4096, 0), (0, 1024)])
def test_an_empty_k_or_n_is_refused_before_any_launch(n, k, monkeypatch):
    """Every schedule reads at least one K block (a Gluon tile's producer would fill a ring slot
    no consumer turns, and hang): every entry refuses K or N of 0 before it launches."""
    m, g = 65536, 256
    kernel = _RecordingKernel()
    for schedule in tk.SCHEDULES:
        monkeypatch.setitem(tk.SCHEDULES, schedule, kernel)
    xq = torch.zeros((m, k), dtype=torch.float8_e4m3fn)
    wq = torch.zeros((g, n, k), dtype=torch.float8_e4m3fn)
    w_scale, x_scale = torch.ones((g, k // 128, n // 128)), torch.ones((m, k // 128))
    sizes = torch.full((g,), m // g)
    out = torch.empty((m, n), dtype=torch.bfloat16)
    words = torch.zeros(2, dtype=torch.int64)
    config = tk.TileConfig("gluon_ws_store", 128, 256, 4, 3, group_tiles_m=8)
    for call in (lambda: tk.run(xq, wq, x_scale, w_scale, sizes, out),
                 lambda: tk.run_addressed(xq, words, x_scale, sizes, out, groups=g),
                 lambda: tk.launch(xq, wq, x_scale, w_scale, sizes, out, config)):
        with pytest.raises(ValueError, match="positive multiples of 128"):
            call()
    assert kernel.launches == []


def test_the_gpu_entry_takes_what_torch_calls_contiguous(monkeypatch):
    """SPEC 1: M may be 0, and a K = 128 call's scales are one column. numpy's empty arrays have
    strides (0, 0) and a column made by a transpose has strides (1, M); torch calls both
    contiguous, so the public entry hands them on as they are (session 34's GPU harness: an
    M = 0 call from numpy was refused). No rows launch nothing; a column launches as its
    contiguous copy does (its rows ``stride(0)`` apart, as the kernel reads them). An ``xq``
    whose K is not the fastest dimension is still refused."""
    kernel = _RecordingKernel()
    for schedule in tk.SCHEDULES:
        monkeypatch.setitem(tk.SCHEDULES, schedule, kernel)
    _launch_without_a_gpu(monkeypatch)
    g, n, k, m = 8, 256, 128, 40
    wq = torch.zeros((g, n, k), dtype=torch.float8_e4m3fn)
    w_scale = torch.ones((g, k // 128, n // 128))

    xq = torch.from_numpy(np.zeros((0, k), np.uint8)).view(torch.float8_e4m3fn)
    x_scale = torch.from_numpy(np.zeros((0, k // 128), np.float32))
    out = torch.from_numpy(np.zeros((0, n), np.float32)).to(torch.bfloat16)
    assert xq.stride() == x_scale.stride() == (0, 0) and xq.is_contiguous()
    assert tk.run(xq, wq, x_scale, w_scale, torch.zeros(g, dtype=torch.int64), out) is out
    assert kernel.launches == []

    xq = torch.zeros((m, k), dtype=torch.float8_e4m3fn)
    sizes = torch.full((g,), m // g)
    out = torch.empty((m, n), dtype=torch.bfloat16)
    column = torch.ones(1, m).t()
    assert column.stride() == (1, m) and column.is_contiguous()
    tk.run(xq, wq, column, w_scale, sizes, out)
    tk.run(xq, wq, column.clone(), w_scale, sizes, out)
    (grid_a, args_a, kw_a), (grid_b, args_b, kw_b) = kernel.launches
    assert grid_a == grid_b and kw_a == kw_b
    assert args_a[2] is column and args_b[2] is not column
    assert all(a is b or a == b for i, (a, b) in enumerate(zip(args_a, args_b, strict=True)) if i != 2)

    with pytest.raises(ValueError, match="row-major"):
        tk.run(torch.zeros((k, m), dtype=torch.float8_e4m3fn).t(), wq, column, w_scale, sizes, out)


def test_gluon_launch_options(monkeypatch):
    """The Gluon tile's launch: its ring depth as the kernel's STAGES (no pipeliner option),
    the register cap setmaxnreg redistributes, and a tile table per program."""
    kernel = _RecordingKernel()
    monkeypatch.setitem(tk.SCHEDULES, "gluon_ws", kernel)
    monkeypatch.setattr(tk, "_sm_count", lambda device: 132)
    allocators = []
    monkeypatch.setattr(tk.triton, "set_allocator", allocators.append)
    m, n, k, g = 32768, 4096, 7168, 256
    xq = torch.zeros((m, k), dtype=torch.float8_e4m3fn)
    wq = torch.zeros((g, n, k), dtype=torch.float8_e4m3fn)
    w_scale, x_scale = torch.ones((g, k // 128, n // 128)), torch.ones((m, k // 128))
    out = torch.empty((m, n), dtype=torch.float32)
    tk.run(xq, wq, x_scale, w_scale, torch.full((g,), m // g), out)
    ((grid, args, kw),) = kernel.launches
    assert grid == (132,) and allocators == [tk._tma_scratch]
    assert kw["STAGES"] == 3 and "num_stages" not in kw and kw["maxnreg"] == tk._GLUON_MAXNREG
    assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"], kw["G_POW2"]) == (128, 256, 128, 4, 256)
    assert args[7] is tk._tile_tables(xq.device, 132, 256)
    assert tk.persistent(m, n, k, g, device=xq.device)
    assert tk.tile_key(m, n, k, g, torch.float32, device=xq.device) == \
        tk.tile_key(m, n, k, g, torch.bfloat16, device=xq.device) == "gluon_ws_m128_n256_w4_s3_g8"
    assert "SKIP_DEAD_HALF" not in kw  # the tile skips a dead half at every r: no option


def _same_argument(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
                and a.stride() == b.stride() and a.dtype == b.dtype)
    return a == b


def test_many_expert_prefill_takes_the_store_warp_tile_where_k_is_short():
    """G >= 64 prefill: gluon_ws_store to K = 5120 (its epilogue off the tensor cores' path
    pays on short K loops), gluon_ws from K = 5248 (measured: Kimi-K2 w13, K = 7168, 0.89x
    with the store form)."""
    for m, n, k, g in ((65536, 2048, 768, 128), (16384, 7168, 2048, 384), (16384, 3072, 5120, 160)):
        assert tk.default_config(m, n, k, g).schedule == "gluon_ws_store"
    for m, n, k, g in ((65536, 4096, 7168, 384), (65536, 4096, 5248, 256), (8192, 5120, 8192, 128)):
        assert tk.default_config(m, n, k, g).schedule == "gluon_ws"


@pytest.mark.parametrize("variant", ["gluon_ws_store"])
def test_gluon_variants_launch_like_gluon_ws(variant, monkeypatch):
    """The store-warp form takes gluon_ws's arguments, grid and options in every form; a float32
    out runs it as gluon_ws (its staging would not fit)."""
    m, n, k, g = 32768, 4096, 7168, 256
    assert tk.default_config(m, n, k, g).schedule == "gluon_ws"
    kernels = {name: _RecordingKernel() for name in tk.GLUON_SCHEDULES}
    for name, kernel in kernels.items():
        monkeypatch.setitem(tk.SCHEDULES, name, kernel)
    monkeypatch.setattr(tk, "_sm_count", lambda device: 132)
    monkeypatch.setattr(tk.triton, "set_allocator", lambda fn: None)
    xq = torch.zeros((m, k), dtype=torch.float8_e4m3fn)
    wq = torch.zeros((g, n, k), dtype=torch.float8_e4m3fn)
    w_scale, x_scale = torch.ones((g, k // 128, n // 128)), torch.ones((m, k // 128))
    sizes = torch.full((g,), m // g)
    words = torch.tensor([wq.data_ptr(), w_scale.data_ptr(), xq.data_ptr(), x_scale.data_ptr()])
    pairs = torch.zeros((m, 2), dtype=torch.int64)
    base = tk.TileConfig("gluon_ws", 128, 256, 4, 3, group_tiles_m=8)
    tile = tk.TileConfig(variant, 128, 256, 4, 3, group_tiles_m=8)
    for dtype in (torch.bfloat16, torch.float32):
        out = torch.empty((m, n), dtype=dtype)
        for config in (base, tile):
            tk.launch(xq, wq, x_scale, w_scale, sizes, out, config)
            tk._launch(xq, words[:2], x_scale, words[:2], sizes, out, n, g, config, addrs=True,
                       x_words=words[2:], out_rows=pairs[:, 1])
        runs = variant if dtype == torch.bfloat16 or variant != "gluon_ws_store" else "gluon_ws"
        want = kernels["gluon_ws"].launches[:2]
        got = kernels[runs].launches[-2:]
        assert len(kernels["gluon_ws"].launches) == (4 if runs == "gluon_ws" else 2)
        for (grid_a, args_a, kw_a), (grid_b, args_b, kw_b) in zip(want, got):
            assert grid_a == grid_b == (132,) and kw_a == kw_b
            assert len(args_a) == len(args_b) and all(map(_same_argument, args_a, args_b))
        for kernel in kernels.values():
            kernel.launches.clear()


def test_tile_keys_leave_out_the_decode_band():
    """Buckets either side of r = 16 at G < 64 run the same decode tile, banded or not: the
    band only orders the programs, so their keys (what the executor merges by) are equal."""
    n, k, g = 4096, 4096, 8
    assert tk.default_config(64, n, k, g).group_tiles_m == 1
    assert tk.default_config(128, n, k, g).group_tiles_m == 8
    cpu = torch.device("cpu")
    assert (tk.tile_key(64, n, k, g, torch.bfloat16, device=cpu)
            == tk.tile_key(128, n, k, g, torch.bfloat16, device=cpu)
            == replace(tk.default_config(128, n, k, g), group_tiles_m=1).key())
    assert tk.tile_key(512, n, k, g, torch.bfloat16, device=cpu) == tk.default_config(512, n, k, g).key()
    # A Gluon tile's buckets either side of r = 64 (tiles with and without dead halves) too.
    n, k, g = 7168, 2048, 256
    assert (tk.tile_key(64 * g, n, k, g, torch.bfloat16, device=cpu)
            == tk.tile_key(128 * g, n, k, g, torch.bfloat16, device=cpu) == tk.default_config(128 * g, n, k, g).key())
