"""The Triton grouped FP8 GEMM kernels with block-wise scales (SPEC 1), for sm_90.

    tensor    shape             dtype      strides passed
    xq        [M, K]            e4m3fn     stride_xm (K fastest)
    wq        [G, N, K]         e4m3fn     stride_wg, stride_wn (K fastest, contiguous)
    x_scale   [M, K/128]        float32    stride_xsm (K/128 fastest)
    w_scale   [G, K/128, N/128] float32    stride_wsg, stride_wsk (N/128 fastest)
    m_sizes   [G]               int32/64   contiguous
    out       [M, N]            bfloat16   stride_om (N fastest)
                                or float32 (every store casts to out_ptr's element type)

One ``@triton.jit`` per schedule; the launcher (``triton_kernel.py``) picks one
per shape class. Every schedule:

- finds each tile's group from ``m_sizes`` inside the kernel (no host reads,
  no helper kernel: the launch can be captured in a CUDA graph);
- reads the weights either from the pointers it is given or, with ``ADDRS``,
  from two int64 device words at ``w_ptr`` (the weight set's ``wq`` and
  ``w_scale`` base addresses). That is how a server graph captured once per
  (G, N, K) serves every weight set of that shape: the same kernel, the same
  tile, only the base pointers' source differs (bit-identical output);
- clamps ``m_sizes`` to the rows that exist: a size outside ``[0, M]`` or
  sizes summing past M never make a store past row M or past a group (the
  group ends are computed as ``min(prefix, M)``);
- uses int64 for every row, group and element offset (operands past 2^31
  elements);
- promotes every 128-wide K block: ``acc += dot * (x_scale * w_scale)``,
  which SPEC 1 asks for and keeps the FP8 MMA's reduced-precision
  accumulation short;
- never masks an operand's load: rows past M are clamped to row M-1 (or
  zero-filled by TMA), rows of the next group are computed and dropped; only
  the store is masked to the group's rows (and the rows' check below masks
  its scale blocks past K).

The schedules:

- :func:`decode_kernel`, :func:`decode_pair_kernel` (few rows per group):
  A and B swapped, ``acc[BLOCK_N, BLOCK_M] += dot(w, x^T)``: the weight tile
  (64/128 rows) is the MMA's M side, the group's few tokens (16-64) its N
  side. The pair kernel runs two K blocks per iteration with each pair's
  scales loaded a pair ahead (the pipeliner does not stage scale loads),
  each program over a whole tile's K range. The single-block kernel takes
  ``PRELOAD`` (the table's choice per tile): every K block's scale products
  taken into registers before the loop (``CHUNK`` blocks at a time), none on
  the loop's path; the same bits. And ``SPLIT_K``: that many programs
  share an output tile, each over its own K range, reduced by the last to
  arrive (float32 slots, counters that reset themselves).
- :func:`persistent_ws_kernel` (prefill, G <= 64): one program per SM walking
  the tiles, TMA loads, Triton's Hopper warp specialisation (a producer and
  two 64-row consumers), 128 x 128 tiles, pairs of K blocks; its group
  lookup is an unrolled scalar walk (the pass rejects reductions and tables).
- :func:`persistent_tma_kernel` (prefill, many experts): the programs (two per
  SM) walk exactly the real tiles group by group through a tile table each
  writes first (O(log G) per tile), one software pipeline across tiles.

For a server graph every schedule also takes ``X_WORDS`` (the activations'
and their scales' base addresses from two more device words: the rows where a
lone call's arrived, or regrouped) and ``ROW_MAP`` (row r stored at
``out[map[r]]``: the callers' order). Neither changes a value computed. Every
schedule but ``persistent_ws`` also takes ``FLAGS`` (a lone call's graph, one
kernel: the server's check of the rows' scales written to ``flags_ptr`` at each
row's stored place by the first column tile's programs; the decode kernels load
the scales for it before their K loop, the persistent ones check the scales their
K loop loads anyway). In ``persistent_ws``'s warp-specialised loop that check cost
the tile 1.12x (seed m1024 n2048 k7168, session 33), so its lone calls keep the
check kernel before it. The decode kernels take ``GROUP_TILES_M`` (row tiles
walked side by side per weight tile: only the programs' order).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_keys import settle

# ---- helpers ---------------------------------------------------------------------------------


@triton.jit
def _weights(w_ptr, ws_ptr, ADDRS: tl.constexpr):
    """The weight set's ``wq`` and ``w_scale`` base pointers.

    ``ADDRS``: ``w_ptr`` is an int64 device buffer whose words 0 and 1 hold
    them (written before a graph replay); else they are the arguments. The
    compiler knows nothing of a loaded address: it is declared 16-byte
    aligned (torch allocations are), or the loads lose their width.
    """
    if ADDRS:
        w_base = tl.multiple_of(tl.load(w_ptr).to(tl.pointer_type(tl.float8e4nv)), 16)
        ws_base = tl.multiple_of(tl.load(w_ptr + 1).to(tl.pointer_type(tl.float32)), 16)
    else:
        w_base = w_ptr
        ws_base = ws_ptr
    return w_base, ws_base


@triton.jit
def _present(w_base, ws_base, x_base, xs_base, ADDRS: tl.constexpr, X_WORDS: tl.constexpr):
    """Whether the loaded operand addresses are not null (always, for any launch that has rows
    to compute). A decode tile's branch takes it so that the address loads stay where they are
    written, issued beside ``m_sizes``'s: unused before the branch, the compiler sank them under
    it, and a launch through the tables waited on two round trips to memory before its first
    weight load instead of one (seen in the SASS; 1.00-1.04x on the one-token launches, session
    30 in bench/NOTES.md). A null word (a server bug: no launch with rows passes one) skips
    the tile instead of faulting."""
    ok = True
    if ADDRS:
        ok = ok & (w_base.to(tl.int64, bitcast=True) != 0)
        ok = ok & (ws_base.to(tl.int64, bitcast=True) != 0)
    if X_WORDS:
        ok = ok & (x_base.to(tl.int64, bitcast=True) != 0)
        ok = ok & (xs_base.to(tl.int64, bitcast=True) != 0)
    return ok


@triton.jit
def _inputs(x_ptr, xs_ptr, X_WORDS: tl.constexpr):
    """The activations' and their scales' base pointers.

    ``X_WORDS``: ``x_ptr`` is an int64 device buffer whose words 0 and 1 hold
    them (a server graph points them at the callers' rows as they arrived, or
    at the rows regrouped per expert); else they are the arguments.
    """
    if X_WORDS:
        x_base = tl.multiple_of(tl.load(x_ptr).to(tl.pointer_type(tl.float8e4nv)), 16)
        xs_base = tl.multiple_of(tl.load(x_ptr + 1).to(tl.pointer_type(tl.float32)), 16)
    else:
        x_base = x_ptr
        xs_base = xs_ptr
    return x_base, xs_base


@triton.jit
def _out_rows(rows, rows_in, map_ptr, stride_map, ROW_MAP: tl.constexpr):
    """The output rows (int64) the tile's ``rows`` are stored to.

    ``ROW_MAP``: row r goes to ``map[r]`` (a server graph's merged calls: the
    callers' order, so no pass after the GEMM moves the output); else to r.
    Only the store's address changes: the values are the same bits.
    """
    if ROW_MAP:
        return tl.load(map_ptr + rows_in * stride_map)
    else:
        return rows.to(tl.int64)


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add_triple(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _locate_tile(m_sizes_ptr, M, G, tile_m, BLOCK_M: tl.constexpr, G_POW2: tl.constexpr):
    """(group, first row of the tile, end row of the group, valid) of flat row tile ``tile_m``.

    Group g owns rows ``[min(prefix_g, M), min(prefix_g + size_g, M))`` with
    each size clamped to ``[0, M]`` first (int64 sums): whatever ``m_sizes``
    holds, no tile reaches past row M or into another group's rows. Two steps
    across the warps (each a barrier round at G >= 128): one scan of the rows and
    tiles together, one sum of the tile's group found as a one-hot. The tiles are
    counted from the clamped sizes before the rows' clamp to M: where ``m_sizes``
    sums past M, a group's tiles past row M own no row (their ``row_stop`` is
    below their first row), and every tile of a row below M comes first.
    """
    offs_g = tl.arange(0, G_POW2)
    raw = tl.load(m_sizes_ptr + offs_g, mask=offs_g < G, other=0).to(tl.int64)
    raw = tl.minimum(tl.maximum(raw, 0), M)
    tiles = (raw + (BLOCK_M - 1)) // BLOCK_M
    ends, tile_end = tl.associative_scan((raw, tiles), 0, _add_pair)
    row_end = tl.minimum(ends, M)
    row_start = tl.minimum(ends - raw, M)
    tile_start = tile_end - tiles
    # Empty groups (no tile) are never hit; past the last group's tiles nothing is.
    hit = (tile_start <= tile_m) & (tile_m < tile_end)
    first_row = row_start + (tile_m - tile_start) * BLOCK_M
    group1, first, stop = tl.reduce((tl.where(hit, offs_g + 1, 0), tl.where(hit, first_row, 0),
                                     tl.where(hit, row_end, 0)), 0, _add_triple)
    valid = group1 > 0
    group = tl.where(valid, group1 - 1, G)
    return group, first.to(tl.int32), stop.to(tl.int32), valid


@triton.jit
def _locate_tile_unrolled(m_sizes_ptr, M, G, tile_m, BLOCK_M: tl.constexpr, G_MAX: tl.constexpr):
    """:func:`_locate_tile` for G <= G_MAX as a fully unrolled scalar walk: no loop, no reduction.

    Triton 3.6's Hopper warp specialisation rejects reduce/scan regions and
    takes a loop nest of exactly two loops (tiles, then K blocks), so the
    persistent tile loop needs its lookup loop-free. Each size is clamped to
    the rows left before M, so the walk's sums stay within [0, M].
    """
    group = G
    first_row = 0
    row_end = 0
    tiles_before = 0
    rows_before = 0
    for g in tl.static_range(G_MAX):
        raw = tl.load(m_sizes_ptr + g, mask=g < G, other=0).to(tl.int64)
        size = tl.minimum(tl.maximum(raw, 0), M - rows_before).to(tl.int32)
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
    """(row tile, column tile) of flat tile ``t``: GROUP_TILES_M row tiles per band before moving along N
    (a band of activations and of weights stays hot in L2)."""
    band = GROUP_TILES_M * num_n
    first_m = (t // band) * GROUP_TILES_M
    band_rows = tl.minimum(num_m - first_m, GROUP_TILES_M)
    return first_m + (t % band) % band_rows, (t % band) // band_rows


@triton.jit
def _opaque_i32(v):
    """``v`` through an opaque register copy: the same number, a value no pass can trace to ``v``.

    Triton 3.6's Hopper warp specialisation, when it splits a 128-row tile
    over two 64-row consumers, rewrites the row coordinate of each activation
    TMA load to ``row + 64`` for the second consumer, and then maps every
    other use of that same value in the second consumer to ``row + 64`` as
    well (rows 64..127 of every tile were never stored: v7 in bench/NOTES.md,
    seen in the TTGIR). Giving the TMA coordinate its own value keeps the row
    arithmetic of the scales and the store untouched.
    """
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _split_k_finish(acc, part_ptr, count_ptr, tile_id, split, SPLIT_K: tl.constexpr,
                    ROWS: tl.constexpr, COLS: tl.constexpr):
    """Combine a split-K tile: (the full sum, whether this program stores it).

    Each split parks its float32 partial in its own slot; the last split of
    the tile to arrive sums the slots in split order (the result does not
    depend on arrival order: graph replay == eager, bit for bit) and resets
    the tile's counter, so the workspace is clean for the next launch or
    replay without a memset.
    """
    offs_tile = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    slots = part_ptr + tile_id * (SPLIT_K * ROWS * COLS) + offs_tile
    tl.store(slots + split * (ROWS * COLS), acc)
    # Every thread's partial is written before one thread announces it.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    if last:
        acc = tl.load(slots, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(slots + s * (ROWS * COLS), cache_modifier=".cg")
        tl.store(count_ptr + tile_id, 0)
    return acc, last


@triton.jit
def _grid_tile(m_sizes_ptr, M, N, G, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               GROUP_TILES_M: tl.constexpr, G_POW2: tl.constexpr):
    """This program's (split, flat tile, column tile, group, first row, group end, valid)
    in a grid of ``row tiles x column tiles x SPLIT_K``."""
    pid = tl.program_id(0)
    split = pid % SPLIT_K
    pid = pid // SPLIT_K
    num_n = N // BLOCK_N
    num_m = tl.num_programs(0) // SPLIT_K // num_n
    tile_m, tile_n = _tile_coords(pid, num_m, num_n, GROUP_TILES_M)
    group, first_row, row_stop, valid = _locate_tile(m_sizes_ptr, M, G, tile_m, BLOCK_M, G_POW2)
    return split, pid, tile_n, group, first_row, row_stop, valid


@triton.jit
def _k_range(K, split, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K blocks ``[k_lo, k_hi)`` of split ``split`` (all of them when SPLIT_K == 1)."""
    num_k = K // BLOCK_K
    if SPLIT_K > 1:
        per_split = tl.cdiv(num_k, SPLIT_K)
        k_lo = tl.minimum(split * per_split, num_k)
        k_hi = tl.minimum(k_lo + per_split, num_k)
    else:
        k_lo = 0
        k_hi = num_k
    return k_lo, k_hi


