"""The FlyDSL kernel's own source, run on the CPU, computes SPEC 1.

No AMD GPU runs here. ``moegemm.kernels.testing_flydsl`` executes ``kernels/_flydsl_gemm.py``
itself with stand-ins for FlyDSL's names, a workgroup's 256 threads at once, the
MFMAs modelled by their register layout (see that module for what it models and
what it does not). So the addresses, swizzles, scale reads and operands checked
here are the kernel's, not a second copy of them: the kernel with ``x_scale``
read in the wrong layout (the bug MSLK's first FlyDSL kernel shipped with G > 1
and K > 128) fails these tests.

The int64 addressing of launches too large to run here is checked through the
kernel's index functions (``moegemm.kernels._flydsl_index``) at the end.
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
    a_piece,
    acc_row,
    b_offset_plain,
    b_offset_preshuffled,
    lane_coords,
    owner_step,
    w_scale_offset,
)
from moegemm.kernels._flydsl_tiles import (
    AUTOTUNE_TILES,
    DEFAULT_TILES,
    FP8_DTYPE,
    fit_tile,
)
from moegemm.kernels.testing import SPEC_TOLERANCE, random_m_sizes, random_problem, rel_error
from moegemm.kernels.testing_flydsl import emulated_module, kernel_source, run


def _select(cond, a, b):
    return a if cond else b


def _emulate(arch, layout, tile, problem, m_sizes=None, weights=None, module=None,
             out_dtype=torch.bfloat16):
    """The kernel of (arch, layout, tile) on ``problem``, emulated: ``(out, writes)``.
    ``weights``: the bytes handed over as ``wq`` (default: ``problem.wq`` in ``layout``)."""
    module = module or emulated_module()
    _, n, k = problem.wq.shape
    if weights is None:
        weights = preshuffle(problem.wq) if layout == "preshuffled" else problem.wq
    shape = module.KernelShape(arch, layout, fit_tile(tile, n, k), n, k,
                               "f32" if out_dtype == torch.float32 else "bf16")
    out = torch.full((problem.xq.shape[0], n), float("nan"), dtype=out_dtype)
    sizes = problem.m_sizes if m_sizes is None else m_sizes
    writes = run(shape, problem.xq, weights, problem.x_scale, problem.w_scale, sizes, out,
                 module=module)
    return out, writes


# Both layouts for the default tiles; the server's layout for the other candidates.
MODEL_CASES = sorted(
    {(tile, layout) for tile in DEFAULT_TILES.values() for layout in ("plain", "preshuffled")}
    | {(tile, "preshuffled") for tile in AUTOTUNE_TILES},
    key=str,
)


def _arch_of(tile):
    return "gfx950" if tile.lds_bytes > 64 * 1024 else "gfx942"


@pytest.mark.parametrize(("tile", "layout"), MODEL_CASES, ids=lambda v: str(v))
def test_emulated_kernel_meets_the_spec(tile, layout):
    arch = _arch_of(tile)
    m = 33 + int(torch.randint(0, 80, (1,)))  # ragged tails in every tile size
    # Two K steps or more (the LDS stages alternate), two N tiles or more, K > 128.
    n, k = 2 * tile.block_n, 2 * tile.block_k
    problem = random_problem(m, n, k, 5, fp8_dtype=FP8_DTYPE[arch])
    out, writes = _emulate(arch, layout, tile, problem)
    assert torch.equal(writes, torch.ones_like(writes)), "every output element is written once"
    assert rel_error(out, reference_float64(*problem.args())) <= SPEC_TOLERANCE


@pytest.mark.parametrize("arch", sorted(DEFAULT_TILES))
def test_emulated_kernel_on_many_groups_and_long_k(arch):
    """G = 37 with empty groups, K = 1024: the scales of every group and K block."""
    sizes = random_m_sizes(37, 301, empty_groups=True)
    problem = random_problem(301, 256, 1024, 37, m_sizes=sizes, fp8_dtype=FP8_DTYPE[arch])
    out, writes = _emulate(arch, "preshuffled", DEFAULT_TILES[arch], problem)
    assert torch.equal(writes, torch.ones_like(writes))
    assert rel_error(out, reference_float64(*problem.args())) <= SPEC_TOLERANCE


@pytest.mark.parametrize("arch", sorted(DEFAULT_TILES))
def test_the_float32_epilogue_stores_the_sums_the_bf16_one_rounds(arch):
    """The expert FFN's h is float32 (server/_ffn.py): the f32 epilogue stores the
    accumulators unrounded, and their bf16 rounding is the bf16 epilogue's bits."""
    problem = random_problem(83, 256, 512, 4, fp8_dtype=FP8_DTYPE[arch])
    tile = DEFAULT_TILES[arch]
    f32, writes = _emulate(arch, "preshuffled", tile, problem, out_dtype=torch.float32)
    bf16, _ = _emulate(arch, "preshuffled", tile, problem)
    assert f32.dtype == torch.float32 and torch.equal(writes, torch.ones_like(writes))
    assert torch.equal(f32.to(torch.bfloat16), bf16)
    ref = reference_float64(*problem.args())
    assert rel_error(f32, ref) < 1e-5  # the bf16 output's rounding (about 1e-3) is gone


