"""Helpers for testing the expert FFN (SPEC 5) on any backend, CPU or GPU.

    p = random_experts(G=4, H=256, I=128)
    x = p.tokens(83)                                   # bf16 [83, H]
    ref = p.ffn_reference(*p.quantized(x), m_sizes)    # float64 [83, H]
    assert rel_error(out, ref) <= FFN_TOLERANCE         # every call, any M
    out = eager_ffn(p, *p.quantized(x), m_sizes)       # the server's chain, eagerly

Weights are scaled by 1/sqrt(K) so ``h`` is of order one and the SiLU is in its
curved range (on huge ``h``, ``silu(v) ~ v`` and a gate/up swap shows far less);
their 128x128 block magnitudes vary log-normally (sigma 1/2), so a scale applied
to the wrong block fails the bound by far. Activations vary less from block to
block (sigma 1/4).

The chain keeps ``h`` and ``a`` in float32 (see ``moegemm.kernels.activation``):
its error is then little more than the output's bf16 rounding: a median of 1.65e-3 and a maximum of 1.8e-3 at every M, M = 1 included (CPU,
200 fresh calls each), so every call is held to the bound. The bf16 ``h`` of
SPEC 5.1's text moved ``a`` across fp8 rounding boundaries: a median of 1.4e-2
and up to 4.8e-2 at M = 1, over the bound about 1 call in 100.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import grouped_gemm
from .activation import silu_mul_quant
from .quant import quantize_activations, quantize_weights
from .reference import ffn_reference_float64, moe_reference_float64

FFN_TOLERANCE = 3e-2
"""SPEC 5.1: ||out - ref||_F / ||ref||_F must not exceed this for ffn and moe."""

FP32_CHAIN_BOUND = 5e-3
"""What the float32 chain meets on every call, M = 1 included (measured max 1.8e-3);
the bf16 chain does not (median 1.4e-2)."""


@dataclass(frozen=True)
class ExpertProblem:
    """One expert set, quantized: ``w13`` ``[G, 2I, H]`` and ``w2`` ``[G, H, I]`` with
    their SPEC 1 scales, and the float weights they came from."""

    w13: torch.Tensor  # float32 [G, 2I, H]
    w2: torch.Tensor  # float32 [G, H, I]
    w13q: torch.Tensor
    w13_scale: torch.Tensor
    w2q: torch.Tensor
    w2_scale: torch.Tensor
    fp8_dtype: torch.dtype

    @property
    def G(self) -> int:
        return self.w13.shape[0]

    @property
    def H(self) -> int:
        return self.w13.shape[2]

    @property
    def I(self) -> int:
        return self.w2.shape[2]

    def tokens(self, m: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Fresh bf16 activations ``[m, H]``, their magnitude varying per 128-block."""
        device = self.w13.device if generator is None else generator.device
        x = torch.randn((m, self.H), generator=generator, device=device)
        blocks = torch.randn((m, self.H // 128, 1), generator=generator, device=device)
        x = (x.reshape(m, self.H // 128, 128) * torch.exp(blocks / 4)).reshape(m, self.H)
        return x.to(self.w13.device, torch.bfloat16)

    def quantized(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` quantized as the server does (SPEC 1.1): ``(xq, x_scale)``."""
        return quantize_activations(x, self.fp8_dtype)

    def ffn_reference(self, xq, x_scale, m_sizes) -> torch.Tensor:
        """SPEC 5.1 in float64 on these experts."""
        return ffn_reference_float64(xq, x_scale, self.w13q, self.w13_scale, self.w2q,
                                     self.w2_scale, torch.as_tensor(m_sizes), self.fp8_dtype)

    def moe_reference(self, xq, x_scale, topk_ids, topk_weights) -> torch.Tensor:
        """SPEC 5.2 in float64 on these experts."""
        return moe_reference_float64(xq, x_scale, self.w13q, self.w13_scale, self.w2q,
                                     self.w2_scale, topk_ids, topk_weights, self.fp8_dtype)


def eager_ffn(p: ExpertProblem, xq, x_scale, m_sizes, *,
              h_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """SPEC 5.1 as the server computes it, eagerly on ``xq``'s device's backend: GEMM(w13)
    into a ``h_dtype`` h (float32, as the server keeps it; bf16 is the contract text's
    chain, for comparison), ``silu_mul_quant``, GEMM(w2). bf16 ``[M, H]``."""
    sizes = torch.as_tensor(m_sizes, dtype=torch.int64, device=xq.device)
    h = torch.empty((xq.shape[0], 2 * p.I), dtype=h_dtype, device=xq.device)
    grouped_gemm(xq, p.w13q, x_scale, p.w13_scale, sizes, out=h)
    aq, a_scale = silu_mul_quant(h, p.fp8_dtype)
    return grouped_gemm(aq, p.w2q, a_scale, p.w2_scale, sizes)


def _varied(shape: tuple[int, int, int], device, generator) -> torch.Tensor:
    """Gaussian weights, each 128x128 block's magnitude log-normal with sigma 1/2."""
    g, n, k = shape
    values = torch.randn(shape, generator=generator, device=device)
    blocks = torch.randn((g, n // 128, 1, k // 128, 1), generator=generator, device=device)
    return (values.view(g, n // 128, 128, k // 128, 128) * torch.exp(blocks / 2)).view(shape)


def random_experts(
    G: int,
    H: int,
    I: int,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> ExpertProblem:
    """Fresh random experts, quantized with the SPEC 1.1 weight quantizer."""
    device = torch.device(device)
    draw_on = generator.device if generator is not None else device
    w13 = _varied((G, 2 * I, H), draw_on, generator) / math.sqrt(H)
    w2 = _varied((G, H, I), draw_on, generator) / math.sqrt(I)
    w13, w2 = w13.to(device), w2.to(device)
    w13q, w13_scale = quantize_weights(w13, fp8_dtype)
    w2q, w2_scale = quantize_weights(w2, fp8_dtype)
    return ExpertProblem(w13, w2, w13q, w13_scale, w2q, w2_scale, fp8_dtype)


def random_routing(
    T: int,
    k: int,
    G: int,
    *,
    experts: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids int64 [T, k], topk_weights float32 [T, k])``: k distinct experts per
    token, drawn from ``experts`` (default: all G), weights a softmax."""
    pool = torch.arange(G) if experts is None else torch.tensor(experts)
    if k > len(pool):
        raise ValueError(f"k={k} distinct experts from a pool of {len(pool)}")
    picks = torch.rand((T, len(pool)), generator=generator).argsort(dim=1)[:, :k]
    ids = pool[picks].to(torch.int64)
    weights = torch.softmax(torch.randn((T, k), generator=generator), dim=1)
    return ids, weights.to(torch.float32)