@triton.jit
def _scale_products(xs_row, ws_col, stride_wsk, c, k_end, CHUNK: tl.constexpr):
    """(blocks ``c + [0, CHUNK)``, their scale products ``xs * ws`` ``[CHUNK, BLOCK_M]``, 0 from
    ``k_end`` on): the float32 products the shipped loop takes block by block, taken at once.
    Blocks along dim 0, so a block's pick (:func:`_pick`) reduces to the tile's column
    layout without a transpose."""
    blk = c + tl.arange(0, CHUNK)
    inside = blk < k_end
    ws = tl.load(ws_col + blk * stride_wsk, mask=inside, other=0.0)
    xs = tl.load(xs_row[None, :] + blk[:, None], mask=inside[:, None], other=0.0)
    return blk, xs * ws[:, None]


@triton.jit
def _pick(blk, scales, kb):
    """Block ``kb``'s row of ``scales`` as its sum with zeros: the product's bits (``+0.0``
    for ``-0.0``, which changes no product-and-add here: ``acc`` is never ``-0.0``; see
    ``_triton_moe_token._row_tile``), other blocks' NaN or infinities left out."""
    return tl.sum(tl.where(blk[:, None] == kb, scales, 0.0), axis=0)


@triton.jit
def _bad_scales(sx):
    """1 where an activation scale is not finite and > 0, else 0 (int32), elementwise (the
    persistent tiles OR it over the scales their K loop loads)."""
    # NaN fails both comparisons; +Inf fails the second (the largest float32).
    return (~((sx > 0.0) & (sx <= 3.4028234663852886e38))).to(tl.int32)


