"""The FlyDSL kernel body of the grouped FP8 GEMM with block-wise scales (SPEC 1).

Imported only by :mod:`moegemm.kernels.flydsl_kernel`, after it has decided that
FlyDSL may load in this process. Nothing here runs at import time except
importing FlyDSL itself.

| argument  | shape                          | dtype (as passed)   | meaning |
|-----------|--------------------------------|---------------------|---------|
| `xq`      | `[M, K]`                       | uint8 (fp8 bytes)   | activations, row-major |
| `wq`      | `[G, N, K]`                    | uint8 (fp8 bytes)   | weights, plain or preshuffled (SPEC 1.3) |
| `x_scale` | `[M, K/128]`                   | float32             | per token, per 128-wide K block |
| `w_scale` | `[G, K/128, N/128]`            | float32             | per 128x128 weight block |
| `m_sizes` | `[G]`                          | int64 or int32      | rows per group, summing to M |
| `out`     | `[M, N]`                       | bfloat16 or float32 | compact output, row-major (the expert FFN's `h` is float32) |
| `M`, `G`  | scalars                        | int32               | rows, groups |

Every tensor arrives with its natural shape, layout-dynamic: FlyDSL packs each
extent as an int32 and each stride as an int64, so no packed value comes near
2^31 for any shape the launcher accepts (each extent is below 2^31; the
products that are not, like ``G * N * K``, exist only as int64 strides and in
the kernel's own int64 address arithmetic). The kernel reads only the base
pointers; N and K are compile-time constants.

Work split. A block of 256 threads (4 waves of 64) owns a ``block_m x block_n``
output tile of one group; the 4 waves split ``block_n``, each wave computes all
``block_m`` rows of its ``block_n / 4`` columns with 16x16 MFMA tiles. The grid
is ``(ceil(M / block_m) + G - 1, N / block_n)``: the first axis bounds the number
of M tiles of any split of M rows into G groups, so it depends only on M and G.
Each block walks ``m_sizes`` to find the group that owns its M tile (no per-tile
map is built on the host, no helper kernel runs); blocks past the last tile exit.

Data flow per ``block_k`` step: the A tile (and its x scales) is staged in LDS,
double-buffered, with an XOR swizzle on 16-byte chunks so the MFMA reads are
free of bank conflicts; B goes from global memory straight into registers,
prefetched one step ahead (the preshuffled layout makes each wave's B read one
contiguous 1 KiB burst per 16x64 tile). The MFMA of one 128-wide K block gives a
partial product that is scaled by ``x_scale * w_scale`` in FP32 and added to the
accumulator, exactly the order of SPEC 1.

MFMA operands. A lane ``l`` of a 16x16 tile holds row (A) or column (B)
``l % 16`` and the 16 bytes ``k = 64 c + 16 (l // 16) + [0, 16)`` of each
64-wide chunk ``c`` — the order in which the preshuffled B tile stores them.
The same K assignment on both operands makes every MFMA sum over a set of K
indices inside one scale block, whichever K order the hardware uses:

- gfx942: ``v_mfma_f32_16x16x32_fp8_fp8`` (e4m3fnuz), four per 128-wide block,
  each on 8 bytes per lane.
- gfx950: ``v_mfma_scale_f32_16x16x128_f8f6f4`` (e4m3fn), one per 128-wide
  block on 32 bytes per lane, with the neutral E8M0 scale 127 (2^0); the FP32
  block scales are applied in software as above.

Addresses are int64 throughout (a group offset ``g * N * K`` passes 2^31 for
DeepSeek-size weights). Each group's size is clamped to ``[0, M]`` before the walk
sums it, rows past M are never read (the row is clamped) and a row is stored only
if it is below both its group's end and M: ``m_sizes`` summing past M (or
negative, or near 2^63) cannot make the kernel write outside ``out``.

The K loop runs ``k_steps - 1`` times with a prefetch of the next step, then the
last step alone, which loads nothing. The FP32 scale is applied with one fused
multiply-add per accumulator (``acc = part * scale + acc``, packed two lanes of
``v_pk_fma_f32`` at a time). The waves-per-EU target of each arch is fixed
(``_flydsl_tiles.waves_per_eu``), so the register budget, and with it occupancy, does not
change with K.
"""

