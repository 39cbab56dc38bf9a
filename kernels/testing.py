"""Helpers for testing any backend against the SPEC (shared by the CPU and GPU test suites).

    problem = random_problem(M, N, K, G, device=dev)
    out = backend.run(*problem.args(), poisoned_out(M, N, dev))
    assert rel_error(out, reference_float64(*problem.args())) <= SPEC_TOLERANCE

Data is fresh random every call (never zeros): activations and weights vary in
magnitude from block to block, so a kernel that applies a scale to the wrong
block fails the tolerance by a wide margin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import quantize_activations, quantize_weights

SPEC_TOLERANCE = 5e-3
"""SPEC 1: ||out - ref||_F / ||ref||_F must not exceed this."""


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``||out - ref||_F / ||ref||_F``, computed in float64."""
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    out64 = out.detach().to("cpu", torch.float64)
    ref64 = ref.detach().to("cpu", torch.float64)
    denom = torch.linalg.norm(ref64)
    if denom == 0:
        raise ValueError("the reference is all zeros: a relative error means nothing")
    return float(torch.linalg.norm(out64 - ref64) / denom)


def random_m_sizes(
    g: int, m: int, *, empty_groups: bool = True, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Ragged int64 group sizes ``[g]`` summing to ``m``.

    With ``empty_groups`` (and g > 1), about a third of the groups get no rows,
    always at least one, while at least two (when g > 2) may get rows.
    """
    if g < 1 or m < 0:
        raise ValueError(f"need g >= 1 and m >= 0, got g={g}, m={m}")
    live = torch.ones(g, dtype=torch.bool)
    if empty_groups and g > 1:
        live = torch.rand(g, generator=generator) > 1 / 3
        dead = int(torch.randint(g, (1,), generator=generator))
        live[dead] = False
        # Keep at least two live groups where possible, so group mix-ups show.
        others = [i for i in torch.randperm(g, generator=generator).tolist() if i != dead]
        for i in others[: min(2, g - 1)]:
            live[i] = True
    live_idx = live.nonzero().flatten()
    # Multinomial cut points: genuinely ragged, not a near-even split.
    weights = torch.rand(len(live_idx), generator=generator) ** 2 + 1e-3
    picks = torch.multinomial(weights, m, replacement=True, generator=generator) if m else None
    sizes = torch.zeros(g, dtype=torch.int64)
    if picks is not None:
        sizes[live_idx] = torch.bincount(picks, minlength=len(live_idx))
    return sizes


def _blockwise_random(
    shape: tuple[int, ...], block_shape: tuple[int, ...], device: torch.device, generator
) -> torch.Tensor:
    # Gaussian values times a log-normal magnitude per block, so scales differ.
    values = torch.randn(shape, generator=generator, device=device)
    blocks = [s // b for s, b in zip(shape, block_shape)]
    magnitude = torch.exp(torch.randn(blocks, generator=generator, device=device))
    for dim, b in enumerate(block_shape):
        magnitude = magnitude.repeat_interleave(b, dim=dim)
    return values.mul_(magnitude)


@dataclass(frozen=True)
class Problem:
    """One quantized grouped-GEMM input set (plain ``[G, N, K]`` weights)."""

    xq: torch.Tensor
    wq: torch.Tensor
    x_scale: torch.Tensor
    w_scale: torch.Tensor
    m_sizes: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        """``(xq, wq, x_scale, w_scale, m_sizes)`` in the order every entry point takes."""
        return self.xq, self.wq, self.x_scale, self.w_scale, self.m_sizes


def random_problem(
    m: int,
    n: int,
    k: int,
    g: int,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    device: torch.device | str = "cpu",
    m_sizes: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Problem:
    """Fresh random quantized inputs on ``device`` via the SPEC 1.1 quantizers.

    ``m_sizes`` defaults to :func:`random_m_sizes` with empty groups. Data is
    drawn on ``generator``'s device (``device`` without one), the weights one
    group at a time, so G=256 DeepSeek-size sets fit in device memory.
    """
    device = torch.device(device)
    draw_on = generator.device if generator is not None else device
    if m_sizes is None:
        on_cpu = generator if draw_on.type == "cpu" else None
        m_sizes = random_m_sizes(g, m, generator=on_cpu)
    x = _blockwise_random((m, k), (1, 128), draw_on, generator).to(device)
    xq, x_scale = quantize_activations(x, fp8_dtype)
    del x
    wq = torch.empty((g, n, k), dtype=fp8_dtype, device=device)
    w_scale = torch.empty((g, k // 128, n // 128), dtype=torch.float32, device=device)
    for group in range(g):
        w = _blockwise_random((n, k), (128, 128), draw_on, generator).to(device)
        wq[group], w_scale[group] = quantize_weights(w, fp8_dtype)
    return Problem(xq, wq, x_scale, w_scale, m_sizes.to(device=device, dtype=torch.int64))


def poisoned_out(m: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A bf16 ``[m, n]`` output buffer full of NaN, so rows a kernel skips show up."""
    return torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