@triton.jit
def scale_flags(scale):
    """Per row of a ``[rows, blocks]`` tile of scales (blocks past K loaded as 1.0): 2 (the
    server's ``BAD_SCALE``) where one is not finite and > 0, else 0 (int32). The server's
    check of fp8 rows, here and in ``_triton_prologue``."""
    return tl.max(_bad_scales(scale), axis=1) << 1


@triton.jit
def _row_flags(xs_base, rows, rows_in, row_stop, map_ptr, stride_map, flags_ptr, stride_xsm, tile_n, split, K,
               BLOCK_K: tl.constexpr, KB_POW2: tl.constexpr, ROW_MAP: tl.constexpr):
    """The server's check of the tile's rows (``FLAGS``: a lone call's graph, one kernel):
    ``flags[dest] = 2`` where a row's scales are not all finite and > 0, else 0 (SPEC 2.2;
    ``_checks.bad_rows`` for fp8 rows, whose codes are not checked), at the row's stored
    place, written by the programs of the first column tile and split only: each row once,
    in its group's tile. Rows past the groups' end belong to no tile and get no flag. Run
    before the K loop, so nothing of it stays live across the loop."""
    if (tile_n == 0) & (split == 0):
        dest = _out_rows(rows, rows_in, map_ptr, stride_map, ROW_MAP)
        kbs = tl.arange(0, KB_POW2)
        scale = tl.load(xs_base + rows_in[:, None] * stride_xsm + kbs[None, :],
                        mask=(kbs < K // BLOCK_K)[None, :], other=1.0)
        tl.store(flags_ptr + dest, scale_flags(scale).to(tl.int8), mask=rows < row_stop)


# ---- decode: A and B swapped -------------------------------------------------------------------


@triton.jit
def decode_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, m_sizes_ptr, out_ptr, map_ptr, part_ptr, count_ptr, flags_ptr,
                  M, N, K, G, stride_xm, stride_wg, stride_wn, stride_xsm, stride_wsg, stride_wsk, stride_om,
                  stride_map,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, G_POW2: tl.constexpr,
                  EVICT_W: tl.constexpr, SPLIT_K: tl.constexpr, ADDRS: tl.constexpr, X_WORDS: tl.constexpr,
                  ROW_MAP: tl.constexpr, PRELOAD: tl.constexpr = False, CHUNK: tl.constexpr = 16,
                  GROUP_TILES_M: tl.constexpr = 1, FLAGS: tl.constexpr = False, KB_POW2: tl.constexpr = 1):
    """Decode, one K block per iteration: ``acc[BLOCK_N, BLOCK_M] += dot(w, x^T) * (ws * xs)``.

    BLOCK_M is the token tile, BLOCK_N (<= 128) the weight tile: one
    weight-scale column per tile.
    """
    w_base, ws_base = _weights(w_ptr, ws_ptr, ADDRS)  # beside m_sizes's load: see _present
    x_base, xs_base = _inputs(x_ptr, xs_ptr, X_WORDS)
    split, tile_id, tile_n, group, first_row, row_stop, valid = _grid_tile(
        m_sizes_ptr, M, N, G, SPLIT_K, BLOCK_M, BLOCK_N, GROUP_TILES_M, G_POW2)
    if valid & _present(w_base, ws_base, x_base, xs_base, ADDRS, X_WORDS):
        rows = first_row + tl.arange(0, BLOCK_M)
        rows_in = tl.minimum(rows, M - 1).to(tl.int64)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        group64 = group.to(tl.int64)
        k_lo, k_hi = _k_range(K, split, SPLIT_K, BLOCK_K)
        if FLAGS:
            _row_flags(xs_base, rows, rows_in, row_stop, map_ptr, stride_map, flags_ptr, stride_xsm, tile_n, split,
                       K, BLOCK_K, KB_POW2, ROW_MAP)
        x_ptrs = x_base + rows_in[:, None] * stride_xm + (k_lo * BLOCK_K + offs_k)[None, :]
        w_ptrs = (w_base + group64 * stride_wg + offs_n.to(tl.int64)[:, None] * stride_wn
                  + (k_lo * BLOCK_K + offs_k)[None, :])
        xs_ptrs = xs_base + rows_in * stride_xsm + k_lo
        ws_ptrs = ws_base + group64 * stride_wsg + (tile_n * BLOCK_N) // 128 + k_lo * stride_wsk
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if PRELOAD:
            # Every block's scale products taken before the loop, block kb's picked out in
            # registers: no load of the loop's path waits on a scale's round trip. A split of
            # more than CHUNK blocks takes the next chunk's products every CHUNK blocks (one
            # round trip per chunk). One flat loop: a loop per chunk kept several copies of
            # the operands' pointer tensors live (255 registers and spills on sm_90).
            xs_row = xs_base + rows_in * stride_xsm
            ws_col = ws_base + group64 * stride_wsg + (tile_n * BLOCK_N) // 128
            blk, scales = _scale_products(xs_row, ws_col, stride_wsk, k_lo, k_hi, CHUNK)
            for kb in range(k_lo, k_hi):
                if kb - k_lo >= CHUNK and (kb - k_lo) % CHUNK == 0:
                    blk, scales = _scale_products(xs_row, ws_col, stride_wsk, kb, k_hi, CHUNK)
                x = tl.load(x_ptrs)
                w = tl.load(w_ptrs, eviction_policy=EVICT_W)
                acc += tl.dot(w, tl.trans(x)) * _pick(blk, scales, kb)[None, :]
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
        else:
            for kb in range(k_lo, k_hi):
                x = tl.load(x_ptrs)
                w = tl.load(w_ptrs, eviction_policy=EVICT_W)
                xs = tl.load(xs_ptrs)
                ws = tl.load(ws_ptrs)
                acc += tl.dot(w, tl.trans(x)) * (xs[None, :] * ws)
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
                xs_ptrs += 1
                ws_ptrs += stride_wsk
        if SPLIT_K > 1:
            acc, last = _split_k_finish(acc, part_ptr, count_ptr, tile_id.to(tl.int64), split, SPLIT_K,
                                        BLOCK_N, BLOCK_M)
        else:
            last = True
        keep = (rows < row_stop) & last
        dest = _out_rows(rows, rows_in, map_ptr, stride_map, ROW_MAP)
        out_ptrs = out_ptr + dest[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=keep[None, :])


@triton.jit
def decode_pair_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, m_sizes_ptr, out_ptr, map_ptr, flags_ptr,
                       M, N, K, G, stride_xm, stride_wg, stride_wn, stride_xsm, stride_wsg, stride_wsk, stride_om,
                       stride_map,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, G_POW2: tl.constexpr,
                       EVICT_W: tl.constexpr, ADDRS: tl.constexpr, X_WORDS: tl.constexpr, ROW_MAP: tl.constexpr,
                       GROUP_TILES_M: tl.constexpr = 1, FLAGS: tl.constexpr = False, KB_POW2: tl.constexpr = 1):
    """Decode, two K blocks per iteration, each pair's scales loaded one iteration ahead.

    The scale loads are not staged by the software pipeliner; waiting on
    them right after the first dot delays the second dot's issue by whatever
    of the L2 latency the first dot does not cover (v9 in bench/NOTES.md).
    An odd last block pairs with itself, its copy scaled by 0. Each program
    runs a whole tile's K range (no split) with its scales loaded in the loop
    (no preload): the forms the table gives a pair.
    """
    w_base, ws_base = _weights(w_ptr, ws_ptr, ADDRS)  # beside m_sizes's load: see _present
    x_base, xs_base = _inputs(x_ptr, xs_ptr, X_WORDS)
    split, _, tile_n, group, first_row, row_stop, valid = _grid_tile(
        m_sizes_ptr, M, N, G, 1, BLOCK_M, BLOCK_N, GROUP_TILES_M, G_POW2)
    if valid & _present(w_base, ws_base, x_base, xs_base, ADDRS, X_WORDS):
        rows = first_row + tl.arange(0, BLOCK_M)
        rows_in = tl.minimum(rows, M - 1).to(tl.int64)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        group64 = group.to(tl.int64)
        k_lo, k_hi = _k_range(K, split, 1, BLOCK_K)
        if FLAGS:
            _row_flags(xs_base, rows, rows_in, row_stop, map_ptr, stride_map, flags_ptr, stride_xsm, tile_n, split,
                       K, BLOCK_K, KB_POW2, ROW_MAP)
        x_ptrs = x_base + rows_in[:, None] * stride_xm + (k_lo * BLOCK_K + offs_k)[None, :]
        w_ptrs = (w_base + group64 * stride_wg + offs_n.to(tl.int64)[:, None] * stride_wn
                  + (k_lo * BLOCK_K + offs_k)[None, :])
        xs_row = xs_base + rows_in * stride_xsm
        ws_col = ws_base + group64 * stride_wsg + (tile_n * BLOCK_N) // 128
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        # The first pair's scales (a lone block pairs with itself).
        k0 = tl.minimum(k_lo, k_hi - 1)
        step = tl.minimum(1, k_hi - 1 - k0)
        s0 = tl.load(xs_row + k0) * tl.load(ws_col + k0 * stride_wsk)
        s1 = tl.load(xs_row + k0 + step) * (tl.load(ws_col + (k0 + step) * stride_wsk) * step.to(tl.float32))
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
            part0 = tl.dot(w0, tl.trans(x0))
            part1 = tl.dot(w1, tl.trans(x1))
            acc += part0 * s0[None, :]
            acc += part1 * s1[None, :]
            s0 = xs0_n * ws0_n
            s1 = xs1_n * ws1_n
            x_ptrs += 2 * BLOCK_K
            w_ptrs += 2 * BLOCK_K
        keep = rows < row_stop
        dest = _out_rows(rows, rows_in, map_ptr, stride_map, ROW_MAP)
        out_ptrs = out_ptr + dest[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=keep[None, :])


