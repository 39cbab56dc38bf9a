"""A warp-specialised persistent grouped FP8 GEMM for many-expert prefill, in Gluon (exploratory).

Same inputs and semantics as ``_triton_gemm.persistent_tma_kernel`` (its
header's layout table): xq [M, K] e4m3fn, wq [G, N, K], x_scale [M, K/128]
f32, w_scale [G, K/128, N/128] f32, m_sizes [G], out [M, N] bf16 or f32.
Groups are found in the kernel from ``m_sizes`` (each size clamped as there),
rows past a group's end are computed and dropped at the store, rows past M
are zero-filled by TMA, offsets into the scales and the output are int64.

Why Gluon: Triton 3.6's ``tl.range(warp_specialize=True)`` takes neither the
tile table nor a reduction, and a plain Triton loop waits on each wgmma
before its scale promotion. Here the roles are explicit:

- one producer warp walks this program's tiles and keeps a ring of
  ``STAGES`` shared-memory slots (a 128 x 128 activation tile and a
  BLOCK_N x 128 weight tile each) filled by TMA, each slot guarded by a
  ``ready`` mbarrier (TMA bytes landed) and an ``empty`` one (both consumers
  done with it);
- two consumer warpgroups (the default partition and a 4-warp worker) each
  own 64 rows of the 128-row tile. Per 128-wide K block a consumer runs an
  async wgmma into a fresh accumulator, waits, frees the slot and promotes
  ``acc += part * (x_scale[row] * w_scale)`` in registers. ``PAIR``: two K
  blocks in flight, the first one's promotion running under the second's
  MMA. Either way the other warpgroup's MMA runs under this one's promotion.
  BLOCK_N 256 (two weight-scale columns, two accumulators) reads 25 % fewer
  bytes from L2 per flop than 128 x 128: at the MMA rate 128 x 128 tiles
  need ~10 TB/s from L2 (64 x 128, the Triton tile: ~15);
- the tile walk is ``persistent_tma``'s: the programs (one per SM) take
  tiles ``pid, pid + programs, ...`` of the real tiles numbered group by
  group, found through a per-program table (O(log G) scalar loads).

Only the plain-pointer form is built. The server's forms would need: ADDRS /
X_WORDS (bases read from device words): the TMA descriptors made on the
device (``tma.make_tensor_descriptor`` in the parent region, from the loaded
addresses, with Triton's allocator scratch), the scale pointers loaded the
same way; ROW_MAP: the store's row index read from the map (one int64 load
per stored row), nothing else changes.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import triton_kernel as tk

BLOCK_M = 128  # two consumer warpgroups of 64 rows
BLOCK_K = 128  # one scale block per K step
CONSUMER_REGS = gl.constexpr(232)  # per thread, each consumer warpgroup (acc + two parts = 192 live floats)
PRODUCER_REGS = gl.constexpr(40)
MAXNREG = 168  # 12 warps x 32 x 168 <= 65536: the budget setmaxnreg redistributes


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
def _load_partition(descs, bufs, table_ptr, tiles, N, K, G_POW2: gl.constexpr, GROUP_TILES_M: gl.constexpr):
    """The producer warp: TMA loads of every K block of this program's tiles into the ring."""
    x_desc, w_desc = descs
    a_bufs, b_bufs, ready, empty = bufs
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    num_n = N // BN
    num_kb = K // BK
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    it = 0
    for t in range(pid, tiles, programs):
        group, first_row, tile_n, row_stop = _find_tile(table_ptr, t, num_n, BM, G_POW2, GROUP_TILES_M)
        w_row = group * N + tile_n * BN
        for kb in range(num_kb):
            slot = it % STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0.
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [first_row, kb * BK], bar, a_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [w_row, kb * BK], bar, b_bufs.index(slot))
            it += 1


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
def _store(acc, out_ptr, first_row, col, row_stop, stride_om, layout: gl.constexpr):
    """Store a 64 x 128 block at (first_row, col), only the rows before ``row_stop``."""
    ROWS: gl.constexpr = acc.shape[0]
    COLS: gl.constexpr = acc.shape[1]
    vals = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), layout)
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = col + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
    gl.store(ptrs, vals, mask=(rows < row_stop)[:, None])


