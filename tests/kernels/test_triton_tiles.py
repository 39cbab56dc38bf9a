"""The triton backend's host-side logic, on the CPU: tile table, grid bound, autotune cache.

Needs the triton package (the ``cuda`` extra) but no GPU; no kernel is launched.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("triton")

from moegemm.kernels import _triton_tune
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


def test_decode_swaps_and_prefill_does_not():
    assert tk.default_config(32, 7168, 8192, 8).swap_ab
    assert not tk.default_config(16384, 7168, 2304, 8).swap_ab
    # Narrow N with long K: 64-row weight tiles split along K, for more tiles; v9:
    # 16-token tiles split 2 ways with pairs of K blocks, their scales a pair ahead.
    narrow = tk.default_config(32, 1280, 8192, 8)
    assert (narrow.block_n, narrow.split_k, narrow.dot_pair, narrow.scale_ahead) == (64, 2, True, True)
    # 32-token tiles (not measured with pairs) keep v5's split-K 4.
    narrow_32 = tk.default_config(24 * 8, 1280, 8192, 8)
    assert (narrow_32.block_m, narrow_32.block_n, narrow_32.split_k, narrow_32.dot_pair) == (32, 64, 4, False)
    # v9: pairs with the scales ahead for one active expert and for K >= 2048 ...
    for m, n, k in ((1, 8192, 1024), (32, 7168, 8192), (128, 8192, 3584)):
        cfg = tk.default_config(m, n, k, 8)
        assert (cfg.block_m, cfg.block_n, cfg.dot_pair, cfg.scale_ahead) == (16, 128, True, True)
    # v10: 8 warps where the weight tiles are fewer than the SMs and K is short (M = 1);
    # the long-K decode shapes keep 4 (8 warps measured 1 % faster to 2 % slower there, v10).
    assert tk.default_config(1, 8192, 1024, 8).num_warps == 8
    assert tk.default_config(1, 8192, 3584, 8).num_warps == 4
    assert tk.default_config(32, 7168, 8192, 8).num_warps == 4
    # ... but not for K = 1024 with enough tiles (slower there), nor at G >= 64.
    assert not tk.default_config(128, 8192, 1024, 8).dot_pair
    assert not tk.default_config(256, 4096, 7168, 256).dot_pair
    # 64-token tiles spill with split-K: they keep the preloaded scales instead.
    wide_tokens = tk.default_config(40 * 8, 1280, 8192, 8)
    assert wide_tokens.block_m == 64 and (wide_tokens.split_k, wide_tokens.preload_scales) == (1, True)


def test_autotune_winner_is_persisted_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEGEMM_AUTOTUNE", "1")
    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_triton_tune, "_memory", None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FakeGPU")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    candidates = tk.candidate_configs(83, 1280, 8192, 8)
    fastest = candidates[-1]
    timings = {cfg: 1.0 + i for i, cfg in enumerate(candidates)}
    timings[fastest] = 0.5
    launched = []

    def fake_launch(*args, config):
        launched.append(config)

    def fake_bench(fn):
        fn()
        return timings[launched[-1]]

    monkeypatch.setattr(_triton_tune, "_bench", fake_bench)
    xq = torch.empty((83, 8192), dtype=torch.float8_e4m3fn)
    wq = torch.empty((8, 1280, 8192), dtype=torch.float8_e4m3fn)
    args = (xq, wq, None, None, None, None)
    got = _triton_tune.tuned_config(args, candidates, candidates[0], fake_launch, tk.TileConfig)
    assert got == fastest and len(launched) == len(candidates)
    stored = json.loads((tmp_path / "triton_tiles.json").read_text())
    assert stored == {"128:1280:8192:8:FakeGPU": dataclasses.asdict(fastest)}
    # A new process (fresh memory) reads the winner without benchmarking.
    monkeypatch.setattr(_triton_tune, "_memory", None)
    launched.clear()
    assert _triton_tune.tuned_config(args, candidates, candidates[0], fake_launch, tk.TileConfig) == fastest
    assert launched == []


def test_autotune_off_by_default(monkeypatch):
    monkeypatch.delenv("MOEGEMM_AUTOTUNE", raising=False)
    assert not _triton_tune.enabled()


def test_round2_options_have_own_keys_and_limits():
    base = tk.TileConfig(64, 128, False)
    keys = {base.key(), dataclasses.replace(base, split_k=2).key(), dataclasses.replace(base, dot_pair=True).key(),
            dataclasses.replace(base, split_k=2, dot_pair=True).key()}
    assert len(keys) == 4
    # Paired dots use one weight-scale column per tile and the plain scale loads.
    assert not tk.TileConfig(64, 256, False, dot_pair=True).fits(1024)
    assert not tk.TileConfig(16, 64, True, preload_scales=True, dot_pair=True).fits(1024)
    assert tk.TileConfig(64, 128, False, dot_pair=True).fits(1280)
    # Warp specialisation rides on the TMA prefill path only.
    assert tk.TileConfig(128, 128, False, tma=True, warp_spec=True).fits(1280)
    assert not tk.TileConfig(128, 128, False, warp_spec=True).fits(1280)
    assert not tk.TileConfig(16, 128, True, tma=True).fits(1280)
    assert not tk.TileConfig(128, 128, False, tma=True, split_k=2).fits(1280)
    # Paired dots with TMA and warp specialisation; the scales a pair ahead only with pairs.
    assert tk.TileConfig(128, 128, False, 4, 2, tma=True, warp_spec=True, dot_pair=True).fits(1280)
    assert tk.TileConfig(128, 128, False, 8, 3, dot_pair=True, scale_ahead=True).fits(1280)
    assert not tk.TileConfig(128, 128, False, 8, 3, scale_ahead=True).fits(1280)
    assert not tk.TileConfig(128, 128, False, 4, 2, tma=True, dot_pair=True, scale_ahead=True).fits(1280)
    # v7 (bench/NOTES.md): warp-specialised pairs for long prefill, the pair with
    # its scales ahead for short K at 128..1024 rows per group; the 3-stage
    # warp-specialised pair (NaN columns on the H200) stays out of table and autotune.
    # v8: persistent warp-specialised tiles for even prefill of >= 128 rows per group:
    # 256 wide (two halves, 2 stages) where 128 x 256 tiles fill the SMs, else the 128-wide pair.
    wide = tk.TileConfig(128, 256, False, 4, 2, 8, tma=True, warp_spec=True, persistent=True)
    pair = tk.TileConfig(128, 128, False, 4, 2, 8, tma=True, warp_spec=True, dot_pair=True, persistent=True)
    assert tk.default_config(1024, 7168, 2304, 8) == wide
    # v9: over 1024 rows per group, 3 stages behind a throwaway lead tile.
    for m, n, k in ((16384, 2048, 7168), (16384, 7168, 2304)):
        assert tk.default_config(m, n, k, 8) == dataclasses.replace(wide, num_stages=3, lead_tile=True)
    assert tk.default_config(1024, 2048, 7168, 8) == pair
    assert tk.default_config(16384, 1152, 7168, 8) == pair  # N not a multiple of 256
    assert tk.default_config(512, 2048, 7168, 8).tma and not tk.default_config(512, 2048, 7168, 8).warp_spec
    # Skewed routing over many experts keeps v5's 64-row TMA tiles (v7: 3683 vs 4943 us).
    assert tk.default_config(32768, 4096, 7168, 256) == tk.TileConfig(64, 128, False, 4, 4, tma=True)
    assert tk.default_config(32768, 7168, 2048, 256) == tk.TileConfig(64, 128, False, 4, 4, tma=True)
    for m, n, k, g in SHAPES:
        for cfg in [tk.default_config(m, n, k, g), *tk.candidate_configs(m, n, k, g)]:
            assert not (cfg.warp_spec and (cfg.dot_pair or cfg.block_n > 128) and cfg.num_stages > 2
                        and not cfg.lead_tile)
            assert not cfg.warp_spec or cfg.block_m == 128 or cfg.block_m == 64


def test_persistent_option_limits_and_key():
    pst = tk.TileConfig(128, 128, False, 4, 2, 8, tma=True, warp_spec=True, dot_pair=True, persistent=True)
    assert pst.fits(2048) and pst.key().endswith("_pst")
    assert pst.key() != dataclasses.replace(pst, persistent=False).key()
    # Persistent tiles ride on TMA; 256 wide only as the persistent tile's two halves, without pairs.
    assert not tk.TileConfig(128, 128, False, 8, 3, persistent=True).fits(2048)
    assert tk.TileConfig(128, 256, False, 4, 3, tma=True, warp_spec=True, persistent=True).fits(2048)
    assert not tk.TileConfig(128, 256, False, 4, 3, tma=True, warp_spec=True).fits(2048)
    assert not tk.TileConfig(128, 256, False, 4, 3, tma=True, warp_spec=True, persistent=True).fits(1152)
    assert not tk.TileConfig(128, 256, False, 4, 2, tma=True, warp_spec=True, dot_pair=True,
                             persistent=True).fits(2048)


def test_lead_tile_only_on_persistent_tiles():
    lead = tk.TileConfig(128, 256, False, 4, 3, 8, tma=True, warp_spec=True, persistent=True, lead_tile=True)
    assert lead.fits(2048) and lead.key() != dataclasses.replace(lead, lead_tile=False).key()
    assert not tk.TileConfig(128, 128, False, 4, 3, 8, tma=True, warp_spec=True, lead_tile=True).fits(2048)


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
    """Stands in for the Triton kernel: records the grid and the constexprs of one launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, kwargs))


