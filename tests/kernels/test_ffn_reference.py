"""SPEC 5's activation and float64 references: the eager chain meets the 3e-2 bound,
and the classic mistakes (gate and up swapped, a scale on the wrong block) fail it."""

import pytest
import torch
from moegemm.kernels import (
    ffn_reference_float64,
    grouped_gemm,
    moe_reference_float64,
    quantize_activations,
    silu_mul_quant,
)
from moegemm.kernels.testing import random_m_sizes, rel_error
from moegemm.kernels.testing_ffn import (
    FFN_TOLERANCE,
    MIN_BOUND_ROWS,
    random_experts,
    random_routing,
)

FP8S = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


def _chain(xq, x_scale, w13q, w13_scale, w2q, w2_scale, m_sizes, fp8):
    """SPEC 5.1 the way a server computes it: bf16 h, bf16 a, quantized aq."""
    h = grouped_gemm(xq, w13q, x_scale, w13_scale, m_sizes)
    aq, a_scale = silu_mul_quant(h, fp8)
    return grouped_gemm(aq, w2q, a_scale, w2_scale, m_sizes)


@pytest.mark.parametrize("fp8", FP8S)
def test_silu_mul_quant_is_the_spec_definition(fp8):
    h = (torch.randn(37, 512) * 4).to(torch.bfloat16)
    aq, a_scale = silu_mul_quant(h, fp8)
    gate, up = h[:, :256].float(), h[:, 256:].float()
    a = (gate / (1 + torch.exp(-gate)) * up).to(torch.bfloat16)
    want_q, want_s = quantize_activations(a, fp8)
    assert aq.dtype == fp8 and aq.shape == (37, 256)
    assert a_scale.dtype == torch.float32 and a_scale.shape == (37, 2)
    assert torch.equal(aq.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(a_scale, want_s)
    # and the dequantized values are SiLU(gate) * up to fp8 precision
    back = (aq.float().reshape(37, 2, 128) * a_scale.unsqueeze(2)).reshape(37, 256)
    assert rel_error(back, a.float()) < 3e-2


def test_silu_mul_quant_refuses_bad_input():
    with pytest.raises(TypeError):
        silu_mul_quant(torch.zeros(2, 256), torch.float8_e4m3fn)
    with pytest.raises(ValueError):
        silu_mul_quant(torch.zeros(2, 384, dtype=torch.bfloat16), torch.float8_e4m3fn)
    with pytest.raises(TypeError):
        silu_mul_quant(torch.zeros(2, 256, dtype=torch.bfloat16), torch.bfloat16)
    aq, a_scale = silu_mul_quant(torch.zeros(0, 256, dtype=torch.bfloat16))
    assert aq.shape == (0, 128) and a_scale.shape == (0, 1)


@pytest.mark.parametrize("fp8", FP8S)
@pytest.mark.parametrize("m, g, h, i", [(64, 1, 256, 128), (83, 4, 384, 256), (301, 8, 256, 384)])
def test_chain_meets_the_bound(fp8, m, g, h, i):
    p = random_experts(g, h, i, fp8_dtype=fp8)
    sizes = random_m_sizes(g, m)
    xq, x_scale = p.quantized(p.tokens(m))
    out = _chain(xq, x_scale, p.w13q, p.w13_scale, p.w2q, p.w2_scale, sizes, fp8)
    ref = p.ffn_reference(xq, x_scale, sizes)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    assert rel_error(out, ref) <= FFN_TOLERANCE


def test_single_rows_meet_the_bound_together():
    """M = 1 calls, one per token, stacked: a single row's error has a tail (testing_ffn)."""
    g, h, i = 3, 256, 256
    p = random_experts(g, h, i)
    outs, refs = [], []
    for _ in range(MIN_BOUND_ROWS):
        sizes = torch.zeros(g, dtype=torch.int64)
        sizes[int(torch.randint(g, ()))] = 1
        xq, x_scale = p.quantized(p.tokens(1))
        outs.append(_chain(xq, x_scale, p.w13q, p.w13_scale, p.w2q, p.w2_scale, sizes,
                           p.fp8_dtype))
        refs.append(p.ffn_reference(xq, x_scale, sizes))
    assert rel_error(torch.cat(outs), torch.cat(refs)) <= FFN_TOLERANCE


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
