"""The ``triton`` backend: our grouped FP8 GEMM with block-wise scales on NVIDIA Hopper.

    backend = create(torch.device("cuda"))
    backend.run(xq, wq, x_scale, w_scale, m_sizes, out)   # capture-safe

The kernel is in ``_triton_gemm.py``. This module checks the device, picks a
tile configuration per shape class from a small table (or, with
``MOEGEMM_AUTOTUNE=1``, from an on-disk cache filled by benchmarking on a
miss, see ``_triton_tune.py``) and launches. Everything the launch needs comes
from static shapes (M, N, K, G), so ``run`` reads no tensor contents on the
host and can be captured into a CUDA graph.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from ._backend import Backend, BackendUnavailable

try:
    import triton
except ImportError as exc:  # the selector turns this into BackendUnavailable
    raise ImportError(f"the triton backend needs the triton package: {exc}") from exc

from . import _triton_tune
from ._triton_gemm import grouped_fp8_kernel

_SCALE_BLOCK = 128


@dataclass(frozen=True)
class TileConfig:
    """One tile shape and schedule for :func:`grouped_fp8_kernel`.

    ``swap_ab`` puts the weight tile on the MMA's M side (decode); ``block_m``
    is then the token tile (16-64). ``group_tiles_m`` row tiles are visited
    before moving along N (L2 reuse at prefill sizes). ``split_k`` > 1 splits
    the K blocks of each output tile over that many programs of the same
    launch (the last to finish reduces, see :func:`_split_workspace`);
    ``dot_pair`` runs two K blocks per loop iteration as two independent dots
    (``block_n`` <= 128, not with ``preload_scales``); with ``scale_ahead``
    each pair's scales are loaded one iteration early. ``tma`` loads the
    prefill tiles by TMA, ``warp_spec`` adds Hopper warp specialisation to
    it (prefill orientation, ``block_n`` <= 128, with or without
    ``dot_pair``, no other option); it finds its group by a walk over
    ``m_sizes`` ``locate_chunk`` groups at a time. ``persistent`` (with
    ``tma``) launches one program per SM that walks the tiles; with
    ``warp_spec`` the producer loads the next tile while the consumers
    store the current one. Its group walk is unrolled over
    ``max(16, next_pow2(G))`` groups: meant for G <= 64. It also takes
    ``block_n`` 256 (two 128-wide halves, not with ``dot_pair``).
    ``lead_tile`` (persistent only): each program first runs a throwaway
    one-block tile, the workaround tried in v9 for the NaN column of the
    first tile of deep warp-specialised buffers.
    """

    block_m: int
    block_n: int
    swap_ab: bool
    num_warps: int = 4
    num_stages: int = 4
    group_tiles_m: int = 1
    evict_w: str = ""
    preload_scales: bool = False
    scale_chunk: int = 32
    prefetch_scales: int = 0
    block_k: int = _SCALE_BLOCK
    split_k: int = 1
    dot_pair: bool = False
    tma: bool = False
    warp_spec: bool = False
    scale_ahead: bool = False
    locate_chunk: int = 16
    persistent: bool = False
    lead_tile: bool = False

    def fits(self, n: int) -> bool:
        """Whether this tile divides N (K is always a multiple of 128)."""
        if self.dot_pair and (self.block_n > 128 or self.preload_scales):
            return False
        if self.persistent and (not self.tma or self.block_n not in (64, 128, 256)):
            return False
        if self.lead_tile and not self.persistent:
            return False
        # TMA tiles are at most 128 wide, except the persistent tile's two 128-wide halves.
        wide = self.block_n > 128 and not (self.persistent and self.block_n == 256)
        if (self.tma or self.warp_spec) and (
                not self.tma or self.swap_ab or wide or self.preload_scales
                or self.split_k > 1 or self.prefetch_scales or self.scale_ahead):
            return False
        if self.scale_ahead and not self.dot_pair:
            return False
        return n % self.block_n == 0 and (self.block_n <= 128 or self.block_n % 128 == 0)

    def key(self) -> str:
        """A short stable name, used in the autotune cache and benchmarks."""
        mode = "swap" if self.swap_ab else "mn"
        evict = "_ef" if self.evict_w else ""
        preload = f"_pre{self.scale_chunk}" if self.preload_scales else ""
        prefetch = f"_pf{self.prefetch_scales}" if self.prefetch_scales else ""
        split = f"_sk{self.split_k}" if self.split_k > 1 else ""
        pair = ("_pairah" if self.scale_ahead else "_pair") if self.dot_pair else ""
        tma = ("_tmaws" if self.warp_spec else "_tma") if self.tma else ""
        if self.warp_spec and self.locate_chunk != 16:
            tma += f"_lc{self.locate_chunk}"
        if self.persistent:
            tma += "_pst"
        if self.lead_tile:
            tma += "_lead"
        return (f"{mode}_m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}"
                f"_g{self.group_tiles_m}{evict}{preload}{prefetch}{split}{pair}{tma}")


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def row_tile_bound(m: int, g: int, block_m: int) -> int:
    """The most row tiles ``m`` rows in ``g`` groups can need (each group rounds up)."""
    if m == 0:
        return 0
    return min(m, (m + g * (block_m - 1)) // block_m, triton.cdiv(m, block_m) + g - 1)


def default_config(m: int, n: int, k: int, g: int) -> TileConfig:
    """The table: a tile configuration per shape class, from static shapes only.

    The class is the mean rows per group, ``m / g`` (the host never sees the
    real split). Measured on one H200 (bench/NOTES.md, v2 sweep):

    - up to 48 rows per group (decode): swap A and B, a token tile of the mean
      rows (doubled for G >= 64, where routing is skewed), 128-row weight tiles,
      3 stages. When fewer than 132 weight tiles of 128 rows exist and K is
      long, each tile is latency-bound: 64-row tiles with the scales loaded
      ahead of the K loop. v9: 16-token tiles at G < 64 run pairs of K blocks
      with the scales a pair ahead (not at K < 2048 with enough tiles); v10:
      with 8 warps where there are fewer weight tiles than SMs and K < 2048.
    - more rows per group (prefill): v7 (bench/NOTES.md) below; 49..127 rows
      per group keep v5's TMA-fed 64 x 128 tiles.

    The L1 prefetch of the scales (``prefetch_scales``) is off: it cost up to
    1.8x on decode shapes (v4 in bench/NOTES.md); autotuning still tries it.
    """
    rows_per_group = max(1, m // max(g, 1))
    if rows_per_group <= 48:
        token_tile = min(64, max(16, _next_pow2(rows_per_group * (2 if g >= 64 else 1))))
        # At most min(g, m) groups have rows.
        weight_tiles = min(g, m) * n // 128
        # v9: two K blocks per iteration with each pair's scales loaded a pair
        # early takes the scale loads' L2 latency off every K block. Measured
        # (bench/NOTES.md, v9) with 16-token tiles at G = 8 only, so only there.
        ahead = token_tile == 16 and g < 64
        if weight_tiles < 132 and k >= 4096:
            if ahead:
                # v9: split-K 2 of pairs (N=1280: 26.5 -> 25.1 us).
                return TileConfig(token_tile, 64, True, num_warps=4, num_stages=3, evict_w="evict_first",
                                  split_k=2, dot_pair=True, scale_ahead=True)
            if token_tile <= 32:
                # v5: split-K 4 over 64-row weight tiles fills the SMs (N=1280: 40 -> 27 us).
                return TileConfig(token_tile, 64, True, num_warps=4, num_stages=3,
                                  evict_w="evict_first", split_k=4)
            return TileConfig(token_tile, 64, True, num_warps=4, num_stages=4,
                              evict_w="evict_first", preload_scales=True, scale_chunk=8)
        if ahead and (weight_tiles < 132 or k >= 2048):
            # v9: M=1 N=8192 K=1024: 6.8 -> 5.6 us; N=7168 K=8192: 119.9 -> 109.7 us;
            # N=8192 K=3584: 59.4 -> 57.4 us. Not at K=1024 with 512 tiles (20.1 -> 21.3 us:
            # 110 KB of shared memory, 2 programs per SM instead of 4).
            # v10: with fewer weight tiles than SMs and short K (one program per SM, a
            # chain of latencies), 8 warps: M=1 N=8192 K=1024: 5.6 -> 4.4 us (two calls).
            # Only where K < 2048: the long-K shapes gained nothing (-1 % to +2 %).
            warps = 8 if weight_tiles < 132 and k < 2048 else 4
            return TileConfig(token_tile, 128, True, num_warps=warps, num_stages=3, evict_w="evict_first",
                              dot_pair=True, scale_ahead=True)
        return TileConfig(token_tile, 128, True, num_warps=4, num_stages=3, evict_w="evict_first")
    # v7 (bench/NOTES.md): 128-row tiles only where routing is even enough (G < 64)
    # and each group fills them; the skewed DeepSeek-like layers (G = 256, a mean
    # of 128 rows per group) ran 20-90 % slower on them than on v5's 64-row tiles.
    even_128 = g < 64 and rows_per_group >= 128
    if even_128:
        # Paired K blocks, warp-specialised (a TMA producer and two 64-row
        # consumers taking turns on the tensor cores; v7: M=16384 N=2048: 600 -> 527 us),
        # persistent since v8: the producer loads the next tile while the consumers
        # store this one (M=16384 N=7168 K=2304: 727 -> 577 us; N=2048 K=7168: 535 -> 516 us;
        # M=1024 N=7168 K=2304: 63.1 -> 58.0 us).
        if n % 256 == 0 and (m // 128) * (n // 256) >= 132:
            # v8: 128 x 256 tiles as two 128-wide halves where they still fill the
            # SMs (M=16384 N=2048 K=7168: 518 -> 455 us; N=7168 K=2304: 632 -> 551 us).
            # Two stages only: with more, the tile writes NaN into column 0 (v8) of
            # each program's first tile (v9), unless a throwaway lead tile goes first.
            if rows_per_group > 1024:
                # v9: 3 stages with the lead tile, equal or better in two calls (M=16384
                # N=2048 K=7168: 434 / 453-456 us against 460 / 453 us for 2 stages;
                # N=7168 K=2304: 533 / 558-563 against 560 / 557 us).
                return TileConfig(128, 256, False, num_warps=4, num_stages=3, group_tiles_m=8,
                                  tma=True, warp_spec=True, persistent=True, lead_tile=True)
            return TileConfig(128, 256, False, num_warps=4, num_stages=2, group_tiles_m=8,
                              tma=True, warp_spec=True, persistent=True)
        return TileConfig(128, 128, False, num_warps=4, num_stages=2, group_tiles_m=8,
                          tma=True, warp_spec=True, dot_pair=True, persistent=True)
    if rows_per_group <= 1024:
        # v5: TMA-fed 64x128 tiles on the ridge (M=1024, G=8: 57.6 -> 49.7 us).
        return TileConfig(64, 128, False, num_warps=4, num_stages=4, tma=True)
    # v5: two K blocks per iteration on 128x128 tiles, two warpgroups (M=16384: 666 -> 592 us);
    # v7: as fast as the warp-specialised pair at K = 2304 (698-719 vs 710-720 us).
    return TileConfig(128, 128, False, num_warps=8, num_stages=3,
                      group_tiles_m=8 if n <= 4096 else 1, dot_pair=True)


def candidate_configs(m: int, n: int, k: int, g: int) -> list[TileConfig]:
    """What opt-in autotuning tries for a shape: the table's choice and its neighbours."""
    found: list[TileConfig] = [default_config(m, n, k, g)]
    rows_per_group = max(1, m // max(g, 1))
    token_tile = min(64, max(16, _next_pow2(rows_per_group)))
    if rows_per_group <= 192:
        for tt in sorted({token_tile, min(64, 2 * token_tile)}):
            for block_n in (64, 128):
                for stages in (3, 4):
                    found.append(TileConfig(tt, block_n, True, 4, stages, evict_w="evict_first"))
            for stages in (3, 4):
                found.append(TileConfig(tt, 64, True, 4, stages, evict_w="evict_first",
                                        preload_scales=True, scale_chunk=8))
    if rows_per_group > 24:
        for bm, bn, warps, stages, group_tiles in (
                (64, 128, 4, 4, 1), (128, 128, 8, 3, 1), (128, 128, 8, 4, 1),
                (128, 128, 8, 5, 1), (128, 128, 8, 4, 8), (128, 64, 4, 4, 1)):
            found.append(TileConfig(bm, bn, False, warps, stages, group_tiles))
    if rows_per_group <= 48:
        # v9: pairs with the scales a pair ahead, alone and with split-K 2.
        for block_n in (64, 128):
            for split in (1, 2):
                found.append(TileConfig(token_tile, block_n, True, 4, 3, evict_w="evict_first",
                                        split_k=split, dot_pair=True, scale_ahead=True))
        # v10: 8 warps (M = 1 N = 8192 K = 1024: 5.6 -> 4.4 us).
        found.append(TileConfig(token_tile, 128, True, 8, 3, evict_w="evict_first",
                                dot_pair=True, scale_ahead=True))
    # Round 2 (v5 in bench/NOTES.md): split-K for too few weight tiles, paired K blocks.
    # Split-K only with small token tiles: 64-token swap tiles spill with it.
    if token_tile <= 32 and k >= 2048:
        for split in (2, 4):
            found.append(TileConfig(token_tile, 128, True, 4, 3, evict_w="evict_first", split_k=split))
            found.append(TileConfig(token_tile, 64, True, 4, 4, evict_w="evict_first",
                                    preload_scales=True, scale_chunk=8, split_k=split))
    # Warp specialisation: correct since v7 (the row fix); only 2-stage forms
    # are offered (more stages of pairs, or of 256-wide tiles, wrote NaN into
    # column 0 on the H200: v7, v8), except the 256-wide tile with a lead tile (v9).
    if rows_per_group > 24:
        found += [TileConfig(128, 128, False, 4, 2, 8, tma=True, warp_spec=True, dot_pair=True),
                  TileConfig(128, 128, False, 4, 2, 8, tma=True, warp_spec=True, dot_pair=True, persistent=True),
                  TileConfig(128, 256, False, 4, 2, 8, tma=True, warp_spec=True, persistent=True),
                  TileConfig(128, 256, False, 4, 3, 8, tma=True, warp_spec=True, persistent=True, lead_tile=True),
                  TileConfig(128, 128, False, 4, 2, 1, tma=True, warp_spec=True, dot_pair=True),
                  TileConfig(128, 128, False, 8, 3, dot_pair=True, scale_ahead=True),
                  TileConfig(64, 128, False, 4, 2, dot_pair=True),
                  TileConfig(128, 128, False, 8, 2, dot_pair=True),
                  TileConfig(128, 128, False, 8, 3, dot_pair=True),
                  TileConfig(64, 128, False, 4, 4, tma=True)]
        if k >= 4096:
            found.append(TileConfig(64, 128, False, 4, 4, split_k=2))
    # The scale prefetch on the main shapes of each class.
    found += [replace(cfg, prefetch_scales=pf) for pf in (0, 2, 4) for cfg in (
        TileConfig(token_tile, 128, True, 4, 3, evict_w="evict_first"),
        TileConfig(token_tile, 64, True, 4, 3, evict_w="evict_first"),
        TileConfig(64, 128, False, 4, 4), TileConfig(128, 128, False, 8, 4),
    ) if (cfg.swap_ab and rows_per_group <= 192) or (not cfg.swap_ab and rows_per_group > 24)]
    unique = []
    for cfg in found:
        if cfg.fits(n) and cfg not in unique:
            unique.append(cfg)
    return unique


# Split-K workspaces: (device, stream, tiles, slot elements) -> (partials, counters).
_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_workspaces_lock = threading.Lock()


def _split_workspace(device: torch.device, tiles: int, split_k: int, tile_elems: int):
    """The float32 partial slots ``[tiles * split_k * tile_elems]`` and int32 counters ``[tiles]``.

    Allocated once per (device, stream, shape) and kept for the process's
    life: the counters start at zero and the kernel's last split of each tile
    puts its counter back to zero, so reuse needs no memset, and a graph
    captured with them stays valid (they are never freed or replaced). Keyed
    on the current stream because two launches in flight at once must not
    share counters: do not run split-K launches of one shape concurrently on
    one stream's workspace from several graphs replayed on different streams.
    An allocation during a capture lands in the graph's pool and its zeroing
    is captured too (harmless: it only clears counters that are already 0).
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, tiles, split_k * tile_elems)
    with _workspaces_lock:
        found = _workspaces.get(key)
        if found is None:
            found = (torch.empty(tiles * split_k * tile_elems, dtype=torch.float32, device=device),
                     torch.zeros(tiles, dtype=torch.int32, device=device))
            _workspaces[key] = found
    return found


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's allocator hook: scratch for the TMA descriptors a launch makes on the device.

    Freed when the launch returns; the caching allocator is stream-ordered, so
    the memory is not handed out again before the kernel is done with it.
    """
    return torch.empty(size, dtype=torch.int8, device="cuda")


_sm_counts: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def _launch(xq, w_arg, x_scale, ws_arg, m_sizes, out, n, g, w_strides, ws_strides,
            config: TileConfig, w_table: bool) -> torch.Tensor:
    m, k = xq.shape
    if m == 0:
        return out
    if config.tma and w_table:
        # The TMA path builds its weight descriptor from one base address. A
        # warp-specialised 128-row tile falls back to the v6 prefill schedule
        # (two warpgroups, plain loads): one warpgroup would hold 128 x 128
        # accumulators and spill. Before the grid: the tile may get narrower.
        if config.block_m == 128 and config.num_warps == 4:
            config = replace(config, num_warps=8, num_stages=3, scale_ahead=config.dot_pair)
        if config.block_n > 128:
            config = replace(config, block_n=128)
        config = replace(config, tma=False, warp_spec=False, persistent=False, lead_tile=False)
    num_m = row_tile_bound(m, g, config.block_m)
    tiles = num_m * (n // config.block_n)
    split_k = max(1, min(config.split_k, k // _SCALE_BLOCK))
    parts = counts = None
    if split_k > 1:
        parts, counts = _split_workspace(xq.device, tiles, split_k, config.block_m * config.block_n)
    if config.tma:
        # Descriptors made on the device need a little global scratch per launch.
        triton.set_allocator(_tma_scratch)
    grid = (min(tiles, _sm_count(xq.device)),) if config.persistent else (tiles * split_k,)
    grouped_fp8_kernel[grid](
        xq, w_arg, x_scale, ws_arg, m_sizes, out,
        m, n, k, g,
        xq.stride(0), w_strides[0], w_strides[1], x_scale.stride(0),
        ws_strides[0], ws_strides[1], out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        G_POW2=max(16, _next_pow2(g)), SWAP_AB=config.swap_ab, EVICT_W=config.evict_w,
        GROUP_TILES_M=config.group_tiles_m,
        PRELOAD_SCALES=config.preload_scales and config.block_n <= 128,
        SCALE_CHUNK=min(config.scale_chunk, _next_pow2(k // _SCALE_BLOCK)),
        PREFETCH_SCALES=config.prefetch_scales, W_TABLE=w_table,
        part_ptr=parts, count_ptr=counts, SPLIT_K=split_k, DOT_PAIR=config.dot_pair,
        USE_TMA=config.tma, WARP_SPEC=config.warp_spec, SCALE_AHEAD=config.scale_ahead,
        LOCATE_CHUNK=max(1, min(config.locate_chunk, _next_pow2(g))),
        PERSISTENT=config.persistent, LEAD_TILE=config.lead_tile,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def launch(xq, wq, x_scale, w_scale, m_sizes, out, config: TileConfig) -> torch.Tensor:
    """Launch one grouped GEMM with ``config`` into ``out`` (no checks, no host reads)."""
    g, n, _ = wq.shape
    return _launch(xq, wq, x_scale, w_scale, m_sizes, out, n, g,
                   (wq.stride(0), wq.stride(1)), (w_scale.stride(0), w_scale.stride(1)),
                   config, w_table=False)


def make_weight_table(wq, w_scale) -> torch.Tensor:
    """An int64 ``[2, G]`` device table of each group's weight and scale addresses, for :func:`run_table`.

    ``wq`` is ``[G, N, K]`` fp8 (or a sequence of G contiguous ``[N, K]``) and
    ``w_scale`` ``[G, K/128, N/128]`` float32 (or a sequence of ``[K/128, N/128]``).
    The table holds raw addresses: the caller keeps the tensors alive while it
    is in use. Building it copies to the device, so do it outside a capture;
    to point a captured graph at another weight set of the same (G, N, K),
    ``table.copy_(make_weight_table(...))`` between replays.
    """
    groups_w = list(wq.unbind(0)) if isinstance(wq, torch.Tensor) else list(wq)
    groups_s = list(w_scale.unbind(0)) if isinstance(w_scale, torch.Tensor) else list(w_scale)
    if len(groups_w) != len(groups_s) or not groups_w:
        raise ValueError(f"need as many weight as scale groups (>= 1), got {len(groups_w)} and {len(groups_s)}")
    n, k = groups_w[0].shape
    for w, s in zip(groups_w, groups_s):
        if (w.dtype != torch.float8_e4m3fn or tuple(w.shape) != (n, k) or not w.is_contiguous()
                or s.dtype != torch.float32 or tuple(s.shape) != (k // 128, n // 128)
                or not s.is_contiguous() or w.device != groups_w[0].device or s.device != w.device):
            raise ValueError("each group needs contiguous e4m3fn [N, K] weights and float32 "
                             "[K/128, N/128] scales, all of one shape, on one device")
    addresses = [[w.data_ptr() for w in groups_w], [s.data_ptr() for s in groups_s]]
    return torch.tensor(addresses, dtype=torch.int64).to(groups_w[0].device)


def run_table(xq, table, x_scale, m_sizes, out, *, n: int, k: int) -> torch.Tensor:
    """SPEC 1 like :func:`run`, the weights found through a :func:`make_weight_table` table.

    ``table`` int64 ``[2, G]`` on the device; ``n`` and ``k`` the weights' shape.
    Capture-safe: the graph captures the table's address, not its contents.
    """
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != 2 or not table.is_contiguous():
        raise ValueError(f"table must be a contiguous int64 [2, G], got {table.dtype} {tuple(table.shape)}")
    if xq.dtype != torch.float8_e4m3fn or xq.shape[1] != k or n % _SCALE_BLOCK or k % _SCALE_BLOCK:
        raise ValueError(f"need e4m3fn xq [M, {k}] and N, K multiples of 128, got {tuple(xq.shape)}, N={n}")
    g = table.shape[1]
    config = default_config(xq.shape[0], n, k, g)
    return _launch(xq, table[0], x_scale, table[1], m_sizes, out, n, g,
                   (0, k), (0, n // _SCALE_BLOCK), config, w_table=True)


def _check(xq, wq, x_scale, w_scale, m_sizes, out) -> None:
    """Layout facts the kernel relies on beyond what the public entry checks."""
    if xq.dtype != torch.float8_e4m3fn or wq.dtype != torch.float8_e4m3fn:
        raise TypeError(f"the triton backend computes in float8_e4m3fn, got {xq.dtype}/{wq.dtype}")
    if xq.stride(1) != 1 or not wq.is_contiguous() or out.stride(1) != 1:
        raise ValueError("xq and out must be row-major and wq contiguous [G, N, K]")
    if x_scale.stride(1) != 1 or w_scale.stride(2) != 1 or not m_sizes.is_contiguous():
        raise ValueError("x_scale [M, K/128] and w_scale [G, K/128, N/128] must be row-major")
    n, k = wq.shape[1], wq.shape[2]
    if n % _SCALE_BLOCK or k % _SCALE_BLOCK:
        raise ValueError(f"N and K must be multiples of 128, got N={n}, K={k}")


def choose_config(xq, wq, x_scale, w_scale, m_sizes, out) -> TileConfig:
    """The table's configuration, or the autotuned one when ``MOEGEMM_AUTOTUNE=1``."""
    m, k = xq.shape
    g, n, _ = wq.shape
    if _triton_tune.enabled():
        return _triton_tune.tuned_config(
            (xq, wq, x_scale, w_scale, m_sizes, out), candidate_configs(m, n, k, g),
            default_config(m, n, k, g), launch, TileConfig,
        )
    return default_config(m, n, k, g)


def run(xq, wq, x_scale, w_scale, m_sizes, out) -> torch.Tensor:
    """SPEC 1 into ``out`` on the GPU; returns ``out``. Capture-safe (no host reads)."""
    _check(xq, wq, x_scale, w_scale, m_sizes, out)
    return launch(xq, wq, x_scale, w_scale, m_sizes, out,
                  choose_config(xq, wq, x_scale, w_scale, m_sizes, out))


def _prepare_weights(wq: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Plain row-major [G, N, K] is the layout the kernel reads.
    return wq.contiguous(), w_scale.contiguous()


def create(device: torch.device) -> Backend:
    """The triton backend for ``device``; raises BackendUnavailable unless it is sm_90-capable CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or torch.version.hip:
        raise BackendUnavailable(f"the triton backend needs an NVIDIA CUDA device, got {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        # FP8 wgmma needs Hopper; sm_89 runs FP8 too but is not what we tune for.
        raise BackendUnavailable(
            f"the triton backend needs compute capability 9.0 or newer, {device} has {major}.{minor}"
        )
    return Backend(
        name="triton",
        device=device,
        fp8_dtype=torch.float8_e4m3fn,
        weight_layout="plain",
        prepare_weights=_prepare_weights,
        run=run,
        capture_safe=True,
    )
