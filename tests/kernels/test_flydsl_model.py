"""The FlyDSL kernel's data movement, replayed on the CPU, computes SPEC 1.

No AMD GPU runs here, so the kernel's numbers are checked through a model: this
file replays the kernel block by block and lane by lane with the very index
functions the kernel is traced from (``moegemm.kernels._flydsl_index``): the
group-ownership walk over ``m_sizes``, the clamped A loads, the swizzled LDS
staging in two stages, the B reads in both weight layouts, the w/x scale
lookups and the masked epilogue. The MFMA is modelled by its register layout:
lane ``l`` feeds row/column ``l % 16`` of A/B and receives rows
``4 (l // 16) + [0, 4)`` of column ``l % 16`` of C, and A and B bytes at the same
(lane group, byte) position meet in one product.

What this does not cover: FlyDSL's lowering and the hardware (see
test_flydsl_isa.py for what compiles), loop-carried values, and barriers.
"""

from __future__ import annotations

import pytest
import torch
from moegemm.kernels import preshuffle, reference_float64
from moegemm.kernels._flydsl_index import (
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
    w_scale_offset,
    x_scale_global_offset,
    x_scale_lds_offset,
    x_scale_piece,
)
from moegemm.kernels._flydsl_tiles import (
    AUTOTUNE_TILES,
    DEFAULT_TILES,
    FP8_DTYPE,
    FlyTile,
    fit_tile,
)
from moegemm.kernels.testing import SPEC_TOLERANCE, random_m_sizes, random_problem, rel_error

_BYTE = torch.arange(CHUNK)


def _select(cond, a, b):
    return a if cond else b


