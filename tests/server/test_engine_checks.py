"""The numpy request checks agree with the torch ones on every byte pattern."""

from __future__ import annotations

import pytest
import torch
from moegemm.server._checks import _bad_rows_numpy, _bad_rows_torch, bad_rows

ALL_BYTES = torch.arange(256, dtype=torch.uint8)

# The engine's two implementations (numpy on the CPU, torch on a GPU), run here
# on CPU tensors: both must give torch's own verdict row by row.
IMPLEMENTATIONS = {
    "numpy": lambda x, s: torch.from_numpy(_bad_rows_numpy(x, s)),
    "torch": _bad_rows_torch,
}


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_codes_never_flag_a_row(impl, dtype):
    """SPEC 2.2's not_finite names fp8 rows' scales, not their codes: every byte, the NaN
    codes among them, leaves its row unflagged."""
    t = torch.randint(0, 0x70, (256, 128), dtype=torch.uint8)
    t[:, 5] = ALL_BYTES  # row b holds byte b
    q = t.view(dtype)
    assert torch.isnan(q.float()).any()  # the NaN codes are there
    assert torch.equal(IMPLEMENTATIONS[impl](q, None), torch.zeros(256, dtype=torch.int8))
    assert IMPLEMENTATIONS[impl](torch.empty(0, 128, dtype=dtype), None).shape == (0,)


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_non_finite_floats_on_every_pattern(impl, dtype):
    x = torch.randn(41, 256).to(dtype)
    for row, bad in ((3, float("nan")), (17, float("inf")), (40, -float("inf"))):
        x[row, 255 - row] = bad
    want = (~torch.isfinite(x).all(dim=1)).to(torch.int8)
    assert torch.equal(IMPLEMENTATIONS[impl](x, None), want) and want.sum() == 3
    if dtype != torch.float32:  # every 16-bit pattern, one per row
        every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        rows = every.reshape(-1, 64)
        want = (~torch.isfinite(rows).all(dim=1)).to(torch.int8)
        assert torch.equal(IMPLEMENTATIONS[impl](rows, None), want)


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
def test_bad_scales_flag_their_rows(impl):
    x = torch.randint(0, 0x70, (17, 256), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(17, 2) + 1e-6
    for row, bad in ((2, 0.0), (5, -1e-3), (9, float("nan")), (11, float("inf"))):
        s[row, row % 2] = bad
    x.view(torch.uint8)[9, 0] = 0x7F  # a NaN code: flags nothing of its own
    got = IMPLEMENTATIONS[impl](x, s)
    want = torch.zeros(17, dtype=torch.int8)
    want[[2, 5, 9, 11]] = 2
    assert torch.equal(got, want)


def test_bad_rows_uses_numpy_on_the_cpu():
    x = torch.randn(4, 128).bfloat16()
    x[1, 0] = float("nan")
    assert torch.equal(bad_rows(x, None), torch.tensor([0, 1, 0, 0], dtype=torch.int8))