# No `from __future__ import annotations`: FlyDSL reads the annotations
# (fx.Tensor, fx.Array[...]) as live objects.
from collections.abc import Callable
from dataclasses import dataclass

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import arith, const_expr, gpu, range_constexpr, rocdl
from flydsl.expr.typing import T

from ._flydsl_index import (
    CHUNK,
    SCALE_BLOCK,
    THREADS,
    WAVE_SIZE,
    WAVES,
    a_global_offset,
    a_lds_offset,
    a_operand_chunk,
    a_piece,
    acc_row,
    b_offset_plain,
    b_offset_preshuffled,
    lane_coords,
    owner_step,
    scales_prescaled,
    w_scale_offset,
    x_scale_global_offset,
    x_scale_lds_offset,
    x_scale_piece,
)
from ._flydsl_tiles import FlyTile, waves_per_eu

E8M0_ONE = 127  # 2^0: the scaled MFMA leaves the product unscaled


@dataclass(frozen=True)
class KernelShape:
    """Everything the compiled code is specialized on (one compile per value)."""

    arch: str
    weight_layout: str  # "plain" | "preshuffled"
    tile: FlyTile
    n: int
    k: int
    out_dtype: str = "bf16"  # "bf16" | "f32": what the epilogue stores


def _bytes16():
    """vector<16xi8>: one lane's 16-byte load (built during a trace: it needs an MLIR context)."""
    return fx.Vector.make_type(16, fx.Uint8)


def _floats4():
    """vector<4xf32>: four consecutive x scales, one per accumulator row of a lane."""
    return fx.Vector.make_type(4, fx.Float32)


def _concat_i32(halves):
    """Two 16-byte operands as the 8 x i32 (32 fp8) one scaled MFMA lane reads."""
    words = [h.bitcast(fx.Int32) for h in halves]
    return fx.Vector.from_elements([w[e] for w in words for e in range(4)], dtype=fx.Int32)


