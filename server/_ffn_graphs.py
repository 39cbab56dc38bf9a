"""Expert FFNs (SPEC 5) in captured graphs: GEMM(w13) -> SiLU*up + fp8 -> GEMM(w2).

A *family* is what a graph depends on: the expert-set shape ``(G, H, I)``,
whether x arrives as bf16 (quantized inside the graph) or as fp8 with scales,
and for ``moe`` the top-k. Each family owns static device buffers sized for
the largest bucket and one graph per bucket (powers of two of rows, up to
``max_bucket_m``; ``moe`` buckets its tokens so that ``tokens * k`` fits);
larger calls run in chunks.

``ffn`` graph, over a bucket of rows (the callers' rows concatenated):

1. check the rows' contents and regroup them per expert (``_prologue``, as the
   gemm graphs do: the merge order of ``_merge`` comes with the sizes), and
   quantize them (bf16 families: one kernel, ``_triton_act.gather_quantize_triton``);
2. GEMM with ``w13``, the fused activation (``kernels._triton_act``), GEMM
   with ``w2``;
3. put the rows back in the callers' order, in one result buffer with the
   flags, downloaded in one copy.

``moe`` graph, over a bucket of tokens: route the (token, slot) pairs to
experts on the device (``_moe_route.route``: counts, positions, the routing
checks), gather the x rows per expert, the FFN above, and the weighted combine
``out[t] = bf16(sum_j w[t, j] * y[pos(t, j)])`` (float32 sum). The host never
reads the ids; the routing flags come back with the output, in the one
download, and a flagged call is answered ``bad_routing``.

Expert sets of one family share its graphs: the GEMMs read each expert's
weight and scale addresses from int64 tables (``w13`` and ``w2``) in the
family's meta buffer, uploaded with the sizes before each replay -- the gemm
graphs' mechanism (``_graphs.fill_addresses``, ``Backend.run_addressed``).

With the triton backend the steps are the Triton kernels named above; with any
other backend (the CPU reference: eager, the real rows only) their torch
definitions below, which the kernels equal bit for bit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from moegemm.kernels import quantize_activations, silu_mul_quant
from moegemm.kernels._backend import Backend

from ._checks import bad_rows, not_finite_error
from ._executor import chunk_sizes
from ._ffn import h_dtype
from ._graphs import ADDRESS_WORDS, _no_gc, bucket_for, buckets_up_to, fill_addresses
from ._merge import plan_merge
from ._tensors import to_backend_fp8

log = logging.getLogger("moegemm.server.ffn_graphs")

BLOCK = 128


# -- the torch definitions of the graph's own steps ------------------------------------------


def silu_mul_quant_torch(h: torch.Tensor, fp8_dtype: torch.dtype):
    """SPEC 5.1's activation as the server computes it: ``a = silu(h[:, :I]) * h[:, I:]`` in
    float32 (not rounded to bf16), quantized (SPEC 1.1): ``kernels.activation``."""
    return silu_mul_quant(h, fp8_dtype)


def route_torch(ids, weights, tokens, G, k, m_sizes, pos, src, live, flags) -> None:
    """``_moe_route.route`` in torch (any device; ``tokens`` an int64 scalar tensor)."""
    bucket = flags.shape[0]
    rows = bucket * k
    e = ids[:rows]
    t = torch.arange(rows, device=ids.device) // k
    eff = torch.where((t < tokens) & (e >= 0) & (e < G), e, G)
    # Stable counting sort by expert: keys are unique, so any sort is stable.
    order = torch.sort(eff * rows + torch.arange(rows, device=ids.device)).indices
    pos[:rows].scatter_(0, order, torch.arange(rows, device=ids.device))
    src[:rows].copy_(order // k)
    counts = torch.zeros(G + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, eff, torch.ones_like(eff))
    m_sizes.copy_(counts[:G])
    live.copy_(counts[:G].sum())
    e2, w2 = e.view(bucket, k), weights[:rows].view(bucket, k)
    bad = (e2 < 0) | (e2 >= G) | ~torch.isfinite(w2)
    bad = bad | ((e2[:, :, None] == e2[:, None, :]) &
                 ~torch.eye(k, dtype=torch.bool, device=ids.device)).any(dim=2)
    real = torch.arange(bucket, device=ids.device) < tokens
    flags.copy_((bad.any(dim=1) & real).to(torch.int8))


def combine_torch(y, pos, weights, tokens, k, out) -> None:
    """``_moe_route.combine`` in torch: the float32 sum in slot order, one rounding at the end."""
    bucket = out.shape[0]
    p, w = pos[: bucket * k].view(bucket, k), weights[: bucket * k].view(bucket, k)
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for j in range(k):
        acc = acc + w[:, j, None] * y.index_select(0, p[:, j]).float()
    real = (torch.arange(bucket, device=out.device) < tokens)[:, None]
    out.copy_(torch.where(real, acc.to(torch.bfloat16), out))


# -- families and their buffers ----------------------------------------------------------------


@dataclass(frozen=True)
class FfnFamily:
    """What a captured graph depends on, besides the bucket; ``top_k`` 0 for ``ffn``."""

    G: int
    H: int
    I: int
    quantize: bool
    top_k: int = 0


class _Buffers:
    """One family's static device buffers (leading rows used by each bucket).

    ``meta`` int64, uploaded in one copy: the group sizes ``[G]`` (ffn; moe's
    are computed on the device), the ``w13`` and ``w2`` tables ``[2, G]`` each,
    ``tokens`` (moe) and ``live`` (ffn: the real rows), and per row its
    (gather, scatter) pair (ffn). ``result``: flags at byte 0 (x's per row or token, then
    moe's routing per token), the bf16 output at :meth:`out_offset`.
    """

    def __init__(self, f: FfnFamily, rows: int, tokens: int, x_dtype, device) -> None:
        G = f.G
        self.family, self.rows, self.tokens = f, rows, tokens
        self.x = torch.zeros((rows, f.H), dtype=x_dtype, device=device)
        self.x_scale = None if f.quantize else \
            torch.ones((rows, f.H // BLOCK), dtype=torch.float32, device=device)
        self.words = 4 * G + 2 + G + 2 * rows
        self.meta = torch.zeros(self.words, dtype=torch.int64, device=device)
        host = torch.zeros(self.words, dtype=torch.int64)
        self.meta_host = host.pin_memory() if device.type == "cuda" else host
        order = self.meta_host[5 * G + 2:].view(rows, 2)
        order.copy_(torch.arange(rows)[:, None])
        self.meta.copy_(self.meta_host)
        out_rows = tokens if f.top_k else rows
        self.result = torch.zeros(self.out_offset(out_rows) + 2 * out_rows * f.H,
                                  dtype=torch.uint8, device=device)
        if f.top_k:
            self.ids = torch.zeros(rows, dtype=torch.int64, device=device)
            self.weights = torch.zeros(rows, dtype=torch.float32, device=device)
            self.m_sizes_dev = torch.zeros(G, dtype=torch.int64, device=device)
            self.live_dev = torch.zeros((), dtype=torch.int64, device=device)
            self.pos = torch.zeros(rows, dtype=torch.int64, device=device)
            self.src = torch.zeros(rows, dtype=torch.int64, device=device)
        self.host_tables: tuple = ()

    def table13(self):
        """The device words with w13's wq and w_scale base addresses (``run_addressed``)."""
        G = self.family.G
        return self.meta[G : G + ADDRESS_WORDS]

    def table2(self):
        """The same for w2 (each table keeps its [2, G] room in ``meta``)."""
        G = self.family.G
        return self.meta[3 * G : 3 * G + ADDRESS_WORDS]

    def tokens_word(self):
        return self.meta[5 * self.family.G]

    def live_word(self):
        return self.meta[5 * self.family.G + 1]

    def m_sizes(self):
        return self.m_sizes_dev if self.family.top_k else self.meta[: self.family.G]

    def order(self, rows: int):
        G = self.family.G
        pairs = self.meta[5 * G + 2 : 5 * G + 2 + 2 * rows].view(rows, 2)
        return pairs[:, 0], pairs[:, 1]

    @staticmethod
    def out_offset(rows: int) -> int:
        return -(-2 * rows // 256) * 256  # room for two flag bytes per row

    def flags(self, n: int) -> torch.Tensor:
        return self.result[:n].view(torch.int8)

    def route_flags(self, n: int) -> torch.Tensor:
        return self.result[n : 2 * n].view(torch.int8)

    def out(self, n: int) -> torch.Tensor:
        at = self.out_offset(n)
        return self.result[at : at + 2 * n * self.family.H].view(torch.bfloat16).view(n, -1)

    def packed(self, launched: int, n: int) -> torch.Tensor:
        return self.result[: self.out_offset(launched) + 2 * n * self.family.H]


def _unpack(host: torch.Tensor, launched: int, n: int, H: int):
    at = _Buffers.out_offset(launched)
    out = host[at : at + 2 * n * H].view(torch.bfloat16).view(n, H)
    return out, host[:n].view(torch.int8), host[launched : launched + n].view(torch.int8)


def _bad_routing(message: str):
    from moegemm.client._errors import error_for

    return error_for(400, "bad_routing", message)


_ROUTING_MESSAGE = ("topk_ids must hold distinct experts per token, each in [0, G), and "
                    "topk_weights finite numbers")


class FfnGraphs:
    """SPEC 5's ``ffn`` and ``moe`` on the device, one captured graph per family and bucket.

    ``ffn(es, x, x_scale, m_sizes)`` and ``moe(es, x, x_scale, topk_ids, topk_weights)``
    return host bf16 tensors and raise the contract's errors (``not_finite``,
    ``bad_routing``); ``ffn_many`` runs several ``ffn`` calls as one merged launch.
    ``es`` has ``G``, ``H``, ``I`` and weight sets ``w13``/``w2`` (``wq``, ``w_scale``).
    Call from one thread (the engine's device thread).
    """

    def __init__(self, backend: Backend, max_bucket_m: int, *, graphs: bool = True) -> None:
        if max_bucket_m < 1 or max_bucket_m & (max_bucket_m - 1):
            raise ValueError(f"max_bucket_m must be a power of two, got {max_bucket_m}")
        self.backend = backend
        self.device = backend.device
        self.fp8 = backend.fp8_dtype
        self.h_dtype = h_dtype(backend)  # float32 where the GEMM writes it (_ffn.py)
        self.max_bucket = max_bucket_m
        self.buckets = buckets_up_to(max_bucket_m)
        is_gpu = self.device.type == "cuda"
        self.use_graphs = bool(graphs and is_gpu and backend.capture_safe)
        self.pad_to_bucket = bool(is_gpu and backend.capture_safe)
        # The gemm pool's seam: the row checks + regrouping kernel and the launcher by
        # address (the public function's kernel and tile), where the backend has them.
        self.check_and_gather = backend.check_and_gather if is_gpu else None
        self.run_table: Callable | None = backend.run_addressed if is_gpu else None
        triton = backend.name == "triton"
        if triton:
            from moegemm.kernels._triton_act import gather_quantize_triton, silu_mul_quant_triton

            from ._moe_route import combine, route

            self._act = lambda h, rows: silu_mul_quant_triton(h, self.fp8, rows=rows)
            self._route, self._combine = route, combine
            self._gather_quant = gather_quantize_triton
        else:
            self._gather_quant = None
            self._act = lambda h, rows: silu_mul_quant_torch(h, self.fp8)
            self._route, self._combine = route_torch, combine_torch
        self._buffers: dict[FfnFamily, _Buffers] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.replays = 0
        self.eager_runs = 0

    # -- families -----------------------------------------------------------------------------

    def _family(self, es, x_dtype: torch.dtype, top_k: int = 0) -> FfnFamily:
        return FfnFamily(es.G, es.H, es.I, x_dtype == torch.bfloat16, top_k)

    def max_tokens(self, k: int) -> int:
        """The largest moe token bucket for top-``k``: a power of two with ``tokens * k <= max_bucket_m``."""
        if k > self.max_bucket:
            raise ValueError(f"top-k {k} exceeds max_bucket_m {self.max_bucket}")
        return 1 << ((self.max_bucket // k).bit_length() - 1)

    def buffers(self, f: FfnFamily) -> _Buffers:
        bufs = self._buffers.get(f)
        if bufs is None:
            x_dtype = torch.bfloat16 if f.quantize else self.fp8
            tokens = self.max_tokens(f.top_k) if f.top_k else 0
            bufs = _Buffers(f, self.max_bucket, tokens, x_dtype, self.device)
            self._buffers[f] = bufs
        return bufs

    def _fill_tables(self, bufs: _Buffers, es) -> None:
        """Write ``es``'s weight tables into the host meta (when they changed)."""
        if self.run_table is None:
            return
        key = (es.w13.wq.data_ptr(), es.w13.w_scale.data_ptr(), es.w2.wq.data_ptr(),
               es.w2.w_scale.data_ptr())
        if bufs.host_tables == key:
            return
        G = es.G
        fill_addresses(bufs.meta_host[G : G + ADDRESS_WORDS], es.w13.wq, es.w13.w_scale)
        fill_addresses(bufs.meta_host[3 * G : 3 * G + ADDRESS_WORDS], es.w2.wq, es.w2.w_scale)
        bufs.host_tables = key

    def _gemm(self, xq, xs, table, ws, m_sizes, out) -> None:
        if self.run_table is not None:
            self.run_table(xq, table, xs, m_sizes, out, groups=ws.wq.shape[0])
        else:
            self.backend.run(xq, ws.wq, xs, ws.w_scale, m_sizes, out)

    # -- the graphs' bodies ----------------------------------------------------------------------

    def _chain(self, bufs: _Buffers, es, xq, xs, rows: int, live) -> torch.Tensor:
        """GEMM(w13) -> activation -> GEMM(w2) over ``rows`` expert-ordered rows."""
        f, m_sizes = bufs.family, bufs.m_sizes()
        if live is None and f.top_k:
            # A backend that reads m_sizes (the CPU reference) gets the rows that belong to
            # experts; the rest (bad ids, flagged) stay zero.
            n = int(bufs.live_dev)
            y = torch.zeros((rows, f.H), dtype=torch.bfloat16, device=self.device)
            y[:n] = self._chain(bufs, es, xq[:n], xs[:n], n, 0)
            return y
        h = torch.empty((rows, 2 * f.I), dtype=self.h_dtype, device=self.device)
        self._gemm(xq, xs, bufs.table13(), es.w13, m_sizes, h)
        aq, a_scale = self._act(h, live)
        y = torch.empty((rows, f.H), dtype=torch.bfloat16, device=self.device)
        self._gemm(aq, a_scale, bufs.table2(), es.w2, m_sizes, y)
        return y

    def _gather(self, bufs: _Buffers, x, xs, src, rows: int, flags) -> tuple:
        """Rows ``src`` of ``x`` (and its scales), checking what the sources hold into ``flags``;
        quantized (bf16 families)."""
        if bufs.family.quantize and self._gather_quant is not None:
            xq = torch.empty((rows, x.shape[1]), dtype=self.fp8, device=self.device)
            xs = torch.empty((rows, x.shape[1] // BLOCK), dtype=torch.float32, device=self.device)
            return self._gather_quant(x, src, flags, (xq, xs))
        if self.check_and_gather is not None:
            xg = torch.empty((rows, x.shape[1]), dtype=x.dtype, device=self.device)
            xsg = None if xs is None else torch.empty((rows, xs.shape[1]), dtype=xs.dtype,
                                                      device=self.device)
            # The kernel runs one program per row of its x argument and reads rows ``src``.
            self.check_and_gather(bufs.x[:rows], None if xs is None else bufs.x_scale[:rows],
                                  src, xg, xsg, flags)
            x, xs = xg, xsg
        else:
            flags.copy_(bad_rows(x, xs))
            x = x.index_select(0, src)
            xs = None if xs is None else xs.index_select(0, src)
        if bufs.family.quantize:
            return quantize_activations(x, self.fp8)
        return x, xs

    def _ffn_body(self, bufs: _Buffers, es, rows: int) -> None:
        gather, scatter = bufs.order(rows)
        xs = None if bufs.x_scale is None else bufs.x_scale[:rows]
        xq, xs = self._gather(bufs, bufs.x[:rows], xs, gather, rows, bufs.flags(rows))
        live = bufs.live_word() if self.pad_to_bucket else None
        y = self._chain(bufs, es, xq, xs, rows, live)
        torch.index_select(y, 0, scatter, out=bufs.out(rows))

    def _moe_body(self, bufs: _Buffers, es, tokens: int) -> None:
        k = bufs.family.top_k
        rows = tokens * k
        self._route(bufs.ids, bufs.weights, bufs.tokens_word(), es.G, k, bufs.m_sizes_dev,
                    bufs.pos, bufs.src, bufs.live_dev, bufs.route_flags(tokens))
        xs = None if bufs.x_scale is None else bufs.x_scale[:tokens]
        xq, xs = self._gather(bufs, bufs.x[:tokens], xs, bufs.src[:rows], rows, bufs.flags(tokens))
        live = bufs.live_dev if self.pad_to_bucket else None
        y = self._chain(bufs, es, xq, xs, rows, live)
        self._combine(y, bufs.pos, bufs.weights, bufs.tokens_word(), k, bufs.out(tokens))

    def _run(self, bufs: _Buffers, es, launched: int) -> str:
        """Replay the bucket's graph (capturing it first if needed), or run eagerly."""
        key = self._graph_key(bufs.family, launched, es)
        if self.use_graphs:
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._capture(bufs, es, launched)
            graph.replay()
            self.replays += 1
            return "graph"
        self._body(bufs, es, launched)
        self.eager_runs += 1
        return "eager"

    def _body(self, bufs: _Buffers, es, launched: int) -> None:
        if bufs.family.top_k:
            self._moe_body(bufs, es, launched)
        else:
            self._ffn_body(bufs, es, launched)

    def _graph_key(self, f: FfnFamily, launched: int, es) -> tuple:
        if self.run_table is not None:
            return (f, launched)
        return (f, launched, es.w13.wq.data_ptr(), es.w2.wq.data_ptr())

    def _capture(self, bufs: _Buffers, es, launched: int) -> torch.cuda.CUDAGraph:
        """Capture one bucket's graph on the buffers as they are (a valid launch's words)."""
        started = time.monotonic()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._body(bufs, es, launched)  # warm-up: Triton compiles outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with _no_gc(), torch.cuda.graph(graph, pool=self._mempool,
                                        capture_error_mode="thread_local"):
            self._body(bufs, es, launched)
        self._graphs[self._graph_key(bufs.family, launched, es)] = graph
        log.info("captured ffn graph %s bucket %d in %.2f s", bufs.family, launched,
                 time.monotonic() - started)
        return graph

    def prepare(self, es, top_ks: Sequence[int] = ()) -> int:
        """Capture every bucket's graphs for ``es``'s shape (``ffn`` with bf16 and fp8 inputs,
        ``moe`` for each of ``top_ks``) ahead of the first calls; return how many are new.

        Calls capture the graph of a bucket they find missing, so this only moves the
        time (Triton compiles and captures: seconds per family) to load time.
        """
        if not self.use_graphs:
            return 0
        before = len(self._graphs)
        families = [self._family(es, dtype) for dtype in (torch.bfloat16, self.fp8)]
        families += [self._family(es, dtype, k) for k in top_ks for dtype in (torch.bfloat16, self.fp8)]
        G = es.G
        for f in families:
            bufs = self.buffers(f)
            self._fill_tables(bufs, es)
            top = bufs.tokens if f.top_k else self.max_bucket
            for bucket in reversed([b for b in self.buckets if b <= top]):
                if self._graph_key(f, bucket, es) in self._graphs:
                    continue
                meta = bufs.meta_host.numpy()
                meta[:G] = 0
                meta[0] = bucket  # every row in the first expert: valid for any bucket
                meta[5 * G] = meta[5 * G + 1] = bucket
                pairs = meta[5 * G + 2 : 5 * G + 2 + 2 * bucket].reshape(bucket, 2)
                pairs[:] = np.arange(bucket, dtype=np.int64)[:, None]
                words = 5 * G + 2 + 2 * bucket
                bufs.meta[:words].copy_(bufs.meta_host[:words])
                self._capture(bufs, es, bucket)
        torch.cuda.synchronize(self.device)
        return len(self._graphs) - before

    def graph_count(self) -> int:
        """Graphs currently held."""
        return len(self._graphs)

    # -- inputs --------------------------------------------------------------------------------

    def _device_fp8(self, x: torch.Tensor, x_scale):
        """x on the device in the family's dtype (bf16 or the device's fp8), and the flags of
        the rows as they came when a conversion could hide them (None otherwise)."""
        x = x.to(self.device, non_blocking=False)
        x_scale = None if x_scale is None else x_scale.to(self.device, torch.float32)
        if x.dtype == torch.bfloat16 or (x.dtype == self.fp8):
            return x, x_scale, None
        # fp16/fp32 are quantized, the other fp8 format converted: check before (fn -> fnuz
        # keeps the bits, and fn's NaN codes are numbers in fnuz).
        flags = bad_rows(x, x_scale)
        if x_scale is None:
            x, x_scale = quantize_activations(x, self.fp8)
        else:
            x, x_scale = to_backend_fp8(x, x_scale, self.fp8)
        return x, x_scale, flags

    def _launch_rows(self, rows: int) -> int:
        return bucket_for(rows, self.buckets) if self.pad_to_bucket else rows

    # -- ffn -------------------------------------------------------------------------------------

    def ffn(self, es, x: torch.Tensor, x_scale, m_sizes: Sequence[int]) -> torch.Tensor:
        """SPEC 5.1 for rows grouped per expert: host bf16 ``[M, H]``; raises NotFinite."""
        (out,) = self.ffn_many(es, [(x, x_scale, m_sizes)])
        if isinstance(out, Exception):
            raise out
        return out

    def ffn_many(self, es, calls) -> list:
        """Several ``(x, x_scale, m_sizes)`` calls on ``es`` merged into one launch (per x dtype
        and per chunk of ``max_bucket_m`` rows): each call's host bf16 ``[M_i, H]`` -- the
        same bits as alone -- or the contract error (NotFinite) for a call with bad rows."""
        results: list = [None] * len(calls)
        by_kind: dict[tuple, list[int]] = {}
        for i, (x, xs, _) in enumerate(calls):
            by_kind.setdefault((x.dtype, xs is None), []).append(i)
        for idx in by_kind.values():
            got = self._ffn_merged(es, [calls[i] for i in idx])
            for i, r in zip(idx, got):
                results[i] = r
        return results

    def _ffn_merged(self, es, calls) -> list:
        plan = plan_merge([np.asarray(c[2], dtype=np.int64) for c in calls])
        prepared = [self._device_fp8(x, xs) for x, xs, _ in calls]
        x = torch.cat([p[0] for p in prepared]) if len(prepared) > 1 else prepared[0][0]
        xs = None
        if prepared[0][1] is not None:
            xs = torch.cat([p[1] for p in prepared]) if len(prepared) > 1 else prepared[0][1]
        bufs = self.buffers(self._family(es, x.dtype))
        rows = plan.total
        if rows <= self.max_bucket:
            # One launch: the graph regroups the rows per expert and puts them back.
            gather = None if plan.is_identity else plan.gather
            out, flags = self._ffn_launch(bufs, es, x, xs, plan.m_sizes, gather)
        else:
            # Chunks of the largest bucket, each already in expert order.
            if not plan.is_identity:
                order = torch.from_numpy(plan.gather).to(self.device)
                x = x.index_select(0, order)
                xs = None if xs is None else xs.index_select(0, order)
            out = torch.empty((rows, es.H), dtype=torch.bfloat16)
            flags = np.zeros(rows, dtype=np.int8)
            for start in range(0, rows, self.max_bucket):
                stop = min(rows, start + self.max_bucket)
                o, fl = self._ffn_launch(bufs, es, x[start:stop],
                                         None if xs is None else xs[start:stop],
                                         chunk_sizes(plan.m_sizes, start, stop), None)
                out[start:stop], flags[start:stop] = o, fl
            if not plan.is_identity:
                out = out.index_select(0, torch.from_numpy(plan.scatter))
                flags = flags[plan.scatter]
        answers = []
        for i, (a, b) in enumerate(zip(plan.offsets[:-1], plan.offsets[1:])):
            raw = prepared[i][2]
            call_flags = flags[a:b] if raw is None else flags[a:b] | raw.cpu().numpy()
            err = not_finite_error(call_flags)
            answers.append(err if err is not None else out[a:b])
        return answers

    def _ffn_launch(self, bufs: _Buffers, es, x, xs, sizes: np.ndarray, gather):
        """One launch over ``len(x)`` rows (``<= max_bucket_m``) in the callers' order, whose
        expert order is ``gather`` (None: the identity) with group sizes ``sizes``:
        host (bf16 ``[n, H]``, int8 flags ``[n]``) in the callers' order."""
        n, G = x.shape[0], es.G
        if n == 0:
            return torch.empty((0, es.H), dtype=torch.bfloat16), np.zeros(0, dtype=np.int8)
        launched = self._launch_rows(n)
        bufs.x[:n].copy_(x)
        if xs is not None:
            bufs.x_scale[:n].copy_(xs)
        self._fill_tables(bufs, es)
        meta = bufs.meta_host.numpy()
        meta[5 * G + 1] = n
        meta[:G] = sizes
        pairs = meta[5 * G + 2 : 5 * G + 2 + 2 * launched].reshape(launched, 2)
        pairs[:] = np.arange(launched, dtype=np.int64)[:, None]  # padding rows stay in place
        if gather is not None:
            pairs[:n, 0] = gather
            pairs[gather, 1] = np.arange(n, dtype=np.int64)
        words = 5 * G + 2 + 2 * launched
        bufs.meta[:words].copy_(bufs.meta_host[:words], non_blocking=True)
        self._run(bufs, es, launched)
        host = bufs.packed(launched, n).to("cpu", copy=True)  # a copy on the CPU too
        out, flags, _ = _unpack(host, launched, n, es.H)
        return out, flags.numpy()

    # -- moe -------------------------------------------------------------------------------------

    def moe(self, es, x: torch.Tensor, x_scale, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor) -> torch.Tensor:
        """SPEC 5.2 for tokens in their own order: host bf16 ``[T, H]``; raises NotFinite or
        BadRouting (checked on the device, never read on the host)."""
        T, k = topk_ids.shape
        if k == 0:  # no expert for any token: the empty sum
            err = not_finite_error(bad_rows(x.cpu(), None if x_scale is None else x_scale.cpu())
                                   .numpy())
            if err is not None:
                raise err
            return torch.zeros((T, es.H), dtype=torch.bfloat16)
        x, x_scale, raw_flags = self._device_fp8(x, x_scale)
        f = self._family(es, x.dtype, top_k=k)
        bufs = self.buffers(f)
        H, G = es.H, es.G
        out = torch.empty((T, H), dtype=torch.bfloat16)
        x_flags = np.zeros(T, dtype=np.int8)
        routing = False
        ids = topk_ids.reshape(-1)
        weights = topk_weights.reshape(-1).to(torch.float32)
        step = bufs.tokens
        for start in range(0, T, step):
            stop = min(T, start + step)
            n = stop - start
            launched = self._launch_rows(n)
            bufs.x[:n].copy_(x[start:stop])
            if x_scale is not None:
                bufs.x_scale[:n].copy_(x_scale[start:stop])
            # int32 ids widen on the device (a copy into the int64 buffer), not on the host.
            bufs.ids[: n * k].copy_(ids[start * k : stop * k].to(self.device))
            bufs.weights[: n * k].copy_(weights[start * k : stop * k])
            self._fill_tables(bufs, es)
            meta = bufs.meta_host.numpy()
            meta[5 * G] = n
            words = 5 * G + 2
            bufs.meta[:words].copy_(bufs.meta_host[:words], non_blocking=True)
            self._run(bufs, es, launched)
            host = bufs.packed(launched, n).to("cpu", copy=True)  # a copy on the CPU too
            o, fl, rfl = _unpack(host, launched, n, H)
            out[start:stop] = o
            x_flags[start:stop] = fl.numpy()
            routing = routing or bool(rfl.numpy().any())
        if raw_flags is not None:
            x_flags |= raw_flags.cpu().numpy()
        err = not_finite_error(x_flags)
        if err is not None:
            raise err
        if routing:
            raise _bad_routing(_ROUTING_MESSAGE)
        return out
