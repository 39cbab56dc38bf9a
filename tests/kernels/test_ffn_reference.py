"""SPEC 5's activation and float64 references: the eager chain (float32 h and a) meets
the 3e-2 bound on every call, M = 1 included, and the classic mistakes (gate and up
swapped, a scale on the wrong block) fail it."""

import math

import pytest
import torch
from moegemm.kernels import (
    ffn_reference_float64,
    grouped_gemm,
    moe_reference_float64,
    quantize_activations,
    reference_float64,
    silu_mul_quant,
)
from moegemm.kernels.testing import random_m_sizes, rel_error
from moegemm.kernels.testing_ffn import (
    FFN_TOLERANCE,
    FP32_CHAIN_BOUND,
    eager_ffn,
    random_experts,
    random_routing,
)

FP8S = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


def _chain(xq, x_scale, w13q, w13_scale, w2q, w2_scale, m_sizes, fp8):
    """SPEC 5.1 the way a server computes it: float32 h and a, quantized aq."""
    h = torch.empty((xq.shape[0], w13q.shape[1]), dtype=torch.float32)
    grouped_gemm(xq, w13q, x_scale, w13_scale, m_sizes, out=h)
    aq, a_scale = silu_mul_quant(h, fp8)
    return grouped_gemm(aq, w2q, a_scale, w2_scale, m_sizes)


