"""SPEC 1.1 quantization and the SPEC 1.2 fn <-> fnuz conversions."""

import ml_dtypes
import numpy as np
import pytest
import torch
from moegemm.kernels import fn_to_fnuz, fnuz_to_fn, fp8_max, quantize_activations, quantize_weights

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
ALL_BYTES = torch.arange(256, dtype=torch.int64).to(torch.uint8)


def test_fp8_max():
    assert fp8_max(torch.float8_e4m3fn) == 448.0
    assert fp8_max(torch.float8_e4m3fnuz) == 240.0
    with pytest.raises(TypeError):
        fp8_max(torch.float8_e5m2)


def _dequant_bound(v, scale):
    # Round to nearest even: half an ulp. Normal e4m3 values have 3 mantissa bits
    # (|error| <= |v| / 16); subnormals have a fixed step of 2^-9 (fn) / 2^-10 (fnuz).
    return torch.maximum(v.abs() / 16, torch.full_like(v, 2.0**-10)) * scale


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_scale_formula_and_round_trip(fp8_dtype, dtype):
    m, k = 37, 384
    x = (torch.randn(m, k) * torch.exp(torch.randn(m, 1) * 2)).to(dtype)
    x[5, 128:256] = 0  # an all-zero block still gets a positive scale
    xq, x_scale = quantize_activations(x, fp8_dtype)
    assert xq.dtype == fp8_dtype and xq.shape == (m, k)
    assert x_scale.dtype == torch.float32 and x_scale.shape == (m, k // 128)
    limit = fp8_max(fp8_dtype)
    xf = x.float()
    for kb in range(k // 128):
        amax = xf[:, kb * 128 : (kb + 1) * 128].abs().max(dim=1).values
        torch.testing.assert_close(x_scale[:, kb], amax.clamp(min=1e-12) / limit, rtol=0, atol=0)
    assert x_scale[5, 1] == pytest.approx(1e-12 / limit)
    assert torch.all(xq[5, 128:256].float() == 0)
    # Each non-zero block's largest element lands exactly on the format's maximum.
    blocks = xq.float().reshape(m, k // 128, 128).abs().amax(dim=2)
    nonzero = torch.ones_like(blocks, dtype=torch.bool)
    nonzero[5, 1] = False
    assert torch.all(blocks[nonzero] == limit)
    scale = x_scale.repeat_interleave(128, dim=1)
    v = xf / scale
    err = (xq.float() * scale - xf).abs()
    assert torch.all(err <= _dequant_bound(v, scale) * (1 + 1e-6))


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_weights_scale_formula_and_round_trip(fp8_dtype):
    g, n, k = 3, 256, 384
    w = torch.randn(g, n, k) * torch.exp(torch.randn(g, n // 128, 1, k // 128, 1)).expand(
        g, n // 128, 128, k // 128, 128
    ).reshape(g, n, k)
    wq, w_scale = quantize_weights(w, fp8_dtype)
    assert wq.dtype == fp8_dtype and wq.shape == (g, n, k)
    assert w_scale.shape == (g, k // 128, n // 128)  # K-major, as the SPEC has it
    limit = fp8_max(fp8_dtype)
    for gi in range(g):
        for nb in range(n // 128):
            for kb in range(k // 128):
                block = w[gi, nb * 128 : (nb + 1) * 128, kb * 128 : (kb + 1) * 128]
                assert w_scale[gi, kb, nb] == block.abs().max() / limit
                qblock = wq[gi, nb * 128 : (nb + 1) * 128, kb * 128 : (kb + 1) * 128].float()
                assert qblock.abs().max() == limit
                s = w_scale[gi, kb, nb]
                err = (qblock * s - block).abs()
                assert torch.all(err <= _dequant_bound(block / s, s) * (1 + 1e-6))


def test_two_dimensional_weights():
    w = torch.randn(256, 128)
    wq, w_scale = quantize_weights(w)
    assert wq.shape == (256, 128) and w_scale.shape == (1, 2)


def test_quantizers_reject_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_activations(torch.randn(4, 200))
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_weights(torch.randn(2, 100, 128))
    with pytest.raises(TypeError):
        quantize_activations(torch.randint(0, 5, (4, 128)))
    with pytest.raises(TypeError):
        quantize_activations(torch.randn(4, 128), torch.bfloat16)


def test_fn_to_fnuz_keeps_bits_and_value_on_every_byte():
    q = ALL_BYTES.view(torch.float8_e4m3fn)
    scale = torch.rand(256) + 0.5
    q2, scale2 = fn_to_fnuz(q, scale)
    assert q2.dtype == torch.float8_e4m3fnuz
    expected_bits = ALL_BYTES.clone()
    expected_bits[0x80] = 0
    expected_bits[0x7F] = expected_bits[0xFF] = 0x80  # fn's NaN, as fnuz's (not +-240)
    assert torch.equal(q2.view(torch.uint8), expected_bits)
    assert torch.equal(scale2, scale * 2)
    before = q.double() * scale.double()
    after = q2.double() * scale2.double()
    finite = ~before.isnan()  # 0x7F / 0xFF are NaN in fn
    assert int(finite.sum()) == 254
    assert torch.equal(before[finite], after[finite])
    assert torch.equal(after.isnan(), ~finite)  # 0x80 (-0 in fn) did not become a NaN; NaN stays


FLT_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("layout", ["element", "activation", "weight"])
def test_fn_to_fnuz_keeps_the_value_where_a_scale_cannot_double(layout):
    # A finite scale over float32's max / 2 doubled is Inf (an audit: Inf answers on an fnuz
    # device where the reference is finite). Such a block keeps its scale; its codes take the
    # fnuz code of the same value, exact up to fnuz's 240 (every fn code of 2 or more dequantizes
    # past float32 at such a scale).
    gen = torch.Generator().manual_seed(0)
    if layout == "element":
        q = ALL_BYTES.view(torch.float8_e4m3fn)
        scale = torch.where(torch.arange(256) % 2 == 0, torch.tensor(3e38), torch.tensor(0.75))
        spread = scale
    elif layout == "activation":
        q = torch.randint(0, 256, (4, 384), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
        scale = torch.tensor([[3e38, 1.0, 2e38], [0.5, 3.3e38, 1e-3], [1.0, 1.0, 1.0], [FLT_MAX] * 3])
        spread = scale.repeat_interleave(128, 1)
    else:
        q = torch.randint(0, 256, (2, 256, 384), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
        scale = torch.rand(2, 3, 2, generator=gen) + 0.5
        scale[0, 1, 0] = scale[1, 2, 1] = 2.5e38
        spread = scale.transpose(1, 2).repeat_interleave(128, 1).repeat_interleave(128, 2)
    q2, scale2 = fn_to_fnuz(q, scale)
    huge = scale * 2 == float("inf")
    assert huge.any() and torch.isfinite(scale2).all()
    assert torch.equal(scale2, torch.where(huge, scale, scale * 2))
    value = q.double()
    finite = ~value.isnan()  # 0x7F / 0xFF are NaN in fn
    fits = finite & (value.abs() <= 240)
    before = value * spread.double()
    spread2 = (scale2 if layout == "element" else
               scale2.repeat_interleave(128, 1) if layout == "activation" else
               scale2.transpose(1, 2).repeat_interleave(128, 1).repeat_interleave(128, 2))
    after = q2.double() * spread2.double()
    assert torch.equal(before[fits], after[fits])  # every block, doubled or kept
    assert not q2.double()[finite].isnan().any()
    assert q2.double()[~finite].isnan().all()  # fn's NaN, kept block or doubled, is fnuz's
    big = finite & ~fits
    assert torch.equal(q2.double()[big].abs(), torch.where(
        (spread[big] * 2).isinf(), 240.0, value[big].abs() / 2))  # kept blocks saturate there


def test_fnuz_to_fn_converts_values_on_every_byte():
    q = ALL_BYTES.view(torch.float8_e4m3fnuz)
    scale = torch.rand(256) + 0.5
    q2, scale2 = fnuz_to_fn(q, scale)
    assert q2.dtype == torch.float8_e4m3fn
    assert torch.equal(scale2, scale)
    v_in, v_out = q.double(), q2.double()
    valid = ~v_in.isnan()  # only 0x80 is NaN in fnuz
    assert int(valid.sum()) == 255
    big = valid & (v_in.abs() >= 2.0**-6)
    assert torch.equal(v_out[big], v_in[big])  # includes the block maxima +-240 at 0x7F/0xFF
    assert v_out[0x7F] == 240 and v_out[0xFF] == -240
    small = valid & ~big
    # Below 2^-6 fn's step is 2^-9: at most half of it is lost, and it rounds to even.
    assert torch.all((v_out[small] - v_in[small]).abs() <= 2.0**-10)
    assert not v_out[valid].isnan().any()


def test_fn_fnuz_round_trip_on_quantized_data():
    x = torch.randn(16, 256) * 10
    xq, x_scale = quantize_activations(x, torch.float8_e4m3fn)
    back, back_scale = fnuz_to_fn(*fn_to_fnuz(xq, x_scale))
    deq = xq.double() * x_scale.double().repeat_interleave(128, 1)
    deq_back = back.double() * back_scale.double().repeat_interleave(128, 1)
    # Only values below 2^-6 can lose a bit on the way back: tiny against the block max.
    assert torch.all((deq - deq_back).abs() <= x_scale.double().repeat_interleave(128, 1) * 2**-9)
    assert (deq - deq_back).abs().max() < 1e-5 * deq.abs().max()


def test_conversions_reject_the_wrong_format():
    q = torch.randn(4, 128).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError):
        fnuz_to_fn(q, torch.ones(4, 1))
    with pytest.raises(TypeError):
        fn_to_fnuz(q.float().to(torch.float8_e4m3fnuz), torch.ones(4, 1))


def _exact_fp8(quotient: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """float64 quotients rounded to the fp8 grid, to nearest even, without passing through
    float32. A float64 quotient ``x * FP8_MAX / amax`` of 16- or 32-bit floats is never within
    2^-53 of a tie it is not exactly on (such a quotient's distance to a 5-bit tie is at least
    about 2^-29 of it), so this rounds the exact quotient."""
    emin = -6 if fp8_dtype == torch.float8_e4m3fn else -7
    magnitude = quotient.abs()
    exponent = torch.floor(torch.log2(torch.where(magnitude > 0, magnitude, 1.0))).clamp(min=emin)
    step = torch.exp2(exponent - 3)
    return torch.round(quotient / step) * step  # exact: a power of two; round: ties to even


# The amax floor as the quantizers hold it: float32's 1e-12 (the scales are float32).
FLOOR = torch.tensor(1e-12).item()


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantized_values_round_the_exact_quotient(fp8_dtype, dtype):
    """SPEC 1.1 in real arithmetic: ``x / (amax / FP8_MAX)`` rounded to fp8 once, to nearest
    even. Every value equals that rounding, activations and weights, normal and subnormal, and
    for bf16 and fp16 inputs what a float64 evaluation of 1.1 in torch gives. For bf16 inputs
    about 0.1 % of the exact quotients are fp8 ties (``0.2578125 * 448 / 2.75`` is 42, between
    40 and 44), which a quotient by the float32 scale (``x_scale``, rounded) moves off the tie:
    rounding that one exactly, as this server did until session 38, picks the other neighbour."""
    gen = torch.Generator().manual_seed(11)
    limit = fp8_max(fp8_dtype)
    x = (torch.randn(512, 1024, generator=gen) * torch.exp(torch.randn(512, 1, generator=gen) * 3)).to(dtype)
    x[0, :128] = torch.linspace(-1e-3, 1e-3, 128).to(dtype)  # a block of subnormal codes
    x[0, 0] = 1.0
    xq, x_scale = quantize_activations(x, fp8_dtype)
    blocks = x.double().reshape(512, 8, 128)
    floor = blocks.abs().amax(dim=2, keepdim=True).clamp(min=FLOOR)
    want = _exact_fp8((blocks * limit / floor).reshape(512, 1024), fp8_dtype)
    assert torch.equal(xq.double(), want)
    if dtype != torch.float32:
        # A float64 evaluation of SPEC 1.1 as a client would write it gives the same codes.
        plain = (blocks / (floor / limit)).clamp(-limit, limit).to(fp8_dtype).reshape(512, 1024)
        assert torch.equal(plain.double(), want)
        by_rounded_scale = _exact_fp8((blocks / x_scale.double()[..., None]).clamp(-limit, limit)
                                      .reshape(512, 1024), fp8_dtype)
        assert (by_rounded_scale != want).sum() > 20
        # Rounded straight from float64 (numpy and ml_dtypes, no float32 step), the quotient
        # by the rounded scale moves some exact ties off; ``x * FP8_MAX / amax`` does not.
        np_fp8 = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e4m3fnuz: ml_dtypes.float8_e4m3fnuz}[fp8_dtype]
        b, fl = blocks.numpy(), floor.numpy()
        codes = xq.view(torch.uint8).numpy()
        exact_np = np.clip(b * limit / fl, -limit, limit).astype(np_fp8).reshape(512, 1024)
        assert np.array_equal(exact_np.view(np.uint8), codes)
        by_scale_np = np.clip(b / (fl / limit), -limit, limit).astype(np_fp8).reshape(512, 1024)
        assert (by_scale_np.view(np.uint8) != codes).sum() > 0
    w = x.reshape(4, 128, 1024)
    wq, _ = quantize_weights(w, fp8_dtype)
    wb = w.double().reshape(4, 1, 128, 8, 128)
    wfloor = wb.abs().amax(dim=(2, 4), keepdim=True).clamp(min=FLOOR)
    assert torch.equal(wq.double(), _exact_fp8((wb * limit / wfloor).reshape(4, 128, 1024), fp8_dtype))


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_slices_give_the_bits_of_one_pass(fp8_dtype, monkeypatch):
    """The rounding runs over slices of the leading blocks (its temporaries bounded): any slice
    size gives the bits and scales of one pass, activations (M = 0 included) and weights."""
    from moegemm.kernels import quant

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(37, 384, generator=gen) * torch.exp(torch.randn(37, 1, generator=gen))).bfloat16()
    w3 = torch.randn(3, 256, 384, generator=gen) * 0.02
    w2 = torch.randn(256, 384, generator=gen).half()
    inputs = [(quantize_activations, x), (quantize_activations, x[:0]), (quantize_weights, w3),
              (quantize_weights, w2)]
    whole = [f(t, fp8_dtype) for f, t in inputs]
    for elements in (1, 128 * 128 * 3 + 5, 384 * 7):
        monkeypatch.setattr(quant, "_SLICE_ELEMENTS", elements)
        for (f, t), (q, s) in zip(inputs, whole, strict=True):
            got_q, got_s = f(t, fp8_dtype)
            assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)), (elements, t.shape)
            assert torch.equal(got_s, s)


def test_quantizers_answer_row_major_codes_for_any_strides():
    """A transposed view (a ``[G, K, N]`` checkpoint read as ``[G, N, K]``) quantizes to
    row-major codes, which ``grouped_gemm`` takes, with the bits of the contiguous input's."""
    from moegemm.kernels import grouped_gemm

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(2, 256, 128, generator=gen).transpose(1, 2)  # [2, 128, 256], strided
    wq, w_scale = quantize_weights(w)
    assert wq.is_contiguous()
    assert torch.equal(wq.view(torch.uint8), quantize_weights(w.contiguous())[0].view(torch.uint8))
    x = torch.randn(256, 3, generator=gen).t()  # [3, 256], strided
    xq, x_scale = quantize_activations(x)
    assert xq.is_contiguous()
    out = grouped_gemm(xq, wq, x_scale, w_scale, torch.tensor([3, 0]))
    assert out.shape == (3, 128)
