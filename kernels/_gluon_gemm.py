"""The 128 x 256 prefill schedule ``gluon_ws``: a warp-specialised persistent grouped FP8 GEMM in Gluon.

The table runs it for many experts (G >= 64) and at G < 64 from 128 rows per group where N is a
multiple of 256 and its tiles fill the SMs (``triton_kernel.default_config``).

Same inputs, semantics and arguments as ``_triton_gemm.persistent_tma_kernel``
(that module's layout table, ``ADDRS`` / ``X_WORDS`` / ``ROW_MAP`` and its
helpers' rules): groups are found in the kernel from ``m_sizes`` (each size
clamped), rows past a group's end are computed and dropped at the store,
rows past M are zero-filled by TMA, offsets into the scales and the output
are int64. ``triton_kernel.launch_plan`` launches it like the Triton
schedules, through every entry (``run``, ``run_addressed``).

Why Gluon: Triton 3.6's ``tl.range(warp_specialize=True)`` takes neither the
tile table nor a reduction, and a plain Triton loop waits on each wgmma
before its scale promotion. Here the roles are explicit:

- one producer warp claims the program's tiles and keeps a ring of
  ``STAGES`` shared-memory slots (a 128 x 128 activation tile and a
  256 x 128 weight tile each) filled by TMA, each slot guarded by a
  ``ready`` mbarrier (TMA bytes landed) and an ``empty`` one (both consumers
  done with it);
- two consumer warpgroups (the default partition and a 4-warp worker) each
  own 64 rows of the 128-row tile. Per 128-wide K block a consumer runs the
  two 128-wide halves of the weight tile as async wgmmas into one fresh
  part, each followed by its promotion ``acc += part * (x_scale[row] *
  w_scale)`` in registers (two accumulators, one per weight-scale column);
  the other warpgroup's MMA runs under this one's promotion. 128 x 256 tiles
  read 25 % fewer bytes from L2 per flop than 128 x 128 (at the MMA rate
  128 x 128 tiles need ~10 TB/s from L2; 64 x 128, the Triton tile: ~15). A
  consumer whose 64 rows hold no row of the tile's group (the second half of
  a group's last row tile of 64 rows or fewer) runs no wgmma (``_tile_sums``);
- the tiles are ``persistent_tma``'s, numbered group by group and found
  through a per-program table (O(log G) scalar loads), but claimed: the
  programs (one per SM) take the launch's next tile from a counter in the
  work buffer (one atomic a tile, in flight under the tile's loads), so the
  tiles in flight at once stay a window of consecutive ones (row tiles that
  share a weight tile, in step through its K blocks in L2) however unequal
  the tiles' times. The producer posts each tile in a small shared-memory
  ring to the partitions that need it, then the end; the last program to
  finish puts the counter back to zero for the next launch.

The TMA descriptors are made on the device, in the parent region, from the
base pointers the kernel was given or loaded from the device words (the
launch needs Triton's global scratch allocator, as ``persistent_tma``'s).

Below ``gluon_ws_kernel``: ``gluon_ws_store_kernel`` (same arguments, semantics and bits;
section comment there), the table's schedule where a tile's K loop is short (K <= 5120).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ._triton_keys import settle

CONSUMER_REGS = gl.constexpr(232)  # per thread, each consumer warpgroup (two accumulators + a part = 192 floats)
PRODUCER_REGS = gl.constexpr(40)
MAXNREG = 168  # 12 warps x 32 x 168 <= 65536: the budget setmaxnreg redistributes
# Tiles the producer may post ahead of the partitions taking them (gluon_ws_store's store warps
# take a tile when they start to drain it, up to two tiles after the producer posted it).
TILE_SLOTS = gl.constexpr(3)


@gluon.jit
def _bases(ptr, scale_ptr, FROM_WORDS: gl.constexpr):
    """An fp8 operand's and its float32 scales' base pointers: the arguments, or (FROM_WORDS) the
    two int64 device words at ``ptr`` (``_triton_gemm._weights`` / ``_inputs``: ADDRS, X_WORDS)."""
    if FROM_WORDS:
        base = gl.multiple_of(gl.load(ptr).to(gl.pointer_type(gl.float8e4nv)), 16)
        scale_base = gl.multiple_of(gl.load(ptr + 1).to(gl.pointer_type(gl.float32)), 16)
    else:
        base = ptr
        scale_base = scale_ptr
    return base, scale_base


@gluon.jit
def _scale_bases(srcs, ADDRS: gl.constexpr, X_WORDS: gl.constexpr):
    """A consumer's two scale bases for its next tile. ``srcs`` is (x_ptr, w_ptr, xs_base,
    ws_base): the kernel's first two arguments and the bases :func:`_prologue` resolved.

    In the server's gemm forms (X_WORDS: the rows by address; the weights too, ADDRS) both are
    loaded again from their device words at each tile (an L1 hit) instead of held: two 64-bit
    bases live across the K loop took ``gluon_ws_store``'s consumers past their 232 registers,
    and ptxas spilled the tile's scale pointers, reloaded from local memory in every K block
    (sm_90 SASS); the lone prefill call's graph ran 5-10 % slower than the public launch at
    K = 4096-5120 (GLM-4.5 w13 t2048 908 vs 834 us, session 12 call 4, gap_gluon). Where only
    the weights come by address (the expert FFN's launches) holding them measured faster
    (reloading the weight base alone: 0.95x on w2), and the public form's bases are arguments
    (the constant bank), so both keep what the prologue resolved."""
    x_ptr, w_ptr, xs_base, ws_base = srcs
    if X_WORDS:
        xs_base = gl.multiple_of(gl.load(x_ptr + 1).to(gl.pointer_type(gl.float32)), 16)
        if ADDRS:
            ws_base = gl.multiple_of(gl.load(w_ptr + 1).to(gl.pointer_type(gl.float32)), 16)
    return xs_base, ws_base


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _tile_table(m_sizes_ptr, M, G, num_n, table_ptr, BLOCK_M: gl.constexpr, G_POW2: gl.constexpr,
                NUM_WARPS: gl.constexpr):
    """Write the program's tile table (3 x G_POW2 int32: each group's tile end, first row, end row)
    and return the tile count; the rules of ``_triton_gemm._tile_table``."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    offs = gl.arange(0, G_POW2, layout=layout)
    raw = gl.load(m_sizes_ptr + offs, mask=offs < G, other=0).to(gl.int64)
    raw = gl.minimum(gl.maximum(raw, 0), M)
    ends = gl.associative_scan(raw, 0, _add)
    row_end = gl.minimum(ends, M).to(gl.int32)
    row_start = gl.minimum(ends - raw, M).to(gl.int32)
    tile_end = gl.associative_scan((row_end - row_start + (BLOCK_M - 1)) // BLOCK_M * num_n, 0, _add)
    gl.store(table_ptr + offs, tile_end)
    gl.store(table_ptr + G_POW2 + offs, row_start)
    gl.store(table_ptr + 2 * G_POW2 + offs, row_end)
    gl.thread_barrier()  # the partitions read the whole table back
    return gl.load(table_ptr + G_POW2 - 1)


@gluon.jit
def _find_tile(table_ptr, t, num_n, BLOCK_M: gl.constexpr, G_POW2: gl.constexpr, GROUP_TILES_M: gl.constexpr):
    """(group, first row, column tile, group end row) of tile ``t``: a binary search over the
    groups' tile ends, then bands of GROUP_TILES_M row tiles sweeping the column tiles
    (``_triton_gemm._find_tile``)."""
    lo = t * 0
    for s in gl.static_range(1, 11):  # G_POW2 <= 1024
        if (G_POW2 >> s) > 0:
            probe = gl.load(table_ptr + (lo + (G_POW2 >> s) - 1))
            lo = gl.where(probe <= t, lo + (G_POW2 >> s), lo)
    before = gl.load(table_ptr + gl.maximum(lo - 1, 0))
    before = gl.where(lo > 0, before, 0)
    row_start = gl.load(table_ptr + G_POW2 + lo)
    row_end = gl.load(table_ptr + 2 * G_POW2 + lo)
    row_tiles = gl.maximum((row_end - row_start + (BLOCK_M - 1)) // BLOCK_M, 1)
    local = t - before
    band = GROUP_TILES_M * num_n
    first_m = (local // band) * GROUP_TILES_M
    band_rows = gl.minimum(row_tiles - first_m, GROUP_TILES_M)
    tile_m = first_m + (local % band) % band_rows
    tile_n = (local % band) // band_rows
    return lo, row_start + tile_m * BLOCK_M, tile_n, row_end


@gluon.jit
def _claim(counters):
    """The launch's next tile: one atomic add on its claim counter (waited for at once). Relaxed:
    a tile's number orders nothing else (its inputs are read-only in the launch)."""
    return gl.atomic_add(counters, 1, sem="relaxed")


@gluon.jit
def _claim_ahead(counters):
    """:func:`_claim` by lane 0 of the warp into a register of its own, not waited for until
    :func:`_claimed` reads it (a scalar atomic is broadcast through shared memory at once)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=layout)
    return gl.atomic_add(counters + lane * 0, gl.full([32], 1, gl.int32, layout), mask=lane == 0,
                         sem="relaxed"), lane


@gluon.jit
def _claimed(got, lane):
    return gl.max(gl.where(lane == 0, got, -1), axis=0)


@gluon.jit
def _load_block(descs, bufs, it, first_row, w_row, kb):
    """The producer: TMA loads of K block ``kb`` of a tile into ring position ``it``, once both
    consumers freed its slot."""
    x_desc, w_desc = descs
    a_bufs, b_bufs, ready, empty = bufs
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BK: gl.constexpr = a_bufs.type.shape[2]
    slot = it % STAGES
    # A fresh mbarrier counts as having completed the phase before phase 0.
    mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
    bar = ready.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [first_row, kb * BK], bar, a_bufs.index(slot))
    tma.async_copy_global_to_shared(w_desc, [w_row, kb * BK], bar, b_bufs.index(slot))
    return it + 1


@gluon.jit
def _load_tile(descs, bufs, it, first_row, w_row, num_kb, counters):
    """The producer: TMA loads of a tile's ``num_kb`` K blocks (at least one: K >= 128) into the
    ring from position ``it``; returns the position after them and the launch's next tile,
    claimed once the first block is asked for and read after the last: the atomic's round trip
    under the tile's loads, off the ring's path."""
    it = _load_block(descs, bufs, it, first_row, w_row, 0)
    got, lane = _claim_ahead(counters)
    for kb in range(1, num_kb):
        it = _load_block(descs, bufs, it, first_row, w_row, kb)
    return it, _claimed(got, lane)


@gluon.jit
def _finish(counters):
    """A program's producer after its last claim: the last program of the launch to get here
    puts both counters back to zero, so the next launch on the stream starts from tile 0
    (every program has made its last claim by then: each one's count is a release after its
    claims, the last one's an acquire before the reset)."""
    done = gl.atomic_add(counters + 1, 1, sem="acq_rel")
    if done == gl.num_programs(0) - 1:
        gl.atomic_xchg(counters, 0, sem="relaxed")
        gl.atomic_xchg(counters + 1, 0, sem="relaxed")


@gluon.jit
def _publish_tile(tiles_ring, i, t, group, first_row, tile_n, row_stop):
    """The producer: post this program's ``i``-th tile (the launch's tile ``t``) in the ring, once
    every partition that takes tiles took the tile that used the slot before."""
    info, posted, taken = tiles_ring
    SLOTS: gl.constexpr = info.type.shape[0]
    slot = i % SLOTS
    mbarrier.wait(taken.index(slot), ((i // SLOTS) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [1], [0])  # every lane holds the fields
    field = gl.arange(0, 8, layout=layout)
    info.index(slot).store(gl.where(field == 0, group, gl.where(field == 1, first_row, gl.where(
        field == 2, tile_n, gl.where(field == 3, row_stop, t)))))
    # The arrive releases the stores above (the lowering syncs the warp first).
    mbarrier.arrive(posted.index(slot), count=1)


@gluon.jit
def _field(values, field, which: gl.constexpr):
    """One field of the eight words a thread holds (a reduction within the thread: no shuffles)."""
    return gl.sum(gl.where(field == which, values, 0), axis=0)


@gluon.jit
def _take_tile(tiles_ring, i):
    """A consumer or the store warps: this program's ``i``-th tile from the ring (the launch's tile
    number, group, first row, column tile, group end row; number and group -1: no more); the slot
    is given back as soon as the fields are in registers. A caller that uses only some fields
    costs only those (the rest are dropped at compile time): ``gluon_ws``'s consumers take the
    number alone and search their table, since the four fields held across their K loop took
    them past their registers (spilled, reloaded in the K loop: sm_90 SASS)."""
    info, posted, taken = tiles_ring
    SLOTS: gl.constexpr = info.type.shape[0]
    slot = i % SLOTS
    mbarrier.wait(posted.index(slot), (i // SLOTS) & 1)
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
    values = info.index(slot).load(layout)
    field = gl.arange(0, 8, layout=layout)
    t = _field(values, field, 4)
    group = _field(values, field, 0)
    first_row = _field(values, field, 1)
    tile_n = _field(values, field, 2)
    row_stop = _field(values, field, 3)
    mbarrier.arrive(taken.index(slot), count=1)
    return t, group, first_row, tile_n, row_stop


@gluon.jit
def _tile_ring(TAKERS: gl.constexpr):
    """The tile ring: the slots the producer posts tiles in, and their posted/taken barriers
    (``TAKERS``: the partitions that take each tile)."""
    info = gl.allocate_shared_memory(gl.int32, [TILE_SLOTS, 8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    posted = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    taken = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(TILE_SLOTS):
        mbarrier.init(posted.index(s), count=1)
        mbarrier.init(taken.index(s), count=TAKERS)
    return info, posted, taken


@gluon.jit
def _load_partition(descs, bufs, tiles_ring, table_ptr, counters, tiles, N, K, G_POW2: gl.constexpr,
                    GROUP_TILES_M: gl.constexpr):
    """The producer warp: claims the launch's tiles one at a time, posts each one's coordinates to
    the other partitions before its first K block is asked for, and keeps the ring filled by TMA;
    then posts the end (group -1)."""
    a_bufs, b_bufs, _ready, _empty = bufs
    BM: gl.constexpr = a_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[1]
    num_n = N // BN
    num_kb = K // a_bufs.type.shape[2]
    it = 0
    i = 0
    t = _claim(counters)
    while t < tiles:
        group, first_row, tile_n, row_stop = _find_tile(table_ptr, t, num_n, BM, G_POW2, GROUP_TILES_M)
        _publish_tile(tiles_ring, i, t, group, first_row, tile_n, row_stop)
        it, t = _load_tile(descs, bufs, it, first_row, group * N + tile_n * BN, num_kb, counters)
        i += 1
    _publish_tile(tiles_ring, i, -1, -1, 0, 0, 0)
    _finish(counters)


@gluon.jit
def _ready(ready, it, STAGES: gl.constexpr):
    """Wait until ring slot ``it`` holds its tiles; return the slot."""
    slot = it % STAGES
    mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
    return slot


@gluon.jit
def _mma(a_bufs, b_bufs, slot, part, HALF: gl.constexpr, COL: gl.constexpr):
    """Issue this warpgroup's async wgmma on ``slot``: its 64 rows of the activation tile times
    weight rows ``[COL * 128, COL * 128 + 128)``, into ``part`` (its old value ignored: a fresh
    accumulator in the same registers)."""
    ROWS: gl.constexpr = a_bufs.type.shape[1] // 2
    a = a_bufs.index(slot).slice(HALF * ROWS, ROWS)
    b = b_bufs.index(slot).slice(COL * 128, 128).permute((1, 0))
    return warpgroup_mma(a, b, part, use_acc=False, is_async=True)


@gluon.jit
def _store(acc, out_ptr, dest, first_row, col, row_stop, stride_om, ROW_MAP: gl.constexpr, layout: gl.constexpr):
    """Store a 64 x 128 block at (first_row, col), only the rows before ``row_stop``; ``ROW_MAP``:
    row r of the block at ``out[dest[r]]`` (``dest`` loaded by the caller)."""
    ROWS: gl.constexpr = acc.shape[0]
    COLS: gl.constexpr = acc.shape[1]
    vals = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), layout)
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = col + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    if ROW_MAP:
        dest = gl.convert_layout(dest, gl.SliceLayout(1, layout))
    else:
        dest = rows.to(gl.int64)
    ptrs = out_ptr + dest[:, None] * stride_om + cols[None, :]
    gl.store(ptrs, vals, mask=(rows < row_stop)[:, None])


@gluon.jit
def _tile_scales(xs_base, ws_base, group, first_row, tile_n, M, stride_xsm, stride_wsg, HALF: gl.constexpr,
                 ROWS: gl.constexpr, BN: gl.constexpr, row_layout: gl.constexpr):
    """This consumer's rows of the tile, their activation-scale rows and the weight-scale column
    pointer.

    The weight scale is loaded per thread: a load from one address for all threads goes into a
    uniform register, and ptxas puts that conversion right before the next wgmma, which then
    waits for the load's L2 latency (seen in the SASS). An offset that is 0 but depends on the
    thread's rows keeps it in an ordinary register, used an iteration later."""
    rows = first_row + HALF * ROWS + gl.arange(0, ROWS, layout=row_layout)
    xs_row = xs_base + gl.minimum(rows, M - 1).to(gl.int64) * stride_xsm
    ws_col = (ws_base + group.to(gl.int64) * stride_wsg + tile_n * (BN // 128) + gl.where(rows < 0, rows, 0))
    return rows, xs_row, ws_col


@gluon.jit
def _bad_scales(sx):
    """1 where an activation scale is not finite and > 0 (the server's check of fp8 rows,
    ``_triton_gemm.scale_flags`` one block at a time), else 0 (int32)."""
    return (~((sx > 0.0) & (sx <= 3.4028234663852886e38))).to(gl.int32)


@gluon.jit
def _store_flags(flags_ptr, dest, rows, row_stop, tile_n, bad, FLAGS: gl.constexpr):
    """``FLAGS`` (a lone call's graph: the rows' check in the GEMM, no check kernel before it):
    the consumer's rows' flags, 2 (``BAD_SCALE``) where a scale of the row was bad, at the row's
    stored place; written by the first column tile only, so each row once."""
    if FLAGS:
        gl.store(flags_ptr + dest, (bad * 2).to(gl.int8), mask=(rows < row_stop) & (tile_n == 0))


@gluon.jit
def _tile_sums(bufs, it, xs_row, ws_col, stride_wsk, num_kb, live, HALF: gl.constexpr, mma_layout: gl.constexpr,
               FLAGS: gl.constexpr):
    """One consumer's two 64 x 128 sums of a tile, both Gluon kernels' K loop (one order of
    operations, so one set of bits). Returns (columns 0-127, columns 128-255, the ring position after
    the tile, and with ``FLAGS`` its rows' check: 1 where a scale the loop read was bad, the
    scales it loads anyway, so the check costs a compare a block and no load).

    A consumer none of whose 64 rows is a row of the tile's group (``live`` false: the second
    half of a group's last row tile of 64 rows or fewer) runs no wgmma; it only turns the ring
    (waits for each slot, frees it), so the other consumer has the tensor cores to itself, and
    its sums, never stored, stay zero. Such a tile takes less time than a full one, so programs
    walking a fixed share of the tiles drifted apart and lost the weight tiles they share in L2
    (up to 12 % slower where a few tiles are tails, session 20); the tiles claimed in launch
    order (:func:`_load_partition`) keep them together (bench/NOTES.md, session 21)."""
    a_bufs, b_bufs, ready, empty = bufs
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    ROWS: gl.constexpr = a_bufs.type.shape[1] // 2
    # A wgmma reads its accumulator operand even when told to ignore it: a part made per tile
    # keeps its registers dead between tiles (the epilogue needs the room).
    p0 = gl.zeros([ROWS, 128], gl.float32, mma_layout)
    acc = gl.zeros([ROWS, 128], gl.float32, mma_layout)
    acc_b = gl.zeros([ROWS, 128], gl.float32, mma_layout)
    sx = gl.load(xs_row)
    sw = gl.load(ws_col)
    sw_b = gl.load(ws_col + 1)
    bad = gl.zeros_like(sx.to(gl.int32))
    mma_kb = num_kb * live.to(gl.int32)
    for kb in range(mma_kb):
        if FLAGS:
            bad = bad | _bad_scales(sx)
        s = sx * sw
        s_b = sx * sw_b
        kn = gl.minimum(kb + 1, num_kb - 1)
        sx = gl.load(xs_row + kn)
        sw = gl.load(ws_col + kn * stride_wsk)
        sw_b = gl.load(ws_col + 1 + kn * stride_wsk)
        slot = _ready(ready, it, STAGES)
        p0 = _mma(a_bufs, b_bufs, slot, p0, HALF, 0)
        p0 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, ))
        acc = acc + p0 * s[:, None]
        p0 = _mma(a_bufs, b_bufs, slot, p0, HALF, 1)
        p0 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, ))
        mbarrier.arrive(empty.index(slot), count=1)
        acc_b = acc_b + p0 * s_b[:, None]
        it += 1
    for kb in range(num_kb - mma_kb):
        slot = _ready(ready, it, STAGES)
        mbarrier.arrive(empty.index(slot), count=1)
        it += 1
    return acc, acc_b, it, bad


@gluon.jit
def _mma_partition(bufs, tiles_ring, table_ptr, scalars, srcs, out_ptr, map_ptr, flags_ptr, HALF: gl.constexpr,
                   G_POW2: gl.constexpr, GROUP_TILES_M: gl.constexpr, ROW_MAP: gl.constexpr,
                   ADDRS: gl.constexpr, X_WORDS: gl.constexpr, FLAGS: gl.constexpr):
    """One consumer warpgroup of ``gluon_ws``: rows ``[HALF * 64, HALF * 64 + 64)`` of every tile
    the producer claims for this program (its number, :func:`_take_tile`), stored by this warpgroup.

    Two accumulators (one per weight-scale column); the two 128-wide halves
    of a K block one after the other into one part (a second part would not
    fit in 232 registers); each K block's scales loaded a block ahead.
    """
    a_bufs, b_bufs, _ready, _empty = bufs
    M, N, K, stride_xsm, stride_wsg, stride_wsk, stride_om, stride_map = scalars
    BM: gl.constexpr = a_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    ROWS: gl.constexpr = BM // 2
    gl.static_assert(BN == 256)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 128, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    # 16-byte stores along N: 16 threads cover 128 columns of bf16.
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    num_n = N // BN
    num_kb = K // BK
    it = 0
    i = 0
    t, _group, _first_row, _tile_n, _row_stop = _take_tile(tiles_ring, i)
    while t >= 0:
        group, first_row, tile_n, row_stop = _find_tile(table_ptr, t, num_n, BM, G_POW2, GROUP_TILES_M)
        xs_base, ws_base = _scale_bases(srcs, ADDRS, X_WORDS)
        rows, xs_row, ws_col = _tile_scales(xs_base, ws_base, group, first_row, tile_n, M, stride_xsm, stride_wsg,
                                            HALF, ROWS, BN, row_layout)
        # Where each row is stored; ROW_MAP: row r at out[map[r]] (``_triton_gemm._out_rows``),
        # loaded here, before the K loop, so its latency is not the epilogue's (v16 loaded it
        # at each of the two stores, with the tensor cores idle).
        if ROW_MAP:
            dest = gl.load(map_ptr + gl.minimum(rows, M - 1).to(gl.int64) * stride_map)
        else:
            dest = rows  # unused: the store numbers the rows itself
        top = first_row + HALF * ROWS
        acc, acc_b, it, bad = _tile_sums(bufs, it, xs_row, ws_col, stride_wsk, num_kb, top < row_stop, HALF,
                                         mma_layout, FLAGS)
        _store(acc_b, out_ptr, dest, top, tile_n * BN + 128, row_stop, stride_om, ROW_MAP, out_layout)
        _store(acc, out_ptr, dest, top, tile_n * BN, row_stop, stride_om, ROW_MAP, out_layout)
        _store_flags(flags_ptr, dest, rows, row_stop, tile_n, bad, FLAGS)
        i += 1
        t, _group, _first_row, _tile_n, _row_stop = _take_tile(tiles_ring, i)


@gluon.jit
def _prologue(x_ptr, w_ptr, xs_ptr, ws_ptr, m_sizes_ptr, work_ptr, M, N, K, G, stride_xm, stride_wn,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, G_POW2: gl.constexpr,
              STAGES: gl.constexpr, ADDRS: gl.constexpr, X_WORDS: gl.constexpr):
    """What both Gluon kernels set up before they fork: the tile table, the bases, the two
    descriptors, the ring (its slots and ready/empty barriers)."""
    gl.static_assert(BLOCK_M == 128 and BLOCK_K == 128)  # two 64-row consumers; one scale block per K step
    pid = gl.program_id(0)
    table = work_ptr + pid * (3 * G_POW2)
    tiles = _tile_table(m_sizes_ptr, M, G, N // BLOCK_N, table, BLOCK_M, G_POW2, gl.num_warps())
    # After every program's table: the launch's two counters (tiles claimed, programs done).
    counters = work_ptr + gl.num_programs(0) * (3 * G_POW2)
    w_base, ws_base = _bases(w_ptr, ws_ptr, ADDRS)
    x_base, xs_base = _bases(x_ptr, xs_ptr, X_WORDS)
    # 128-byte swizzle: what wgmma reads (both operands fp8, K-major rows of 128 bytes).
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    x_desc = tma.make_tensor_descriptor(x_base, [M, K], [stride_xm, 1], [BLOCK_M, BLOCK_K], smem_layout)
    w_desc = tma.make_tensor_descriptor(w_base, [G * N, K], [stride_wn, 1], [BLOCK_N, BLOCK_K], smem_layout)
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], smem_layout)
    b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], smem_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
    return (tiles, table, counters, (x_ptr, w_ptr, xs_base, ws_base), (x_desc, w_desc),
            (a_bufs, b_bufs, ready, empty))


@gluon.jit
def gluon_ws_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, m_sizes_ptr, out_ptr, map_ptr, work_ptr, flags_ptr,
                    M, N, K, G, stride_xm, stride_wg, stride_wn, stride_xsm, stride_wsg, stride_wsk, stride_om,
                    stride_map,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, G_POW2: gl.constexpr,
                    GROUP_TILES_M: gl.constexpr, STAGES: gl.constexpr, ADDRS: gl.constexpr,
                    X_WORDS: gl.constexpr, ROW_MAP: gl.constexpr, FLAGS: gl.constexpr = False):
    """Persistent warp-specialised grouped GEMM: one program per SM, 128 x 256 tiles (module doc).

    ``stride_wg`` is unused (the weight descriptor spans all groups' rows); it keeps the
    argument list the Triton schedules' (``triton_kernel.launch_plan``).
    """
    tiles, table, counters, srcs, descs, bufs = _prologue(
        x_ptr, w_ptr, xs_ptr, ws_ptr, m_sizes_ptr, work_ptr, M, N, K, G, stride_xm, stride_wn, BLOCK_M, BLOCK_N,
        BLOCK_K, G_POW2, STAGES, ADDRS, X_WORDS)
    tiles_ring = _tile_ring(2)
    fence_async_shared()
    scalars = (M, N, K, stride_xsm, stride_wsg, stride_wsk, stride_om, stride_map)
    TOP: gl.constexpr = 0
    BOTTOM: gl.constexpr = 1
    gl.warp_specialize([
        (_mma_partition, (bufs, tiles_ring, table, scalars, srcs, out_ptr, map_ptr, flags_ptr, TOP, G_POW2,
                          GROUP_TILES_M, ROW_MAP, ADDRS, X_WORDS, FLAGS)),
        (_mma_partition, (bufs, tiles_ring, table, scalars, srcs, out_ptr, map_ptr, flags_ptr, BOTTOM, G_POW2,
                          GROUP_TILES_M, ROW_MAP, ADDRS, X_WORDS, FLAGS)),
        (_load_partition, (descs, bufs, tiles_ring, table, counters, tiles, N, K, G_POW2, GROUP_TILES_M)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- issue 15: the tile's fixed cost off the tensor cores' path ---------------------------------
#
# ``gluon_ws`` pays per tile, with the tensor cores idle: the consumers' table search (O(log G)
# dependent global loads), the first K block's scale loads before its first wgmma, and the
# epilogue (both warpgroups convert and store 64 x 256 while no wgmma is issued). A fit over
# v17's Gluon cases: ~7.86 ns x K + 1.75 us a tile. ``gluon_ws_store`` has its arguments,
# semantics and accumulation order (so its bits), and takes two of those costs off the path:
#
# - the tile's fields from the ring: the consumers take (group, first row, column tile, group
#   end) as the producer found them, one shared-memory read instead of the search (gluon_ws's
#   consumers take only the tile's number: its four fields, held across gluon_ws's K loop, made
#   ptxas spill into it). Session 10 measured this hand-over alone with gluon_ws's K loop and
#   epilogue: 1.04x on the 12 w2 cases, 0.975x on the 12 w13 ones (`bench/results/session10/
#   call3_gluon11.json`, in the archive of sessions 1-22). (Issuing a block's first wgmma before its scale product, to put the
#   first scale loads under the MMA, cost 52-136 bytes of spills at 232 registers: not done.)
# - the epilogue in a partition of its own: each consumer writes its 64 x 256 to shared memory
#   (bf16, straight from the MMA layout: stmatrix, no layout conversion) and goes on to its
#   next tile; two store warps, taking each tile from the ring too, move it to global memory
#   with gluon_ws's masked stores (and row map). Rows past the group's end are never written
#   (masked stores, not TMA: a TMA store cannot stop at a group's end nor follow the row map).

# Triton packs the producer warp and the two store warps into one warpgroup (with a padding
# warp), whose setmaxnreg is the largest request: 8 x 32 x 232 + 4 x 32 x 40 fits MAXNREG's
# 12 x 32 x 168 as gluon_ws does. 48 would take the default consumer down to 224 registers.
STORE_REGS = gl.constexpr(40)
# The staged blocks: 16-byte pieces of a row swizzled by the row (mod 8), so the consumers'
# stmatrix and the store warps' 16-byte reads meet each bank once per wavefront.
STAGE_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
STAGE_CHUNK = gl.constexpr(8)  # rows the store warps move at a time: one swizzle period


@gluon.jit
def _pinned(x):
    """``x`` through an opaque move (the same bits), so LLVM cannot order the K loop's promotions
    after how the epilogue reads the sums: read by the staging stores, it reordered them and
    ptxas spilled the accumulators (gluon_ws_store: 850-900 bytes, 12 with this)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _stage(acc, acc_b, staging, i, HALF: gl.constexpr):
    """A consumer's two 64 x 128 sums of its ``i``-th tile into its staging buffers, once the store
    warps have drained the tile before."""
    stage, staged, drained = staging
    mbarrier.wait(drained.index(HALF), (i & 1) ^ 1)
    stage.index(2 * HALF + 1).store(_pinned(acc_b).to(stage.dtype))
    stage.index(2 * HALF).store(_pinned(acc).to(stage.dtype))
    mbarrier.arrive(staged.index(HALF), count=1)  # after a warpgroup sync: every thread's stores are in


@gluon.jit
def _staging_mma_partition(bufs, tiles_ring, staging, scalars, srcs, flags_ptr, HALF: gl.constexpr,
                           ADDRS: gl.constexpr, X_WORDS: gl.constexpr, FLAGS: gl.constexpr):
    """A consumer warpgroup of ``gluon_ws_store``: the tile from the ring, its sums staged in shared
    memory for the store warps."""
    a_bufs, b_bufs, _ready, _empty = bufs
    M, _N, K, stride_xsm, stride_wsg, stride_wsk, _stride_om, _stride_map = scalars
    BM: gl.constexpr = a_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    ROWS: gl.constexpr = BM // 2
    gl.static_assert(BN == 256)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 128, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    num_kb = K // BK
    it = 0
    i = 0  # this program's tile count so far
    _t, group, first_row, tile_n, row_stop = _take_tile(tiles_ring, i)
    while group >= 0:
        xs_base, ws_base = _scale_bases(srcs, ADDRS, X_WORDS)
        rows, xs_row, ws_col = _tile_scales(xs_base, ws_base, group, first_row, tile_n, M, stride_xsm, stride_wsg,
                                            HALF, ROWS, BN, row_layout)
        acc, acc_b, it, bad = _tile_sums(bufs, it, xs_row, ws_col, stride_wsk, num_kb,
                                         first_row + HALF * ROWS < row_stop, HALF, mma_layout, FLAGS)
        _stage(acc, acc_b, staging, i, HALF)
        _store_flags(flags_ptr, rows, rows, row_stop, tile_n, bad, FLAGS)  # in place (no row map)
        i += 1
        _t, group, first_row, tile_n, row_stop = _take_tile(tiles_ring, i)


@gluon.jit
def _drain(chunks, first, out_ptr, dests, first_dest, top, col, row_stop, ROW_MAP: gl.constexpr, stride_om,
           layout: gl.constexpr, ROWS: gl.constexpr):
    """Store a staged 64 x 128 block (``chunks[first:]``, CHUNK rows each) at (top, col), only the
    rows before ``row_stop``; ``ROW_MAP``: row r at ``out[map[r]]``, the offsets of those rows for
    the block's chunks at ``dests[first_dest:]`` (:func:`_tile_dests`)."""
    CHUNK: gl.constexpr = chunks.type.shape[1]
    COLS: gl.constexpr = chunks.type.shape[2]
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    # Only the chunks holding rows of the group; a run-time trip count also keeps the loop rolled
    # (unrolled, ptxas would keep every chunk's addresses in the store warps' few registers).
    live = gl.minimum(gl.maximum(row_stop - top, 0), ROWS)
    for c in range((live + CHUNK - 1) // CHUNK):
        rows = top + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        inside = rows < row_stop
        if ROW_MAP:
            # The chunk read before its offsets: in the other order ptxas reloaded two of the
            # consumers' row-scale pointers inside their K loop (one register allocation for
            # the whole kernel; sm_90 SASS, session 18). The in-place branch keeps its order.
            vals = chunks.index(first + c).load(layout)
            # The same bytes seen as a stack of chunks (a view of rank 1 per chunk).
            by_chunk = dests._reinterpret(gl.int64, dests.type.shape, gl.SwizzledSharedLayout(1, 1, 1, [0]))
            # Whole 16-byte pieces (the kernel's contract, ``triton_kernel.tile_for_out``: a row
            # stride that is a multiple of 8): read back from shared memory, the offsets' factor
            # is lost, and the rows were stored 2 bytes at a time (session 17).
            offset = gl.multiple_of(by_chunk.index(first_dest + c).load(gl.SliceLayout(1, layout)), 8)
        else:
            offset = rows.to(gl.int64) * stride_om
            vals = chunks.index(first + c).load(layout)
        gl.store((out_ptr + col) + offset[:, None] + cols[None, :], vals, mask=inside[:, None])


@gluon.jit
def _tile_dests(dests, map_ptr, first_row, row_stop, M, stride_map, stride_om):
    """Where a tile's rows go (``map[r] * stride_om``, the offset of the output row) into ``dests``
    (``[rows / CHUNK, CHUNK]``, shared by the store warps), loaded once a tile, before its sums
    are staged. Loaded in each chunk, the map stood in the store warps' path: one dependent L2
    round trip a chunk, each row's entry loaded twice; the merged calls' form ran 1.16-1.38x
    the in-place one on the short-K cases (session 17, ``bench/kernel_ab.py --forms map``); once a
    tile, that form ran 1.10-1.36x faster on Qwen3-30B w2, GLM-4.5 w2 t8192 and Qwen3-235B w2
    t8192, the other real prefill cases within noise (session 18).
    Offsets rather than rows: with the rows, ptxas spilled two of the consumers' scale
    pointers into their K loop (the kernel's registers are allocated together)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [gl.num_warps(), 1], [1, 0])
    CHUNKS: gl.constexpr = dests.type.shape[0]
    CHUNK: gl.constexpr = dests.type.shape[1]
    rows = (first_row + gl.arange(0, CHUNKS, layout=gl.SliceLayout(1, layout))[:, None] * CHUNK
            + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))[None, :])
    found = gl.load(map_ptr + gl.minimum(rows, M - 1).to(gl.int64) * stride_map, mask=rows < row_stop, other=0)
    gl.thread_barrier()  # (the store warps') the previous tile's chunks are stored: its offsets are read
    dests.store(found * stride_om)
    gl.thread_barrier()


@gluon.jit
def _store_partition(staging, dests, tiles_ring, scalars, out_ptr, map_ptr, ROW_MAP: gl.constexpr):
    """The store warps: every staged block of this program's tiles to global memory, in the order
    the consumers stage them, each tile taken from the ring as the consumers take it."""
    stage, staged, drained = staging
    M, _N, _K, _stride_xsm, _stride_wsg, _stride_wsk, stride_om, stride_map = scalars
    ROWS: gl.constexpr = stage.type.shape[1]
    COLS: gl.constexpr = stage.type.shape[2]
    CHUNK: gl.constexpr = STAGE_CHUNK
    # The same bytes seen as pieces of CHUNK rows, so a run-time loop can walk a block: a piece
    # is one whole swizzle period, so the swizzle of its rows is theirs in the block.
    chunks = stage._reinterpret(stage.dtype, [4 * (ROWS // CHUNK), CHUNK, COLS], STAGE_LAYOUT)
    VEC: gl.constexpr = 16 // (stage.dtype.primitive_bitwidth // 8)  # 16-byte accesses
    LANES_N: gl.constexpr = COLS // VEC
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // LANES_N, LANES_N], [gl.num_warps(), 1], [1, 0])
    i = 0
    _t, group, first_row, tile_n, row_stop = _take_tile(tiles_ring, i)
    while group >= 0:
        if ROW_MAP:
            _tile_dests(dests, map_ptr, first_row, row_stop, M, stride_map, stride_om)
        for h in range(2):  # loops, not unrolled: the store warps have few registers
            mbarrier.wait(staged.index(h), i & 1)
            for c in range(2):
                _drain(chunks, (2 * h + c) * (ROWS // CHUNK), out_ptr, dests, h * (ROWS // CHUNK), first_row + h * ROWS,
                       tile_n * (2 * COLS) + c * COLS, row_stop, ROW_MAP, stride_om, layout, ROWS)
            mbarrier.arrive(drained.index(h), count=1)
        i += 1
        _t, group, first_row, tile_n, row_stop = _take_tile(tiles_ring, i)


@gluon.jit
def gluon_ws_store_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, m_sizes_ptr, out_ptr, map_ptr, work_ptr, flags_ptr,
                          M, N, K, G, stride_xm, stride_wg, stride_wn, stride_xsm, stride_wsg, stride_wsk,
                          stride_om, stride_map,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                          G_POW2: gl.constexpr, GROUP_TILES_M: gl.constexpr, STAGES: gl.constexpr,
                          ADDRS: gl.constexpr, X_WORDS: gl.constexpr, ROW_MAP: gl.constexpr,
                          FLAGS: gl.constexpr = False):
    """``gluon_ws`` with the tile's fields taken from the ring and the epilogue in two store warps
    (section comment above): each consumer stages its 64 x 256 bf16 in shared memory (32 KB; 208 KB
    with the three ring slots) and starts its next tile. bf16 only: float32 would need 128 KB more (``tile_for_out`` runs
    ``gluon_ws`` instead). ``FLAGS`` stores in place only (the consumers write the flags; the
    row map is the store warps')."""
    gl.static_assert(not (FLAGS and ROW_MAP))
    tiles, table, counters, srcs, descs, bufs = _prologue(
        x_ptr, w_ptr, xs_ptr, ws_ptr, m_sizes_ptr, work_ptr, M, N, K, G, stride_xm, stride_wn, BLOCK_M, BLOCK_N,
        BLOCK_K, G_POW2, STAGES, ADDRS, X_WORDS)
    tiles_ring = _tile_ring(3)  # both consumers and the store warps
    OUT_BYTES: gl.constexpr = out_ptr.dtype.element_ty.primitive_bitwidth // 8
    gl.static_assert(OUT_BYTES == 2)
    # Blocks 2h and 2h + 1: consumer h's columns 0-127 and 128-255.
    stage = gl.allocate_shared_memory(out_ptr.dtype.element_ty, [4, BLOCK_M // 2, 128], STAGE_LAYOUT)
    staged = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    drained = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # Where the rows of the tile being stored go (ROW_MAP: ``_tile_dests``), by chunk.
    dests = gl.allocate_shared_memory(gl.int64, [BLOCK_M // STAGE_CHUNK, STAGE_CHUNK],
                                      gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for h in gl.static_range(2):
        mbarrier.init(staged.index(h), count=1)
        mbarrier.init(drained.index(h), count=1)
    fence_async_shared()
    staging = (stage, staged, drained)
    scalars = (M, N, K, stride_xsm, stride_wsg, stride_wsk, stride_om, stride_map)
    TOP: gl.constexpr = 0
    BOTTOM: gl.constexpr = 1
    gl.warp_specialize([
        (_staging_mma_partition, (bufs, tiles_ring, staging, scalars, srcs, flags_ptr, TOP, ADDRS, X_WORDS, FLAGS)),
        (_staging_mma_partition, (bufs, tiles_ring, staging, scalars, srcs, flags_ptr, BOTTOM, ADDRS, X_WORDS,
                                  FLAGS)),
        (_load_partition, (descs, bufs, tiles_ring, table, counters, tiles, N, K, G_POW2, GROUP_TILES_M)),
        (_store_partition, (staging, dests, tiles_ring, scalars, out_ptr, map_ptr, ROW_MAP)),
    ], [4, 1, 2], [CONSUMER_REGS, PRODUCER_REGS, STORE_REGS])

# Every kernel's cache key as any process computes it, whatever it launches first (_triton_keys).
settle(globals())
