"""The FlyDSL kernel body of the grouped FP8 GEMM with block-wise scales (SPEC 1).

Imported only by :mod:`moegemm.kernels.flydsl_kernel`, after it has decided that
FlyDSL may load in this process. Nothing here runs at import time except
importing FlyDSL itself.

| argument  | shape                          | dtype (as passed)   | meaning |
|-----------|--------------------------------|---------------------|---------|
| `xq`      | `[M * K]`                      | uint8 (fp8 bytes)   | activations, row-major `[M, K]` |
| `wq`      | `[G * N * K]`                  | uint8 (fp8 bytes)   | weights, plain `[G, N, K]` or preshuffled (SPEC 1.3) |
| `x_scale` | `[M * K/128]`                  | float32             | per token, per 128-wide K block |
| `w_scale` | `[G * K/128 * N/128]`          | float32             | per 128x128 weight block |
| `m_sizes` | `[G]`                          | int64 or int32      | rows per group, summing to M |
| `out`     | `[M * N]`                      | bfloat16            | compact output, row-major `[M, N]` |
| `M`, `G`  | scalars                        | int32               | rows, groups |

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
DeepSeek-size weights). Rows past M are never read (the row is clamped) and rows
past the group's end are computed but never stored.
"""

# No `from __future__ import annotations`: FlyDSL reads the annotations
# (fx.Tensor, fx.Array[...]) as live objects.
from collections.abc import Callable
from dataclasses import dataclass

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import arith, const_expr, gpu, range_constexpr, rocdl
from flydsl.expr.typing import T

from ._flydsl_tiles import FlyTile

WAVES = 4
WAVE_SIZE = 64
THREADS = WAVES * WAVE_SIZE
SCALE_BLOCK = 128  # the K and N extent of one block scale (SPEC 1)
CHUNK = 16  # bytes one lane moves per load
E8M0_ONE = 127  # 2^0: the scaled MFMA leaves the product unscaled


