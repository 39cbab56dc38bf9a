"""The expert FFN of SPEC 5 as a plain eager chain: ``FfnExecutor``, the oracle.

    eager = FfnExecutor(backend)
    out = eager.ffn(es, x, x_scale, m_sizes)            # host bf16 [M, H]
    out = eager.moe(es, x, x_scale, topk_ids, topk_weights)  # host bf16 [T, H]

The server runs expert calls through the engine (``_ffn_executor`` and
``_ffn_graphs``: merged, staged, in captured graphs); this module is the same
chain written the obvious way, one call at a time, which the server's answers
equal bit for bit on the same device (the GPU tests hold them to it), and the
place of ``H_DTYPE``, the one choice both share.

``FfnExecutor`` is the chain of SPEC 5.1, built from the backend's GEMM
(``backend.run``, the kernel the gemm endpoint runs) and
``moegemm.kernels.silu_mul_quant``: GEMM(w13) -> SiLU(gate) * up quantized ->
GEMM(w2). One departure from the text: ``h`` (GEMM(w13)'s output) and ``a``
stay float32, where SPEC 5.1 writes bf16. The bf16 chain misses the contract's
own bound (3e-2 against the float64 chain) on small calls: at M = 1 a median
of 1.4e-2 and a maximum of 3.2e-2 over 200 CPU calls (4.8e-2 seen), the bf16
rounding of h being the cause; with float32 h and a, a median of 1.65e-3 and
a maximum of 1.8e-3 at every M (see ``moegemm.kernels.activation``). GEMM(w13)
writes its float32 sum unrounded (the kernels store float32 when ``out`` is
float32); the final output stays bf16. ``moe`` permutes the tokens to experts, runs the same chain, and
combines the k answers of each token weighted, in float32, j = 0..k-1 in order.
It checks what the tensors hold on the host (routing, NaN/Inf) before any
device work, so bad input changes nothing and never indexes out of bounds (the
server checks them on the device instead, and never reads the ids).
"""

from __future__ import annotations

import numpy as np
import torch
from moegemm.client._errors import BadRouting
from moegemm.kernels import quantize_activations, silu_mul_quant
from moegemm.kernels._backend import Backend

from ._checks import bad_rows, not_finite_error
from ._tensors import FP8, to_backend_fp8
from .experts import ExpertSet

H_DTYPE = torch.float32
"""GEMM(w13)'s output ``h``: float32, not SPEC 5.1's bf16 (see the module docstring).
Every backend's GEMM writes it."""


def check_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, G: int) -> None:
    """BadRouting unless every id is in ``[0, G)``, distinct within its token, and
    every weight finite (SPEC 2.2 ``bad_routing``). Host tensors ``[T, k]``."""
    ids = topk_ids.numpy()
    if ids.size == 0:
        return
    if int(ids.min()) < 0 or int(ids.max()) >= G:
        raise BadRouting(f"topk_ids holds an expert outside [0, {G})")
    if ids.shape[1] > 1:
        ordered = np.sort(ids, axis=1)
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            raise BadRouting("topk_ids repeats an expert within a token; each token's k "
                             "experts are distinct")
    if not bool(np.isfinite(topk_weights.numpy()).all()):
        raise BadRouting("topk_weights holds NaN or Inf")


class FfnExecutor:
    """SPEC 5.1/5.2 eagerly on ``backend``'s device, one call at a time."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.device = backend.device
        self.fp8 = backend.fp8_dtype

    def ffn(self, es: ExpertSet, x: torch.Tensor, x_scale: torch.Tensor | None,
            m_sizes: list[int]) -> torch.Tensor:
        """Rows grouped per expert (``m_sizes`` checked by the caller): bf16 ``[M, H]``."""
        _check_finite(x, x_scale)
        xq, xs = self._quantized(x, x_scale)
        sizes = torch.tensor(m_sizes, dtype=torch.int64, device=self.device)
        return self._chain(es, xq, xs, sizes).cpu()

    def moe(self, es: ExpertSet, x: torch.Tensor, x_scale: torch.Tensor | None,
            topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Tokens in their own order, ``k`` experts each: bf16 ``[T, H]``."""
        check_routing(topk_ids, topk_weights, es.G)
        _check_finite(x, x_scale)
        tokens, k = topk_ids.shape
        # Per-token quantization commutes with the gather: quantize T rows, not T*k.
        xq, xs = self._quantized(x, x_scale)
        ids = topk_ids.to(self.device, torch.int64).reshape(-1)
        order = torch.argsort(ids, stable=True)  # expert-major, tokens in order within
        rows = order // k
        sizes = torch.bincount(ids, minlength=es.G)
        y = self._chain(es, xq[rows], xs[rows], sizes)
        per_token = torch.empty_like(y)
        per_token[order] = y
        per_token = per_token.view(tokens, k, es.H).float()
        weights = topk_weights.to(self.device, torch.float32)
        acc = torch.zeros((tokens, es.H), dtype=torch.float32, device=self.device)
        for j in range(k):
            acc += weights[:, j:j + 1] * per_token[:, j]
        return acc.to(torch.bfloat16).cpu()

    def _chain(self, es: ExpertSet, xq, xs, sizes) -> torch.Tensor:
        rows = xq.shape[0]
        if rows == 0:  # nothing to launch (a GPU kernel's grid would be empty)
            return torch.empty((0, es.H), dtype=torch.bfloat16, device=self.device)
        h = torch.empty((rows, 2 * es.I), dtype=H_DTYPE, device=self.device)
        self.backend.run(xq, es.w13.wq, xs, es.w13.w_scale, sizes, h)
        aq, a_scale = silu_mul_quant(h, self.fp8)
        out = torch.empty((rows, es.H), dtype=torch.bfloat16, device=self.device)
        return self.backend.run(aq, es.w2.wq, a_scale, es.w2.w_scale, sizes, out)

    def _quantized(self, x: torch.Tensor, x_scale: torch.Tensor | None):
        x_dev = x.to(self.device)
        if x.dtype in FP8:
            return to_backend_fp8(x_dev.contiguous(), x_scale.to(self.device).contiguous(),
                                  self.fp8)
        return quantize_activations(x_dev, self.fp8)


def _check_finite(x: torch.Tensor, x_scale: torch.Tensor | None) -> None:
    # Before any conversion: fn -> fnuz keeps the bits, and fn's NaN patterns are
    # valid fnuz numbers.
    error = not_finite_error(bad_rows(x, x_scale).numpy())
    if error is not None:
        raise error
