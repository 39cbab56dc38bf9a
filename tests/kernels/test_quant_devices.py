"""Quantization (SPEC 1.1) gives the same bits on every device.

The server quantizes bf16 inputs on its GPU; callers and tests check it against
the CPU. Scales are exact IEEE quotients ``amax / FP8_MAX`` (float64 division
rounded once agrees), and a GPU gives the CPU's bits: on the H200, dividing by
a Python number had given scales one ulp off, and some fp8 values with them.
"""

from __future__ import annotations

import pytest
import torch
from moegemm.kernels import quantize_activations, quantize_weights

FORMATS = [(torch.float8_e4m3fn, 448.0), (torch.float8_e4m3fnuz, 240.0)]


def _data(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    # magnitudes over many binades, so scales land everywhere in a binade, and
    # all finite in float16 (the server refuses Inf: SPEC 2.2 not_finite)
    spread = torch.exp(torch.randn(shape[:-1], generator=gen) * 2).clamp(max=1e3)[..., None]
    return torch.randn(shape, generator=gen) * spread


@pytest.mark.parametrize("fp8,limit", FORMATS)
def test_activation_scales_are_exact_quotients(fp8, limit):
    x = _data((512, 1024), 1)
    _, xs = quantize_activations(x, fp8)
    amax = x.reshape(512, 8, 128).abs().amax(-1).double().clamp(min=1e-12)
    assert torch.equal(xs, (amax / limit).float())


@pytest.mark.parametrize("fp8,limit", FORMATS)
def test_weight_scales_are_exact_quotients(fp8, limit):
    w = _data((2, 256, 384), 2)
    _, ws = quantize_weights(w, fp8)
    amax = w.reshape(2, 2, 128, 3, 128).abs().amax(dim=(2, 4)).double().clamp(min=1e-12)
    assert torch.equal(ws, (amax / limit).float().transpose(1, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
@pytest.mark.parametrize("fp8,limit", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_quantizes_to_the_cpu_bits(fp8, limit, dtype):
    x = _data((1335, 2048), 3).to(dtype)
    w = _data((3, 256, 512), 4).to(dtype)
    assert torch.isfinite(x).all() and torch.isfinite(w).all()
    for fn, t in ((quantize_activations, x), (quantize_weights, w)):
        q_cpu, s_cpu = fn(t, fp8)
        q_gpu, s_gpu = fn(t.cuda(), fp8)
        assert torch.equal(s_gpu.cpu(), s_cpu)
        assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))


def _non_finite_blocks(dtype):
    """Blocks whose codes come out NaN: NaN inputs of either sign (each block's amax NaN), and
    +-Inf (``inf / inf``, a NaN made by the division; x86's and CUDA's float64 ones are
    negative, CUDA's float32 ones positive)."""
    x = _data((4, 512), 5)
    negative_nan = torch.tensor(float("nan")).neg()
    x[0, 3], x[1, 130] = float("nan"), negative_nan
    x[2, 260], x[3, 400] = float("inf"), -float("inf")
    x[3, 401] = float("inf")
    return x.to(dtype)


def _assert_one_nan_code(q, fp8, block):
    """Two blocks of ``block`` elements all NaN (amax NaN), and the three ``inf / inf``."""
    bits = q.view(torch.uint8)
    nan = q.float().isnan()
    assert nan.sum() == 2 * block + 3
    assert (bits[nan] == (0x7F if fp8 == torch.float8_e4m3fn else 0x80)).all()


@pytest.mark.parametrize("fp8,limit", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_nan_code_is_the_positive_one(fp8, limit, dtype):
    """Inputs holding NaN or Inf (the server flags such rows; the codes are its internal ones):
    every NaN code is one code, 0x7F in fn, whatever the NaN's sign."""
    x = _non_finite_blocks(dtype)
    w = torch.zeros((1, 128, 512), dtype=dtype)
    w[0, :4] = x
    for fn, t, block in ((quantize_activations, x, 128), (quantize_weights, w, 128 * 128)):
        q, _ = fn(t, fp8)
        _assert_one_nan_code(q, fp8, block)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
@pytest.mark.parametrize("fp8,limit", FORMATS)
def test_gpu_nan_codes_are_the_cpu_ones(fp8, limit):
    x = _non_finite_blocks(torch.bfloat16)
    q_cpu, s_cpu = quantize_activations(x, fp8)
    q_gpu, s_gpu = quantize_activations(x.cuda(), fp8)
    _assert_one_nan_code(q_gpu.cpu(), fp8, 128)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    # NaN scales' payloads are the device's (CUDA's float32 NaN is 0x7FFFFFFF, x86's 0x7FC00000)
    torch.testing.assert_close(s_gpu.cpu(), s_cpu, rtol=0, atol=0, equal_nan=True)