# ---- prefill ---------------------------------------------------------------------------------


# ---- persistent: one program per SM ---------------------------------------------------------------


@triton.jit
def persistent_ws_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, m_sizes_ptr, out_ptr, map_ptr,
                         M, N, K, G, stride_xm, stride_wg, stride_wn, stride_xsm, stride_wsg, stride_wsk, stride_om,
                         stride_map,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, G_POW2: tl.constexpr,
                         GROUP_TILES_M: tl.constexpr, ADDRS: tl.constexpr,
                         X_WORDS: tl.constexpr, ROW_MAP: tl.constexpr):
    """Persistent warp-specialised prefill: one program per SM walks the tiles ``pid, pid + programs, ...``.

    The tile loop is the warp-specialised loop: the TMA producer runs ahead
    into the next tile's K blocks while the two consumers scale, convert and
    store the current one. The tile count is the launcher's static bound;
    tiles past the real row tiles run an empty K range and store nothing (no
    branch: the pass rejects loops under an ``if``). Triton 3.6's warp
    specialisation rejects any reduce or scan in the kernel and sinks stores
    made before the loop into the consumer partitions (a tile table in memory
    would race with the producer), so the group lookup is an unrolled scalar
    walk over G_POW2 groups: the table keeps this kernel to G <= 64.

    128 x 128 tiles, pairs of K blocks (each consumer scales its first product
    while the second runs), 2 stages. (The 128 x 256 form and its throwaway lead
    tile, which worked around a Triton 3.6 warp-specialisation race of deep
    buffers, went when the Gluon tile replaced them in the table: session 11.)
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    num_n = N // BLOCK_N
    # The launcher's row_tile_bound, from M and G alone.
    num_m = tl.minimum(tl.minimum(M, (M + G * (BLOCK_M - 1)) // BLOCK_M), tl.cdiv(M, BLOCK_M) + G - 1)
    w_base, ws_base = _weights(w_ptr, ws_ptr, ADDRS)
    x_base, xs_base = _inputs(x_ptr, xs_ptr, X_WORDS)
    x_desc = tl.make_tensor_descriptor(x_base, shape=[M, K], strides=[stride_xm, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    num_kb = K // BLOCK_K
    w_desc = tl.make_tensor_descriptor(w_base, shape=[G * N, K], strides=[stride_wn, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    for t in tl.range(pid, num_m * num_n, programs, warp_specialize=True):
        tile_m, tile_n = _tile_coords(t, num_m, num_n, GROUP_TILES_M)
        group, first_row, row_stop, valid = _locate_tile_unrolled(m_sizes_ptr, M, G, tile_m, BLOCK_M, G_POW2)
        group = tl.minimum(group, G - 1)
        rows = first_row + tl.arange(0, BLOCK_M)
        rows_in = tl.minimum(rows, M - 1).to(tl.int64)
        tma_row = _opaque_i32(first_row)  # see _opaque_i32
        num_k = tl.where(valid, num_kb, 0)
        w_row = group * N + tile_n * BLOCK_N
        xs_ptrs = xs_base + rows_in * stride_xsm
        ws_ptrs = ws_base + group.to(tl.int64) * stride_wsg + (tile_n * BLOCK_N) // 128
        keep = (rows < row_stop) & valid
        dest = _out_rows(rows, rows_in, map_ptr, stride_map, ROW_MAP)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + dest[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=keep[:, None])


@triton.jit
def _tile_table(m_sizes_ptr, M, G, num_n, table_ptr, BLOCK_M: tl.constexpr, G_POW2: tl.constexpr):
    """Write the launch's tile table into ``table_ptr`` (3 x G_POW2 int32); return the tile count.

    Tiles are numbered group by group: group g owns ``row_tiles_g * num_n``
    consecutive tiles (its rows clamped as in :func:`_locate_tile`). The table
    holds each group's tile end (inclusive prefix), first row and end row,
    read back with scalar loads (:func:`_find_tile`).
    """
    offs = tl.arange(0, G_POW2)
    raw = tl.load(m_sizes_ptr + offs, mask=offs < G, other=0).to(tl.int64)
    raw = tl.minimum(tl.maximum(raw, 0), M)
    ends = tl.cumsum(raw, 0)
    row_end = tl.minimum(ends, M).to(tl.int32)
    row_start = tl.minimum(ends - raw, M).to(tl.int32)
    tile_end = tl.cumsum((row_end - row_start + (BLOCK_M - 1)) // BLOCK_M * num_n, 0)
    tl.store(table_ptr + offs, tile_end)
    tl.store(table_ptr + G_POW2 + offs, row_start)
    tl.store(table_ptr + 2 * G_POW2 + offs, row_end)
    tl.debug_barrier()  # every thread of the program reads the whole table back
    return tl.load(table_ptr + G_POW2 - 1)


@triton.jit
def _find_tile(table_ptr, t, num_n, BLOCK_M: tl.constexpr, G_POW2: tl.constexpr,
               GROUP_TILES_M: tl.constexpr):
    """(group, first row, column tile, group end row) of tile ``t`` < the tile count.

    A binary search over the groups' tile ends: log2(G_POW2) dependent scalar
    loads from this program's table (L1-resident after the first tile). Within
    its group the tile is placed by :func:`_tile_coords`: bands of
    GROUP_TILES_M row tiles sweep the column tiles, so the row tiles of one
    (group, column tile) run at about the same time on neighbouring programs
    and the weight tile comes from HBM about once per band.
    """
    lo = t * 0
    for s in tl.static_range(1, 11):  # G_POW2 <= 1024
        if (G_POW2 >> s) > 0:
            probe = tl.load(table_ptr + (lo + (G_POW2 >> s) - 1))
            lo = tl.where(probe <= t, lo + (G_POW2 >> s), lo)
    before = tl.load(table_ptr + lo - 1, mask=lo > 0, other=0)
    row_start = tl.load(table_ptr + G_POW2 + lo)
    row_end = tl.load(table_ptr + 2 * G_POW2 + lo)
    row_tiles = tl.maximum((row_end - row_start + (BLOCK_M - 1)) // BLOCK_M, 1)
    tile_m, tile_n = _tile_coords(t - before, row_tiles, num_n, GROUP_TILES_M)
    return lo, row_start + tile_m * BLOCK_M, tile_n, row_end


@triton.jit
def persistent_tma_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, m_sizes_ptr, out_ptr, map_ptr, work_ptr, flags_ptr,
                          M, N, K, G, stride_xm, stride_wg, stride_wn, stride_xsm, stride_wsg, stride_wsk,
                          stride_om, stride_map,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          G_POW2: tl.constexpr, GROUP_TILES_M: tl.constexpr, ADDRS: tl.constexpr,
                          X_WORDS: tl.constexpr, ROW_MAP: tl.constexpr, FLAGS: tl.constexpr = False):
    """Persistent TMA prefill for many experts: the programs walk exactly the real tiles.

    Each program first writes its own tile table (``work_ptr``: 3 x G_POW2
    int32 per program, :func:`_tile_table`), then walks tiles ``pid, pid +
    programs, ...`` in group order (:func:`_find_tile`: O(log G) per tile; no
    program spends time on empty groups or on row tiles past the groups'
    ends). The tile loop and the K loop are flattened into one software
    pipeline, so the TMA loads of the next tile are in flight while the
    current one is scaled and stored. Not warp-specialised: Triton 3.6's pass
    takes neither the table nor a reduction (see :func:`persistent_ws_kernel`).

    BLOCK_N = 128 (one weight-scale column), one dot per K block; BLOCK_M 64
    (4 warps, two programs per SM: one's scale-and-store overlaps the other's
    MMA) or 128 (8 warps: two warpgroups of 64 rows). v12 measured 128 x 256
    halves spilling (255 registers) and 1.2-3x slower.
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    num_n = N // BLOCK_N
    table = work_ptr + pid * (3 * G_POW2)
    tiles = _tile_table(m_sizes_ptr, M, G, num_n, table, BLOCK_M, G_POW2)
    w_base, ws_base = _weights(w_ptr, ws_ptr, ADDRS)
    x_base, xs_base = _inputs(x_ptr, xs_ptr, X_WORDS)
    x_desc = tl.make_tensor_descriptor(x_base, shape=[M, K], strides=[stride_xm, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    num_kb = K // BLOCK_K
    w_desc = tl.make_tensor_descriptor(w_base, shape=[G * N, K], strides=[stride_wn, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    for t in tl.range(pid, tiles, programs, flatten=True):
        group, first_row, tile_n, row_stop = _find_tile(table, t, num_n, BLOCK_M, G_POW2, GROUP_TILES_M)
        rows = first_row + tl.arange(0, BLOCK_M)
        rows_in = tl.minimum(rows, M - 1).to(tl.int64)
        w_row = group * N + tile_n * BLOCK_N
        xs_ptrs = xs_base + rows_in * stride_xsm
        ws_ptrs = ws_base + group.to(tl.int64) * stride_wsg + (tile_n * BLOCK_N) // 128
        keep = rows < row_stop
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        bad = tl.zeros((BLOCK_M,), dtype=tl.int32)
        for kb in range(num_kb):
            x = x_desc.load([first_row, kb * BLOCK_K])
            w = w_desc.load([w_row, kb * BLOCK_K])
            sx = tl.load(xs_ptrs + kb)
            if FLAGS:
                bad = bad | _bad_scales(sx)
            s = sx * tl.load(ws_ptrs + kb * stride_wsk)
            acc += tl.dot(x, tl.trans(w)) * s[:, None]
        dest = _out_rows(rows, rows_in, map_ptr, stride_map, ROW_MAP)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + dest[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=keep[:, None])
        if FLAGS:  # the rows' check (a lone call's graph): the first column tile's, each row once
            tl.store(flags_ptr + dest, (bad * 2).to(tl.int8), mask=keep & (tile_n == 0))

SCHEDULES = {
    "decode": decode_kernel,
    "decode_pair": decode_pair_kernel,
    "persistent_ws": persistent_ws_kernel,
    "persistent_tma": persistent_tma_kernel,
}

# Every kernel's cache key as any process computes it, whatever it launches first (_triton_keys).
settle(globals())
