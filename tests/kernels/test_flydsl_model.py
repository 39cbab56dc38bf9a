"""The FlyDSL kernel's own source, run on the CPU, computes SPEC 1.

No AMD GPU runs here. ``moegemm.kernels.testing_flydsl`` executes ``kernels/_flydsl_gemm.py``
itself with stand-ins for FlyDSL's names, a workgroup's 256 threads at once, the
MFMAs modelled by their register layout (see that module for what it models and
what it does not). So the addresses, swizzles, scale reads and operands checked
here are the kernel's, not a second copy of them: the kernel with ``x_scale``
read in the wrong layout (the bug MSLK's first FlyDSL kernel shipped with G > 1
and K > 128) fails these tests.

Launches too large to hold (a DeepSeek-V3 layer, M * N past 2^31) run their last
workgroup on operands that record offsets instead of holding data, the kernel's
int32 values (indices, M, G, loop counters) as int32: an offset narrowed to int32
wraps there as on the device, and the test of it fails.
"""

from __future__ import annotations

import pytest
import torch
from moegemm.kernels import preshuffle, reference_float64
from moegemm.kernels._flydsl_index import owner_step
from moegemm.kernels._flydsl_tiles import (
    AUTOTUNE_TILES,
    DEFAULT_TILES,
    FP8_DTYPE,
    LDS_BUDGET,
    fit_tile,
)
from moegemm.kernels.testing import SPEC_TOLERANCE, random_m_sizes, random_problem, rel_error
from moegemm.kernels.testing_flydsl import Recording, emulated_module, kernel_source, run
from moegemm.kernels.testing_flydsl import launch as launch_emulated


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


# Each arch's default tile in both layouts; every other candidate in the server's layout, on
# each arch whose LDS budget takes it.
MODEL_CASES = [(arch, DEFAULT_TILES[arch], layout) for arch in sorted(DEFAULT_TILES)
               for layout in ("plain", "preshuffled")] + [
    (arch, tile, "preshuffled") for arch in sorted(DEFAULT_TILES) for tile in AUTOTUNE_TILES
    if tile != DEFAULT_TILES[arch] and tile.lds_bytes <= LDS_BUDGET[arch]]


@pytest.mark.parametrize(("arch", "tile", "layout"), MODEL_CASES, ids=lambda v: str(v))
def test_emulated_kernel_meets_the_spec(arch, tile, layout):
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
    """The expert FFN's h is float32 (server/_ffn_graphs.H_DTYPE): the f32 epilogue stores the
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


def _last_workgroup(launch, arch, module=None):
    """The last workgroup of a large launch that owns rows, emulated on operands that hold
    nothing (``Recording``): ``(its group, its rows [row0, row_end), the operands)``."""
    g_count, n, k, m = LARGE_LAUNCHES[launch]
    tile = fit_tile(DEFAULT_TILES[arch], n, k)
    sizes = [m // g_count] * g_count
    sizes[-1] += m - sum(sizes)
    tiles_m = -(-m // tile.block_m) + g_count - 1
    for tile_m in range(tiles_m - 1, -1, -1):  # the last tile index that owns rows
        state = (0, 0, -1, 0, 0)
        for g, rows in enumerate(sizes):
            state = owner_step(state, g, rows, tile_m, tile.block_m, _select)
        _, _, group, row0, row_end = state
        if group >= 0:
            break
    assert group == g_count - 1 and row_end == m
    ops = {"xq": Recording(m * k, torch.uint8), "wq": Recording(g_count * n * k, torch.uint8),
           "x_scale": Recording(m * k // 128, torch.float32),
           "w_scale": Recording(g_count * (k // 128) * (n // 128), torch.float32),
           "out": Recording(m * n, torch.bfloat16)}
    module = module or emulated_module()
    shape = module.KernelShape(arch, "preshuffled", tile, n, k)
    launch_emulated(shape, ops["xq"], ops["wq"], ops["x_scale"], ops["w_scale"],
                    torch.tensor(sizes, dtype=torch.int64), ops["out"], m, g_count,
                    module=module, blocks=[(tile_m, n // tile.block_n - 1)])
    return group, row0, row_end, ops


@pytest.mark.parametrize("launch", sorted(LARGE_LAUNCHES))
@pytest.mark.parametrize("arch", sorted(DEFAULT_TILES))
def test_the_last_workgroup_of_a_large_launch_reads_and_writes_its_own_elements(launch, arch):
    """The kernel's own source, for the last workgroup of a launch too large to hold (its
    operands record offsets instead): every access lies inside what the workgroup owns, by
    torch's strides of the natural tensors, the largest past 2^31, and every value the
    kernel computes in int32 (block and thread indices, M, G, loop counters) is int32 in the
    emulation too, wrapping as it would on the device."""
    g_count, n, k, m = LARGE_LAUNCHES[launch]
    group, row0, row_end, ops = _last_workgroup(launch, arch)
    owned = {  # [first, end) of the elements the workgroup may touch in each operand
        "xq": (_strided((m, k), row0, 0), _strided((m, k), row_end - 1, k - 1) + 1),
        "wq": (_strided((g_count, n, k), group, 0, 0), _strided((g_count, n, k), group + 1, 0, 0)
               if group + 1 < g_count else g_count * n * k),
        "x_scale": (row0 * (k // 128), row_end * (k // 128)),
        "w_scale": (group * (k // 128) * (n // 128), (group + 1) * (k // 128) * (n // 128)),
        "out": (_strided((m, n), row0, 0), _strided((m, n), row_end - 1, n - 1) + 1),
    }
    for name, (first, end) in owned.items():
        spans = ops[name].spans
        assert spans, name
        assert first <= min(a for a, _ in spans) and max(b for _, b in spans) <= end, name
    top = {name: max(b for _, b in ops[name].spans) for name in ("wq", "out")}
    assert top["wq"] > _INT32_MAX or g_count * n * k <= _INT32_MAX
    assert top["out"] > _INT32_MAX or m * n <= _INT32_MAX
    assert (g_count * n * k > _INT32_MAX) or (m * n > _INT32_MAX)


def test_an_int32_group_offset_fails_on_a_large_launch():
    """The emulation has teeth on widths: the weights' group offset narrowed to int32 (right
    for small sets, wrapping on a DeepSeek-V3 layer) fails the large launch."""
    right = "w_base = group * group_bytes"
    source = kernel_source()
    assert source.count(right) == 1, "the kernel's group offset moved: update this test"
    module = emulated_module(source.replace(right, "w_base = fx.Int32(group) * group_bytes"))
    with pytest.raises(AssertionError):
        group, _, _, ops = _last_workgroup("dsv3", "gfx942", module=module)
        first = group * 4096 * 7168
        assert min(a for a, _ in ops["wq"].spans) >= first


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
