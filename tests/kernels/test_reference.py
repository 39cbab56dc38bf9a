"""The reference backend against the float64 SPEC formula, and the public entry points."""

import dataclasses

import pytest
import torch
from moegemm.kernels import (
    fn_to_fnuz,
    grouped_gemm,
    grouped_gemm_preshuffled,
    preshuffle,
    reference_float64,
    unshuffle,
)
from moegemm.kernels.testing import (
    SPEC_TOLERANCE,
    poisoned_out,
    random_m_sizes,
    random_problem,
    rel_error,
)

SHAPES = [  # (M, N, K, G)
    (0, 128, 256, 3),
    (1, 256, 384, 1),
    (1, 128, 1024, 8),
    (83, 384, 512, 3),
    (83, 1024, 256, 8),
    (1335, 256, 1024, 3),
    (1335, 512, 768, 8),
    (1335, 128, 128, 1),
]


@pytest.mark.parametrize("m, n, k, g", SHAPES)
def test_reference_meets_the_spec_bound(m, n, k, g):
    p = random_problem(m, n, k, g)
    out = grouped_gemm(*p.args(), out=poisoned_out(m, n))
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()  # also: the NaN poison was overwritten everywhere
    if m == 0:
        return
    ref = reference_float64(*p.args())
    assert torch.isfinite(ref).all()
    assert rel_error(out, ref) <= SPEC_TOLERANCE


@pytest.mark.parametrize("m, n, k, g", [(83, 256, 512, 3), (1335, 384, 768, 8)])
def test_wrong_scales_break_the_bound(m, n, k, g):
    """The bound is tight enough that the classic scale mix-ups fail it by far."""
    p = random_problem(m, n, k, g)
    out = grouped_gemm(*p.args())
    assert rel_error(out, reference_float64(*p.args())) <= SPEC_TOLERANCE
    wrong = {
        "K blocks of x_scale reversed": (p.xq, p.wq, p.x_scale.flip(1), p.w_scale, p.m_sizes),
        "another group's w_scale": (p.xq, p.wq, p.x_scale, p.w_scale.roll(1, 0), p.m_sizes),
        "w_scale's K and N blocks swapped": (
            p.xq,
            p.wq,
            p.x_scale,
            p.w_scale.flip(1).flip(2),
            p.m_sizes,
        ),
        "rows shifted to the next group": (
            p.xq,
            p.wq.roll(1, 0),
            p.x_scale,
            p.w_scale.roll(1, 0),
            p.m_sizes,
        ),
    }
    for what, args in wrong.items():
        assert rel_error(out, reference_float64(*args)) > 20 * SPEC_TOLERANCE, what


def test_ragged_groups_land_on_their_own_rows():
    g, n, k = 5, 256, 256
    sizes = torch.tensor([0, 7, 0, 1, 12])
    p = random_problem(int(sizes.sum()), n, k, g, m_sizes=sizes)
    out = grouped_gemm(*p.args())
    start = 0
    for gi, rows in enumerate(sizes.tolist()):
        # Each group alone, as a G=1 problem, must give the same rows bit for bit.
        alone = grouped_gemm(
            p.xq[start : start + rows],
            p.wq[gi : gi + 1].contiguous(),
            p.x_scale[start : start + rows],
            p.w_scale[gi : gi + 1],
            torch.tensor([rows]),
        )
        assert torch.equal(out[start : start + rows], alone)
        start += rows


def test_large_k_at_a_real_shape():
    p = random_problem(300, 1024, 7168, 2)
    out = grouped_gemm(*p.args())
    assert rel_error(out, reference_float64(*p.args())) <= SPEC_TOLERANCE


def test_rows_in_chunks_give_the_bits_of_one_chunk(monkeypatch):
    """Groups larger than a chunk (7 rows here; 146 at K=7168, N=4096), chunk edges inside
    groups: each chunk takes its own rows' scales, and the bits do not depend on the chunk."""
    from moegemm.kernels import reference

    sizes = torch.tensor([23, 0, 5, 40, 1])
    p = random_problem(69, 256, 512, 5, m_sizes=sizes)
    whole = grouped_gemm(*p.args())
    kb, n = 512 // 128, 256
    monkeypatch.setattr(reference, "_CHUNK_ELEMENTS", kb * n * 7)
    chunked = grouped_gemm(*p.args())
    assert torch.equal(chunked, whole)
    assert rel_error(chunked, reference_float64(*p.args())) <= SPEC_TOLERANCE