@dataclass(frozen=True)
class KernelShape:
    """Everything the compiled code is specialized on (one compile per value)."""

    arch: str
    weight_layout: str  # "plain" | "preshuffled"
    tile: FlyTile
    n: int
    k: int


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
    k64 = k_dim // 64  # 64-wide K chunks per weight row (preshuffled tiles)
    group_elems = n_dim * k_dim

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
        lane = tid % WAVE_SIZE
        lane_row = lane % 16  # row of A / column of B this lane feeds
        lane_k = lane // 16  # which 16-byte slice of a 64-wide K chunk

        xq_p = fx.get_iter(xq)
        wq_p = fx.get_iter(wq)
        xs_p = fx.get_iter(x_scale)
        ws_p = fx.get_iter(w_scale)
        ms_p = fx.get_iter(m_sizes)
        out_p = fx.get_iter(out)

        # Group ownership: walk m_sizes, counting M tiles, until this block's tile.
        c_bm = fx.Int64(bm)
        rows_before = fx.Int64(0)
        tiles_before = fx.Int64(0)
        group = fx.Int64(-1)
        row0 = fx.Int64(0)
        row_end = fx.Int64(0)
        for g in range(G):
            rows = fx.Int64(fx.ptr_load(ms_p + fx.Int64(g)))
            tiles = (rows + c_bm - 1) // c_bm
            mine = (tile_m >= tiles_before) & (tile_m < tiles_before + tiles)
            group = arith.select(mine, fx.Int64(g), group)
            row0 = arith.select(mine, rows_before + (tile_m - tiles_before) * c_bm, row0)
            row_end = arith.select(mine, rows_before + rows, row_end)
            rows_before = rows_before + rows
            tiles_before = tiles_before + tiles

        if group >= 0:
            lds = fx.SharedAllocator().allocate(Staging).peek()
            lds_a = lds.a.ptr
            lds_xs = lds.xs.ptr
            last_row = fx.Int64(M) - 1
            col0 = tile_n * bn + wave * wave_n  # first output column of this wave
            w_base = group * group_elems
            ws_base = group * (k_scales * n_scales) + fx.Int64(col0 // SCALE_BLOCK)

            def load_a(step):
                """This thread's 16-byte pieces of the A tile and x scales of K step ``step``."""
                pieces = []
                for p in range_constexpr(a_passes):
                    c = p * THREADS + tid
                    row = fx.min(row0 + fx.Int64(c // chunks_per_row), last_row)
                    off = row * k_dim + step * bk + fx.Int64((c % chunks_per_row) * CHUNK)
                    pieces.append(
                        fx.ptr_load(xq_p + off, result_type=fx.Vector.make_type(16, fx.Uint8))
                    )
                scales = []
                for p in range_constexpr(xs_passes):
                    i = fx.min(p * THREADS + tid, xs_count - 1)
                    row = fx.min(row0 + fx.Int64(i % bm), last_row)
                    scales.append(
                        fx.ptr_load(xs_p + (row * k_scales + step * k_sub + fx.Int64(i // bm)))
                    )
                return pieces, scales

            def store_a(stage, pieces, scales):
                """Write one step's A pieces (swizzled) and x scales into LDS stage ``stage``."""
                for p in range_constexpr(a_passes):
                    c = p * THREADS + tid
                    row = c // chunks_per_row
                    slot = (c % chunks_per_row) ^ (row % 8)
                    fx.ptr_store(
                        pieces[p], lds_a + fx.Int64(stage * a_stage + row * bk + slot * CHUNK)
                    )
                for p in range_constexpr(xs_passes):
                    # Threads past the end repeat the last scale: same value, same place.
                    i = fx.min(p * THREADS + tid, xs_count - 1)
                    fx.ptr_store(scales[p], lds_xs + fx.Int64(stage * xs_stage + i))

            def load_b(step):
                """This lane's B operands of K step ``step``: [scale block][n tile][64-chunk]."""
                regs = []
                for s in range_constexpr(k_sub):
                    per_n = []
                    for j in range_constexpr(n_sub):
                        per_c = []
                        for c in range_constexpr(2):
                            k0 = step * (bk // 64) + (s * 2 + c)  # 64-wide chunk index
                            n16 = fx.Int64((col0 + j * 16) // 16)
                            if const_expr(preshuffled):
                                # One contiguous 1 KiB tile per (n16, k0); lane l reads bytes 16l..16l+15.
                                off = w_base + (n16 * k64 + k0) * 1024 + fx.Int64(lane * CHUNK)
                            else:
                                n = n16 * 16 + fx.Int64(lane_row)
                                off = w_base + n * k_dim + k0 * 64 + fx.Int64(lane_k * CHUNK)
                            per_c.append(
                                fx.ptr_load(
                                    wq_p + off, result_type=fx.Vector.make_type(16, fx.Uint8)
                                )
                            )
                        per_n.append(per_c)
                    regs.append(per_n)
                return regs

            def load_ws(step):
                """The w scale of each scale block of K step ``step`` for this wave's columns."""
                return [
                    fx.ptr_load(ws_p + (ws_base + (step * k_sub + s) * n_scales))
                    for s in range_constexpr(k_sub)
                ]

            def block_product(a, b):
                """One 16x16 tile over one 128-wide K block: unscaled FP32 partial sums."""
                zero = fx.Vector.filled(4, 0.0, fx.Float32)
                if const_expr(arch == "gfx950"):
                    a32 = [a[0].bitcast(fx.Int32), a[1].bitcast(fx.Int32)]
                    b32 = [b[0].bitcast(fx.Int32), b[1].bitcast(fx.Int32)]
                    a8 = fx.Vector.from_elements(
                        [a32[c][e] for c in range(2) for e in range(4)], dtype=fx.Int32
                    )
                    b8 = fx.Vector.from_elements(
                        [b32[c][e] for c in range(2) for e in range(4)], dtype=fx.Int32
                    )
                    return fx.Vector(
                        rocdl.mfma_scale_f32_16x16x128_f8f6f4(
                            T.f32x4, [a8, b8, zero, 0, 0, 0, E8M0_ONE, 0, E8M0_ONE]
                        )
                    )
                part = zero
                for c in range_constexpr(2):
                    a64 = a[c].bitcast(fx.Int64)
                    b64 = b[c].bitcast(fx.Int64)
                    for h in range_constexpr(2):
                        part = rocdl.mfma_f32_16x16x32_fp8_fp8(
                            T.f32x4, [a64[h], b64[h], part, 0, 0, 0]
                        )
                return fx.Vector(part)

            # Prologue: step 0 into stage 0.
            pieces, scales = load_a(fx.Int64(0))
            store_a(0, pieces, scales)
            b_cur = load_b(fx.Int64(0))
            ws_cur = load_ws(fx.Int64(0))
            gpu.barrier()

            acc = [
                [fx.Vector.filled(4, 0.0, fx.Float32) for _ in range(n_sub)] for _ in range(m_sub)
            ]
            for step in range(k_steps):
                stage = step % 2
                # Prefetch the next step (the last step re-reads itself: cheaper than a branch).
                nxt = fx.Int64(fx.min(step + 1, k_steps - 1))
                pieces, scales = load_a(nxt)
                b_next = load_b(nxt)
                ws_next = load_ws(nxt)

                for s in range_constexpr(k_sub):
                    for i in range_constexpr(m_sub):
                        row = i * 16 + lane_row
                        a = []
                        for c in range_constexpr(2):
                            slot = (s * 8 + c * 4 + lane_k) ^ (row % 8)
                            a.append(
                                fx.ptr_load(
                                    lds_a + fx.Int64(stage * a_stage + row * bk + slot * CHUNK),
                                    result_type=fx.Vector.make_type(16, fx.Uint8),
                                )
                            )
                        xs4 = fx.ptr_load(
                            lds_xs + fx.Int64(stage * xs_stage + s * bm + i * 16 + lane_k * 4),
                            result_type=fx.Vector.make_type(4, fx.Float32),
                        )
                        scale4 = xs4 * ws_cur[s]
                        for j in range_constexpr(n_sub):
                            acc[i][j] = acc[i][j] + block_product(a, b_cur[s][j]) * scale4

                store_a(1 - stage, pieces, scales)
                gpu.barrier()
                b_cur = b_next
                ws_cur = ws_next

            # Epilogue: each lane holds rows 4*lane_k + r of its tiles, column lane_row.
            for i in range_constexpr(m_sub):
                for j in range_constexpr(n_sub):
                    vals = acc[i][j].to(fx.BFloat16)
                    col = fx.Int64(col0 + j * 16 + lane_row)
                    for r in range_constexpr(4):
                        row = row0 + fx.Int64(i * 16 + lane_k * 4 + r)
                        if row < row_end:
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

    return launch_grouped_fp8_gemm
