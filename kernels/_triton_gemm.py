"""The Triton grouped FP8 GEMM kernel with block-wise scales (SPEC 1), for sm_90.

    tensor    shape             dtype      strides passed
    xq        [M, K]            e4m3fn     stride_xm (K fastest)
    wq        [G, N, K]         e4m3fn     stride_wg, stride_wn (K fastest)
    x_scale   [M, K/128]        float32    stride_xsm (K/128 fastest)
    w_scale   [G, K/128, N/128] float32    stride_wsg, stride_wsk (N/128 fastest)
    m_sizes   [G]               int32/64   contiguous
    out       [M, N]            bfloat16   stride_om (N fastest)

One program computes one (row tile, column tile) of one group. The grid comes
from static shapes only: a bound on the number of row tiles over all groups
times the column tiles. Each program resolves its group from ``m_sizes`` in
registers (prefix sums of rows and of row tiles), so no host code reads
``m_sizes`` and no helper kernel runs: the launch can be captured in a CUDA
graph. Programs past the last real row tile exit at once.

Two orientations, chosen per shape class by the launcher:

- ``SWAP_AB=False`` (prefill): ``acc[BLOCK_M, BLOCK_N] += dot(x, w^T) * (xs * ws)``.
- ``SWAP_AB=True`` (decode): ``acc[BLOCK_N, BLOCK_M] += dot(w, x^T) * (ws * xs)``.
  The weight tile is the MMA's M side (64 or 128 rows) and the few tokens of a
  group its N side (16-64), so the tensor cores are not mostly padding.

Options for the shapes where one tile per program falls short (v5 in
bench/NOTES.md): ``SPLIT_K`` programs per output tile, each over a range of K
blocks, reduced by the last to arrive through a float32 workspace and per-tile
counters (``part_ptr``, ``count_ptr``); ``DOT_PAIR``, two K blocks per
iteration with two independent dots and their scale loads issued together;
``USE_TMA`` (prefill orientation), TMA loads through descriptors made on the
device, and with ``WARP_SPEC`` Triton's Hopper warp specialisation (a
producer warpgroup feeding two consumer warpgroups).

Every 128-wide K block's product is scaled and added to a float32 accumulator
("promotion"), which is what SPEC 1 asks for and what keeps the FP8 MMA's
reduced-precision accumulation short. Loads are never masked: rows past M are
clamped to row M-1 and rows of the next group are computed and dropped; only
the store is masked to the group's rows. Row and group offsets are int64, so
operands of 2^31 elements or more work.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _locate_tile(m_sizes_ptr, G, tile_m, BLOCK_M: tl.constexpr, G_POW2: tl.constexpr):
    """(group, first row of the tile, end row of the group, valid) of flat row tile ``tile_m``."""
    offs_g = tl.arange(0, G_POW2)
    sizes = tl.load(m_sizes_ptr + offs_g, mask=offs_g < G, other=0).to(tl.int32)
    tiles = (sizes + (BLOCK_M - 1)) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    row_end = tl.cumsum(sizes, 0)
    # The group is the first whose tiles end after tile_m; empty groups end
    # where the previous one did and are skipped by the count.
    group = tl.sum((tile_end <= tile_m).to(tl.int32), 0)
    pick = offs_g == group
    group_tile_end = tl.sum(tl.where(pick, tile_end, 0), 0)
    group_tiles = tl.sum(tl.where(pick, tiles, 0), 0)
    group_row_end = tl.sum(tl.where(pick, row_end, 0), 0)
    group_size = tl.sum(tl.where(pick, sizes, 0), 0)
    first_row = group_row_end - group_size + (tile_m - (group_tile_end - group_tiles)) * BLOCK_M
    return group, first_row, group_row_end, group < G


@triton.jit
def _locate_tile_scalar(m_sizes_ptr, G, tile_m, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """:func:`_locate_tile` as a scalar walk over the groups, with no reduction or scan.

    Triton 3.6's Hopper warp specialisation rejects kernels holding reduce or
    scan regions, so the warp-specialised variant finds its group this way.
    The walk goes CHUNK groups at a time, unrolled, so the CHUNK size loads
    of a chunk are in flight together: one memory latency per chunk instead
    of one per group (a program of G = 8 waited eight L2 latencies before its
    first load, v7 in bench/NOTES.md).
    """
    group = G
    first_row = 0
    row_end = 0
    tiles_before = 0
    rows_before = 0
    for g0 in range(0, G, CHUNK):
        for j in tl.static_range(CHUNK):
            g = g0 + j
            size = tl.load(m_sizes_ptr + g, mask=g < G, other=0).to(tl.int32)
            tiles = (size + (BLOCK_M - 1)) // BLOCK_M
            hit = (group == G) & (tile_m < tiles_before + tiles)
            group = tl.where(hit, g, group)
            first_row = tl.where(hit, rows_before + (tile_m - tiles_before) * BLOCK_M, first_row)
            row_end = tl.where(hit, rows_before + size, row_end)
            tiles_before += tiles
            rows_before += size
    return group, first_row, row_end, group < G


@triton.jit
def _prefetch_l1(ptrs):
    """Ask for ``ptrs`` in L1 without waiting: a hint with no result, so the loop carries nothing."""
    tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.b32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _opaque_i32(v):
    """``v`` through an opaque register copy: the same number, a value no pass can trace to ``v``.

    Triton 3.6's Hopper warp specialisation (``nvgpu-warp-specialization``),
    when it splits a 128-row tile over two 64-row consumers, rewrites the row
    coordinate of each activation TMA load to ``row + 64`` for the second
    consumer, and then maps every other use of that same value in the second
    consumer to ``row + 64`` as well. Its ``first_row + tl.arange(0, 128)``,
    already sliced to rows 64..127, then covered rows 128..191: the store
    missed rows 64..127 of every tile (left NaN-poisoned) and overwrote the
    next tile's first half with wrong scales (v7 in bench/NOTES.md, seen in
    the TTGIR). Giving the TMA coordinate its own value keeps the row
    arithmetic of the scales and the store untouched.
    """
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _tma_ws_tile(x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr, M, N, K, G, stride_xm, stride_wn, stride_xsm,
                 stride_wsg, stride_wsk, stride_om, group, first_row, row_stop, valid, tile_n,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WARP_SPEC: tl.constexpr,
                 DOT_PAIR: tl.constexpr):
    """One prefill tile with TMA loads, optionally warp-specialised (``USE_TMA`` in the kernel).

    The descriptors are made on the device: with WARP_SPEC the compiler
    splits the tile's rows over two consumer warpgroups and rewrites the
    activation descriptor's box to match, which a host-made descriptor (box
    fixed on the host) would not follow. Triton 3.6's Hopper warp
    specialisation only takes a loop that no ``if`` encloses, so nothing here
    branches on ``valid``: a surplus tile runs an empty K range and stores
    nothing. TMA fills rows past M with zeros, so the activation rows need no
    clamping; the weights are seen as ``[G * N, K]`` (contiguous ``wq``).

    ``DOT_PAIR``: two K blocks per iteration, two independent dots; each
    consumer scales the first product while the second one runs on the
    tensor cores. An odd last block pairs with itself, its copy scaled by 0.
    """
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G * N, K], strides=[stride_wn, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    rows = first_row + tl.arange(0, BLOCK_M)
    rows_in = tl.minimum(rows, M - 1).to(tl.int64)
    # The TMA row coordinate as a value of its own (see _opaque_i32).
    tma_row = _opaque_i32(first_row)
    num_k = tl.where(valid, K // BLOCK_K, 0)
    w_row = group * N + tile_n * BLOCK_N
    xs_ptrs = xs_ptr + rows_in * stride_xsm
    ws_ptrs = ws_ptr + group.to(tl.int64) * stride_wsg + (tile_n * BLOCK_N) // 128
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if DOT_PAIR:
        for kp in tl.range(0, (num_k + 1) // 2, warp_specialize=WARP_SPEC):
            kb = 2 * kp
            step = tl.minimum(1, num_k - 1 - kb)  # 0 on an odd last block
            x0 = x_desc.load([tma_row, kb * BLOCK_K])
            w0 = w_desc.load([w_row, kb * BLOCK_K])
            x1 = x_desc.load([tma_row, (kb + step) * BLOCK_K])
            w1 = w_desc.load([w_row, (kb + step) * BLOCK_K])
            s0 = tl.load(xs_ptrs + kb) * tl.load(ws_ptrs + kb * stride_wsk)
            s1 = tl.load(xs_ptrs + kb + step) * (tl.load(ws_ptrs + (kb + step) * stride_wsk) * step.to(tl.float32))
            part0 = tl.dot(x0, tl.trans(w0))
            part1 = tl.dot(x1, tl.trans(w1))
            acc += part0 * s0[:, None]
            acc += part1 * s1[:, None]
    else:
        for kb in tl.range(0, num_k, warp_specialize=WARP_SPEC):
            x = x_desc.load([tma_row, kb * BLOCK_K])
            w = w_desc.load([w_row, kb * BLOCK_K])
            xs = tl.load(xs_ptrs + kb)
            ws = tl.load(ws_ptrs + kb * stride_wsk)
            acc += tl.dot(x, tl.trans(w)) * (xs[:, None] * ws)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = (rows < row_stop) & valid
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(tl.bfloat16), mask=keep[:, None])


@triton.jit
def _locate_tile_unrolled(m_sizes_ptr, G, tile_m, BLOCK_M: tl.constexpr, G_MAX: tl.constexpr):
    """:func:`_locate_tile_scalar` for G <= G_MAX, fully unrolled: no loop, no reduction.

    The persistent tile loop needs its group lookup loop-free: Triton's loop
    flattening and its Hopper warp specialisation both take a loop nest of
    exactly two loops (tiles, then K blocks).
    """
    group = G
    first_row = 0
    row_end = 0
    tiles_before = 0
    rows_before = 0
    for g in tl.static_range(G_MAX):
        size = tl.load(m_sizes_ptr + g, mask=g < G, other=0).to(tl.int32)
        tiles = (size + (BLOCK_M - 1)) // BLOCK_M
        hit = (group == G) & (tile_m < tiles_before + tiles)
        group = tl.where(hit, g, group)
        first_row = tl.where(hit, rows_before + (tile_m - tiles_before) * BLOCK_M, first_row)
        row_end = tl.where(hit, rows_before + size, row_end)
        tiles_before += tiles
        rows_before += size
    return group, first_row, row_end, group < G


@triton.jit
def _tile_coords(t, num_m, num_n, GROUP_TILES_M: tl.constexpr):
    """(row tile, column tile) of flat tile ``t``: GROUP_TILES_M row tiles per band before moving along N."""
    band = GROUP_TILES_M * num_n
    first_m = (t // band) * GROUP_TILES_M
    band_rows = tl.minimum(num_m - first_m, GROUP_TILES_M)
    return first_m + (t % band) % band_rows, (t % band) // band_rows


@triton.jit
def _tma_persistent(x_ptr, w_ptr, xs_ptr, ws_ptr, m_sizes_ptr, out_ptr, M, N, K, G, stride_xm, stride_wn,
                    stride_xsm, stride_wsg, stride_wsk, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_TILES_M: tl.constexpr, G_MAX: tl.constexpr, WARP_SPEC: tl.constexpr,
                    DOT_PAIR: tl.constexpr, LEAD_TILE: tl.constexpr):
    """Persistent prefill: one program per SM walks the tiles ``pid, pid + programs, ...``.

    The tile loop is the outer of a two-loop nest. With WARP_SPEC it is the
    warp-specialised loop: the TMA producer runs ahead into the next tile's
    K blocks while the consumers scale, convert and store the current one,
    so a short K range (K = 2304: 18 blocks) no longer pays the pipeline fill
    and the store per tile. The tile count is the launcher's static bound;
    tiles past the real row tiles run an empty K range and store nothing (no
    branch: the pass rejects loops under an ``if``). G <= G_MAX (the group
    walk is unrolled).

    BLOCK_N = 256 (not with DOT_PAIR): two 128-wide halves, two dots per K
    block sharing the activation tile, each half with its own weight-scale
    column; two 64 x 128 accumulators and one product live per consumer.
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    num_n = N // BLOCK_N
    # row_tile_bound of the launcher, from M and G alone.
    num_m = tl.minimum(tl.minimum(M, (M + G * (BLOCK_M - 1)) // BLOCK_M), tl.cdiv(M, BLOCK_M) + G - 1)
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    num_kb = K // BLOCK_K
    HALF_N: tl.constexpr = BLOCK_N // 2 if BLOCK_N > 128 else BLOCK_N
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G * N, K], strides=[stride_wn, 1],
                                       block_shape=[HALF_N, BLOCK_K])
    # LEAD_TILE: each program first runs a throwaway tile of one K block that
    # stores nothing (t < 0 below). The deep warp-specialised tiles wrote NaN
    # into column 0 of each program's first tile only (v9 in bench/NOTES.md:
    # something overwrites the first weight row of the first load), so the
    # first load goes to a tile whose result is dropped.
    for t in tl.range(pid - programs if LEAD_TILE else pid, num_m * num_n, programs, warp_specialize=WARP_SPEC):
        tile_m, tile_n = _tile_coords(tl.maximum(t, 0), num_m, num_n, GROUP_TILES_M)
        group, first_row, row_stop, valid = _locate_tile_unrolled(m_sizes_ptr, G, tile_m, BLOCK_M, G_MAX)
        group = tl.minimum(group, G - 1)
        rows = first_row + tl.arange(0, BLOCK_M)
        rows_in = tl.minimum(rows, M - 1).to(tl.int64)
        tma_row = _opaque_i32(first_row)  # see _opaque_i32
        num_k = tl.where(t < 0, 1, tl.where(valid, num_kb, 0))
        valid = valid & (t >= 0)
        w_row = group * N + tile_n * BLOCK_N
        xs_ptrs = xs_ptr + rows_in * stride_xsm
        ws_ptrs = ws_ptr + group.to(tl.int64) * stride_wsg + (tile_n * BLOCK_N) // 128
        if BLOCK_N > 128:
            tl.static_assert(not DOT_PAIR, "a 256-wide tile runs one K block per iteration")
            acc_a = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
            acc_b = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
            for kb in range(num_k):
                x = x_desc.load([tma_row, kb * BLOCK_K])
                w_a = w_desc.load([w_row, kb * BLOCK_K])
                w_b = w_desc.load([w_row + HALF_N, kb * BLOCK_K])
                xs = tl.load(xs_ptrs + kb)
                s_a = xs * tl.load(ws_ptrs + kb * stride_wsk)
                s_b = xs * tl.load(ws_ptrs + 1 + kb * stride_wsk)
                acc_a += tl.dot(x, tl.trans(w_a)) * s_a[:, None]
                acc_b += tl.dot(x, tl.trans(w_b)) * s_b[:, None]
            keep = (rows < row_stop) & valid
            offs_n = tile_n * BLOCK_N + tl.arange(0, HALF_N)
            out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(out_ptrs, acc_a.to(tl.bfloat16), mask=keep[:, None])
            tl.store(out_ptrs + HALF_N, acc_b.to(tl.bfloat16), mask=keep[:, None])
        else:
            _persistent_tile_128(x_desc, w_desc, xs_ptrs, ws_ptrs, out_ptr, stride_wsk, stride_om, rows, row_stop,
                                 valid, tma_row, w_row, tile_n, num_k, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PAIR)


