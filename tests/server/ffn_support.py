"""Helpers of the expert-FFN tests: stand-in expert sets and the float64 chain of SPEC 5."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from moegemm.kernels import quantize_activations, reference_float64
from moegemm.kernels.testing import random_problem

FFN_TOLERANCE = 3e-2
"""SPEC 5.1: relative Frobenius error against the float64 chain."""


def expert_set(G: int, H: int, I: int, fp8, device, gen: torch.Generator, name: str = "e"):
    """A duck-typed ExpertSet: ``G``, ``H``, ``I`` and WeightSet-like ``w13``/``w2`` on ``device``."""
    p13 = random_problem(1, 2 * I, H, G, fp8_dtype=fp8, generator=gen)
    p2 = random_problem(1, H, I, G, fp8_dtype=fp8, generator=gen)

    def ws(p, suffix, N, K):
        return SimpleNamespace(wq=p.wq.to(device), w_scale=p.w_scale.to(device), G=G, N=N, K=K,
                               name=f"{name}.{suffix}")

    return SimpleNamespace(name=name, G=G, H=H, I=I, w13=ws(p13, "w13", 2 * I, H),
                           w2=ws(p2, "w2", H, I))


def _quantize64(a: torch.Tensor, fp8):
    limit = 448.0 if fp8 == torch.float8_e4m3fn else 240.0
    m, k = a.shape
    blocks = a.reshape(m, k // 128, 128)
    scale = blocks.abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / limit
    return (blocks / scale).clamp(-limit, limit).to(fp8).reshape(m, k), scale.reshape(m, -1)


def ffn_float64(es, xq, x_scale, m_sizes, fp8) -> torch.Tensor:
    """SPEC 5.1 in float64 (h and a unrounded, aq quantized from the float64 a)."""
    try:
        from moegemm.kernels import ffn_reference_float64
    except ImportError:
        ffn_reference_float64 = None
    w13q, w13s = es.w13.wq.cpu(), es.w13.w_scale.cpu()
    w2q, w2s = es.w2.wq.cpu(), es.w2.w_scale.cpu()
    sizes = torch.as_tensor(m_sizes, dtype=torch.int64)
    if ffn_reference_float64 is not None:
        return ffn_reference_float64(xq.cpu(), x_scale.cpu(), w13q, w13s, w2q, w2s, sizes, fp8)
    h = reference_float64(xq.cpu(), w13q, x_scale.cpu(), w13s, sizes)
    gate, up = h[:, : es.I], h[:, es.I :]
    aq, a_scale = _quantize64(gate / (1.0 + torch.exp(-gate)) * up, fp8)
    return reference_float64(aq, w2q, a_scale, w2s, sizes)


def moe_float64(es, xq, x_scale, topk_ids, topk_weights, fp8) -> torch.Tensor:
    """SPEC 5.2 in float64: ``out[t] = sum_j w[t, j] * ffn_{ids[t, j]}(x[t])``."""
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64).cpu()
    order = torch.argsort(flat, stable=True)
    rows = order // k
    sizes = torch.bincount(flat, minlength=es.G)
    y = ffn_float64(es, xq.cpu()[rows], x_scale.cpu()[rows], sizes, fp8)
    w = topk_weights.reshape(-1).double().cpu()[order]
    out = torch.zeros((T, es.H), dtype=torch.float64)
    return out.index_add_(0, rows, y * w[:, None])


def quantized(x: torch.Tensor, x_scale, fp8):
    """What the server computes on: x as given (fp8) or quantized (bf16), on the CPU."""
    if x_scale is None:
        return quantize_activations(x.cpu(), fp8)
    return x.cpu(), x_scale.cpu()


def random_x(T: int, H: int, gen: torch.Generator, fp8=None, device="cpu"):
    """bf16 ``[T, H]`` (``fp8`` None) or fp8 with scales, drawn on ``gen``'s device."""
    x = torch.randn((T, H), generator=gen, device=gen.device) * 2
    if fp8 is None:
        return x.to(torch.bfloat16).to(device), None
    xq, xs = quantize_activations(x, fp8)
    return xq.to(device), xs.to(device)


def random_routing(T: int, G: int, k: int, gen: torch.Generator, *, experts=None,
                   dtype=torch.int64):
    """``topk_ids`` distinct per token (from ``experts``, default all G) and positive weights."""
    pool = torch.arange(G) if experts is None else torch.as_tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(T)]) \
        if T else torch.zeros((0, k), dtype=torch.int64)
    w = torch.rand((T, k), generator=gen) + 0.05
    return ids.to(dtype), (w / w.sum(dim=1, keepdim=True)).float()


POOL_ROWS = 16
"""Small calls are judged together until this many rows: one row's error has a heavy tail (about
one row in twenty passes 3e-2 with the CPU reference, the chain's definition, on these weights'
log-normal block magnitudes), while the bound is about the chain, not one unlucky row."""


def repeats(rows: int) -> int:
    """How many fresh calls of ``rows`` rows make up one judged sample."""
    return max(1, -(-POOL_ROWS // max(rows, 1)))


def pooled_error(pairs) -> float:
    """The relative Frobenius error of (out, float64 ref) pairs taken together."""
    from moegemm.kernels.testing import rel_error

    return rel_error(torch.cat([o.double() for o, _ in pairs]), torch.cat([r for _, r in pairs]))
