"""The fused SiLU*up + fp8 kernel equals the torch definition of SPEC 5.1 bit for bit.

On a GPU against ``silu_mul_quant`` (E1's ``kernels/activation.py``, or the same
definition in ``_ffn_graphs``); on the CPU in Triton's interpreter (a fresh
process with ``TRITON_INTERPRET=1``), against the same definition with numpy's
``expf``, which is what the interpreter computes (the GPU uses the math
library's, as torch does).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

FORMATS = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _h(m: int, inter: int, gen: torch.Generator, device="cpu",
       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dtype`` ``[m, 2I]`` with large, tiny, zero and signed-zero values, and a block of zeros."""
    h = torch.randn((m, 2 * inter), generator=gen) * 4
    h *= torch.exp(torch.randn((m, 1), generator=gen) * 2)  # rows of very different size
    h[0, :6] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0])
    h[0, inter + 7] = -1e-6
    if m > 1:
        h[1, inter : inter + 128] = 0  # a zero up block: a == 0, the scale's floor
    return h.to(dtype).to(device)


def _same(got, want) -> bool:
    return torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and \
        torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))


def compare_on_cpu() -> None:
    """The interpreter's kernel against the definition with numpy's exp (called in a subprocess)."""
    from moegemm.kernels import quantize_activations
    from moegemm.kernels._triton_act import silu_mul_quant_triton

    gen = torch.Generator().manual_seed(0)
    for fp8 in FORMATS:
        for (m, inter), dtype in zip(((1, 128), (5, 768), (3, 2048)),
                                     (torch.float32, torch.bfloat16, torch.float32)):
            h = _h(m, inter, gen, dtype=dtype)
            gate, up = h[:, :inter].float().numpy(), h[:, inter:].float().numpy()
            with np.errstate(over="ignore"):
                a = (gate / (np.float32(1.0) + np.exp(-gate)) * up).astype(np.float32)
            want = quantize_activations(torch.from_numpy(a), fp8)  # a not rounded to bf16
            assert _same(silu_mul_quant_triton(h, fp8), want), (fp8, m, inter)
            # Rows past ``rows`` are left as they were.
            aq = torch.zeros((m, inter), dtype=fp8)
            scale = torch.full((m, inter // 128), -1.0)
            silu_mul_quant_triton(h, fp8, rows=torch.tensor(1), out=(aq, scale))
            assert _same((aq[:1], scale[:1]), (want[0][:1], want[1][:1]))
            assert (aq[1:].view(torch.uint8) == 0).all() and (scale[1:] == -1).all()


def compare_gather_on(device) -> None:
    """``gather_quantize_triton`` against the torch ops it replaces, repeated rows included."""
    from moegemm.kernels import _triton_act, quantize_activations
    from moegemm.kernels._triton_act import gather_quantize_triton
    from moegemm.server._checks import bad_rows

    gen = torch.Generator().manual_seed(0 if device == "cpu" else torch.seed())
    saved = _triton_act._FEW_ROWS
    # 7168: few rows take a whole row at once, more rows chunks of 8 blocks (row_chunk)
    cases = ((1, 128, 1, saved), (6, 384, 3, saved), (9, 7168, 2, saved), (9, 7168, 2, 0))
    for fp8 in FORMATS:
        for rows, k, repeat, few_rows in cases:
            x = torch.randn((rows, k), generator=gen) * torch.exp(torch.randn((rows, 1), generator=gen))
            x[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
            if rows > 2:
                x[1, 5], x[2, k - 1] = float("nan"), -float("inf")
            x = x.to(torch.bfloat16).to(device)
            gather = torch.randint(0, rows, (rows * repeat,), generator=gen)
            gather[:rows] = torch.arange(rows)  # every row at least once, so every flag is set
            gather = gather.to(device)
            out = (torch.empty((len(gather), k), dtype=fp8, device=device),
                   torch.empty((len(gather), k // 128), device=device))
            flags = torch.full((rows,), 7, dtype=torch.int8, device=device)
            _triton_act._FEW_ROWS = few_rows
            try:
                gather_quantize_triton(x, gather, flags, out)
            finally:
                _triton_act._FEW_ROWS = saved
            want = quantize_activations(x.index_select(0, gather), fp8)
            finite = torch.isfinite(want[1]).all(dim=1)  # rows with NaN/Inf: flagged, values moot
            got = (out[0][finite], out[1][finite])
            assert _same(got, (want[0][finite], want[1][finite])), (fp8, rows, k, few_rows)
            assert torch.equal(flags.cpu(), bad_rows(x.cpu(), None)), (flags, fp8, few_rows)


def test_kernel_in_the_triton_interpreter():
    pytest.importorskip("triton")
    here = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_triton_act; " \
           "test_triton_act.compare_on_cpu(); test_triton_act.compare_gather_on('cpu')"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gather_quantize_equals_the_torch_ops_on_the_gpu():
    pytest.importorskip("triton")
    compare_gather_on("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gather_quantize_equals_the_torch_ops_on_many_rows():
    """A prefill's worth of bf16 rows (65536 x 7168: about half a million of their exact
    quotients are fp8 ties): every code and scale as ``quantize_activations`` gives them."""
    pytest.importorskip("triton")
    from moegemm.kernels import quantize_activations
    from moegemm.kernels._triton_act import gather_quantize_triton

    dev, fp8 = torch.device("cuda"), torch.float8_e4m3fn
    gen = torch.Generator(device=dev).manual_seed(torch.seed())
    rows, k = 65536, 7168
    x = (torch.randn(rows, k, device=dev, generator=gen) * 3).to(torch.bfloat16)
    out = (torch.empty(rows, k, dtype=fp8, device=dev), torch.empty(rows, k // 128, device=dev))
    gather_quantize_triton(x, torch.arange(rows, device=dev),
                           torch.zeros(rows, dtype=torch.int8, device=dev), out)
    for start in range(0, rows, 8192):
        want = quantize_activations(x[start:start + 8192], fp8)
        assert _same((out[0][start:start + 8192], out[1][start:start + 8192]), want), start


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fp8", FORMATS)
def test_kernel_equals_the_torch_definition_on_the_gpu(fp8):
    pytest.importorskip("triton")
    from moegemm.kernels import silu_mul_quant
    from moegemm.kernels._triton_act import silu_mul_quant_triton

    gen = torch.Generator().manual_seed(torch.seed())
    for m, inter in ((1, 128), (83, 768), (256, 2048), (7, 384)):
        h = _h(m, inter, gen, "cuda")
        want = silu_mul_quant(h, fp8)  # the torch definition (SPEC 5.1's activation)
        assert _same(silu_mul_quant_triton(h, fp8), want), (fp8, m, inter)
        # A row stride other than 2I (a view into a wider buffer) reads the same.
        wide = torch.zeros((m, 2 * inter + 256), dtype=h.dtype, device="cuda")
        wide[:, : 2 * inter] = h
        assert _same(silu_mul_quant_triton(wide[:, : 2 * inter], fp8), want)
        rows = torch.tensor(m // 2, device="cuda")
        aq = torch.zeros((m, inter), dtype=fp8, device="cuda")
        scale = torch.full((m, inter // 128), -1.0, device="cuda")
        silu_mul_quant_triton(h, fp8, rows=rows, out=(aq, scale))
        half = m // 2
        assert _same((aq[:half], scale[:half]), (want[0][:half], want[1][:half]))
        assert (scale[half:] == -1).all()
