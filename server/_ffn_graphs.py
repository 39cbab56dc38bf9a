"""Expert FFNs (SPEC 5) in captured graphs: GEMM(w13) -> SiLU*up + fp8 -> GEMM(w2).

A *family* is what a graph depends on: the expert-set shape ``(G, H, I)``,
whether x arrives as bf16 (quantized inside the graph) or as fp8 with scales,
and for ``moe`` the top-k. Each family owns static device buffers sized for
the largest bucket (:class:`FfnBuffers`) and one graph per bucket (powers of
two of rows up to ``max_bucket_m``; ``moe`` buckets its tokens so that
``tokens * k`` fits). The executor (``_ffn_executor.py``) writes a launch's
inputs and words into the buffers, then :meth:`FfnGraphs.launch` replays the
bucket's graph (or runs the same body eagerly).

``ffn`` graph, over a bucket of rows (the callers' rows concatenated):

1. check the rows' contents and regroup them per expert (the gemm graphs'
   prologue, ``Backend.check_and_gather``: the merge order comes with the
   sizes), and quantize them (bf16 families: one kernel,
   ``_triton_act.gather_quantize_triton``);
2. GEMM with ``w13``, the fused activation (``kernels._triton_act``), GEMM
   with ``w2``;
3. put the rows back in the callers' order, in one result buffer with the
   flags, downloaded in one copy.

``moe`` graph, over a bucket of two or more tokens: route the (token, slot) pairs to
experts on the device (``_triton_route.route``: counts, positions, the routing
checks), gather the x rows per expert (bf16 tokens: quantized by the routing
kernel itself in a launch of up to ``ROUTE_QUANTIZES_UP_TO`` rows, else each
token once and stored at its k rows, ``_triton_route.quantize_scatter``), the FFN
above, and the weighted combine
``out[t] = bf16(sum_j w[t, j] * y[pos(t, j)])`` (float32 sum). The host never
reads the ids (int32 or int64 as sent, see ``kernels/_triton_route.py``); the routing flags
come back with the output, in the one download. The bucket of one token runs two
kernels instead (``Backend.ffn.moe_token``, triton backend): a lone token's valid ids are
distinct, so every expert it names gets one row and the routing, quantization,
activation and combine fold into the two GEMMs; the same bits.

Expert sets of one family share its graphs: the GEMMs read each matrix's
weight and scale base addresses from int64 words (``w13`` and ``w2``) in the
family's meta buffer, uploaded with the sizes before each replay -- the gemm
graphs' mechanism (``_graphs.fill_addresses``, ``Backend.run_addressed``).
Without it (a backend with no address launcher) a graph is bound to one set.

Graphs are captured when a set is loaded (:meth:`FfnGraphs.prepare`, on the
engine's loader thread and stream), never on a call's path; a family's graphs
and buffers are dropped when no loaded set has its shape (:meth:`forget`).
Each family's buffers have a lock: the engine's thread holds it while a batch
uses them, a capture while it writes them. Made with ``compile_only`` (a
process compiling a new shape's kernels ahead for a server, ``_ahead.py``),
:meth:`FfnGraphs.prepare` runs the captures' warm-ups only, under the backend's
compile-only launches, and keeps no family's buffers past its warm-up.

With the triton backend the steps are the Triton kernels named above; with any
other backend (the CPU reference: eager, the real rows only) their torch
definitions below, which the kernels equal bit for bit.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from moegemm.kernels import BLOCK, quantize_activations, silu_mul_quant
from moegemm.kernels._backend import Backend

from ._checks import bad_rows
from ._graphs import (
    ADDRESS_WORDS,
    LAUNCH_ALLOWANCE,
    _no_gc,
    bucket_for,
    buckets_up_to,
    fill_addresses,
    meta_bytes,
)

log = logging.getLogger("moegemm.server.ffn_graphs")

H_DTYPE = torch.float32
"""GEMM(w13)'s output ``h`` (and ``a``) stay float32, where SPEC 5.1 writes bf16. The bf16 chain
misses the contract's own bound (3e-2 against the float64 chain) on small calls: at M = 1 a
median of 1.4e-2 and a maximum of 3.2e-2 over 200 CPU calls (4.8e-2 seen), the bf16 rounding of
h being the cause; with float32 h and a, a median of 1.65e-3 and a maximum of 1.8e-3 at every M
(``moegemm.kernels.activation``). GEMM(w13) writes its float32 sum unrounded (every backend's
GEMM stores float32 when ``out`` is float32); the final output stays bf16."""

# The most rows (tokens * k) whose gather and quantization the routing kernel does itself (one
# kernel node less). Its programs walk their expert's rows one by one, so a hot expert's rows
# queue behind each other; the per-row gather kernel wins from there. Measured (H200, the moe
# graph's kernel times summed, bench/profile_moe.py): one token of top-8 (8 rows) ~1 us faster
# fused on DeepSeek-V3 and Qwen3-30B; 128 rows 2-8 us slower, 2048 rows 26-41 us slower.
ROUTE_QUANTIZES_UP_TO = 8


# -- the torch definitions of the graph's own steps ------------------------------------------


def expert_ids_torch(ids: torch.Tensor, wide: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` expert ids of int32 words ``ids`` (int32 ids, or int64 ids as
    (low, high) pairs when the device scalar ``wide`` is 1), int64; an int64 id whose
    high word is not 0 reads as -1. No host read of ``wide``."""
    index = torch.arange(rows, device=ids.device)
    lo = ids[index * (1 + wide)]
    hi = torch.where(wide != 0, ids[index * 2 + 1], 0)
    return torch.where(hi == 0, lo, -1).to(torch.int64)