def build_launcher(shape: KernelShape) -> Callable:
    """A ``@flyc.jit`` launcher ``(xq, wq, x_scale, w_scale, m_sizes, out, M, G, stream)``.

    The caller has validated ``shape`` (tile divisibility, LDS budget); this
    function only traces what it is given.
    """
    arch = shape.arch
    preshuffled = shape.weight_layout == "preshuffled"
    bm, bn, bk = shape.tile.block_m, shape.tile.block_n, shape.tile.block_k
    n_dim, k_dim = shape.n, shape.k

    wave_n = bn // WAVES  # columns per wave
    n_sub = wave_n // 16  # 16-wide MFMA tiles per wave along N
    m_sub = bm // 16  # 16-tall MFMA tiles along M
    k_sub = bk // SCALE_BLOCK  # scale blocks per K step
    k_steps = k_dim // bk
    k_scales = k_dim // SCALE_BLOCK  # row length of x_scale
    n_scales = n_dim // SCALE_BLOCK  # row length of w_scale
    chunks_per_row = bk // CHUNK
    a_passes = bm * bk // (CHUNK * THREADS)  # 16-byte A loads per thread per step
    xs_count = bm * k_sub  # x scales per step
    xs_passes = -(-xs_count // THREADS)
    a_stage = bm * bk  # bytes of one A stage
    xs_stage = xs_count  # floats of one x-scale stage
    group_bytes = n_dim * k_dim
    # A block of at most 128 columns has one w scale per 128-block of K: it is
    # folded into the x scales as they are staged, and the MFMA loop applies one
    # product per accumulator. Wider blocks multiply per wave in the loop.
    prescaled = scales_prescaled(bn)
    out_f32 = shape.out_dtype == "f32"

    @fx.struct
    class Staging:
        a: fx.Array[fx.Uint8, 2 * a_stage, 16]
        xs: fx.Array[fx.Float32, 2 * xs_stage, 16]

    @flyc.kernel
    def grouped_fp8_gemm_kernel(
        xq: fx.Tensor,
        wq: fx.Tensor,
        x_scale: fx.Tensor,
        w_scale: fx.Tensor,
        m_sizes: fx.Tensor,
        out: fx.Tensor,
        M: fx.Int32,
        G: fx.Int32,
    ):
        tid = fx.thread_idx.x
        tile_m = fx.Int64(fx.block_idx.x)
        tile_n = fx.block_idx.y
        wave = tid // WAVE_SIZE
        lane_row, lane_k = lane_coords(tid % WAVE_SIZE)
        lane_row64, lane_k64 = fx.Int64(lane_row), fx.Int64(lane_k)

        xq_p = fx.get_iter(xq)
        wq_p = fx.get_iter(wq)
        xs_p = fx.get_iter(x_scale)
        ws_p = fx.get_iter(w_scale)
        ms_p = fx.get_iter(m_sizes)
        out_p = fx.get_iter(out)

        # Group ownership: walk m_sizes, counting M tiles, until this block's tile.
        zero64 = fx.Int64(0)
        m64 = fx.Int64(M)
        rows_before, tiles_before, group, row0, row_end = (
            zero64,
            zero64,
            fx.Int64(-1),
            zero64,
            zero64,
        )
        for g in range(G):
            # In [0, M]: a negative, oversized or wrapping size cannot move rows past M.
            rows = fx.min(fx.max(fx.Int64(fx.ptr_load(ms_p + fx.Int64(g))), zero64), m64)
            rows_before, tiles_before, group, row0, row_end = owner_step(
                (rows_before, tiles_before, group, row0, row_end),
                fx.Int64(g),
                rows,
                tile_m,
                bm,
                arith.select,
            )

        if group >= 0:
            lds = fx.SharedAllocator().allocate(Staging).peek()
            lds_a = lds.a.ptr
            lds_xs = lds.xs.ptr
            last_row = m64 - 1
            row_stop = fx.min(row_end, m64)  # stores stop at the group's end and at M
            tile_col0 = fx.Int64(tile_n * bn)
            col0 = tile_col0 + fx.Int64(wave * wave_n)  # first output column of this wave
            w_base = group * group_bytes
            b_offset = b_offset_preshuffled if const_expr(preshuffled) else b_offset_plain

            def load_a(step):
                """This thread's 16-byte A pieces and x scales of K step ``step`` (rows clamped to M)."""
                pieces = []
                for p in range_constexpr(a_passes):
                    row, chunk = a_piece(p * THREADS + tid, chunks_per_row)
                    grow = fx.min(row0 + fx.Int64(row), last_row)
                    off = a_global_offset(grow, k_dim, step, bk, fx.Int64(chunk))
                    pieces.append(fx.ptr_load(xq_p + off, result_type=_bytes16()))
                scales = []
                for p in range_constexpr(xs_passes):
                    row, sub = x_scale_piece(fx.min(p * THREADS + tid, xs_count - 1), bm)
                    grow = fx.min(row0 + fx.Int64(row), last_row)
                    off = x_scale_global_offset(grow, k_scales, step, k_sub, fx.Int64(sub))
                    scales.append(fx.ptr_load(xs_p + off))
                    if const_expr(prescaled):  # and the w scale of its 128-block, next to it
                        kblock = step * k_sub + sub
                        off = w_scale_offset(group, k_scales, n_scales, tile_col0, kblock)
                        scales.append(fx.ptr_load(ws_p + off))
                return pieces, scales

            def store_a(stage, pieces, scales):
                """Write one step's A pieces (swizzled) and x scales into LDS stage ``stage``."""
                for p in range_constexpr(a_passes):
                    row, chunk = a_piece(p * THREADS + tid, chunks_per_row)
                    off = a_lds_offset(stage, a_stage, row, bk, chunk)
                    fx.ptr_store(pieces[p], lds_a + fx.Int64(off))
                for p in range_constexpr(xs_passes):
                    # Threads past the end repeat the last scale: same value, same place.
                    row, sub = x_scale_piece(fx.min(p * THREADS + tid, xs_count - 1), bm)
                    off = x_scale_lds_offset(stage, xs_stage, sub, bm, row)
                    if const_expr(prescaled):
                        value = scales[2 * p] * scales[2 * p + 1]
                    else:
                        value = scales[p]
                    fx.ptr_store(value, lds_xs + fx.Int64(off))

            def load_b(step):
                """This lane's B operands of K step ``step``: [128-block][16-col tile][64-half]."""
                regs = []
                for sub in range_constexpr(k_sub):
                    per_n = []
                    for j in range_constexpr(n_sub):
                        n16 = (col0 + j * 16) // 16
                        per_half = []
                        for half in range_constexpr(2):
                            k64 = step * (bk // 64) + (sub * 2 + half)
                            off = b_offset(w_base, n16, k64, lane_row64, lane_k64, k_dim)
                            per_half.append(fx.ptr_load(wq_p + off, result_type=_bytes16()))
                        per_n.append(per_half)
                    regs.append(per_n)
                return regs

            def load_ws(step):
                """The w scale of each 128-block of K step ``step`` for this wave's columns.

                Empty when the staged x scales already carry it (``prescaled``).
                """
                if const_expr(prescaled):
                    return []
                return [
                    fx.ptr_load(
                        ws_p + w_scale_offset(group, k_scales, n_scales, col0, step * k_sub + sub)
                    )
                    for sub in range_constexpr(k_sub)
                ]

            def block_product(a, b):
                """One 16x16 tile over one 128-wide K block: unscaled FP32 partial sums."""
                zero = fx.Vector.filled(4, 0.0, fx.Float32)
                if const_expr(arch == "gfx950"):
                    a8 = _concat_i32(a)
                    b8 = _concat_i32(b)
                    return fx.Vector(
                        rocdl.mfma_scale_f32_16x16x128_f8f6f4(
                            T.f32x4, [a8, b8, zero, 0, 0, 0, E8M0_ONE, 0, E8M0_ONE]
                        )
                    )
                part = zero
                for half in range_constexpr(2):
                    a64 = a[half].bitcast(fx.Int64)
                    b64 = b[half].bitcast(fx.Int64)
                    for h in range_constexpr(2):
                        part = rocdl.mfma_f32_16x16x32_fp8_fp8(
                            T.f32x4, [a64[h], b64[h], part, 0, 0, 0]
                        )
                return fx.Vector(part)

            # Prologue: step 0 into stage 0.
            first_pieces, first_scales = load_a(zero64)
            store_a(0, first_pieces, first_scales)
            b_cur = load_b(zero64)
            ws_cur = load_ws(zero64)
            gpu.barrier()

            acc = [
                [fx.Vector.filled(4, 0.0, fx.Float32) for _ in range(n_sub)] for _ in range(m_sub)
            ]

            slots = [(sub, i) for sub in range(k_sub) for i in range(m_sub)]

            def read_a(stage, slot):
                """The A operand and the 4 x scales of MFMA row tile ``i`` of 128-block ``sub``, from LDS."""
                sub, i = slot
                row = i * 16 + lane_row
                a = []
                for half in range_constexpr(2):
                    chunk = a_operand_chunk(sub, half, lane_k)
                    off = a_lds_offset(stage, a_stage, row, bk, chunk)
                    a.append(fx.ptr_load(lds_a + fx.Int64(off), result_type=_bytes16()))
                # The 4 accumulator rows of this lane: consecutive scales in LDS.
                off = x_scale_lds_offset(stage, xs_stage, sub, bm, acc_row(i, lane_k, 0))
                return a, fx.ptr_load(lds_xs + fx.Int64(off), result_type=_floats4())

            def compute(stage, b_regs, ws, acc):
                """``acc`` plus one K step from LDS stage ``stage`` and the B registers.

                Software-pipelined by hand, one row tile ``i`` (of one 128-block) a
                slot: the slot's LDS reads are issued one slot ahead, its MFMAs
                next, and the products of the previous slot are folded into the
                accumulators only then, so no VALU waits on the MFMA it follows.
                A scheduling barrier closes each slot, which keeps the register
                count the same for every K.
                """
                acc = [list(row) for row in acc]

                def fold(pending):
                    i, parts, scale4 = pending
                    for j in range_constexpr(n_sub):
                        acc[i][j] = fx.fma(parts[j], scale4, acc[i][j])

                nxt = read_a(stage, slots[0])
                pending = None
                for n_slot in range_constexpr(len(slots)):
                    sub, i = slots[n_slot]
                    a, xs4 = nxt
                    if const_expr(n_slot + 1 < len(slots)):
                        nxt = read_a(stage, slots[n_slot + 1])
                    parts = [block_product(a, b_regs[sub][j]) for j in range_constexpr(n_sub)]
                    if const_expr(pending is not None):
                        fold(pending)
                    pending = (i, parts, xs4 if const_expr(prescaled) else xs4 * ws[sub])
                    rocdl.sched_barrier(0)
                fold(pending)
                return acc

            # Every step but the last prefetches the next one; the last loads nothing.
            if const_expr(k_steps > 1):
                # unroll=1: LLVM would fully unroll a short loop (K = 512 is 3 trips)
                # and spend registers on it; kept rolled, every K compiles alike.
                for step in range(k_steps - 1, unroll=1):
                    stage = step % 2
                    nxt = fx.Int64(step + 1)
                    pieces, scales = load_a(nxt)
                    b_next = load_b(nxt)
                    ws_next = load_ws(nxt)
                    acc = compute(stage, b_cur, ws_cur, acc)
                    store_a(1 - stage, pieces, scales)
                    gpu.barrier()
                    b_cur = b_next
                    ws_cur = ws_next
            acc = compute((k_steps - 1) % 2, b_cur, ws_cur, acc)

            # Epilogue: a lane holds rows acc_row(i, lane_k, r) of column lane_row of each tile.
            for i in range_constexpr(m_sub):
                for j in range_constexpr(n_sub):
                    vals = acc[i][j] if const_expr(out_f32) else acc[i][j].to(fx.BFloat16)
                    col = col0 + j * 16 + lane_row64
                    for r in range_constexpr(4):
                        row = row0 + fx.Int64(acc_row(i, lane_k, r))
                        if row < row_stop:
                            fx.ptr_store(vals[r], out_p + (row * n_dim + col))

    @flyc.jit
    def launch_grouped_fp8_gemm(
        xq: fx.Tensor,
        wq: fx.Tensor,
        x_scale: fx.Tensor,
        w_scale: fx.Tensor,
        m_sizes: fx.Tensor,
        out: fx.Tensor,
        M: fx.Int32,
        G: fx.Int32,
        stream: fx.Stream = fx.Stream(None),  # noqa: B008 (FlyDSL reads the default stream this way)
    ):
        tiles_m = (M + bm - 1) // bm + G - 1
        grouped_fp8_gemm_kernel(xq, wq, x_scale, w_scale, m_sizes, out, M, G).launch(
            grid=(tiles_m, n_dim // bn, 1), block=(THREADS, 1, 1), stream=stream
        )

    # The register budget of a fixed occupancy, whatever K is (FlyDSL's rocdl.waves_per_eu).
    launch_grouped_fp8_gemm.compile_hints = {
        **launch_grouped_fp8_gemm.compile_hints,
        "waves_per_eu": waves_per_eu(arch, shape.tile),
    }
    return launch_grouped_fp8_gemm
