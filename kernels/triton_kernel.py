"""The ``triton`` backend: our grouped FP8 GEMM with block-wise scales on NVIDIA Hopper.

    backend = create(torch.device("cuda"))
    backend.run(xq, wq, x_scale, w_scale, m_sizes, out)            # capture-safe
    backend.run_addressed(xq, addresses, x_scale, m_sizes, out, groups=G)

The kernels are in ``_triton_gemm.py`` (one per schedule) and, for many-expert
prefill, ``_gluon_gemm.py`` (the same arguments). This module checks
the device, picks a schedule and tile per shape class from a small table (the
tiles measured on the H200, ``bench/NOTES.md``; nothing tunes at run time, so a
figure measured for a shape is the path every call of that shape takes) and
launches. Everything the launch needs comes
from static shapes (M, N, K, G), so neither entry reads tensor contents on
the host and both can be captured into a CUDA graph.

``run_addressed`` is the entry a server graph uses: the weight set's ``wq``
and ``w_scale`` base addresses are two int64 words on the device
(``_backend.weight_addresses`` gives them; a server writes them into its own
buffer before each replay), so one graph per (G, N, K) and bucket serves
every weight set of that shape. It runs the same kernel with the same tile
as ``run`` for the same shape: the output is the same, bit for bit.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, replace

import torch

from ._backend import BLOCK, Backend, BackendUnavailable, check_operands

try:
    import triton
except ImportError as exc:  # the selector turns this into BackendUnavailable
    raise ImportError(f"the triton backend needs the triton package: {exc}") from exc

from ._gluon_gemm import MAXNREG as _GLUON_MAXNREG
from ._gluon_gemm import gluon_ws_kernel, gluon_ws_store_kernel
from ._triton_gemm import SCHEDULES as _TRITON_SCHEDULES

GLUON_SCHEDULES = {"gluon_ws": gluon_ws_kernel, "gluon_ws_store": gluon_ws_store_kernel}
"""The Gluon 128 x 256 prefill kernels (``_gluon_gemm.py``): one argument list, one launch;
``default_config`` picks ``gluon_ws_store`` for many experts where the K loop is short,
``gluon_ws`` otherwise."""
SCHEDULES = {**_TRITON_SCHEDULES, **GLUON_SCHEDULES}
"""Every schedule's kernel by name: the Triton ones (``_triton_gemm.py``) and the Gluon ones."""

_L2_EXPERT_BYTES = 32 << 20  # one expert's fp8 weights above this: the Gluon tile from r = 16
# The warp-specialised schedule finds a tile's group by an unrolled walk over
# max(16, next_pow2(G)) groups (its pass takes no table and no reduction); past this
# the walk costs more than the schedule gains (v11: at G = 128 it ran 1.4-2.5x slower
# than 64-row TMA tiles).
PERSISTENT_G_MAX = 64
# The tile table of the persistent TMA and Gluon schedules: its binary search is unrolled for up to
# 1024 groups.
TABLE_G_MAX = 1024


