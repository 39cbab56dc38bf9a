"""The FlyDSL kernel's data movement, replayed on the CPU, computes SPEC 1.

No AMD GPU runs here, so the kernel's numbers are checked through a model: this
file replays the kernel block by block and lane by lane with the very index
functions the kernel is traced from (``moegemm.kernels._flydsl_index``): the
group-ownership walk over ``m_sizes`` (each size clamped to ``[0, M]``), the
clamped A loads, the swizzled LDS staging in two stages (x scales pre-multiplied
by the w scale when the block is at most 128 columns wide), the B reads in both
weight layouts, the w/x scale lookups, the K loop whose last step prefetches
nothing, and the epilogue masked by the group's end and by M. The MFMA is modelled by its register layout:
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
    scales_prescaled,
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
            rows = min(max(rows, 0), kernel.m)  # the kernel's clamp, before the sum
            state = owner_step(state, g, rows, tile_m, kernel.bm, _select)
        _, _, self.group, self.row0, row_end = state
        self.row_stop = min(row_end, kernel.m)
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
            xs = k.x_scale[x_scale_global_offset(grow, k.k_scales, step, k.k_sub, sub)]
            if k.prescaled:  # the block's one w scale per 128-block, folded in as it is staged
                col = self.tile_n * k.bn
                xs = (
                    xs
                    * k.w_scale[
                        w_scale_offset(
                            self.group, k.k_scales, k.n_scales, col, step * k.k_sub + sub
                        )
                    ]
                )
            scales.append(xs)
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
            last = step == k.k_steps - 1
            if not last:  # the last step prefetches nothing
                pieces, scales = self.load_a(step + 1)
                b_next = [self.load_b(step + 1, w) for w in range(WAVES)]
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
                        scale4 = xs4 if k.prescaled else xs4 * ws[sub]
                        for j in range(k.n_sub):
                            acc[w, i, j] += _mfma(k.decode(a), k.decode(b_regs[sub][j])) * scale4
            if not last:
                self.store_a(1 - stage, pieces, scales)
                b_cur = b_next
        for w in range(WAVES):
            col0 = self.tile_n * k.bn + w * k.wave_n
            for i in range(k.m_sub):
                for j in range(k.n_sub):
                    col = col0 + j * 16 + lane_row
                    for r in range(4):
                        row = self.row0 + acc_row(i, lane_k, r)
                        keep = row < self.row_stop
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
        self.prescaled = scales_prescaled(self.bn)
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


# ----------------------------------------------------------------------------- bounds


@pytest.mark.parametrize(
    ("sizes", "effective"),
    [
        ([70, 70, 5], [70, 0, 0]),  # the sum is past M: groups 1 and 2 own rows past M
        ([-5, 2**62, 3], [0, 70, 0]),  # negative and huge sizes: clamped to [0, M] first
        ([30, 2**63 - 1, 2**63 - 1], [30, 40, 0]),  # an int64 sum that would wrap
    ],
    ids=["sum-past-m", "negative-and-huge", "wrapping-sum"],
)
def test_replay_never_writes_past_m(sizes, effective):
    """Sizes the server would refuse still keep every store inside ``out`` ``[M, N]``.

    The replay's ``out`` is exactly ``[M, N]``: a store to a row past M would
    raise IndexError. What is stored equals SPEC 1 for the clamped sizes.
    """
    m = 70
    problem = random_problem(m, 256, 256, 3, m_sizes=torch.tensor(effective))
    args = list(problem.args())
    for arch, layout in (("gfx942", "plain"), ("gfx950", "preshuffled")):
        wq = preshuffle(problem.wq) if layout == "preshuffled" else problem.wq
        replay = _Replay(
            layout, DEFAULT_TILES[arch], problem.xq, wq, problem.x_scale, problem.w_scale, sizes
        )
        out, writes = replay.run()
        assert torch.equal(writes, torch.ones_like(writes))
        assert rel_error(out.to(torch.bfloat16), reference_float64(*args)) <= SPEC_TOLERANCE


# ----------------------------------------------------------------------------- int64 addressing

_INT32_MAX = 2**31 - 1

# (G, N, K, M): a DeepSeek-V3 layer (7.5e9 weight bytes), and M * N past 2^31.
LARGE_LAUNCHES = {"dsv3": (256, 4096, 7168, 32768), "mn": (8, 4096, 512, 2**19 + 128)}


def _strided(shape, *index):
    """The element offset of ``index`` in a contiguous tensor of ``shape`` (torch's own strides)."""
    strides = torch.empty(shape, device="meta").stride()
    return sum(i * s for i, s in zip(index, strides, strict=True))


@pytest.mark.parametrize("launch", sorted(LARGE_LAUNCHES))
@pytest.mark.parametrize("arch", sorted(DEFAULT_TILES))
def test_addressing_past_2_31_lands_on_the_natural_element(launch, arch):
    """The last workgroup of a large launch, every lane of every wave, through the kernel's index functions.

    Each offset (int64 tensors, as the kernel computes in Int64) is compared
    with the element's offset from torch's strides of the natural tensor (and,
    preshuffled, of SPEC 1.3's tile order); the largest pass 2^31 and none
    passes the end of its tensor.
    """
    g_count, n, k, m = LARGE_LAUNCHES[launch]
    tile = fit_tile(DEFAULT_TILES[arch], n, k)
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    sizes = [m // g_count] * g_count
    sizes[-1] += m - sum(sizes)
    tiles_m = -(-m // bm) + g_count - 1
    # The last workgroup that owns rows: walk every tile index from the end.
    for tile_m in range(tiles_m - 1, -1, -1):
        state = (0, 0, -1, 0, 0)
        for g, rows in enumerate(sizes):
            state = owner_step(state, g, min(max(rows, 0), m), tile_m, bm, _select)
        _, _, group, row0, row_end = state
        if group >= 0:
            break
    assert group == g_count - 1 and row_end == m
    tile_n, step = n // bn - 1, k // bk - 1
    lane_row, lane_k = lane_coords(torch.arange(WAVE_SIZE, dtype=torch.int64))
    k_sub, n_sub = bk // SCALE_BLOCK, bn // WAVES // 16
    tid = torch.arange(THREADS, dtype=torch.int64)
    seen = {"wq": [], "out": [], "xq": []}

    # A: the clamped global rows of each 16-byte piece.
    for p in range(bm * bk // (CHUNK * THREADS)):
        row, chunk = a_piece(p * THREADS + tid, bk // CHUNK)
        grow = torch.clamp(row0 + row, max=m - 1)
        got = a_global_offset(grow, k, step, bk, chunk)
        assert torch.equal(got, _strided((m, k), grow, step * bk + chunk * CHUNK))
        seen["xq"].append(got)
    for w in range(WAVES):
        col0 = tile_n * bn + w * (bn // WAVES)
        for sub in range(k_sub):
            ws = w_scale_offset(group, k // SCALE_BLOCK, n // SCALE_BLOCK, col0, step * k_sub + sub)
            assert ws == _strided(
                (g_count, k // SCALE_BLOCK, n // SCALE_BLOCK),
                group,
                step * k_sub + sub,
                col0 // SCALE_BLOCK,
            )
            for j in range(n_sub):
                col = col0 + j * 16 + lane_row
                for half in range(2):
                    k64 = step * (bk // 64) + sub * 2 + half
                    kk = k64 * 64 + lane_k * CHUNK
                    base = group * n * k
                    plain = b_offset_plain(base, (col0 + j * 16) // 16, k64, lane_row, lane_k, k)
                    assert torch.equal(plain, _strided((g_count, n, k), group, col, kk))
                    shuffled = b_offset_preshuffled(
                        base, (col0 + j * 16) // 16, k64, lane_row, lane_k, k
                    )
                    # SPEC 1.3: [G, N/16, K/64, KLane 4, NLane 16, KPack 16].
                    spec = _strided(
                        (g_count, n // 16, k // 64, 4, 16, 16),
                        group,
                        col // 16,
                        kk // 64,
                        (kk % 64) // 16,
                        col % 16,
                        kk % 16,
                    )
                    assert torch.equal(shuffled, spec)
                    seen["wq"] += [plain, shuffled]
        for i in range(bm // 16):
            for r in range(4):
                row = row0 + acc_row(i, lane_k, r)
                col = col0 + lane_row
                keep = row < min(row_end, m)
                got = row * n + col
                assert torch.equal(got[keep], _strided((m, n), row[keep], col[keep]))
                seen["out"].append(got[keep])
    numel = {"wq": g_count * n * k, "out": m * n, "xq": m * k}
    for what, offsets in seen.items():
        top = int(torch.cat(offsets).max())
        width = CHUNK if what != "out" else 1
        assert top + width <= numel[what], what
    # Where the launch is large, the offsets are: past int32, exactly as computed.
    assert int(torch.cat(seen["wq"]).max()) > _INT32_MAX or g_count * n * k <= _INT32_MAX
    assert int(torch.cat(seen["out"]).max()) > _INT32_MAX or m * n <= _INT32_MAX
    assert (g_count * n * k > _INT32_MAX) or (m * n > _INT32_MAX)


def test_spec_preshuffle_order_is_the_layout_modules():
    """The tile order the large-offset check assumes is :func:`preshuffle`'s, on a small tensor."""
    g, n, k = 2, 32, 128
    w = torch.arange(g * n * k, dtype=torch.int64).reshape(g, n, k)
    shuffled = preshuffle(w).reshape(-1)
    gg, nn, kk = torch.meshgrid(torch.arange(g), torch.arange(n), torch.arange(k), indexing="ij")
    spec = _strided(
        (g, n // 16, k // 64, 4, 16, 16), gg, nn // 16, kk // 64, (kk % 64) // 16, nn % 16, kk % 16
    )
    assert torch.equal(shuffled[spec.reshape(-1)], w.reshape(-1))
