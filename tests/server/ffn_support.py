"""Helpers of the expert-FFN tests: stand-in expert sets, the float64 chain of SPEC 5, and
``FfnExecutor``, the server's chain run eagerly (the oracle its answers equal bit for bit)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from moegemm.client._errors import BadRouting
from moegemm.kernels import ffn_reference_float64, quantize_activations, silu_mul_quant
from moegemm.kernels._backend import Backend
from moegemm.kernels.testing import random_problem
from moegemm.server._checks import bad_rows, not_finite_error
from moegemm.server._ffn_graphs import H_DTYPE
from moegemm.server._tensors import FP8, to_backend_fp8

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


def ffn_float64(es, xq, x_scale, m_sizes, fp8) -> torch.Tensor:
    """SPEC 5.1 in float64 (h and a unrounded, aq quantized from the float64 a)."""
    w13q, w13s = es.w13.wq.cpu(), es.w13.w_scale.cpu()
    w2q, w2s = es.w2.wq.cpu(), es.w2.w_scale.cpu()
    sizes = torch.as_tensor(m_sizes, dtype=torch.int64)
    return ffn_reference_float64(xq.cpu(), x_scale.cpu(), w13q, w13s, w2q, w2s, sizes, fp8)


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


# -- the server's expert executor, driven with tensors ------------------------------------------


def ffn_call(es, x: torch.Tensor, x_scale, m_sizes, deadline=None):
    """A validated ffn call as the server makes one: the body packed, decoded and checked
    by ``_request`` (the one validator), against expert set ``es``."""
    from moegemm.client._wire import packb
    from moegemm.server._request import decode_gemm
    from moegemm.server._request import ffn_call as validate
    from server_support import wire

    body = {"x": wire(x.cpu()), "m_sizes": wire(torch.as_tensor(m_sizes, dtype=torch.int64))}
    if x_scale is not None:
        body["x_scale"] = wire(x_scale.cpu())
    return validate(decode_gemm(packb(body)), lambda: es, max_m=1 << 20, deadline=deadline)


def moe_call(es, x: torch.Tensor, x_scale, topk_ids, topk_weights, deadline=None):
    """A validated moe call (``_request.moe_call``) against expert set ``es``."""
    from moegemm.client._wire import packb
    from moegemm.server._request import decode_moe
    from moegemm.server._request import moe_call as validate
    from server_support import wire

    body = {"x": wire(x.cpu()), "topk_ids": wire(topk_ids.cpu()),
            "topk_weights": wire(topk_weights.cpu())}
    if x_scale is not None:
        body["x_scale"] = wire(x_scale.cpu())
    return validate(decode_moe(packb(body)), lambda: es, max_m=1 << 20, max_top_k=1 << 20,
                    deadline=deadline)


def answer_rows(out, width: int) -> torch.Tensor:
    """An engine or executor answer (bf16 bytes ``[rows, 2 width]``) as bf16 ``[rows, width]``."""
    rows = torch.from_numpy(out.copy())
    if not rows.numel():
        return torch.empty((out.shape[0], width), dtype=torch.bfloat16)
    return rows.view(torch.bfloat16)


class Runner:
    """The server's ``ExpertExecutor`` (and its ``FfnGraphs``) driven with tensors: calls go
    through the real validator and run as the engine runs a batch; answers come back as
    host bf16 tensors, errors as exceptions (``*_many``: in the list)."""

    def __init__(self, backend, max_bucket: int, *, graphs: bool = True, top_ks=(1, 2, 8)):
        from moegemm.server._ffn_executor import ExpertExecutor
        from moegemm.server._ffn_graphs import FfnGraphs
        from moegemm.server._staging import Staging

        self.graphs = FfnGraphs(backend, max_bucket, graphs=graphs)
        self.executor = ExpertExecutor(self.graphs, Staging(backend.device), top_ks)
        self.launches = []

    def prepare(self, es) -> int:
        return self.executor.prepare(es)

    def run(self, es, calls) -> list:
        """One batch of validated calls (one key), as ``Engine._run_batch`` runs it."""
        self.executor.staging.enter()
        outcomes, launches = self.executor.run_calls(es, calls)
        self.launches.append(launches)
        return [o if isinstance(o, Exception) else answer_rows(o, es.H) for o in outcomes]

    def ffn_many(self, es, calls) -> list:
        """``(x, x_scale, m_sizes)`` calls merged as the engine would: in batches by key."""
        return self._batched(es, [ffn_call(es, *c) for c in calls])

    def moe_many(self, es, calls) -> list:
        """``(x, x_scale, topk_ids, topk_weights)`` calls merged by key, as ``ffn_many``."""
        return self._batched(es, [moe_call(es, *c) for c in calls])

    def _batched(self, es, calls) -> list:
        by_key: dict = {}
        for i, call in enumerate(calls):
            if call.rows == 0:
                continue
            by_key.setdefault(self.executor.batch_key(call), []).append(i)
        results: list = [torch.empty((c.out_shape[0], es.H), dtype=torch.bfloat16)
                         for c in calls]
        for idx in by_key.values():
            limit = max(self.executor.batch_rows(calls[idx[0]]), 1)
            batch, rows = [], 0
            for i in idx + [None]:
                if i is None or (batch and rows + calls[i].rows > limit):
                    for j, out in zip(batch, self.run(es, [calls[b] for b in batch])):
                        results[j] = out
                    batch, rows = [], 0
                if i is not None:
                    batch.append(i)
                    rows += calls[i].rows
        return results

    def ffn(self, es, x, x_scale, m_sizes) -> torch.Tensor:
        return _raised(self.ffn_many(es, [(x, x_scale, m_sizes)])[0])

    def moe(self, es, x, x_scale, topk_ids, topk_weights) -> torch.Tensor:
        return _raised(self.moe_many(es, [(x, x_scale, topk_ids, topk_weights)])[0])


def _raised(out):
    if isinstance(out, Exception):
        raise out
    return out


# -- the eager chain: the oracle the server's expert answers equal bit for bit ----------------
#
# SPEC 5.1/5.2 written the obvious way, one call at a time, from the backend's GEMM
# (``backend.run``, the kernel the gemm endpoint runs) and ``silu_mul_quant``: GEMM(w13) ->
# SiLU(gate) * up quantized -> GEMM(w2), h in float32 as the server keeps it
# (``_ffn_graphs.H_DTYPE``). ``moe`` permutes the tokens to experts, runs the same chain and
# combines the k answers of each token weighted, in float32, j = 0..k-1 in order. It checks
# what the tensors hold on the host (routing, NaN/Inf) before any device work (the server
# checks them on the device instead, and never reads the ids).


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

    def ffn(self, es, x: torch.Tensor, x_scale: torch.Tensor | None,
            m_sizes: list[int]) -> torch.Tensor:
        """Rows grouped per expert (``m_sizes`` checked by the caller): bf16 ``[M, H]``."""
        _check_finite(x, x_scale)
        xq, xs = self._quantized(x, x_scale)
        sizes = torch.tensor(m_sizes, dtype=torch.int64, device=self.device)
        return self._chain(es, xq, xs, sizes).cpu()

    def moe(self, es, x: torch.Tensor, x_scale: torch.Tensor | None,
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

    def _chain(self, es, xq, xs, sizes) -> torch.Tensor:
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