def _gather16(flat: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The 16 bytes at each offset: ``[len(offsets), 16]``."""
    return flat[offsets.unsqueeze(1) + _BYTE]


class _Block:
    """One workgroup of the kernel, replayed: LDS, registers, accumulators."""

    def __init__(self, kernel: _Replay, tile_m: int, tile_n: int):
        self.kernel = kernel
        state = (0, 0, -1, 0, 0)
        for g, rows in enumerate(kernel.sizes):
            state = owner_step(state, g, rows, tile_m, kernel.bm, _select)
        _, _, self.group, self.row0, self.row_end = state
        self.tile_n = tile_n
        k = kernel
        # LDS starts as garbage: a read of a byte nobody wrote shows up as noise.
        self.lds_a = torch.randint(0, 256, (2 * k.a_stage,), dtype=torch.uint8)
        self.lds_xs = torch.full((2 * k.xs_stage,), float("nan"), dtype=torch.float64)

    def load_a(self, step: int):
        k, tid = self.kernel, torch.arange(THREADS)
        pieces, scales = [], []
        for p in range(k.a_passes):
            row, chunk = a_piece(p * THREADS + tid, k.chunks_per_row)
            grow = torch.clamp(self.row0 + row, max=k.m - 1)
            pieces.append(_gather16(k.xq, a_global_offset(grow, k.k, step, k.bk, chunk)))
        for p in range(k.xs_passes):
            row, sub = x_scale_piece(torch.clamp(p * THREADS + tid, max=k.xs_count - 1), k.bm)
            grow = torch.clamp(self.row0 + row, max=k.m - 1)
            scales.append(k.x_scale[x_scale_global_offset(grow, k.k_scales, step, k.k_sub, sub)])
        return pieces, scales

    def store_a(self, stage: int, pieces, scales) -> None:
        k, tid = self.kernel, torch.arange(THREADS)
        written = []
        for p in range(k.a_passes):
            row, chunk = a_piece(p * THREADS + tid, k.chunks_per_row)
            off = a_lds_offset(stage, k.a_stage, row, k.bk, chunk)
            self.lds_a[off.unsqueeze(1) + _BYTE] = pieces[p]
            written.append(off)
        # The swizzle must be a permutation of the stage's 16-byte slots.
        written = torch.cat(written)
        assert torch.equal(
            written.sort().values, stage * k.a_stage + torch.arange(0, k.a_stage, CHUNK)
        )
        for p in range(k.xs_passes):
            row, sub = x_scale_piece(torch.clamp(p * THREADS + tid, max=k.xs_count - 1), k.bm)
            self.lds_xs[x_scale_lds_offset(stage, k.xs_stage, sub, k.bm, row)] = scales[p]

    def load_b(self, step: int, wave: int):
        k = self.kernel
        lane_row, lane_k = lane_coords(torch.arange(WAVE_SIZE))
        col0 = self.tile_n * k.bn + wave * k.wave_n
        regs = []
        for sub in range(k.k_sub):
            per_n = []
            for j in range(k.n_sub):
                halves = []
                for half in range(2):
                    k64 = step * (k.bk // 64) + sub * 2 + half
                    off = k.b_offset(
                        self.group * k.n * k.k, (col0 + j * 16) // 16, k64, lane_row, lane_k, k.k
                    )
                    halves.append(_gather16(k.wq, off))
                per_n.append(torch.cat(halves, dim=1))
            regs.append(per_n)
        ws = [
            k.w_scale[
                w_scale_offset(self.group, k.k_scales, k.n_scales, col0, step * k.k_sub + sub)
            ]
            for sub in range(k.k_sub)
        ]
        return regs, ws

    def run(self, out: torch.Tensor, writes: torch.Tensor) -> None:
        k = self.kernel
        lane_row, lane_k = lane_coords(torch.arange(WAVE_SIZE))
        self.store_a(0, *self.load_a(0))
        b_cur = [self.load_b(0, w) for w in range(WAVES)]
        acc = torch.zeros(WAVES, k.m_sub, k.n_sub, WAVE_SIZE, 4, dtype=torch.float64)
        for step in range(k.k_steps):
            stage = step % 2
            nxt = min(step + 1, k.k_steps - 1)
            pieces, scales = self.load_a(nxt)
            b_next = [self.load_b(nxt, w) for w in range(WAVES)]
            for w in range(WAVES):
                b_regs, ws = b_cur[w]
                for sub in range(k.k_sub):
                    for i in range(k.m_sub):
                        row = i * 16 + lane_row
                        a = torch.cat(
                            [
                                _gather16(
                                    self.lds_a,
                                    a_lds_offset(
                                        stage, k.a_stage, row, k.bk, a_operand_chunk(sub, h, lane_k)
                                    ),
                                )
                                for h in range(2)
                            ],
                            dim=1,
                        )
                        xs_off = x_scale_lds_offset(
                            stage, k.xs_stage, sub, k.bm, acc_row(i, lane_k, 0)
                        )
                        xs4 = self.lds_xs[xs_off.unsqueeze(1) + torch.arange(4)]
                        for j in range(k.n_sub):
                            acc[w, i, j] += _mfma(k.decode(a), k.decode(b_regs[sub][j])) * (
                                xs4 * ws[sub]
                            )
            self.store_a(1 - stage, pieces, scales)
            b_cur = b_next
        for w in range(WAVES):
            col0 = self.tile_n * k.bn + w * k.wave_n
            for i in range(k.m_sub):
                for j in range(k.n_sub):
                    col = col0 + j * 16 + lane_row
                    for r in range(4):
                        row = self.row0 + acc_row(i, lane_k, r)
                        keep = row < self.row_end
                        out[row[keep], col[keep]] = acc[w, i, j, keep, r]
                        writes[row[keep], col[keep]] += 1


def _mfma(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A 16x16 MFMA on per-lane operands ``[64, bytes]``: each lane's 4 accumulator values.

    Lane ``16 q + r`` holds row r of A (column r of B) for lane group q; the
    product pairs A and B values at the same (q, byte). Lane ``16 q + c`` gets
    C rows ``4 q + [0, 4)`` of column c.
    """
    a = a.reshape(4, 16, -1)  # [q, row, byte]
    b = b.reshape(4, 16, -1)  # [q, col, byte]
    c = torch.einsum("qre,qce->rc", a, b)  # [row, col]
    q, col = torch.arange(WAVE_SIZE) // 16, torch.arange(WAVE_SIZE) % 16
    rows = (q * 4).unsqueeze(1) + torch.arange(4)
    return c[rows, col.unsqueeze(1)]


class _Replay:
    """The kernel's compile-time constants for one (tile, N, K), and its inputs as flat arrays."""

    def __init__(self, layout, tile: FlyTile, xq, wq_dev, x_scale, w_scale, m_sizes):
        self.m, self.k = xq.shape
        g, self.n, _ = wq_dev.shape
        tile = fit_tile(tile, self.n, self.k)
        self.bm, self.bn, self.bk = tile.block_m, tile.block_n, tile.block_k
        self.wave_n = self.bn // WAVES
        self.n_sub, self.m_sub = self.wave_n // 16, self.bm // 16
        self.k_sub, self.k_steps = self.bk // SCALE_BLOCK, self.k // self.bk
        self.k_scales, self.n_scales = self.k // SCALE_BLOCK, self.n // SCALE_BLOCK
        self.chunks_per_row = self.bk // CHUNK
        self.a_passes = self.bm * self.bk // (CHUNK * THREADS)
        self.xs_count = self.bm * self.k_sub
        self.xs_passes = -(-self.xs_count // THREADS)
        self.a_stage, self.xs_stage = self.bm * self.bk, self.xs_count
        self.b_offset = b_offset_preshuffled if layout == "preshuffled" else b_offset_plain
        self.sizes = [int(s) for s in m_sizes]
        self.grid = (-(-self.m // self.bm) + g - 1, self.n // self.bn)
        self.xq = xq.view(torch.uint8).reshape(-1)
        self.wq = wq_dev.view(torch.uint8).reshape(-1)
        self.x_scale = x_scale.double().reshape(-1)
        self.w_scale = w_scale.double().reshape(-1)
        table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(xq.dtype)
        self._values = table.double()

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        return self._values[raw.long()]

    def run(self):
        out = torch.full((self.m, self.n), float("nan"), dtype=torch.float64)
        writes = torch.zeros((self.m, self.n), dtype=torch.int64)
        for tile_m in range(self.grid[0]):
            for tile_n in range(self.grid[1]):
                block = _Block(self, tile_m, tile_n)
                if block.group >= 0:
                    block.run(out, writes)
        return out, writes


def _replay(arch, layout, tile, problem):
    wq = preshuffle(problem.wq) if layout == "preshuffled" else problem.wq
    return _Replay(
        layout, tile, problem.xq, wq, problem.x_scale, problem.w_scale, problem.m_sizes
    ).run()


# Both layouts for the default tiles; the server's layout for the other candidates.
MODEL_CASES = sorted(
    {(tile, layout) for tile in DEFAULT_TILES.values() for layout in ("plain", "preshuffled")}
    | {(tile, "preshuffled") for tile in AUTOTUNE_TILES},
    key=str,
)


@pytest.mark.parametrize(("tile", "layout"), MODEL_CASES, ids=lambda v: str(v))
def test_replayed_kernel_meets_the_spec(tile, layout):
    arch = "gfx950" if tile.lds_bytes > 64 * 1024 else "gfx942"
    m = 33 + int(torch.randint(0, 80, (1,)))  # ragged tails in every tile size
    # Two K steps or more (the LDS stages alternate), two N tiles or more.
    n, k = 2 * tile.block_n, 2 * tile.block_k
    problem = random_problem(m, n, k, 5, fp8_dtype=FP8_DTYPE[arch])
    out, writes = _replay(arch, layout, tile, problem)
    assert torch.equal(writes, torch.ones_like(writes)), (
        "every output element is written exactly once"
    )
    ref = reference_float64(*problem.args())
    assert rel_error(out.to(torch.bfloat16), ref) <= SPEC_TOLERANCE


def test_replay_with_m_tile_past_every_group_and_empty_groups():
    """Zero-row groups at both ends and in the middle; a single row overall."""
    sizes = torch.tensor([0, 1, 0, 0], dtype=torch.int64)
    problem = random_problem(1, 256, 256, 4, m_sizes=sizes)
    out, writes = _replay("gfx950", "preshuffled", DEFAULT_TILES["gfx950"], problem)
    assert int(writes.sum()) == 256 and int(writes.max()) == 1
    assert rel_error(out.to(torch.bfloat16), reference_float64(*problem.args())) <= SPEC_TOLERANCE


def test_replay_catches_the_wrong_weight_layout():
    """The model is sharp: plain weights read as preshuffled miss the tolerance by far."""
    problem = random_problem(70, 256, 256, 3, m_sizes=random_m_sizes(3, 70, empty_groups=False))
    wrong = _Replay(
        "preshuffled",
        DEFAULT_TILES["gfx942"],
        problem.xq,
        problem.wq,
        problem.x_scale,
        problem.w_scale,
        problem.m_sizes,
    )
    out, _ = wrong.run()
    assert rel_error(out.to(torch.bfloat16), reference_float64(*problem.args())) > 0.5