@gluon.jit
def _mma_partition(bufs, table_ptr, tiles, scalars, xs_ptr, ws_ptr, out_ptr, HALF: gl.constexpr,
                   G_POW2: gl.constexpr, GROUP_TILES_M: gl.constexpr, PAIR: gl.constexpr):
    """One consumer warpgroup: rows ``[HALF * 64, HALF * 64 + 64)`` of every tile.

    BLOCK_N 128: one accumulator; ``PAIR`` keeps two K blocks in flight (the
    first one's promotion under the second's MMA), else one. BLOCK_N 256: two
    accumulators (one per weight-scale column), the two 128-wide halves of a K
    block one after the other (a second part would not fit in 232 registers).
    """
    a_bufs, b_bufs, ready, empty = bufs
    M, N, K, stride_xsm, stride_wsg, stride_wsk, stride_om = scalars
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    ROWS: gl.constexpr = BM // 2
    WIDE: gl.constexpr = BN == 256
    gl.static_assert(BN == 128 or (WIDE and not PAIR))
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 128, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    # 16-byte stores along N: 16 threads cover 128 columns of bf16.
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    num_n = N // BN
    num_kb = K // BK
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    it = 0
    for t in range(pid, tiles, programs):
        # The parts' registers: a wgmma reads its accumulator operand even when told to ignore it,
        # so parts made per tile keep them dead between tiles (the epilogue needs the room).
        p0 = gl.zeros([ROWS, 128], gl.float32, mma_layout)
        group, first_row, tile_n, row_stop = _find_tile(table_ptr, t, num_n, BM, G_POW2, GROUP_TILES_M)
        rows = first_row + HALF * ROWS + gl.arange(0, ROWS, layout=row_layout)
        xs_row = xs_ptr + gl.minimum(rows, M - 1).to(gl.int64) * stride_xsm
        # The weight scale loaded per thread: a load from one address for all threads goes into a
        # uniform register, and ptxas puts that conversion right before the next wgmma, which
        # then waits for the load's L2 latency (seen in the SASS). An offset that is 0 but
        # depends on the thread's rows keeps it in an ordinary register, used an iteration later.
        ws_col = (ws_ptr + group.to(gl.int64) * stride_wsg + tile_n * (BN // 128)
                  + gl.where(rows < 0, rows, 0))
        acc = gl.zeros([ROWS, 128], gl.float32, mma_layout)
        if WIDE:
            acc_b = gl.zeros([ROWS, 128], gl.float32, mma_layout)
            sx = gl.load(xs_row)
            sw = gl.load(ws_col)
            sw_b = gl.load(ws_col + 1)
            for kb in range(num_kb):
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
            _store(acc_b, out_ptr, first_row + HALF * ROWS, tile_n * BN + 128, row_stop, stride_om, out_layout)
        elif PAIR:
            # Two K blocks in flight; each pair's scales loaded one pair ahead.
            p1 = gl.zeros([ROWS, 128], gl.float32, mma_layout)
            sx0 = gl.load(xs_row)
            sw0 = gl.load(ws_col)
            sx1 = gl.load(xs_row + gl.minimum(1, num_kb - 1))
            sw1 = gl.load(ws_col + gl.minimum(1, num_kb - 1) * stride_wsk)
            for kp in range(num_kb // 2):
                s0 = sx0 * sw0
                s1 = sx1 * sw1
                kn = gl.minimum(2 * kp + 2, num_kb - 1)
                kn1 = gl.minimum(2 * kp + 3, num_kb - 1)
                sx0 = gl.load(xs_row + kn)
                sw0 = gl.load(ws_col + kn * stride_wsk)
                sx1 = gl.load(xs_row + kn1)
                sw1 = gl.load(ws_col + kn1 * stride_wsk)
                slot0 = _ready(ready, it, STAGES)
                p0 = _mma(a_bufs, b_bufs, slot0, p0, HALF, 0)
                slot1 = _ready(ready, it + 1, STAGES)
                p1 = _mma(a_bufs, b_bufs, slot1, p1, HALF, 0)
                p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0, ))
                mbarrier.arrive(empty.index(slot0), count=1)
                acc = acc + p0 * s0[:, None]
                p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1, ))
                mbarrier.arrive(empty.index(slot1), count=1)
                acc = acc + p1 * s1[:, None]
                it += 2
            if num_kb % 2 == 1:  # the odd last block; its scales are the prefetched sx0, sw0
                slot0 = _ready(ready, it, STAGES)
                p0 = _mma(a_bufs, b_bufs, slot0, p0, HALF, 0)
                p0 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, ))
                mbarrier.arrive(empty.index(slot0), count=1)
                acc = acc + p0 * (sx0 * sw0)[:, None]
                it += 1
        else:
            # One K block at a time; its scales loaded a block ahead.
            sx = gl.load(xs_row)
            sw = gl.load(ws_col)
            for kb in range(num_kb):
                s = sx * sw
                kn = gl.minimum(kb + 1, num_kb - 1)
                sx = gl.load(xs_row + kn)
                sw = gl.load(ws_col + kn * stride_wsk)
                slot = _ready(ready, it, STAGES)
                p0 = _mma(a_bufs, b_bufs, slot, p0, HALF, 0)
                p0 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, ))
                mbarrier.arrive(empty.index(slot), count=1)
                acc = acc + p0 * s[:, None]
                it += 1
        _store(acc, out_ptr, first_row + HALF * ROWS, tile_n * BN, row_stop, stride_om, out_layout)