@triton.jit
def _persistent_tile_128(x_desc, w_desc, xs_ptrs, ws_ptrs, out_ptr, stride_wsk, stride_om, rows, row_stop, valid,
                         tma_row, w_row, tile_n, num_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, DOT_PAIR: tl.constexpr):
    """One tile of :func:`_tma_persistent` of BLOCK_N <= 128 (one weight-scale column)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if DOT_PAIR:
        for kp in range((num_k + 1) // 2):
            kb = 2 * kp
            step = tl.minimum(1, num_k - 1 - kb)  # 0 on an odd last block
            x0 = x_desc.load([tma_row, kb * BLOCK_K])
            w0 = w_desc.load([w_row, kb * BLOCK_K])
            x1 = x_desc.load([tma_row, (kb + step) * BLOCK_K])
            w1 = w_desc.load([w_row, (kb + step) * BLOCK_K])
            s0 = tl.load(xs_ptrs + kb) * tl.load(ws_ptrs + kb * stride_wsk)
            s1 = tl.load(xs_ptrs + kb + step) * (tl.load(ws_ptrs + (kb + step) * stride_wsk)
                                                 * step.to(tl.float32))
            part0 = tl.dot(x0, tl.trans(w0))
            part1 = tl.dot(x1, tl.trans(w1))
            acc += part0 * s0[:, None]
            acc += part1 * s1[:, None]
    else:
        for kb in range(num_k):
            x = x_desc.load([tma_row, kb * BLOCK_K])
            w = w_desc.load([w_row, kb * BLOCK_K])
            s = tl.load(xs_ptrs + kb) * tl.load(ws_ptrs + kb * stride_wsk)
            acc += tl.dot(x, tl.trans(w)) * s[:, None]
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = (rows < row_stop) & valid
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(tl.bfloat16), mask=keep[:, None])


@triton.jit
def grouped_fp8_kernel(
    x_ptr, w_ptr, xs_ptr, ws_ptr, m_sizes_ptr, out_ptr,
    M, N, K, G,
    stride_xm, stride_wg, stride_wn, stride_xsm, stride_wsg, stride_wsk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    G_POW2: tl.constexpr, SWAP_AB: tl.constexpr, EVICT_W: tl.constexpr,
    GROUP_TILES_M: tl.constexpr, PRELOAD_SCALES: tl.constexpr, SCALE_CHUNK: tl.constexpr,
    PREFETCH_SCALES: tl.constexpr = 0, W_TABLE: tl.constexpr = False,
    part_ptr=None, count_ptr=None, SPLIT_K: tl.constexpr = 1, DOT_PAIR: tl.constexpr = False,
    USE_TMA: tl.constexpr = False, WARP_SPEC: tl.constexpr = False, SCALE_AHEAD: tl.constexpr = False,
    LOCATE_CHUNK: tl.constexpr = 1, PERSISTENT: tl.constexpr = False, LEAD_TILE: tl.constexpr = False,
):
    """SPEC 1 for one output tile; see the module docstring for the layout."""
    if PERSISTENT:
        _tma_persistent(x_ptr, w_ptr, xs_ptr, ws_ptr, m_sizes_ptr, out_ptr, M, N, K, G, stride_xm, stride_wn,
                        stride_xsm, stride_wsg, stride_wsk, stride_om, BLOCK_M, BLOCK_N, BLOCK_K,
                        GROUP_TILES_M, G_POW2, WARP_SPEC, DOT_PAIR, LEAD_TILE)
        return
    pid = tl.program_id(0)
    # Split-K: SPLIT_K consecutive programs share one output tile, each over
    # its own range of K blocks (SPLIT_K == 1: the whole K range).
    split = pid % SPLIT_K
    pid = pid // SPLIT_K
    num_n = N // BLOCK_N
    # Super-grouping GROUP_TILES_M row tiles before moving along N keeps a band
    # of activations and a band of weights hot in L2 at prefill sizes.
    num_m = tl.num_programs(0) // SPLIT_K // num_n
    band = GROUP_TILES_M * num_n
    band_id = pid // band
    first_m = band_id * GROUP_TILES_M
    band_rows = tl.minimum(num_m - first_m, GROUP_TILES_M)
    tile_m = first_m + (pid % band) % band_rows
    tile_n = (pid % band) // band_rows

    if WARP_SPEC:
        group, first_row, row_stop, valid = _locate_tile_scalar(m_sizes_ptr, G, tile_m, BLOCK_M, LOCATE_CHUNK)
    else:
        group, first_row, row_stop, valid = _locate_tile(m_sizes_ptr, G, tile_m, BLOCK_M, G_POW2)
    if USE_TMA:
        _tma_ws_tile(x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr, M, N, K, G, stride_xm, stride_wn, stride_xsm,
                     stride_wsg, stride_wsk, stride_om, tl.minimum(group, G - 1), first_row, row_stop,
                     valid, tile_n, BLOCK_M, BLOCK_N, BLOCK_K, WARP_SPEC, DOT_PAIR)
    elif valid:
        rows = first_row + tl.arange(0, BLOCK_M)
        # Clamped, not masked: reads stay in bounds and the loads stay plain.
        rows_in = tl.minimum(rows, M - 1).to(tl.int64)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        group64 = group.to(tl.int64)
        if W_TABLE:
            # w_ptr / ws_ptr are int64 tables of each group's weight and scale
            # addresses, so one captured graph serves every weight set of a shape.
            # The compiler knows nothing of a loaded address: say it is 16-byte
            # aligned (torch allocations are), or the loads lose their width
            # and the pipeliner drops them.
            w_group = tl.multiple_of(tl.load(w_ptr + group64).to(tl.pointer_type(tl.float8e4nv)), 16)
            ws_group = tl.load(ws_ptr + group64).to(tl.pointer_type(tl.float32))
        else:
            w_group = w_ptr + group64 * stride_wg
            ws_group = ws_ptr + group64 * stride_wsg

        num_k = K // BLOCK_K
        if SPLIT_K > 1:
            per_split = tl.cdiv(num_k, SPLIT_K)
            k_lo = tl.minimum(split * per_split, num_k)
            k_hi = tl.minimum(k_lo + per_split, num_k)
        else:
            k_lo = 0
            k_hi = num_k
        x_ptrs = x_ptr + rows_in[:, None] * stride_xm + (k_lo * BLOCK_K + offs_k)[None, :]
        w_ptrs = w_group + offs_n.to(tl.int64)[:, None] * stride_wn + (k_lo * BLOCK_K + offs_k)[None, :]
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PRELOAD_SCALES:
            # The scales are loaded SCALE_CHUNK K blocks at a time, before the
            # inner loop: loads in the loop that do not feed the dot are not
            # staged by the software pipeliner, so each would stall a full
            # memory latency per K block (what limits a decode tile that has
            # an SM to itself). The inner loop then holds only the x and w
            # loads, which the pipeliner keeps num_stages deep. Only for
            # BLOCK_N <= 128 (one weight-scale column per tile).
            offs_c = tl.arange(0, SCALE_CHUNK)
            xs_rows = xs_ptr + rows_in[:, None] * stride_xsm
            ws_tile = ws_group + (tile_n * BLOCK_N) // 128
            for chunk in range(k_lo, k_hi, SCALE_CHUNK):
                in_k = chunk + offs_c < k_hi
                xs_all = tl.load(xs_rows + (chunk + offs_c)[None, :], mask=in_k[None, :], other=0.0)
                ws_all = tl.load(ws_tile + (chunk + offs_c) * stride_wsk, mask=in_k, other=0.0)
                s_all = xs_all * ws_all[None, :]  # [BLOCK_M, SCALE_CHUNK]
                for j in range(tl.minimum(SCALE_CHUNK, k_hi - chunk)):
                    x = tl.load(x_ptrs)
                    w = tl.load(w_ptrs, eviction_policy=EVICT_W)
                    s = tl.sum(tl.where((offs_c == j)[None, :], s_all, 0.0), 1)  # [BLOCK_M]
                    if SWAP_AB:
                        acc += tl.dot(w, tl.trans(x)) * s[None, :]
                    else:
                        acc += tl.dot(x, tl.trans(w)) * s[:, None]
                    x_ptrs += BLOCK_K
                    w_ptrs += BLOCK_K
        elif DOT_PAIR and SCALE_AHEAD:
            # DOT_PAIR with each pair's scales loaded one iteration ahead and
            # combined (xs * ws) before the loop needs them: the scale loads
            # are not staged by the software pipeliner, and waiting on them
            # right after the first dot delays the second dot's issue by
            # whatever of the L2 latency the first dot does not cover.
            tl.static_assert(BLOCK_N <= 128, "DOT_PAIR needs one weight-scale column per tile")
            xs_row = xs_ptr + rows_in * stride_xsm
            ws_col = ws_group + (tile_n * BLOCK_N) // 128
            step = tl.minimum(1, k_hi - 1 - k_lo)
            s0 = tl.load(xs_row + k_lo) * tl.load(ws_col + k_lo * stride_wsk)
            s1 = tl.load(xs_row + k_lo + step) * (tl.load(ws_col + (k_lo + step) * stride_wsk) * step.to(tl.float32))
            for kb in range(k_lo, k_hi, 2):
                step = tl.minimum(1, k_hi - 1 - kb)  # 0 on an odd last block
                x0 = tl.load(x_ptrs)
                w0 = tl.load(w_ptrs, eviction_policy=EVICT_W)
                x1 = tl.load(x_ptrs + step * BLOCK_K)
                w1 = tl.load(w_ptrs + step * BLOCK_K, eviction_policy=EVICT_W)
                # The next pair's scales (clamped in range; unused after the last pair).
                kn = tl.minimum(kb + 2, k_hi - 1)
                step_n = tl.minimum(1, k_hi - 1 - kn)
                xs0_n = tl.load(xs_row + kn)
                ws0_n = tl.load(ws_col + kn * stride_wsk)
                xs1_n = tl.load(xs_row + kn + step_n)
                ws1_n = tl.load(ws_col + (kn + step_n) * stride_wsk) * step_n.to(tl.float32)
                if SWAP_AB:
                    part0 = tl.dot(w0, tl.trans(x0))
                    part1 = tl.dot(w1, tl.trans(x1))
                    acc += part0 * s0[None, :]
                    acc += part1 * s1[None, :]
                else:
                    part0 = tl.dot(x0, tl.trans(w0))
                    part1 = tl.dot(x1, tl.trans(w1))
                    acc += part0 * s0[:, None]
                    acc += part1 * s1[:, None]
                s0 = xs0_n * ws0_n
                s1 = xs1_n * ws1_n
                x_ptrs += 2 * BLOCK_K
                w_ptrs += 2 * BLOCK_K
        elif DOT_PAIR:
            # Two K blocks per iteration, two independent dots: the second
            # block's wgmma can run while the first block's product is scaled
            # and added (one wgmma -> wait -> FMA chain per block otherwise).
            # An odd last block pairs with itself, its second copy scaled by 0.
            tl.static_assert(BLOCK_N <= 128, "DOT_PAIR needs one weight-scale column per tile")
            xs_ptrs = xs_ptr + rows_in * stride_xsm + k_lo
            ws_ptrs = ws_group + (tile_n * BLOCK_N) // 128 + k_lo * stride_wsk
            for kb in range(k_lo, k_hi, 2):
                step = tl.minimum(1, k_hi - 1 - kb)  # 0 on an odd last block
                x0 = tl.load(x_ptrs)
                w0 = tl.load(w_ptrs, eviction_policy=EVICT_W)
                x1 = tl.load(x_ptrs + step * BLOCK_K)
                w1 = tl.load(w_ptrs + step * BLOCK_K, eviction_policy=EVICT_W)
                xs0 = tl.load(xs_ptrs)
                ws0 = tl.load(ws_ptrs)
                xs1 = tl.load(xs_ptrs + step)
                ws1 = tl.load(ws_ptrs + step * stride_wsk) * step.to(tl.float32)
                if SWAP_AB:
                    part0 = tl.dot(w0, tl.trans(x0))
                    part1 = tl.dot(w1, tl.trans(x1))
                    acc += part0 * (xs0[None, :] * ws0)
                    acc += part1 * (xs1[None, :] * ws1)
                else:
                    part0 = tl.dot(x0, tl.trans(w0))
                    part1 = tl.dot(x1, tl.trans(w1))
                    acc += part0 * (xs0[:, None] * ws0)
                    acc += part1 * (xs1[:, None] * ws1)
                x_ptrs += 2 * BLOCK_K
                w_ptrs += 2 * BLOCK_K
                xs_ptrs += 2
                ws_ptrs += 2 * stride_wsk
        else:
            xs_ptrs = xs_ptr + rows_in * stride_xsm + k_lo
            if BLOCK_N <= 128:
                # The whole column tile shares one 128-wide weight-scale block.
                ws_ptrs = ws_group + (tile_n * BLOCK_N) // 128 + k_lo * stride_wsk
            else:
                ws_ptrs = ws_group + offs_n // 128 + k_lo * stride_wsk
            for kb in range(k_lo, k_hi):
                if PREFETCH_SCALES > 0:
                    # The scale loads below wait a full L2 latency each K block
                    # (the pipeliner stages only the dot operands); asking for
                    # the scales PREFETCH_SCALES blocks ahead turns that into an
                    # L1 hit. Clamped to the last block: never out of bounds.
                    ahead = tl.minimum(kb + PREFETCH_SCALES, k_hi - 1) - kb
                    _prefetch_l1(xs_ptrs + ahead)
                    _prefetch_l1(ws_ptrs + ahead * stride_wsk)
                x = tl.load(x_ptrs)
                w = tl.load(w_ptrs, eviction_policy=EVICT_W)
                xs = tl.load(xs_ptrs)
                ws = tl.load(ws_ptrs)
                if SWAP_AB:
                    part = tl.dot(w, tl.trans(x))
                    if BLOCK_N <= 128:
                        acc += part * (xs[None, :] * ws)
                    else:
                        acc += part * (ws[:, None] * xs[None, :])
                else:
                    part = tl.dot(x, tl.trans(w))
                    if BLOCK_N <= 128:
                        acc += part * (xs[:, None] * ws)
                    else:
                        acc += part * (xs[:, None] * ws[None, :])
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
                xs_ptrs += 1
                ws_ptrs += stride_wsk

        if SPLIT_K > 1:
            # Each split parks its float32 partial in its own slot; the last
            # split of the tile to arrive sums the slots in split order (the
            # result does not depend on arrival order) and stores. It then
            # resets the tile's counter, so the workspace is clean for the next
            # launch or graph replay without a memset.
            tile_id = pid.to(tl.int64)
            if SWAP_AB:
                offs_tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            else:
                offs_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            slots = part_ptr + tile_id * (SPLIT_K * BLOCK_M * BLOCK_N) + offs_tile
            tl.store(slots + split * (BLOCK_M * BLOCK_N), acc)
            # Every thread's partial is written before one thread announces it.
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
            last = arrived == SPLIT_K - 1
            if last:
                acc = tl.load(slots, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):
                    acc += tl.load(slots + s * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
                tl.store(count_ptr + tile_id, 0)
        else:
            last = True
        # Only the store is masked: rows of the next group and rows past M drop here.
        keep = (rows < row_stop) & last
        rows64 = rows.to(tl.int64)
        if SWAP_AB:
            out_ptrs = out_ptr + rows64[None, :] * stride_om + offs_n[:, None]
            tl.store(out_ptrs, acc.to(tl.bfloat16), mask=keep[None, :])
        else:
            out_ptrs = out_ptr + rows64[:, None] * stride_om + offs_n[None, :]
            tl.store(out_ptrs, acc.to(tl.bfloat16), mask=keep[:, None])
