"""SiLU(gate) * up with the 1x128 fp8 quantization of its output (SPEC 5.1), in torch.

    aq, a_scale = silu_mul_quant(h, fp8_dtype)

``h`` is the bf16 ``[M, 2I]`` output of the w13 GEMM: gate columns ``0..I-1``,
up columns ``I..2I-1`` (vLLM's w13 layout). This is the definition the fused
GPU kernels are held to bit for bit: the product is computed in float32,
rounded once to bf16, then quantized per token and per 128-wide block exactly
as :func:`moegemm.kernels.quantize_activations` does.
"""

from __future__ import annotations

import torch

from .quant import BLOCK, fp8_max, quantize_activations


def silu_mul_quant(
    h: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """``a = bf16(silu(h[:, :I]) * h[:, I:])`` quantized: ``(aq [M, I], a_scale [M, I/128])``.

    ``silu(v) = v / (1 + exp(-v))`` in float32. ``aq`` is in ``fp8_dtype``,
    ``a_scale`` float32. Runs on any device; reads no tensor contents on the
    host. Raises TypeError/ValueError unless ``h`` is bf16 ``[M, 2I]`` with
    ``I % 128 == 0``.
    """
    fp8_max(fp8_dtype)  # refuses a dtype that is not an fp8 e4m3 format
    if h.dtype != torch.bfloat16:
        raise TypeError(f"h must be bfloat16, got {h.dtype}")
    if h.dim() != 2 or h.shape[1] % (2 * BLOCK):
        raise ValueError(f"h must be [M, 2I] with I % {BLOCK} == 0, got {tuple(h.shape)}")
    inter = h.shape[1] // 2
    gate = h[:, :inter].float()
    up = h[:, inter:].float()
    a = (gate / (1.0 + torch.exp(-gate)) * up).to(torch.bfloat16)
    return quantize_activations(a, fp8_dtype)
