"""SPEC 1.3: the MFMA B preshuffle and its inverse."""

import pytest
import torch
from moegemm.kernels import preshuffle, unshuffle


def _random_fp8(*shape):
    return (torch.randn(*shape) * 50).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("shape", [(128, 256), (3, 256, 384), (2, 2, 48, 192)])
def test_unshuffle_inverts_preshuffle(shape):
    w = _random_fp8(*shape)
    shuffled = preshuffle(w)
    assert shuffled.shape == w.shape and shuffled.dtype == w.dtype
    assert shuffled.is_contiguous()
    assert not torch.equal(shuffled.view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(unshuffle(shuffled).view(torch.uint8), w.view(torch.uint8))


def test_preshuffle_places_every_element_where_spec_says():
    g, n, k = 2, 48, 192
    w = torch.randn(g, n, k)
    flat = preshuffle(w).reshape(g, -1)
    gi, ni, ki = torch.meshgrid(torch.arange(g), torch.arange(n), torch.arange(k), indexing="ij")
    # (N0, NLane, K0, KLane, KPack) -> (N0, K0, KLane, NLane, KPack), written out by hand.
    n0, n_lane = ni // 16, ni % 16
    k0, k_lane, k_pack = ki // 64, (ki % 64) // 16, ki % 16
    pos = (((n0 * (k // 64) + k0) * 4 + k_lane) * 16 + n_lane) * 16 + k_pack
    assert torch.equal(flat[gi, pos], w)


@pytest.mark.parametrize("shape", [(40, 128), (32, 96), (128,)])
def test_layout_rejects_bad_shapes(shape):
    w = torch.randn(*shape)
    with pytest.raises(ValueError):
        preshuffle(w)
    with pytest.raises(ValueError):
        unshuffle(w)
