"""The numpy request checks agree with the torch ones on every byte pattern."""

from __future__ import annotations

import pytest
import torch
from moegemm.server._checks import floats_finite, fp8_has_nan, scales_ok

ALL_BYTES = torch.arange(256, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_nan_on_every_byte(dtype):
    for b in range(256):
        t = torch.randint(0, 0x70, (33, 128), dtype=torch.uint8)
        t[17, 5] = b
        q = t.view(dtype)
        assert fp8_has_nan(q) == bool(torch.isnan(q.float()).any()), hex(b)
    assert fp8_has_nan(torch.empty(0, 128, dtype=dtype)) is False
    with pytest.raises(TypeError):
        fp8_has_nan(torch.zeros(3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_floats_finite_matches_torch(dtype):
    x = torch.randn(41, 256).to(dtype)
    assert floats_finite(x)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[40, 255] = bad
        assert not floats_finite(y)
    # Every 16-bit pattern, compared with torch's own verdict.
    if dtype != torch.float32:
        every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        for chunk in every.split(4096):
            assert floats_finite(chunk) == bool(torch.isfinite(chunk).all())
    assert floats_finite(torch.empty(0, 8, dtype=dtype))


def test_scales():
    s = torch.rand(17, 56) + 1e-6
    assert scales_ok(s)
    for bad in (0.0, -1e-3, float("nan"), float("inf")):
        t = s.clone()
        t[3, 7] = bad
        assert not scales_ok(t)
    assert scales_ok(torch.empty(0, 56))


def test_an_empty_tensor_too_large_to_lay_out_is_bad_tensor():
    # Found by hypothesis: zero elements, but strides past int64.
    from moegemm.client import BadTensor
    from moegemm.client._wire import decode_tensor
    from moegemm.server._tensors import to_torch

    with pytest.raises(BadTensor):
        to_torch(decode_tensor({"dtype": "float32", "shape": [0, 2**62, 4], "data": b""}))
    assert to_torch(decode_tensor({"dtype": "float32", "shape": [0, 5, 4], "data": b""})).shape == (0, 5, 4)


def test_bad_rows_on_the_cpu_match_the_torch_formula():
    """bad_rows runs in numpy on the CPU; it must flag exactly what the device
    (torch) formula flags, row by row, for every dtype."""
    from moegemm.server import _checks

    gen = torch.Generator().manual_seed(torch.seed())
    for dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.bfloat16, torch.float16,
                  torch.float32):
        if dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            x = torch.randint(0, 256, (64, 256), generator=gen, dtype=torch.uint8).view(dtype)
            scale = torch.rand(64, 2, generator=gen) + 0.1
            scale[3, 1], scale[9, 0], scale[10, 1] = 0.0, float("inf"), -1.0
        else:
            x = torch.randn(64, 256, generator=gen).to(dtype)
            x[5, 7], x[20, 0], x[33, 255] = float("nan"), float("inf"), float("-inf")
            scale = None
        got = _checks.bad_rows(x, scale)
        if dtype == torch.float8_e4m3fn:
            want = ((x.view(torch.uint8) & 0x7F) == 0x7F).any(dim=1).to(torch.int8)
        elif dtype == torch.float8_e4m3fnuz:
            want = (x.view(torch.uint8) == 0x80).any(dim=1).to(torch.int8)
        else:
            want = (~torch.isfinite(x.float()).all(dim=1)).to(torch.int8)
        if scale is not None:
            want = want | ((~((scale > 0) & torch.isfinite(scale)).all(dim=1)).to(torch.int8) << 1)
        assert torch.equal(got, want), dtype
        assert got.any()
    assert _checks.bad_rows(torch.empty(0, 128, dtype=torch.bfloat16), None).shape == (0,)