@gluon.jit
def grouped_gemm_ws_kernel(x_desc, w_desc, xs_ptr, ws_ptr, m_sizes_ptr, out_ptr, work_ptr,
                           M, N, K, G, stride_xsm, stride_wsg, stride_wsk, stride_om,
                           G_POW2: gl.constexpr, GROUP_TILES_M: gl.constexpr, STAGES: gl.constexpr,
                           PAIR: gl.constexpr):
    """Persistent warp-specialised grouped GEMM: one program per SM, 128 x 128 tiles (module doc)."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    pid = gl.program_id(0)
    table = work_ptr + pid * (3 * G_POW2)
    tiles = _tile_table(m_sizes_ptr, M, G, N // BN, table, BM, G_POW2, gl.num_warps())
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()
    bufs = (a_bufs, b_bufs, ready, empty)
    scalars = (M, N, K, stride_xsm, stride_wsg, stride_wsk, stride_om)
    TOP: gl.constexpr = 0
    BOTTOM: gl.constexpr = 1
    gl.warp_specialize([
        (_mma_partition, (bufs, table, tiles, scalars, xs_ptr, ws_ptr, out_ptr, TOP, G_POW2, GROUP_TILES_M, PAIR)),
        (_mma_partition, (bufs, table, tiles, scalars, xs_ptr, ws_ptr, out_ptr, BOTTOM, G_POW2, GROUP_TILES_M,
                          PAIR)),
        (_load_partition, ((x_desc, w_desc), bufs, table, tiles, N, K, G_POW2, GROUP_TILES_M)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- host side ---------------------------------------------------------------------------------


def operand_layout() -> gl.NVMMASharedLayout:
    """The shared layout of both 128 x 128 fp8 tiles (128-byte swizzle: what wgmma reads)."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)


def launch(xq, wq, x_scale, w_scale, m_sizes, out, *, stages: int = 4, pair: bool = True,
           block_n: int = 128, group_tiles_m: int = 8) -> torch.Tensor:
    """SPEC 1 into ``out`` (bf16 or float32) with this kernel: capture-safe, no host reads.

    Layouts as ``triton_kernel.run`` checks them (``wq`` contiguous, rows K-major).
    The descriptors are made on the host per call (a captured graph keeps them).
    """
    m, k = xq.shape
    g, n, _ = wq.shape
    if m == 0:
        return out
    if block_n not in (128, 256) or n % block_n or k % BLOCK_K:
        raise ValueError(f"need BLOCK_N 128 or 256 dividing N and K a multiple of 128, got N={n}, K={k}, "
                         f"BLOCK_N={block_n}")
    layout = operand_layout()
    x_desc = TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [BLOCK_M, BLOCK_K], layout)
    w_desc = TensorDescriptor(wq.view(g * n, k), [g * n, k], [k, 1], [block_n, BLOCK_K], layout)
    programs = min(tk.row_tile_bound(m, g, BLOCK_M) * (n // block_n), tk._sm_count(xq.device))
    g_pow2 = max(16, tk._next_pow2(g))
    if g_pow2 > tk.TABLE_G_MAX:
        raise ValueError(f"at most {tk.TABLE_G_MAX} groups, got {g}")
    grouped_gemm_ws_kernel[(programs, )](
        x_desc, w_desc, x_scale, w_scale, m_sizes, out, tk._tile_tables(xq.device, programs, g_pow2),
        m, n, k, g, x_scale.stride(0), (k // 128) * (n // 128), n // 128, out.stride(0),
        G_POW2=g_pow2, GROUP_TILES_M=group_tiles_m, STAGES=stages, PAIR=pair and block_n == 128,
        num_warps=4, maxnreg=MAXNREG)
    return out