def test_int32_m_sizes_and_many_groups():
    g = 256
    p = random_problem(600, 128, 256, g)
    out = grouped_gemm(p.xq, p.wq, p.x_scale, p.w_scale, p.m_sizes.to(torch.int32))
    assert rel_error(out, reference_float64(*p.args())) <= SPEC_TOLERANCE


def test_fnuz_inputs_give_the_same_output():
    """fn -> fnuz halves values and doubles scales, both exact: the output is identical."""
    p = random_problem(83, 256, 384, 3)
    out_fn = grouped_gemm(*p.args())
    xq, x_scale = fn_to_fnuz(p.xq, p.x_scale)
    wq, w_scale = fn_to_fnuz(p.wq, p.w_scale)
    out_fnuz = grouped_gemm(xq, wq, x_scale, w_scale, p.m_sizes)
    assert torch.equal(out_fn.view(torch.int16), out_fnuz.view(torch.int16))


def test_fnuz_problem_meets_the_bound():
    p = random_problem(83, 256, 384, 3, fp8_dtype=torch.float8_e4m3fnuz)
    out = grouped_gemm(*p.args())
    assert rel_error(out, reference_float64(*p.args())) <= SPEC_TOLERANCE


def test_preshuffled_entry_matches_plain():
    p = random_problem(83, 256, 512, 3)
    plain = grouped_gemm(*p.args())
    out = poisoned_out(83, 256)
    shuffled = grouped_gemm_preshuffled(
        p.xq, preshuffle(p.wq), p.x_scale, p.w_scale, p.m_sizes, out=out
    )
    assert shuffled is out
    assert torch.equal(shuffled.view(torch.int16), plain.view(torch.int16))


def test_random_m_sizes_are_ragged_with_empty_groups():
    for g, m in [(3, 83), (8, 1335), (64, 5)]:
        sizes = random_m_sizes(g, m)
        assert sizes.dtype == torch.int64 and sizes.shape == (g,)
        assert int(sizes.sum()) == m and bool((sizes >= 0).all())
        assert bool((sizes == 0).any())
    assert random_m_sizes(1, 9).tolist() == [9]


def _args(m=4, n=256, k=384, g=2):
    return list(random_problem(m, n, k, g, m_sizes=torch.tensor([m] + [0] * (g - 1))).args())


@pytest.mark.parametrize(
    "index, bad, error",
    [
        (0, lambda t: t.float(), TypeError),  # xq not fp8
        (1, lambda t: t.view(torch.uint8).view(torch.float8_e4m3fnuz), TypeError),  # mixed fp8
        (2, lambda t: t.double(), TypeError),  # x_scale not float32
        (3, lambda t: t.half(), TypeError),  # w_scale not float32
        (4, lambda t: t.float(), TypeError),  # m_sizes not integer
        (0, lambda t: t[:, :128], ValueError),  # K disagrees
        (1, lambda t: t[:, :200], ValueError),  # N % 128
        (1, lambda t: t[:, :0], ValueError),  # N == 0 (a multiple of 128, not positive)
        (2, lambda t: t[:, :1], ValueError),  # x_scale shape
        (3, lambda t: t.transpose(1, 2), ValueError),  # w_scale shape
        (4, lambda t: t[:1], ValueError),  # m_sizes length
        (1, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), ValueError),  # strided wq
    ],
)
def test_contract_violations_raise(index, bad, error):
    args = _args()
    args[index] = bad(args[index])
    with pytest.raises(error):
        grouped_gemm(*args)


def test_bad_out_buffer_raises():
    args = _args()
    with pytest.raises(TypeError):
        grouped_gemm(*args, out=torch.empty(4, 256, dtype=torch.float16))
    with pytest.raises(ValueError):
        grouped_gemm(*args, out=torch.empty(4, 128))
    with pytest.raises(ValueError):
        grouped_gemm(*args, out=torch.empty(4, 128, dtype=torch.bfloat16))


