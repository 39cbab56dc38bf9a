"""Where the FlyDSL kernel reads and writes: its index arithmetic.

Every function here uses only ``+ - * // % ^`` on its arguments, so the same
code runs on FlyDSL values inside the kernel (``_flydsl_gemm.py``) and on torch
tensors when ``testing_flydsl`` runs the kernel's source on the CPU.
Units: bytes for fp8 data, elements for scales.
"""

from __future__ import annotations

WAVES = 4
WAVE_SIZE = 64
THREADS = WAVES * WAVE_SIZE
CHUNK = 16  # bytes one lane moves per load
SCALE_BLOCK = 128  # the K and N extent of one block scale (SPEC 1)
SWIZZLE = 8  # A rows cycle their 16-byte chunks over 8 slots: 8 rows x 16 B span all LDS banks


def owner_step(state, g, rows, tile_m, block_m, select):
    """One group of the walk over ``m_sizes`` that finds the group owning M tile ``tile_m``.

    ``state`` is ``(rows_before, tiles_before, group, row0, row_end)``, starting
    at ``(0, 0, -1, 0, 0)``; after the last group, ``group`` is the owner (-1 if
    ``tile_m`` is past the last tile) and ``[row0, row_end)`` bounds the tile's
    rows in that group. Group ``g`` has ``rows`` rows, hence ``ceil(rows / block_m)``
    tiles. ``select(cond, a, b)`` is the caller's ``cond ? a : b``.
    """
    rows_before, tiles_before, group, row0, row_end = state
    tiles = (rows + block_m - 1) // block_m
    mine = (tile_m >= tiles_before) & (tile_m < tiles_before + tiles)
    return (
        rows_before + rows,
        tiles_before + tiles,
        select(mine, g, group),
        select(mine, rows_before + (tile_m - tiles_before) * block_m, row0),
        select(mine, rows_before + rows, row_end),
    )


def scales_prescaled(block_n):
    """Whether a block's staged x scales carry the w scale: its columns share one (``block_n <= 128``)."""
    return block_n <= SCALE_BLOCK


def lane_coords(lane):
    """(row of A / column of B that the lane feeds, which 16-byte slice of a 64-wide K chunk)."""
    return lane % 16, lane // 16


def a_piece(c, chunks_per_row):
    """Piece ``c`` of an A tile staged by the block: (row in the tile, 16-byte chunk in the row)."""
    return c // chunks_per_row, c % chunks_per_row


def a_global_offset(row, k_dim, step, block_k, chunk):
    """Byte offset in ``xq`` ``[M, K]`` of a 16-byte piece of K step ``step``."""
    return row * k_dim + step * block_k + chunk * CHUNK


def a_lds_offset(stage, stage_bytes, row, block_k, chunk):
    """Byte offset in LDS of a 16-byte A piece, its chunk XOR-swizzled by the row."""
    return stage * stage_bytes + row * block_k + (chunk ^ (row % SWIZZLE)) * CHUNK


def a_operand_chunk(sub, half, lane_k):
    """The 16-byte chunk (within a K step's row) a lane feeds for 64-wide ``half`` of 128-block ``sub``."""
    return sub * 8 + half * 4 + lane_k


def x_scale_piece(i, block_m):
    """Scale ``i`` of a K step staged by the block: (row in the tile, 128-block within the step)."""
    return i % block_m, i // block_m


def x_scale_global_offset(row, k_scales, step, k_sub, sub):
    """Element offset in ``x_scale`` ``[M, K/128]``."""
    return row * k_scales + step * k_sub + sub


def x_scale_lds_offset(stage, stage_elems, sub, block_m, row):
    """Element offset in LDS of the x scale of tile row ``row`` and 128-block ``sub``."""
    return stage * stage_elems + sub * block_m + row


def w_scale_offset(group, k_scales, n_scales, col, kblock):
    """Element offset in ``w_scale`` ``[G, K/128, N/128]`` for output column ``col``."""
    return group * (k_scales * n_scales) + kblock * n_scales + col // SCALE_BLOCK


def b_offset_plain(group_base, n16, k64, lane_row, lane_k, k_dim):
    """Byte offset of a lane's 16 B operand in plain ``[G, N, K]`` weights.

    Column ``16 n16 + lane_row``, K bytes ``64 k64 + 16 lane_k + [0, 16)``.
    """
    return group_base + (n16 * 16 + lane_row) * k_dim + k64 * 64 + lane_k * CHUNK


def b_offset_preshuffled(group_base, n16, k64, lane_row, lane_k, k_dim):
    """The same operand in the SPEC 1.3 layout: tile (n16, k64) is 1 KiB, lane-major.

    ``(N0, K0, KLane, NLane, KPack)`` puts KLane = lane_k before NLane =
    lane_row, so lane ``16 lane_k + lane_row`` reads bytes ``16 lane .. 16 lane + 15``.
    """
    return group_base + (n16 * (k_dim // 64) + k64) * 1024 + (lane_k * 16 + lane_row) * CHUNK


def acc_row(sub_m, lane_k, r):
    """Tile row of accumulator element ``r`` (0..3) of a lane in 16-row MFMA tile ``sub_m``."""
    return sub_m * 16 + lane_k * 4 + r