def test_emulation_with_m_tile_past_every_group_and_empty_groups():
    """Zero-row groups at both ends and in the middle; a single row overall."""
    sizes = torch.tensor([0, 1, 0, 0], dtype=torch.int64)
    problem = random_problem(1, 256, 256, 4, m_sizes=sizes)
    out, writes = _emulate("gfx950", "preshuffled", DEFAULT_TILES["gfx950"], problem)
    assert int(writes.sum()) == 256 and int(writes.max()) == 1
    assert rel_error(out, reference_float64(*problem.args())) <= SPEC_TOLERANCE


def test_emulation_catches_the_wrong_weight_layout():
    """Plain weights read as preshuffled miss the tolerance by far."""
    problem = random_problem(70, 256, 256, 3, m_sizes=random_m_sizes(3, 70, empty_groups=False),
                             fp8_dtype=FP8_DTYPE["gfx942"])
    out, _ = _emulate("gfx942", "preshuffled", DEFAULT_TILES["gfx942"], problem,
                      weights=problem.wq)
    assert rel_error(out, reference_float64(*problem.args())) > 0.5


@pytest.mark.parametrize("arch", sorted(DEFAULT_TILES))
def test_emulation_catches_x_scales_read_in_the_wrong_layout(arch):
    """The kernel's source with x_scale read as ``[K/128, M]`` (MSLK's shipped bug: right
    only for G = 1 or K = 128) fails: what runs here is the kernel's own addressing."""
    right = "off = x_scale_global_offset(grow, k_scales, step, k_sub, fx.Int64(sub))"
    wrong = "off = (step * k_sub + fx.Int64(sub)) * m64 + grow"
    source = kernel_source()
    assert source.count(right) == 1, "the kernel's x-scale read moved: update this test"
    module = emulated_module(source.replace(right, wrong))
    problem = random_problem(90, 256, 512, 3, m_sizes=random_m_sizes(3, 90, empty_groups=False),
                             fp8_dtype=FP8_DTYPE[arch])
    out, _ = _emulate(arch, "preshuffled", DEFAULT_TILES[arch], problem, module=module)
    assert rel_error(out, reference_float64(*problem.args())) > 0.1


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
def test_emulation_never_writes_past_m(sizes, effective):
    """Sizes the server would refuse still keep every store inside ``out`` ``[M, N]``.

    The emulated ``out`` is exactly ``[M, N]``: a store to a row past M raises
    IndexError. What is stored equals SPEC 1 for the clamped sizes.
    """
    m = 70
    for arch, layout in (("gfx942", "plain"), ("gfx950", "preshuffled")):
        problem = random_problem(m, 256, 256, 3, m_sizes=torch.tensor(effective),
                                 fp8_dtype=FP8_DTYPE[arch])
        out, writes = _emulate(arch, layout, DEFAULT_TILES[arch], problem,
                               m_sizes=torch.tensor(sizes, dtype=torch.int64))
        assert torch.equal(writes, torch.ones_like(writes))
        assert rel_error(out, reference_float64(*problem.args())) <= SPEC_TOLERANCE


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