def test_weight_table_fallback_sizes_the_grid_for_the_narrower_tile(monkeypatch):
    # v8 (device run 3): a 256-wide table tile fell back to 128-wide plain tiles
    # through a weight table, but the grid was sized for 256: the right half of
    # the tiles never ran (NaN rows in the GPU test). The grid must follow the
    # tile that is launched.
    kernel = _RecordingKernel()
    monkeypatch.setattr(tk, "grouped_fp8_kernel", kernel)
    m, n, k, g = 16896, 512, 1024, 2
    assert tk.default_config(m, n, k, g).block_n == 256
    xq = torch.zeros((m, k), dtype=torch.float8_e4m3fn)
    wq = torch.zeros((g, n, k), dtype=torch.float8_e4m3fn)
    w_scale = torch.ones((g, k // 128, n // 128))
    out = torch.empty((m, n), dtype=torch.bfloat16)
    sizes = torch.tensor([m // 2, m - m // 2])
    tk.run_table(xq, tk.make_weight_table(wq, w_scale), torch.ones((m, k // 128)), sizes, out, n=n, k=k)
    (grid, consts), = kernel.launches
    assert consts["BLOCK_N"] == 128 and not consts["PERSISTENT"] and not consts["USE_TMA"]
    assert grid == (tk.row_tile_bound(m, g, consts["BLOCK_M"]) * n // 128,)