@pytest.mark.parametrize("sizes", [[3, 0], [-1, 5], [5, -1]])
def test_m_sizes_that_are_negative_or_do_not_sum_to_m_raise_in_the_reference(sizes):
    args = _args()
    assert args[0].shape[0] == 4
    args[4] = torch.tensor(sizes)
    with pytest.raises(ValueError, match="sum to M"):
        grouped_gemm(*args)
    with pytest.raises(ValueError, match="sum to M"):
        reference_float64(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_reference_runs_on_the_gpu():
    p = random_problem(83, 256, 384, 3)
    on_cpu = grouped_gemm(*p.args())
    gpu_args = [t.cuda() for t in p.args()]
    from moegemm.kernels import reference

    on_gpu = reference.grouped_gemm(*gpu_args, poisoned_out(83, 256, "cuda"))
    assert rel_error(on_gpu, reference_float64(*p.args())) <= SPEC_TOLERANCE
    assert rel_error(on_gpu, on_cpu) <= 1e-2 * SPEC_TOLERANCE


def test_empty_k_is_refused_by_the_public_entry_and_the_reference():
    xq = torch.empty(3, 0, dtype=torch.float8_e4m3fn)
    wq = torch.empty(2, 128, 0, dtype=torch.float8_e4m3fn)
    x_scale, w_scale = torch.empty(3, 0), torch.empty(2, 0, 1)
    m_sizes = torch.tensor([3, 0])
    with pytest.raises(ValueError, match="positive multiples"):
        grouped_gemm(xq, wq, x_scale, w_scale, m_sizes)
    from moegemm.kernels import reference

    with pytest.raises(ValueError, match="positive multiples"):
        reference.grouped_gemm(
            xq, wq, x_scale, w_scale, m_sizes, out=torch.empty(3, 128, dtype=torch.bfloat16)
        )


# The reference backend on the CPU; on a CUDA device every kind of tile the table picks there
# (one-token pairs, split-K decode, 16/32-token decode, 128 x 128 persistent, both Gluon tiles).
FAR_APART = [("cpu", (83, 256, 512, 3))] + ([("cuda", shape) for shape in [
    (16, 1280, 1024, 8), (32, 1280, 8192, 8), (83, 256, 512, 3), (2048, 512, 1024, 8),
    (8192, 1024, 1024, 64), (4096, 512, 6144, 64)]] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device, shape", FAR_APART, ids=lambda v: str(v))
@pytest.mark.parametrize("x_factor, w_factor", [(1e35, 1e-35), (1e-35, 1e35), (1e30, 1e-30)])
def test_scales_far_apart_give_the_finite_answer(device, shape, x_factor, w_factor):
    """SPEC 1: no NaN or Inf where the reference is finite, on every backend. Activation scales
    near float32's top with weight scales near its bottom (a product of ordinary size): a K
    block's dot times the activation scale alone would pass float32's range (Inf, and NaN where
    blocks of both signs meet), so every backend multiplies the two scales first."""
    m, n, k, g = shape
    p = random_problem(m, n, k, g, device=device)
    args = (p.xq, p.wq, p.x_scale * x_factor, p.w_scale * w_factor, p.m_sizes)
    want = reference_float64(*args)
    assert torch.isfinite(want).all() and want.abs().max() < 1e30
    out = grouped_gemm(*args, out=poisoned_out(m, n, device=device))
    assert torch.isfinite(out).all()
    assert rel_error(out, want) <= SPEC_TOLERANCE


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_numpy_made_and_column_operands_on_every_backend(device):
    """SPEC 1 on every backend's public entry: M = 0 gives an empty output (operands from
    numpy's empty arrays, strides (0, 0)), and a K = 128 call whose scales are a transposed
    row (strides (1, M)) gives the answer its contiguous copy gives, bit for bit."""
    import numpy as np

    g, n = 8, 256
    p = random_problem(40, n, 128, g, device=device)
    xq = torch.from_numpy(np.zeros((0, 128), np.uint8)).view(p.xq.dtype).to(device)
    x_scale = torch.from_numpy(np.zeros((0, 1), np.float32)).to(device)
    empty = grouped_gemm(xq, p.wq, x_scale, p.w_scale, torch.zeros(g, dtype=torch.int64, device=device))
    assert empty.shape == (0, n) and empty.dtype == torch.bfloat16
    column = p.x_scale.reshape(1, 40).t()
    assert column.stride() == (1, 40) and torch.equal(column, p.x_scale)
    out = grouped_gemm(p.xq, p.wq, column, p.w_scale, p.m_sizes, out=poisoned_out(40, n, device))
    assert torch.equal(out, grouped_gemm(*p.args()))
    assert rel_error(out, reference_float64(*p.args())) <= SPEC_TOLERANCE


def _misaligned(t: torch.Tensor, offset: int = 8) -> torch.Tensor:
    """``t``'s values in a contiguous view starting ``offset`` bytes past a 16-byte boundary."""
    raw = torch.zeros(t.numel() * t.element_size() + 64, dtype=torch.uint8, device=t.device)
    start = (-raw.data_ptr()) % 16 + offset
    view = raw[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 == offset
    return view


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("entry", [grouped_gemm, grouped_gemm_preshuffled])
def test_the_public_entries_hand_a_backend_aligned_operands(monkeypatch, entry, out_dtype):
    """A GPU kernel's vector and TMA accesses need each base on a 16-byte boundary; a caller's
    contiguous view at another offset (a tensor over a received buffer) is copied first, and
    a misaligned ``out`` gets the answer copied in."""
    from moegemm.kernels import reference

    from moegemm import kernels

    seen = []

    def run(*operands):
        seen.append([t.data_ptr() % 16 for t in operands])
        return reference.grouped_gemm(*operands)

    backend = kernels.Backend(name="recording", device=torch.device("cpu"),
                              fp8_dtype=torch.float8_e4m3fn,
                              weight_layout="plain", prepare_weights=lambda w, s: (w, s), run=run)
    monkeypatch.setattr(kernels, "get_backend", lambda device: backend)
    p = random_problem(37, 256, 384, 3)
    args = list(p.args())
    if entry is grouped_gemm_preshuffled:
        args[1] = preshuffle(args[1])
    expected = entry(*args, out=poisoned_out(37, 256, "cpu").to(out_dtype))
    out = _misaligned(poisoned_out(37, 256, "cpu").to(out_dtype))
    answer = entry(*(_misaligned(t) for t in args), out=out)
    assert answer is out and torch.equal(out, expected)  # float32: the sums unrounded
    assert seen == [[0] * 6, [0] * 6]


def test_a_preshuffled_backend_runs_plain_weights_without_copying_them(monkeypatch):
    """A backend whose loaded weights are preshuffled (flydsl) runs the public ``grouped_gemm``
    on the caller's weights as they are, through its kernel's plain layout (a preshuffled copy
    per call was 7.5 GB for a DeepSeek-V3 layer); ``grouped_gemm_preshuffled`` runs ``run``."""
    from moegemm.kernels import reference

    from moegemm import kernels

    seen = []

    def recorder(layout):
        def run(xq, wq, *rest):
            seen.append((layout, wq.data_ptr()))
            plain = unshuffle(wq) if layout == "preshuffled" else wq
            return reference.grouped_gemm(xq, plain, *rest)
        return run

    backend = kernels.Backend(name="recording", device=torch.device("cpu"),
                              fp8_dtype=torch.float8_e4m3fn, weight_layout="preshuffled",
                              prepare_weights=lambda w, s: (preshuffle(w), s),
                              run=recorder("preshuffled"), run_plain=recorder("plain"))
    monkeypatch.setattr(kernels, "get_backend", lambda device: backend)
    p = random_problem(37, 256, 384, 3)
    xq, wq, x_scale, w_scale, m_sizes = p.args()
    expected = reference.grouped_gemm(xq, wq, x_scale, w_scale, m_sizes)
    assert torch.equal(grouped_gemm(xq, wq, x_scale, w_scale, m_sizes), expected)
    shuffled = preshuffle(wq)
    assert torch.equal(grouped_gemm_preshuffled(xq, shuffled, x_scale, w_scale, m_sizes), expected)
    assert seen == [("plain", wq.data_ptr()), ("preshuffled", shuffled.data_ptr())]
    # The pairing is the backend's invariant: a preshuffled backend without a plain entry (its
    # weights would reach a kernel reading another layout) is refused, as is a plain one with.
    with pytest.raises(ValueError, match="run_plain is required with preshuffled weights"):
        dataclasses.replace(backend, run_plain=None)
    with pytest.raises(ValueError, match="run_plain"):
        dataclasses.replace(backend, weight_layout="plain")