@pytest.mark.parametrize("h_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", FP8S)
def test_silu_mul_quant_is_the_definition(fp8, h_dtype):
    """a = silu(gate) * up in float32, quantized with no bf16 rounding in between."""
    h = (torch.randn(37, 512) * 4).to(h_dtype)
    aq, a_scale = silu_mul_quant(h, fp8)
    gate, up = h[:, :256].float(), h[:, 256:].float()
    a = gate / (1 + torch.exp(-gate)) * up
    want_q, want_s = quantize_activations(a, fp8)
    assert aq.dtype == fp8 and aq.shape == (37, 256)
    assert a_scale.dtype == torch.float32 and a_scale.shape == (37, 2)
    assert torch.equal(aq.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(a_scale, want_s)
    # and the dequantized values are SiLU(gate) * up to fp8 precision
    back = (aq.float().reshape(37, 2, 128) * a_scale.unsqueeze(2)).reshape(37, 256)
    assert rel_error(back, a.float()) < 3e-2
    if h_dtype == torch.float32:
        # a is not rounded to bf16 first: that would quantize differently somewhere
        rounded_q, _ = quantize_activations(a.to(torch.bfloat16), fp8)
        assert not torch.equal(aq.view(torch.uint8), rounded_q.view(torch.uint8))


def test_gemm_float32_out_is_the_sum_unrounded():
    """A float32 out gets the float32 sum that the bf16 out is the rounding of."""
    p = random_experts(3, 256, 128)
    sizes = torch.tensor([5, 0, 12])
    xq, x_scale = p.quantized(p.tokens(17))
    wide = torch.full((17, 256), float("nan"))
    assert grouped_gemm(xq, p.w13q, x_scale, p.w13_scale, sizes, out=wide) is wide
    narrow = grouped_gemm(xq, p.w13q, x_scale, p.w13_scale, sizes)
    assert narrow.dtype == torch.bfloat16 and torch.equal(wide.to(torch.bfloat16), narrow)
    assert not torch.equal(wide, narrow.float())
    ref = reference_float64(xq, p.w13q, x_scale, p.w13_scale, sizes)
    assert rel_error(wide, ref) < rel_error(narrow, ref) / 10
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        grouped_gemm(xq, p.w13q, x_scale, p.w13_scale, sizes,
                     out=torch.empty(17, 256, dtype=torch.float16))


def test_silu_mul_quant_refuses_bad_input():
    with pytest.raises(TypeError):
        silu_mul_quant(torch.zeros(2, 256, dtype=torch.float16), torch.float8_e4m3fn)
    with pytest.raises(ValueError):
        silu_mul_quant(torch.zeros(2, 384, dtype=torch.bfloat16), torch.float8_e4m3fn)
    with pytest.raises(TypeError):
        silu_mul_quant(torch.zeros(2, 256, dtype=torch.bfloat16), torch.bfloat16)
    aq, a_scale = silu_mul_quant(torch.zeros(0, 256, dtype=torch.bfloat16))
    assert aq.shape == (0, 128) and a_scale.shape == (0, 1)


@pytest.mark.parametrize("fp8", FP8S)
@pytest.mark.parametrize("m, g, h, i", [(1, 1, 256, 128), (1, 4, 512, 512), (7, 3, 256, 256),
                                        (83, 4, 384, 256), (301, 8, 256, 384)])
def test_chain_meets_the_bound(fp8, m, g, h, i):
    p = random_experts(g, h, i, fp8_dtype=fp8)
    sizes = random_m_sizes(g, m)
    xq, x_scale = p.quantized(p.tokens(m))
    out = _chain(xq, x_scale, p.w13q, p.w13_scale, p.w2q, p.w2_scale, sizes, fp8)
    ref = p.ffn_reference(xq, x_scale, sizes)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    assert rel_error(out, ref) <= FFN_TOLERANCE


def test_single_rows_each_meet_a_tight_bound():
    """Fresh M = 1 calls, each on its own: the float32 chain stays at or below 5e-3
    (measured max 1.8e-3) where the bf16-h chain of SPEC 5.1's text scatters up to the
    3e-2 bound and past it (median 1.4e-2): it fails this check, so the check is real.

    Seeded: the float32 chain's errors have a thin tail past 5e-3 (a code one step off on a
    block's large value), about one M = 1 call in 20,000 in session 38's search (6.2e-3 at
    most there, the same with either rounding of SPEC 1.1), and one fresh-clone CI run drew
    1.1e-2 among its 60; unseeded, this failed now and then."""
    g, h, i = 4, 512, 512
    gen = torch.Generator().manual_seed(0)
    p = random_experts(g, h, i, generator=gen)
    fp32, bf16 = [], []
    for _ in range(60):
        sizes = torch.zeros(g, dtype=torch.int64)
        sizes[int(torch.randint(g, (), generator=gen))] = 1
        xq, x_scale = p.quantized(p.tokens(1, generator=gen))
        ref = p.ffn_reference(xq, x_scale, sizes)
        fp32.append(rel_error(eager_ffn(p, xq, x_scale, sizes), ref))
        bf16.append(rel_error(eager_ffn(p, xq, x_scale, sizes, h_dtype=torch.bfloat16), ref))
    assert max(fp32) <= FP32_CHAIN_BOUND
    assert max(bf16) > FP32_CHAIN_BOUND and sorted(bf16)[len(bf16) // 2] > FP32_CHAIN_BOUND


@pytest.mark.parametrize("m", [1, 7, 83])
def test_ragged_and_empty_groups_meet_the_bound(m):
    """Every call on its own, groups ragged and empty among them."""
    g = 6
    p = random_experts(g, 256, 256)
    for _ in range(20):
        sizes = random_m_sizes(g, m)
        xq, x_scale = p.quantized(p.tokens(m))
        out = eager_ffn(p, xq, x_scale, sizes)
        assert rel_error(out, p.ffn_reference(xq, x_scale, sizes)) <= FFN_TOLERANCE


def test_controls_fail_the_bound():
    """Gate and up swapped, or a scale block moved, are caught by a wide margin."""
    g, h, i, m = 4, 384, 256, 200
    p = random_experts(g, h, i)
    fp8 = p.fp8_dtype
    sizes = random_m_sizes(g, m)
    xq, x_scale = p.quantized(p.tokens(m))
    ref = p.ffn_reference(xq, x_scale, sizes)
    good = _chain(xq, x_scale, p.w13q, p.w13_scale, p.w2q, p.w2_scale, sizes, fp8)
    assert rel_error(good, ref) <= FFN_TOLERANCE
    swapped_q = torch.cat([p.w13q[:, i:], p.w13q[:, :i]], dim=1)
    swapped_s = torch.cat([p.w13_scale[:, :, i // 128:], p.w13_scale[:, :, :i // 128]], dim=2)
    controls = {
        "gate and up swapped": (swapped_q, swapped_s, p.w2_scale),
        "w13 scale blocks along K reversed": (p.w13q, p.w13_scale.flip(1), p.w2_scale),
        "w2 scale blocks along N rolled": (p.w13q, p.w13_scale, p.w2_scale.roll(1, 2)),
        "another expert's w2 scales": (p.w13q, p.w13_scale, p.w2_scale.roll(1, 0)),
    }
    for what, (w13q, w13_scale, w2_scale) in controls.items():
        out = _chain(xq, x_scale, w13q, w13_scale.contiguous(), p.w2q, w2_scale.contiguous(),
                     sizes, fp8)
        assert rel_error(out, ref) > 3 * FFN_TOLERANCE, what


def test_ffn_reference_is_per_row():
    """Each row's float64 answer depends only on its own expert (ragged, empty groups)."""
    g, h, i = 5, 256, 128
    p = random_experts(g, h, i)
    sizes = torch.tensor([3, 0, 1, 0, 4])
    xq, x_scale = p.quantized(p.tokens(8))
    ref = p.ffn_reference(xq, x_scale, sizes)
    experts = torch.repeat_interleave(torch.arange(g), sizes)
    for r in range(8):
        one = torch.zeros(g, dtype=torch.int64)
        one[experts[r]] = 1
        row = ffn_reference_float64(xq[r:r + 1], x_scale[r:r + 1], p.w13q, p.w13_scale, p.w2q,
                                    p.w2_scale, one, p.fp8_dtype)
        assert torch.allclose(row[0], ref[r], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k", [1, 2, 8])
def test_moe_reference_is_the_weighted_sum(k):
    g, h, i, t = 9, 256, 128, 13
    p = random_experts(g, h, i)
    ids, weights = random_routing(t, k, g)
    xq, x_scale = p.quantized(p.tokens(t))
    ref = p.moe_reference(xq, x_scale, ids, weights)
    assert ref.shape == (t, h) and ref.dtype == torch.float64
    want = torch.zeros(t, h, dtype=torch.float64)
    for tok in range(t):
        for j in range(k):
            one = torch.zeros(g, dtype=torch.int64)
            one[ids[tok, j]] = 1
            y = ffn_reference_float64(xq[tok:tok + 1], x_scale[tok:tok + 1], p.w13q,
                                      p.w13_scale, p.w2q, p.w2_scale, one, p.fp8_dtype)
            want[tok] += float(weights[tok, j]) * y[0]
    assert torch.allclose(ref, want, rtol=1e-12, atol=1e-12)


def test_moe_reference_empty():
    p = random_experts(3, 256, 128)
    xq, x_scale = p.quantized(p.tokens(0))
    ids = torch.zeros((0, 2), dtype=torch.int64)
    ref = moe_reference_float64(xq, x_scale, p.w13q, p.w13_scale, p.w2q, p.w2_scale, ids,
                                torch.zeros((0, 2)), p.fp8_dtype)
    assert ref.shape == (0, 256)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_the_oracle_rounds_a_once(fp8):
    """The float64 chain's ``aq``: each value rounded once, to nearest even. Just past a
    midpoint between two fp8 codes (by 2^-40 of it: float32 cannot hold that, so torch's cast,
    through float32, sees the midpoint and takes the even code) the value goes up; at the
    midpoint itself, to the even code."""
    from moegemm.kernels.quant import fp8_max
    from moegemm.kernels.reference import _quantize_float64

    codes = torch.arange(0x00, 0x7F, dtype=torch.uint8).view(fp8).double()  # 0 up, ascending
    mid = (codes[:-1] + codes[1:]) / 2
    limit = fp8_max(fp8)
    # Blocks of 128 whose amax is the format's maximum, so the scale is exactly 1.
    a = torch.full((mid.numel(), 128), limit, dtype=torch.float64)
    a[:, 0] = mid * (1 + 2.0**-40)
    a[:, 1] = mid
    a[:, 2] = -mid * (1 + 2.0**-40)
    aq, scale = _quantize_float64(a, fp8)
    assert (scale == 1).all()
    got = aq.double()
    assert torch.equal(got[:, 0], codes[1:])
    # codes[i] is the code of bits i: the even one of each pair is the one of even index.
    even = torch.where(torch.arange(len(mid)) % 2 == 0, codes[:-1], codes[1:])
    assert torch.equal(got[:, 1], even)
    assert torch.equal(got[:, 2], -codes[1:])


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_nearest_saturates_both_infinities(fp8):
    """Past the format's range, either sign and past float32's too, a value is the format's
    maximum (the clamp's); NaN stays NaN."""
    from moegemm.kernels.quant import fp8_max, fp8_nearest

    limit = fp8_max(fp8)
    got = fp8_nearest(torch.tensor([math.inf, -math.inf, 1e300, -1e300, math.nan],
                                   dtype=torch.float64), fp8).double()
    assert got[:4].tolist() == [limit, -limit, limit, -limit] and got[4].isnan()