def route_torch(ids, wide, weights, tokens, G, k, m_sizes, pos, src, live, flags) -> None:
    """``_triton_route.route`` in torch (any device; ``tokens`` and ``wide`` int64 scalar tensors)."""
    bucket = flags.shape[0]
    rows = bucket * k
    e = expert_ids_torch(ids, wide, rows)
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
    """``kernels/_triton_route.combine`` in torch: the float32 sum in slot order, one rounding at the end."""
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


# Where the words of a launch sit in ``FfnBuffers.meta``, after the G group sizes.
_T13, _T2 = 0, ADDRESS_WORDS  # the w13 and w2 base addresses (wq, w_scale each)
_TOKENS, _LIVE, _WIDE = 2 * ADDRESS_WORDS, 2 * ADDRESS_WORDS + 1, 2 * ADDRESS_WORDS + 2
_HEAD = 2 * ADDRESS_WORDS + 3  # words before the (gather, scatter) pairs


class FfnBuffers:
    """One family's static device buffers (leading rows used by each bucket).

    ``meta`` int64, uploaded in one copy: the group sizes ``[G]`` (ffn; moe's
    are computed on the device), the ``w13`` and ``w2`` address words, ``tokens``
    (moe), ``live`` (ffn: the real rows), ``wide`` (moe: int64 ids), and per row
    its (gather, scatter) pair (ffn). ``result``: the x flags per unit (row or
    token), then moe's routing flags per token, the bf16 output at
    :meth:`out_offset`. ``units``: the rows (ffn) or tokens (moe) a launch holds.
    """

    def __init__(self, f: FfnFamily, rows: int, units: int, x_dtype, device) -> None:
        G = f.G
        self.family, self.rows, self.units = f, rows, units
        self.lock = threading.Lock()
        # The callers' rows (ffn) or tokens (moe): ``units`` of them.
        self.x = torch.zeros((units, f.H), dtype=x_dtype, device=device)
        self.x_scale = None if f.quantize else \
            torch.ones((units, f.H // BLOCK), dtype=torch.float32, device=device)
        self.words = G + _HEAD + 2 * rows
        self.meta = torch.zeros(self.words, dtype=torch.int64, device=device)
        host = torch.zeros(self.words, dtype=torch.int64)
        self.meta_host = host.pin_memory() if device.type == "cuda" else host
        self.meta_host[G + _HEAD:].view(rows, 2).copy_(torch.arange(rows)[:, None])
        self.meta.copy_(self.meta_host)
        self.result = torch.zeros(self.out_offset(units) + 2 * units * f.H, dtype=torch.uint8,
                                  device=device)
        if f.top_k:
            self.ids = torch.zeros(rows, dtype=torch.int64, device=device)
            self.weights = torch.zeros(rows, dtype=torch.float32, device=device)
            self.m_sizes_dev = torch.zeros(G, dtype=torch.int64, device=device)
            self.live_dev = torch.zeros((), dtype=torch.int64, device=device)
            self.pos = torch.zeros(rows, dtype=torch.int64, device=device)
            self.src = torch.zeros(rows, dtype=torch.int64, device=device)
            # The one-token body's workspace (``kernels/_triton_moe_token.py``): slot parts, and counters that
            # start at zero and are left at zero by every launch.
            self.parts = torch.zeros((f.top_k, f.H), dtype=torch.float32, device=device)
            self.counts = torch.zeros(f.H // 64, dtype=torch.int32, device=device)
        # What meta_host holds from earlier launches (the executor skips rewriting it):
        # the address words' source, and how many leading pairs are the identity.
        self.host_tables: tuple = ()
        self.host_identity = rows
        self.lane = None  # the executor's byte views and addresses of these buffers

    def _word(self, at: int) -> torch.Tensor:
        return self.meta[self.family.G + at]

    def table13(self) -> torch.Tensor:
        """The device words with w13's wq and w_scale base addresses (``run_addressed``)."""
        G = self.family.G
        return self.meta[G + _T13 : G + _T13 + ADDRESS_WORDS]

    def table2(self) -> torch.Tensor:
        G = self.family.G
        return self.meta[G + _T2 : G + _T2 + ADDRESS_WORDS]

    def tokens_word(self) -> torch.Tensor:
        return self._word(_TOKENS)

    def live_word(self) -> torch.Tensor:
        return self._word(_LIVE)

    def wide_word(self) -> torch.Tensor:
        return self._word(_WIDE)

    def ids_words(self) -> torch.Tensor:
        """``ids`` as int32 words: int32 ids fill the first half, int64 ids all of it."""
        return self.ids.view(torch.int32)

    def m_sizes(self) -> torch.Tensor:
        return self.m_sizes_dev if self.family.top_k else self.meta[: self.family.G]

    def order(self, rows: int):
        at = self.family.G + _HEAD
        pairs = self.meta[at : at + 2 * rows].view(rows, 2)
        return pairs[:, 0], pairs[:, 1]

    def meta_words(self, launched: int) -> int:
        """The leading words of ``meta`` a launch over ``launched`` units reads."""
        return self.family.G + _HEAD + (0 if self.family.top_k else 2 * launched)

    def host_words(self) -> np.ndarray:
        """``meta_host`` as numpy (pinned on a GPU): where a launch's words are written."""
        return self.meta_host.numpy()

    @property
    def word_at(self) -> dict[str, int]:
        """The index in ``meta`` of each word: the address words' first, ``tokens``,
        ``live``, ``wide`` and the first (gather, scatter) pair."""
        G = self.family.G
        return {"tokens": G + _TOKENS, "live": G + _LIVE, "wide": G + _WIDE,
                "t13": G + _T13, "t2": G + _T2, "pairs": G + _HEAD}

    @staticmethod
    def out_offset(units: int) -> int:
        return -(-2 * units // 256) * 256  # room for two flag bytes per unit

    def flags(self, n: int) -> torch.Tensor:
        return self.result[:n].view(torch.int8)

    def route_flags(self, n: int) -> torch.Tensor:
        return self.result[n : 2 * n].view(torch.int8)

    def out(self, n: int) -> torch.Tensor:
        at = self.out_offset(n)
        return self.result[at : at + 2 * n * self.family.H].view(torch.bfloat16).view(n, -1)

    def packed_bytes(self, launched: int, n: int) -> int:
        """The bytes of ``result`` holding the flags and the first ``n`` output rows of a
        launch over ``launched`` units."""
        return self.out_offset(launched) + 2 * n * self.family.H


def unpack(host, launched: int, n: int, H: int):
    """The packed result of a launch (a host byte array or tensor) as (bf16 output bytes
    ``[n, 2H]``, x flags ``[n]``, routing flags ``[n]``)."""
    at = FfnBuffers.out_offset(launched)
    return (host[at : at + 2 * n * H].reshape(n, 2 * H), host[:n].view(np.int8),
            host[launched : launched + n].view(np.int8))


def _weakly(obj) -> Callable[[], object]:
    """A weak reference to ``obj`` where it takes one (an ExpertSet does), else a strong one
    (the tests' and benchmarks' stand-in sets)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class FfnGraphs:
    """SPEC 5's ``ffn`` and ``moe`` bodies on the device, one captured graph per family and
    bucket (or eager: graphs off, the CPU). Used from the engine's threads only: calls on
    its device thread, captures and drops on its loader thread."""

    def __init__(self, backend: Backend, max_bucket_m: int, *, graphs: bool = True,
                 compile_only: bool = False) -> None:
        if max_bucket_m < 1 or max_bucket_m & (max_bucket_m - 1):
            raise ValueError(f"max_bucket_m must be a power of two, got {max_bucket_m}")
        self.backend = backend
        self.device = backend.device
        self.fp8 = backend.fp8_dtype
        self.max_bucket = max_bucket_m
        self.buckets = buckets_up_to(max_bucket_m)
        is_gpu = self.device.type == "cuda"
        self.use_graphs = bool(graphs and is_gpu and backend.capture_safe)
        self.pad_to_bucket = bool(is_gpu and backend.capture_safe)
        # The gemm pool's seam: the row checks + regrouping kernel and the launcher by
        # address (the public function's kernel and tile), where the backend has them.
        self.check_and_gather = backend.check_and_gather if is_gpu else None
        self.run_table: Callable | None = backend.run_addressed if is_gpu else None
        self._gather_quant = backend.gather_quantize if is_gpu else None
        kernels = backend.ffn if is_gpu else None  # the backend's FFN kernels, else torch's
        if kernels is not None:
            self._act = lambda h, rows: kernels.silu_mul_quant(h, self.fp8, rows=rows)
            self._route, self._combine = kernels.route, kernels.combine
            # bf16 tokens: quantized by the routing kernel for a few rows, past that once per
            # token and stored at its k rows.
            self._quantize_scatter = kernels.quantize_scatter
            self._moe_token = kernels.moe_token
        else:
            self._moe_token = None
            self._quantize_scatter = None
            self._act = lambda h, rows: silu_mul_quant(h, self.fp8)
            self._route, self._combine = route_torch, combine_torch
        self._buffers: dict[FfnFamily, FfnBuffers] = {}
        # Every set prepared and not forgotten (live, or about to be swapped in), by id, held
        # weakly (a set that failed to go live and was dropped counts no more): a family's
        # shape is dropped only when none of them has it.
        self._sets: dict[int, Callable[[], object]] = {}
        self._buffers_lock = threading.Lock()  # the device thread and the loader make them
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._side: torch.cuda.Stream | None = None  # the captures' warm-up stream
        self.compile_only = compile_only
        self.replays = 0
        self.eager_runs = 0
        self.captures = 0

    # -- families -----------------------------------------------------------------------------

    def family(self, es, quantize: bool, top_k: int = 0) -> FfnFamily:
        return FfnFamily(es.G, es.H, es.I, quantize, top_k)

    def max_tokens(self, k: int) -> int:
        """The largest moe token bucket for top-``k``: a power of two with ``tokens * k <=
        max_bucket_m``."""
        if not 1 <= k <= self.max_bucket:
            raise ValueError(f"top-k {k} is outside [1, max_bucket_m={self.max_bucket}]")
        return 1 << ((self.max_bucket // k).bit_length() - 1)

    def units(self, f: FfnFamily) -> int:
        """What one launch of ``f`` holds: rows (ffn) or tokens (moe)."""
        return self.max_tokens(f.top_k) if f.top_k else self.max_bucket

    def held(self, f: FfnFamily) -> FfnBuffers | None:
        """The family's static buffers, if a set's :meth:`prepare` made them (its graphs
        use them)."""
        return self._buffers.get(f)

    def holds(self, bufs: FfnBuffers) -> bool:
        """Whether ``bufs`` are still their family's static buffers (not forgotten)."""
        return self._buffers.get(bufs.family) is bufs

    def batch_buffers(self, f: FfnFamily, units: int) -> FfnBuffers:
        """Buffers for one eager batch over ``units`` rows (ffn) or tokens (moe): the
        family's static ones where a set prepared it, else buffers of the batch's own size,
        freed with it. A family nobody prepared (a top-k without graphs, or the shape of
        a set deleted while its calls waited) never holds device memory past its batch:
        callers choosing new top-ks cannot pile up static buffers."""
        bufs = self._buffers.get(f)
        if bufs is not None:
            return bufs
        return self._allocate(f, self.launch_rows(min(units, self.units(f))))

    def _allocate(self, f: FfnFamily, units: int | None = None, device=None) -> FfnBuffers:
        """Buffers for launches of up to ``units`` rows or tokens (default: the largest)."""
        x_dtype = torch.bfloat16 if f.quantize else self.fp8
        device = device or self.device
        if units is None:
            return FfnBuffers(f, self.max_bucket, self.units(f), x_dtype, device)
        return FfnBuffers(f, units * max(f.top_k, 1), units, x_dtype, device)

    def shape_bytes(self, es, top_ks: Iterable[int]) -> int:
        """The device memory an expert set of ``es``'s shape (``G``, ``H``, ``I``) takes beside
        its matrices and their gemm graphs while it loads (0 where a loaded set has the
        shape, or with graphs off): the static buffers of every family :meth:`prepare`
        captures, at the largest bucket, and the largest launch's temporaries twice (its
        eager warm-up's stay in the allocator's cache while the capture takes its own), a
        routed row's being its rows gathered in fp8 with scales, ``h`` in float32, the
        activation's fp8 rows and scales, and ``y`` in bf16, and ``_graphs.LAUNCH_ALLOWANCE``.
        (A backend without the Triton steps runs torch's routing and activation, whose own
        temporaries are not counted.)"""
        families = self.families(es, top_ks)
        if not self.use_graphs or any(f in self._buffers for f in families):
            return 0
        meta = torch.device("meta")
        static = sum(meta_bytes(self._allocate(f, device=meta)) for f in families)
        H, I = es.H, es.I
        row = (H + H // BLOCK * 4 + 2 * I * H_DTYPE.itemsize + I + I // BLOCK * 4
               + 2 * H)
        return static + 2 * self.max_bucket * row + LAUNCH_ALLOWANCE

    def buffers(self, f: FfnFamily) -> FfnBuffers:
        """The family's static buffers, made and published now if no :meth:`prepare` made
        them (tests and profiles that write them by hand)."""
        bufs = self._buffers.get(f)
        if bufs is None:
            with self._buffers_lock:
                bufs = self._buffers.get(f)
                if bufs is None:
                    bufs = self._buffers[f] = self._allocate(f)
        return bufs

    def launch_rows(self, n: int) -> int:
        """The bucket a launch over ``n`` units runs (``n`` itself without padding)."""
        return bucket_for(n, self.buckets) if self.pad_to_bucket else n

    def fill_tables(self, bufs: FfnBuffers, es) -> None:
        """Write ``es``'s address words into the host meta (when they changed)."""
        if self.run_table is None:
            return
        key = (es.w13.wq.data_ptr(), es.w13.w_scale.data_ptr(), es.w2.wq.data_ptr(),
               es.w2.w_scale.data_ptr())
        if bufs.host_tables == key:
            return
        at = bufs.word_at
        fill_addresses(bufs.meta_host[at["t13"] : at["t13"] + ADDRESS_WORDS], es.w13.wq,
                       es.w13.w_scale)
        fill_addresses(bufs.meta_host[at["t2"] : at["t2"] + ADDRESS_WORDS], es.w2.wq,
                       es.w2.w_scale)
        bufs.host_tables = key

    def _gemm(self, xq, xs, table, ws, m_sizes, out) -> None:
        if self.run_table is not None:
            self.run_table(xq, table, xs, m_sizes, out, groups=ws.wq.shape[0])
        else:
            self.backend.run(xq, ws.wq, xs, ws.w_scale, m_sizes, out)

    # -- launching ---------------------------------------------------------------------------------

    def graph(self, f: FfnFamily, launched: int, es) -> torch.cuda.CUDAGraph | None:
        """The captured graph of ``f`` over ``launched`` units for ``es``, if any."""
        return self._graphs.get(self._graph_key(f, launched, es))

    def launch(self, bufs: FfnBuffers, es, launched: int) -> str:
        """Run the family's body over ``launched`` units on the buffers as the caller wrote
        them: "graph" (its captured graph replayed: on the family's static buffers only) or
        "eager"."""
        graph = self.graph(bufs.family, launched, es) if self.holds(bufs) else None
        if graph is not None:
            graph.replay()
            self.replays += 1
            return "graph"
        self._body(bufs, es, launched)
        self.eager_runs += 1
        return "eager"

    def _graph_key(self, f: FfnFamily, launched: int, es) -> tuple:
        if self.run_table is not None:
            return (f, launched)
        return (f, launched, es.w13.wq.data_ptr(), es.w2.wq.data_ptr())

    # -- the graphs' bodies ----------------------------------------------------------------------

    def _chain(self, bufs: FfnBuffers, es, xq, xs, rows: int, live) -> torch.Tensor:
        """GEMM(w13) -> activation -> GEMM(w2) over ``rows`` expert-ordered rows."""
        f, m_sizes = bufs.family, bufs.m_sizes()
        if live is None and f.top_k:
            # A backend that reads m_sizes (the CPU reference) gets the rows that belong to
            # experts; the rest (bad ids, flagged) stay zero.
            n = int(bufs.live_dev)
            y = torch.zeros((rows, f.H), dtype=torch.bfloat16, device=self.device)
            y[:n] = self._chain(bufs, es, xq[:n], xs[:n], n, 0)
            return y
        h = torch.empty((rows, 2 * f.I), dtype=H_DTYPE, device=self.device)  # float32 (H_DTYPE)
        self._gemm(xq, xs, bufs.table13(), es.w13, m_sizes, h)
        aq, a_scale = self._act(h, live)
        y = torch.empty((rows, f.H), dtype=torch.bfloat16, device=self.device)
        self._gemm(aq, a_scale, bufs.table2(), es.w2, m_sizes, y)
        return y

    def _gather(self, bufs: FfnBuffers, x, xs, src, rows: int, flags) -> tuple:
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
            self.check_and_gather(x, xs, src, xg, xsg, flags)
            x, xs = xg, xsg
        else:
            flags.copy_(bad_rows(x, xs))
            x = x.index_select(0, src)
            xs = None if xs is None else xs.index_select(0, src)
        if bufs.family.quantize:
            return quantize_activations(x, self.fp8)
        return x, xs

    def _ffn_body(self, bufs: FfnBuffers, es, rows: int) -> None:
        gather, scatter = bufs.order(rows)
        xs = None if bufs.x_scale is None else bufs.x_scale[:rows]
        xq, xs = self._gather(bufs, bufs.x[:rows], xs, gather, rows, bufs.flags(rows))
        live = bufs.live_word() if self.pad_to_bucket else None
        y = self._chain(bufs, es, xq, xs, rows, live)
        torch.index_select(y, 0, scatter, out=bufs.out(rows))

    def _moe_body(self, bufs: FfnBuffers, es, tokens: int) -> None:
        if tokens == 1 and self._moe_token is not None:
            self._token_body(bufs, es)
            return
        k = bufs.family.top_k
        xq, xs = self._route_gather(bufs, es, tokens)
        live = bufs.live_dev if self.pad_to_bucket else None
        y = self._chain(bufs, es, xq, xs, tokens * k, live)
        self._combine(y, bufs.pos, bufs.weights, bufs.tokens_word(), k, bufs.out(tokens))

    def _token_body(self, bufs: FfnBuffers, es) -> None:
        """moe's body for a launch of one token, in two kernels (``kernels/_triton_moe_token.py``): the token's
        valid ids are distinct, so each expert it names gets one row, the token itself --
        nothing to route, gather or put back, and the GEMMs can quantize, activate and
        combine as they go (a kernel costs 2-5 us of dependent latency at this size). From
        two tokens an expert may get several rows: the grouped body. The bits are the
        grouped body's for the same rows (``kernels/_triton_moe_token.py`` says how)."""
        f = bufs.family
        h = torch.empty((f.top_k, 2 * f.I), dtype=torch.float32, device=self.device)
        xs = None if bufs.x_scale is None else bufs.x_scale[:1]
        self._moe_token(bufs.x[:1], xs, bufs.ids_words(), bufs.wide_word(),
                        bufs.weights[: f.top_k], bufs.tokens_word(), bufs.table13(),
                        bufs.table2(), f.G, f.I, h, bufs.parts, bufs.counts, bufs.out(1),
                        bufs.flags(1), bufs.route_flags(1))

    def _route_gather(self, bufs: FfnBuffers, es, tokens: int) -> tuple:
        """moe's first step over ``tokens`` bucket tokens: route them, and the routed rows
        gathered per expert (quantized for bf16 tokens), as ``(xq, x_scale)``."""
        k = bufs.family.top_k
        rows = tokens * k
        route = (bufs.ids_words(), bufs.wide_word(), bufs.weights, bufs.tokens_word(), es.G, k,
                 bufs.m_sizes_dev, bufs.pos, bufs.src, bufs.live_dev, bufs.route_flags(tokens))
        if bufs.family.quantize and self._quantize_scatter is not None:
            xq = torch.empty((rows, es.H), dtype=self.fp8, device=self.device)
            xs = torch.empty((rows, es.H // BLOCK), dtype=torch.float32, device=self.device)
            if rows <= ROUTE_QUANTIZES_UP_TO:
                self._route(*route, quantize=(bufs.x[:tokens], (xq, xs), bufs.flags(tokens)))
            else:
                self._route(*route)
                self._quantize_scatter(bufs.x[:tokens], bufs.pos[:rows], k, bufs.flags(tokens),
                                       (xq, xs))
        else:
            self._route(*route)
            xs = None if bufs.x_scale is None else bufs.x_scale[:tokens]
            xq, xs = self._gather(bufs, bufs.x[:tokens], xs, bufs.src[:rows], rows,
                                  bufs.flags(tokens))
        return xq, xs

    def _body(self, bufs: FfnBuffers, es, launched: int) -> None:
        if bufs.family.top_k:
            self._moe_body(bufs, es, launched)
        else:
            self._ffn_body(bufs, es, launched)

    # -- capture and release -------------------------------------------------------------------

    def prepare(self, es, top_ks: Iterable[int] = ()) -> int:
        """Capture every bucket's graph for ``es``'s shape (``ffn`` with bf16 and fp8 inputs,
        ``moe`` for each of ``top_ks`` up to G) that is not there yet, on the current thread
        and stream; return how many are new. Calls of a top-k not captured run eagerly."""
        self._sets[id(es)] = _weakly(es)
        if not self.use_graphs:
            return 0
        before = len(self._graphs)
        for f in self.families(es, top_ks):
            self._prepare_family(f, es)
        torch.cuda.synchronize(self.device)
        return len(self._graphs) - before

    def families(self, es, top_ks: Iterable[int]) -> list[FfnFamily]:
        """The families :meth:`prepare` captures for ``es``: ``ffn`` and each top-k up to G,
        with bf16 and fp8 inputs."""
        kinds = [0] + sorted({k for k in top_ks if 1 <= k <= min(es.G, self.max_bucket)})
        return [self.family(es, quantize, k) for k in kinds for quantize in (True, False)]

    def prepared(self, es, top_ks: Iterable[int]) -> bool:
        """Whether every graph :meth:`prepare` would capture for ``es`` is there (graphs off:
        there is nothing to capture)."""
        return not self.use_graphs or all(
            self._graph_key(f, b, es) in self._graphs
            for f in self.families(es, top_ks) for b in self.buckets if b <= self.units(f))

    def _prepare_family(self, f: FfnFamily, es) -> None:
        # A new family's buffers are published with its graphs, at the end: until then no
        # batch sees them (a deleted set's calls of a forgotten shape may still be running).
        bufs = self._buffers.get(f)
        fresh = bufs is None
        if fresh:
            bufs = self._allocate(f)
        top = bufs.units
        missing = [b for b in reversed(self.buckets)
                   if b <= top and self._graph_key(f, b, es) not in self._graphs]
        if not missing:
            return
        started = time.monotonic()
        with bufs.lock:
            self.fill_tables(bufs, es)
            for bucket in missing:
                meta = bufs.host_words()
                at = bufs.word_at
                G = f.G
                meta[:G] = 0
                meta[0] = bucket  # every row in the first expert: valid for any bucket
                meta[at["tokens"]] = meta[at["live"]] = bucket
                meta[at["wide"]] = 1  # (ids are all zero: expert 0 for every slot)
                pairs = meta[at["pairs"] : at["pairs"] + 2 * bucket].reshape(bucket, 2)
                pairs[:] = np.arange(bucket, dtype=np.int64)[:, None]
                words = at["pairs"] + 2 * bucket
                bufs.meta[:words].copy_(bufs.meta_host[:words])
                if f.top_k:  # distinct experts per token: routing the warm-up validly
                    bufs.ids[: bucket * f.top_k].copy_(
                        torch.arange(f.top_k, device=self.device).repeat(bucket))
                self._capture(bufs, es, bucket)
            # The identity order was written for the largest missing bucket's rows; past them
            # the host order is the identity only if it was already.
            bufs.host_identity = max(bufs.host_identity, missing[0])
        if self.compile_only:
            # Its device may be nearly full: a family's buffers live only while it warms up.
            torch.cuda.synchronize(self.device)
            with self._buffers_lock:
                self._buffers.pop(f, None)
        elif fresh:
            with self._buffers_lock:
                self._buffers[f] = bufs
        log.info("captured %d ffn graphs for %s in %.2f s", len(missing), f,
                 time.monotonic() - started)

    def _capture(self, bufs: FfnBuffers, es, launched: int) -> None:
        """Capture one bucket's graph on the buffers as they are (a valid launch's words)."""
        # One warm-up stream for all captures: split-K workspaces are kept per stream.
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._body(bufs, es, launched)  # warm-up: Triton compiles outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.compile_only:
            return
        graph = torch.cuda.CUDAGraph()
        # thread_local: the event loop's thread keeps allocating pinned request buffers
        # during a capture, which "global" mode would turn into errors.
        with _no_gc(), torch.cuda.graph(graph, pool=self._mempool,
                                        capture_error_mode="thread_local"):
            self._body(bufs, es, launched)
        self._graphs[self._graph_key(bufs.family, launched, es)] = graph
        self.captures += 1

    def forget(self, es) -> int:
        """Drop what only ``es`` (replaced or deleted, or never swapped in) used: its own
        graphs (graphs bound to one set), and the graphs and buffers of every family whose
        shape no other prepared set has (one loaded meanwhile, not yet swapped in, too).
        Returns how many graphs were dropped."""
        self._sets.pop(id(es), None)
        shapes = {(a.G, a.H, a.I) for held in list(self._sets.values()) if (a := held())}
        before = len(self._graphs)
        # A copy of the families first (one C call): a batch may be adding one.
        for f in [f for f in list(self._buffers) if (f.G, f.H, f.I) not in shapes]:
            with self._buffers[f].lock, self._buffers_lock:  # not while a batch uses them
                for key in [key for key in self._graphs if key[0] == f]:
                    del self._graphs[key]
                del self._buffers[f]
        if self.run_table is None:
            ptrs = (es.w13.wq.data_ptr(), es.w2.wq.data_ptr())
            for key in [key for key in self._graphs if key[2:] == ptrs]:
                del self._graphs[key]
        return before - len(self._graphs)

    def graph_count(self) -> int:
        """Graphs currently held."""
        return len(self._graphs)