@dataclass(frozen=True)
class TileConfig:
    """One schedule (a kernel of :data:`SCHEDULES`) and its tile.

    ``decode`` / ``decode_pair``: ``block_m`` is the token tile (16-64),
    ``block_n`` the weight tile (64 or 128) on the MMA's M side; ``evict_w`` the
    weights' cache policy; ``group_tiles_m`` row tiles walked side by side per
    weight tile (a band). ``decode`` only: ``split_k`` programs share an output
    tile; ``preload`` takes the scale products before the K loop.
    ``persistent_ws``: 128 x 128 (pairs of K blocks), 4 warps (warp-specialised:
    a producer and two 64-row consumers), ``group_tiles_m`` row tiles per band.
    ``persistent_tma``: 64 (4 warps) or 128 (8 warps) rows x 128, ``group_tiles_m``
    row tiles of one group per band; ``per_sm`` programs per SM.
    ``gluon_ws``: 128 x 256, 4 warps (a producer warp and two 64-row consumer
    warpgroups: 12 warps launched), ``num_stages`` ring slots, ``group_tiles_m``
    row tiles of one group per band; one program per SM, each claiming its next tile from the
    launch's counter (``_gluon_gemm``).
    """

    schedule: str
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    group_tiles_m: int = 1
    split_k: int = 1
    evict_w: str = ""
    per_sm: int = 1
    preload: bool = False

    @property
    def swap_ab(self) -> bool:
        """Whether the weights sit on the MMA's M side (the decode schedules)."""
        return self.schedule.startswith("decode")

    @property
    def checks_rows(self) -> bool:
        """Whether the kernel can check the rows' scales itself (``FLAGS``: a lone call's graph
        as one kernel): every schedule but ``persistent_ws``, whose warp-specialised K loop ran
        1.12x slower with the check than the check kernel and the GEMM together (seed m1024
        n2048 k7168: 64.9 against 59.8 us, session 33)."""
        return self.schedule != "persistent_ws"

    def fits(self, n: int, g: int = 1) -> bool:
        """Whether this tile divides N and the schedule takes G groups (K is a multiple of 128)."""
        if self.schedule not in SCHEDULES or n % self.block_n:
            return False
        if (self.split_k > 1 or self.preload) and self.schedule != "decode":
            return False
        if self.per_sm != 1 and self.schedule != "persistent_tma":
            return False
        if self.swap_ab:
            return self.block_n in (64, 128) and self.block_m in (16, 32, 64)
        if self.schedule == "persistent_ws":
            # 2 stages: deeper warp-specialised buffers wrote NaN into column 0 (v8, v9).
            return (self.block_m == 128 and self.block_n == 128 and self.num_warps == 4
                    and self.num_stages == 2 and g <= PERSISTENT_G_MAX)
        if self.schedule in GLUON_SCHEDULES:
            # gluon_ws_store stages the output beside the ring: 64 KB more, so 3 slots at most.
            stages = (3, 4) if self.schedule != "gluon_ws_store" else (3,)
            return (self.block_m == 128 and self.block_n == 256 and self.num_warps == 4
                    and self.num_stages in stages and g <= TABLE_G_MAX)
        return (self.block_m in (64, 128) and self.block_n == 128
                and self.num_warps == self.block_m // 16 and self.per_sm in (1, 2) and g <= TABLE_G_MAX)

    def key(self) -> str:
        """A short stable name: the merge key's tile (``tile_key``) and the benchmarks' label."""
        extra = (f"_sk{self.split_k}" if self.split_k > 1 else "") + ("_ef" if self.evict_w else "") + (
            f"_p{self.per_sm}" if self.per_sm != 1 else "") + ("_pre" if self.preload else "")
        return (f"{self.schedule}_m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}"
                f"_g{self.group_tiles_m}{extra}")


def row_tile_bound(m: int, g: int, block_m: int) -> int:
    """The most row tiles ``m`` rows in ``g`` groups can need (each group rounds up)."""
    if m == 0:
        return 0
    return min(m, (m + g * (block_m - 1)) // block_m, triton.cdiv(m, block_m) + g - 1)


SMS = 132  # the H200's multiprocessors: where "fills the SMs" rules below are measured


def default_config(m: int, n: int, k: int, g: int) -> TileConfig:
    """The tile table: one schedule and tile per shape class, from static shapes only.

    The host never sees how the rows split over the groups, so the class is the mean rows per
    group ``r = m / g``. Why each rule holds, with its measurements: ``bench/NOTES.md``.

    1. **Decode** (the weights' bytes bound the time): ``r <= 48``; at G >= 64 only below
       r = 32, and only below r = 16 for experts over 32 MiB (``n * k``) with N % 256 == 0,
       which do not stay in the 50 MB L2 between token tiles. The swapped schedules: the
       weights on the MMA's M side, the tokens on its N side; token tile ``next_pow2(r)`` in
       [16, 64], doubled at G >= 64 (skewed routing puts several times the mean on the hot
       experts); weights evicted first. At G < 64 from r = 16 the programs walk the row tiles
       in bands of 8 per weight tile (a hot expert's token tiles run side by side and read its
       weights once from HBM); else row tile by row tile.

       a. Fewer 128-row weight tiles than SMs and K >= 4096 (a few experts): 16-token tiles
          unsplit behind a 6-slot ring where the weight tiles are at least 60 % of the SMs and
          the scale products preload (each program streams its own SM's share without the
          split's sums); else tiles of up to 32 tokens split along K, the split doubled from 2
          up to 8 while the programs stay within three per SM; both with 8 warps where the row
          tiles are walked one by one. A 64-token tile unsplit, 4 warps.
       b. 16-token tiles at G < 64, where the weight tiles are fewer than SMs or K >= 2048: the
          pair schedule (two K blocks an iteration, the scales a pair ahead); 64-row weight
          tiles and 8 warps where the weight tiles are fewer than SMs and K < 2048 (a single
          active expert: twice the programs).
       c. 16-token tiles at G >= 64: the 8-warp pair where the weight tiles fill at most two
          programs per SM (a decode step's handful of experts) or K >= 4096; the 8-warp single
          block tile where they are at most 8 per SM (the pair's programs would run in more
          than one wave).
       d. Otherwise the single-block schedule over 128-row weight tiles.

       The 16- and 32-token tiles of a and d take their scale products into registers before
       the K loop where a chunk holds at most 1024 (:func:`_preloaded`).
    2. **G < 64, r >= 128** (even routing, full tiles): ``gluon_ws`` 128 x 256 where N % 256 == 0
       and its tiles fill the SMs; else ``persistent_ws`` 128 x 128.
    3. **G >= 64, N % 256 == 0** (many experts, skewed routing): the Gluon 128 x 256 tile, one
       program per SM, bands of 8 row tiles per group; ``gluon_ws_store`` (the epilogue in warps
       of its own) to K = 5120, ``gluon_ws`` above it.
    4. **Otherwise** (G < 64 with 48 < r < 128, or N not a multiple of 256): ``persistent_tma``
       64 x 128, two programs per SM, bands of 8 row tiles per group.
    """
    rows_per_group = max(1, m // max(g, 1))
    many = g >= 64 and (rows_per_group >= 32 or (rows_per_group >= 16 and n % 256 == 0 and n * k > _L2_EXPERT_BYTES))
    if rows_per_group <= 48 and not many:
        token_tile = min(64, max(16, triton.next_power_of_2(rows_per_group * (2 if g >= 64 else 1))))
        weight_tiles = min(g, m) * n // 128  # at most min(g, m) groups have rows
        pair = token_tile == 16 and g < 64
        ef = "evict_first"
        band = 8 if g < 64 and rows_per_group >= 16 else 1
        T = functools.partial(TileConfig, evict_w=ef, group_tiles_m=band)
        if weight_tiles < SMS and k >= 4096:
            warps = 8 if band == 1 else 4
            if token_tile == 16 and 5 * weight_tiles >= 3 * SMS:
                # Weight tiles for 60 % of the SMs, their scale products preloaded: unsplit,
                # each program on its own SM behind a 6-slot ring, without the split's sums
                # (bench/NOTES.md, session 35; not preloaded, the ring waits on the scales).
                # 16-token tiles only: two fit an SM (108 KB), and a hot expert's extra row
                # tiles find room; the 32-token ring (120 KB) was not measured.
                unsplit = _preloaded(T("decode", token_tile, 128, warps, 6), k)
                if unsplit.preload:
                    return unsplit
            if token_tile <= 32:
                split = 2
                while split < 8 and weight_tiles * split * 2 <= 3 * SMS:
                    split *= 2
                return _preloaded(T("decode", token_tile, 128, warps, 3, split_k=split), k)
            return _preloaded(T("decode", token_tile, 128, 4, 3), k)
        if pair and (weight_tiles < SMS or k >= 2048):
            if weight_tiles < SMS and k < 2048:
                return T("decode_pair", token_tile, 64, 8, 3)
            return T("decode_pair", token_tile, 128, 4, 3)
        if token_tile == 16 and g >= 64 and (weight_tiles <= 2 * SMS or k >= 4096):
            return T("decode_pair", 16, 128, 8, 3)
        if token_tile == 16 and g >= 64 and weight_tiles <= 8 * SMS:
            return T("decode", 16, 128, 8, 3)
        return _preloaded(T("decode", token_tile, 128, 4, 3), k)
    if g < 64 and rows_per_group >= 128:
        if n % 256 == 0 and (m // 128) * (n // 256) >= SMS:
            return TileConfig("gluon_ws", 128, 256, 4, 3, group_tiles_m=8)
        return TileConfig("persistent_ws", 128, 128, 4, 2, group_tiles_m=8)
    if g >= 64 and n % 256 == 0:
        return TileConfig("gluon_ws_store" if k <= 5120 else "gluon_ws", 128, 256, 4, 3, group_tiles_m=8)
    return TileConfig("persistent_tma", 64, 128, 4, 4, group_tiles_m=8, per_sm=2)


def _preloaded(config: TileConfig, k: int) -> TileConfig:
    """``config`` with its scale products preloaded where the table's rule says so: 16- and
    32-token ``decode`` tiles whose chunk holds at most 1024 products (a pair never: it loads
    each pair's scales a pair ahead)."""
    if config.schedule != "decode" or config.block_m > 32 or config.block_m * scale_chunk(config, k) > 1024:
        return config
    return replace(config, preload=True)


def candidate_configs(m: int, n: int, k: int, g: int) -> list[TileConfig]:
    """The table's choice for a shape and its neighbours: what ``bench/bench_kernels.py --sweep``
    times beside it (the table's rules come from such sweeps)."""
    T = TileConfig
    found = [default_config(m, n, k, g)]
    rows_per_group = max(1, m // max(g, 1))
    ef = "evict_first"
    if rows_per_group <= 48:
        tt = min(64, max(16, triton.next_power_of_2(rows_per_group)))
        for token in sorted({tt, min(64, 2 * tt)}):
            for block_n in (64, 128):
                found.append(T("decode", token, block_n, 4, 3, evict_w=ef))
                if token <= 32:
                    for split in (2, 4):
                        found.append(T("decode", token, block_n, 4, 3, split_k=split, evict_w=ef))
            if token == 16:
                for block_n in (64, 128):
                    found.append(T("decode_pair", token, block_n, 4, 3, evict_w=ef))
                found.append(T("decode_pair", token, 128, 8, 3, evict_w=ef))
        found += [_preloaded(c, k) for c in found if c.swap_ab]
        if n % 256 == 0:  # 128-row tiles read a hot expert's weights once for more of its rows
            found += [T("gluon_ws", 128, 256, 4, 3, group_tiles_m=8), T("gluon_ws_store", 128, 256, 4, 3, group_tiles_m=8)]
    else:
        found += [T("persistent_tma", 64, 128, 4, 4, group_tiles_m=8, per_sm=2),
                  T("persistent_tma", 64, 128, 4, 4, per_sm=2),
                  T("persistent_tma", 128, 128, 8, 4, group_tiles_m=8),
                  T("gluon_ws", 128, 256, 4, 3, group_tiles_m=8),
                  T("gluon_ws", 128, 256, 4, 4, group_tiles_m=8),
                  T("gluon_ws_store", 128, 256, 4, 3, group_tiles_m=8),
                  T("persistent_ws", 128, 128, 4, 2, group_tiles_m=8)]
    return [c for c in dict.fromkeys(found) if c.fits(n, g)]


# Split-K workspaces: (device, stream, tiles, slot elements) -> (partials, counters).
_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_workspaces_lock = threading.Lock()


def _split_workspace(device: torch.device, tiles: int, split_k: int, tile_elems: int):
    """The float32 partial slots ``[tiles * split_k * tile_elems]`` and int32 counters ``[tiles]``.

    Eager launches: allocated once per (device, current stream, shape) and kept
    for the process's life. The counters start at zero and the kernel's last
    split of each tile puts its counter back to zero, so reuse needs no memset.
    Keyed on the current stream because two launches in flight at once must not
    share counters.

    A launch being captured into a graph gets a workspace of its own, its
    counters zeroed by a memset node that runs at the start of every replay. A
    cached one must never be made during a capture: its zeroing would be
    captured, not run, so its counters would hold whatever the graph pool's
    memory held (earlier captures' data), no split would see itself last and
    the tiles would never be stored -- every later graph that shared it would
    answer zeros (seen on the H200: a server's expert FFN graph answered zeros
    once other graphs had used the pool). The partial slots are written before
    they are read within a launch, so the pool may hand their memory to later
    allocations of the graph or of other graphs that never run at once with it.
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return (torch.empty(tiles * split_k * tile_elems, dtype=torch.float32, device=device),
                torch.zeros(tiles, dtype=torch.int32, device=device))
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


def grid_for(config: TileConfig, m: int, n: int, k: int, g: int, sms: int) -> tuple[int]:
    """The launch grid: row-tile bound x column tiles (x splits), or one program per SM."""
    tiles = row_tile_bound(m, g, config.block_m) * (n // config.block_n)
    if config.schedule == "persistent_ws" or config.schedule in GLUON_SCHEDULES:
        return (min(tiles, sms),)
    if config.schedule == "persistent_tma":
        return (min(tiles, sms * config.per_sm),)
    return (tiles * max(1, min(config.split_k, k // BLOCK)),)


FLOAT32_OUT_PREFILL = TileConfig("persistent_tma", 128, 128, 8, 4, group_tiles_m=8)
"""What a warp-specialised tile runs as when ``out`` is float32 (see :func:`tile_for_out`)."""


def tile_for_out(config: TileConfig, out: torch.Tensor) -> TileConfig:
    """The tile a launch into ``out`` runs: ``config``, except a ``persistent_ws`` tile into a
    float32 ``out``, which runs as :data:`FLOAT32_OUT_PREFILL`.

    Compiled for sm_90 (Triton 3.6), the float32 store stages through 48 KB more
    shared memory in the warp-specialised kernel: 128x128 s2 197 KB (bf16 148);
    warp-specialised tiles over ~150 KB wrote NaN into column 0 (bench/NOTES.md v8,
    v9). The persistent TMA tile is not
    warp-specialised (checked into float32 on the H200, v12). A ``gluon_ws_store``
    tile into float32 runs as ``gluon_ws`` (same tile, same sums): its staging would
    need 128 KB of shared memory beside the 144 KB ring. So does one into rows
    whose stride is not a multiple of 8 elements: its store warps write whole
    16-byte pieces. Both entries apply this, so they still launch one tile.
    """
    if out.dtype == torch.float32 and config.schedule == "persistent_ws":
        return FLOAT32_OUT_PREFILL
    if config.schedule == "gluon_ws_store" and (out.dtype == torch.float32 or out.stride(0) % 8):
        return replace(config, schedule="gluon_ws")
    return config


def _tile_tables(device: torch.device, programs: int, g_pow2: int) -> torch.Tensor:
    """The persistent schedules' work buffer: int32 ``[programs * 3 * g_pow2 + 2]``, the
    per-program tile tables and, after them, the Gluon tiles' two launch counters (tiles
    claimed, programs done).

    Each program writes its own table before reading it. The counters start at zero and the
    last program of a Gluon launch puts them back to zero, so eager launches reuse one buffer
    per (device, current stream, size), kept for the process's life; two launches in flight at
    once on two streams do not share one.

    A launch being captured into a graph gets a buffer of its own, its counters zeroed by a
    memset node just before the launch in every replay (as ``_split_workspace``'s, for the same
    reason: a cached buffer made during a capture would never be zeroed, and graphs replayed on
    other streams must not share counters).
    """
    size = programs * 3 * g_pow2 + 2
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        work = torch.empty(size, dtype=torch.int32, device=device)
        work[-2:].zero_()
        return work
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = ("tiles", str(device), stream, size)
    with _workspaces_lock:
        found = _workspaces.get(key)
        if found is None:
            found = _workspaces[key] = (torch.zeros(size, dtype=torch.int32, device=device),)
    return found[0]


def scale_chunk(config: TileConfig, k: int) -> int:
    """K blocks whose scale products a decode program preloads at once (``preload``): every
    block of its split, a power of two, at most 2048 products per tile (16 registers a
    thread at 4 warps) so long K does not take the accumulator's registers."""
    per_split = -(-(k // BLOCK) // max(1, min(config.split_k, k // BLOCK)))
    return max(16, min(triton.next_power_of_2(per_split), 2048 // config.block_m))


def launch_plan(xq, w_arg, x_scale, ws_arg, m_sizes, out, n: int, g: int, config: TileConfig,
                addrs: bool, x_words: torch.Tensor | None = None, out_rows: torch.Tensor | None = None,
                flags: torch.Tensor | None = None):
    """(kernel, grid, args, constexprs and launch options) of one launch of ``config``.

    ``addrs``: ``w_arg`` is the int64 address pair, ``ws_arg`` unused;
    ``x_words``: the activations' and scales' base addresses (int64 device
    words) instead of ``xq``'s and ``x_scale``'s (which still give M, K and the
    strides); ``out_rows``: int64 ``[M]`` (any stride), row r stored at
    ``out[out_rows[r]]``; ``flags``: int8, the rows' scale check written where each row
    is stored (:func:`run_addressed`; not on ``persistent_ws``, on the other persistent tiles
    only in place). Nothing is launched:
    ``bench/bench_kernels.py`` compiles the plans of a run ahead with ``kernel.warmup``.
    """
    m, k = xq.shape
    if n < BLOCK or k < BLOCK:
        # Every schedule reads at least one K block; the Gluon tiles' producer loads the first
        # before it claims the next tile, and a ring slot no consumer turns would hang them.
        # Checked here, where every entry's launch is planned.
        raise ValueError(f"N and K must be positive multiples of 128, got N={n}, K={k}")
    if not config.fits(n, g):
        # A tile that does not divide N, more groups than its schedule's walk holds (the tile
        # table's binary search is unrolled for TABLE_G_MAX groups: past it a tile would land in
        # the group before its own; persistent_ws walks PERSISTENT_G_MAX), a form its kernel
        # does not take (a split or preloaded pair): it would compute something its key does
        # not say. Every table tile fits; a sweep's or a caller's may not.
        raise ValueError(f"{config.key()} does not take N={n} with G={g} (TileConfig.fits: "
                         f"at most {TABLE_G_MAX} groups but on the decode tiles)")
    config = tile_for_out(config, out)
    kernel = SCHEDULES[config.schedule]
    grid = grid_for(config, m, n, k, g, _sm_count(xq.device))
    g_pow2 = max(16, triton.next_power_of_2(g))
    consts = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": BLOCK,
              "ADDRS": addrs, "X_WORDS": x_words is not None, "ROW_MAP": out_rows is not None,
              "G_POW2": g_pow2, "num_warps": config.num_warps, "num_stages": config.num_stages}
    extra = ()
    if flags is not None and not config.checks_rows:
        raise ValueError(f"{config.schedule} does not check the rows inside (checks_rows): a check kernel runs "
                         "before it")
    if flags is not None and out_rows is not None and not config.swap_ab:
        # The staging tile's consumers write the flags where the rows are (the row map is its
        # store warps'); a lone prefill call's graph stores in place.
        raise ValueError(f"the rows' check inside {config.schedule} needs the in-place store (no out_rows)")
    flags_arg = m_sizes if flags is None else flags  # m_sizes: a pointer FLAGS=False never reads
    if config.swap_ab:
        consts.update(EVICT_W=config.evict_w, GROUP_TILES_M=config.group_tiles_m, FLAGS=flags is not None,
                      KB_POW2=triton.next_power_of_2(k // BLOCK) if flags is not None else 1)
        extra = (flags_arg,)
        if config.schedule == "decode":
            split_k = max(1, min(config.split_k, k // BLOCK))
            parts = counts = None
            if split_k > 1:
                parts, counts = _split_workspace(xq.device, grid[0] // split_k, split_k,
                                                 config.block_m * config.block_n)
            extra = (parts, counts, flags_arg)
            # CHUNK only shapes the preloaded loop: the plain one gets one value, so one kernel.
            consts.update(SPLIT_K=split_k, PRELOAD=config.preload,
                          CHUNK=scale_chunk(config, k) if config.preload else 16)
    elif config.schedule == "persistent_ws":
        consts.update(GROUP_TILES_M=config.group_tiles_m)
    elif config.schedule == "persistent_tma":
        extra = (_tile_tables(xq.device, grid[0], g_pow2), flags_arg)
        consts.update(GROUP_TILES_M=config.group_tiles_m, FLAGS=flags is not None)
    elif config.schedule in GLUON_SCHEDULES:
        # The ring depth is the kernel's STAGES; the launch option caps the registers each of the
        # 12 warps starts with (setmaxnreg then moves them from the producer to the consumers).
        extra = (_tile_tables(xq.device, grid[0], g_pow2), flags_arg)
        del consts["num_stages"]
        consts.update(GROUP_TILES_M=config.group_tiles_m, STAGES=config.num_stages, maxnreg=_GLUON_MAXNREG,
                      FLAGS=flags is not None)
    else:
        raise ValueError(f"unknown schedule {config.schedule}")
    x_arg = xq if x_words is None else x_words
    xs_arg = x_scale if x_words is None else x_words
    map_arg = m_sizes if out_rows is None else out_rows
    args = (x_arg, w_arg, xs_arg, ws_arg, m_sizes, out, map_arg, *extra,
            m, n, k, g,
            xq.stride(0), n * k, k, x_scale.stride(0), (k // BLOCK) * (n // BLOCK),
            n // BLOCK, out.stride(0), 0 if out_rows is None else out_rows.stride(0))
    return kernel, grid, args, consts


def _launch(xq, w_arg, x_scale, ws_arg, m_sizes, out, n: int, g: int, config: TileConfig,
            addrs: bool, x_words: torch.Tensor | None = None,
            out_rows: torch.Tensor | None = None, flags: torch.Tensor | None = None) -> torch.Tensor:
    """Launch ``config``'s kernel (see :func:`launch_plan` for the arguments)."""
    if xq.shape[0] == 0:
        return out
    kernel, grid, args, consts = launch_plan(xq, w_arg, x_scale, ws_arg, m_sizes, out, n, g, config,
                                             addrs, x_words, out_rows, flags)
    if kernel is not SCHEDULES["decode"] and kernel is not SCHEDULES["decode_pair"]:
        # Descriptors made on the device need a little global scratch per launch.
        triton.set_allocator(_tma_scratch)
    kernel[grid](*args, **consts)
    return out


def launch(xq, wq, x_scale, w_scale, m_sizes, out, config: TileConfig) -> torch.Tensor:
    """Launch one grouped GEMM with ``config`` into ``out`` (no checks, no host reads)."""
    g, n, _ = wq.shape
    return _launch(xq, wq, x_scale, w_scale, m_sizes, out, n, g, config, addrs=False)


def run_addressed(xq, addresses, x_scale, m_sizes, out, *, groups: int,
                  inputs: torch.Tensor | None = None, out_rows: torch.Tensor | None = None,
                  flags: torch.Tensor | None = None) -> torch.Tensor:
    """SPEC 1 like :func:`run`, the weight set found through two address words.

    ``addresses`` int64 on the device, words 0 and 1 the base of a contiguous
    ``wq [groups, N, K]`` and ``w_scale [groups, K/128, N/128]`` (``_backend.weight_addresses``);
    N is ``out``'s width (bf16 or float32), K ``xq``'s. Capture-safe: a graph captures the
    words' address, not their contents. Same kernel and tile as :func:`run`.

    For a server graph (one graph serving lone and merged calls):

    - ``inputs``: int64 device words holding the base addresses of the
      activations and their scales, laid out like ``xq`` and ``x_scale``
      (which then give only the shape and strides): the rows as the callers
      sent them, or regrouped per expert, chosen per replay;
    - ``out_rows``: int64 ``[M]`` on the device (any stride): row r is stored at
      ``out[out_rows[r]]`` (the callers' order) instead of ``out[r]``.

    Neither changes what is computed: the output values are the same bits.

    - ``flags``: int8 ``[M]`` on the device: the launch also writes each row's check of
      its scales (2 where one is not finite and > 0, else 0: the server's ``bad_rows`` of
      fp8 rows) at the row's stored place, so a lone call's graph is one kernel. Rows in
      no group get no flag. Not on a ``persistent_ws`` tile (:func:`checks_rows`); on the
      other persistent tiles (:func:`persistent`: prefill) only with the rows stored in place
      (no ``out_rows``), as a lone prefill call's graph stores them.
    """
    if addresses.dtype != torch.int64 or addresses.numel() < 2 or not addresses.is_contiguous():
        raise ValueError(f"addresses must be contiguous int64 words (>= 2), got {addresses.dtype} "
                         f"{tuple(addresses.shape)}")
    if inputs is not None and (inputs.dtype != torch.int64 or inputs.numel() < 2 or not inputs.is_contiguous()):
        raise ValueError("inputs must be contiguous int64 words (>= 2)")
    if out_rows is not None and (out_rows.dtype != torch.int64 or out_rows.shape[0] < xq.shape[0]):
        raise ValueError("out_rows must be int64 with a row per row of xq")
    if flags is not None and (flags.dtype != torch.int8 or not flags.is_contiguous()
                              or flags.numel() < out.shape[0] or flags.device != out.device):
        raise ValueError("flags must be contiguous int8 with a byte per row of out, on out's device")
    _check_out_dtype(out)
    m, k = xq.shape
    n = out.shape[1]
    if xq.dtype != torch.float8_e4m3fn or n % BLOCK or k % BLOCK or groups < 1:
        raise ValueError(f"need e4m3fn xq [M, K], N and K multiples of 128, G >= 1; got {tuple(xq.shape)}, "
                         f"N={n}, G={groups}")
    config = default_config(m, n, k, groups)
    return _launch(xq, addresses, x_scale, addresses, m_sizes, out, n, groups, config, addrs=True,
                   x_words=inputs, out_rows=out_rows, flags=flags)


def tile_key(m: int, n: int, k: int, g: int, out_dtype: torch.dtype, *,
             device: torch.device) -> str:
    """The key of the tile both entries launch for this shape into an ``out_dtype`` output
    (``Backend.tile_key``): :func:`default_config`, then :func:`tile_for_out`; a decode tile's
    band (``group_tiles_m``) left out: it only orders the programs, each row's sums are the
    same bits (so buckets on either side of r = 16 still merge). The output: rows of ``n``, whole
    (the server's buffers)."""
    tile = tile_for_out(default_config(m, n, k, g), torch.empty(0, n, dtype=out_dtype))
    return (replace(tile, group_tiles_m=1) if tile.swap_ab else tile).key()


def persistent(m: int, n: int, k: int, g: int, *, device: torch.device) -> bool:
    """Whether the tile for this shape is persistent (``Backend.persistent``)."""
    schedule = default_config(m, n, k, g).schedule
    return schedule in ("persistent_tma", "persistent_ws") or schedule in GLUON_SCHEDULES


def checks_rows(m: int, n: int, k: int, g: int, *, device: torch.device) -> bool:
    """Whether the tile a bf16 launch of this shape runs checks the rows' scales inside
    (``run_addressed``'s ``flags``; ``Backend.checks_rows``): :attr:`TileConfig.checks_rows`."""
    return default_config(m, n, k, g).checks_rows


OUT_DTYPES = (torch.bfloat16, torch.float32)
"""What the kernels store: bf16 (SPEC 1) or the float32 accumulator unrounded (the FFN's h)."""


def _check_out_dtype(out: torch.Tensor) -> None:
    if out.dtype not in OUT_DTYPES:
        raise TypeError(f"out must be bfloat16 or float32, got {out.dtype}")


def _rows(t: torch.Tensor) -> bool:
    """Whether ``t`` is rows of unit-stride elements, as the kernels index it (row r from
    ``r * t.stride(0)``; rows may be padded apart). A column of one element, or a tensor of no
    element (numpy's empty arrays have strides (0, 0)), has no stride to keep."""
    return t.stride(1) == 1 or t.shape[1] == 1 or t.numel() == 0


def _check(xq, wq, x_scale, w_scale, m_sizes, out) -> None:
    """Layout facts the kernel relies on beyond what the public entry checks."""
    if xq.dtype != torch.float8_e4m3fn or wq.dtype != torch.float8_e4m3fn:
        raise TypeError(f"the triton backend computes in float8_e4m3fn, got {xq.dtype}/{wq.dtype}")
    check_operands(xq, wq, x_scale, w_scale, m_sizes, out)
    _check_out_dtype(out)
    if not _rows(xq) or not wq.is_contiguous() or not _rows(out):
        raise ValueError("xq and out must be row-major and wq contiguous [G, N, K]")
    if not _rows(x_scale) or not w_scale.is_contiguous() or not m_sizes.is_contiguous():
        raise ValueError("x_scale [M, K/128] row-major, w_scale [G, K/128, N/128] contiguous")


def run(xq, wq, x_scale, w_scale, m_sizes, out) -> torch.Tensor:
    """SPEC 1 into ``out`` (bf16, or float32: the sum unrounded) on the GPU; returns ``out``.
    Capture-safe (no host reads). M = 0 launches nothing (an empty output, SPEC 1)."""
    _check(xq, wq, x_scale, w_scale, m_sizes, out)
    m, k = xq.shape
    g, n, _ = wq.shape
    if m == 0:
        return out
    return launch(xq, wq, x_scale, w_scale, m_sizes, out, default_config(m, n, k, g))


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
    from . import _triton_ahead
    from ._backend import FfnKernels
    from ._triton_act import gather_quantize_triton, silu_mul_quant_triton
    from ._triton_moe_token import moe_token
    from ._triton_prologue import check_and_gather
    from ._triton_route import combine, quantize_scatter, route

    return Backend(
        name="triton",
        device=device,
        fp8_dtype=torch.float8_e4m3fn,
        weight_layout="plain",
        prepare_weights=_prepare_weights,
        run=run,
        capture_safe=True,
        run_addressed=run_addressed,
        check_and_gather=check_and_gather,
        gather_quantize=gather_quantize_triton,
        tile_key=functools.partial(tile_key, device=device),
        persistent=functools.partial(persistent, device=device),
        checks_rows=functools.partial(checks_rows, device=device),
        ffn=FfnKernels(silu_mul_quant=silu_mul_quant_triton, route=route, combine=combine,
                       quantize_scatter=quantize_scatter, moe_token=moe_token),
        ahead=_triton_ahead.create(),
    )
