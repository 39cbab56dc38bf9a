"""From validated expert calls to host answers: merging, staging, graphs (SPEC 5.1, 5.2).

The engine hands :meth:`ExpertExecutor.run_calls` a batch of ``ffn`` calls
(``_request.FfnCall``) or ``moe`` calls (``_request.MoeCall``) for one expert
set, one input dtype (and for moe one top-k and one ids dtype), as it hands
the gemm executor (``_executor.py``) gemm calls; the engine's batching, queue
bound, deadlines, fair turns and loop-thread rule are the same for all three.
Two ways, chosen by what the calls need, as for gemm:

- **the graph path**: inputs the graph takes as they are (bf16, or the
  device's fp8 with scales), at most one bucket, a captured graph. Each
  caller's rows (and a moe call's ids and weights) go by one driver copy from
  where its body lies to their place in the family's static buffers, the
  launch's words by one more, the graph does the rest (``_ffn_graphs``), and
  one copy brings flags and output back: no torch call on the way;
- **the general path**: a conversion first (fp16/fp32 quantized, the other
  fp8 format converted), more units than the largest bucket (chunks), a top-k
  with no captured graphs, or no graphs at all (the CPU): torch copies, the
  same body replayed or run eagerly.

**Merged equals alone, bit for bit** (SPEC 5.1). A merged batch runs the
bucket of its total rows, and the GEMMs' tile is chosen from that bucket: a
larger bucket can switch schedule or split-K, which changes the float32
summation order of every row. So a call joins only batches whose bucket runs
the same tiles as its own bucket, for both GEMMs (``Backend.tile_key``):
:meth:`ExpertExecutor.batch_key` names the run of consecutive buckets that
share its tiles, and :meth:`batch_rows` bounds a batch by that run's top.
Everything else in the chain is per row (the prologue, the activation and
quantization, the moe combine per token), so equal tiles give equal bits.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch
from moegemm.client._errors import BadRouting

from ._checks import bad_rows, not_finite_error
from ._executor import COPY_OUT_BELOW, Launches, body_view, chunk_sizes, to_device_fp8
from ._ffn_graphs import H_DTYPE, FfnBuffers, FfnGraphs, unpack
from ._graphs import bucket_for
from ._merge import group_order, plan_merge
from ._staging import Staging
from ._tensors import TORCH_DTYPES

_ROUTING = ("topk_ids must hold distinct experts per token, each in [0, G), and "
            "topk_weights finite numbers")


class _Lane:
    """A family's static buffers as flat byte views and their addresses (the graph path)."""

    def __init__(self, bufs: FfnBuffers) -> None:
        def flat(t: torch.Tensor):
            return t.view(-1).view(torch.uint8), t.data_ptr()

        self.x, self.x_addr = flat(bufs.x)
        self.x_row = bufs.x.stride(0) * bufs.x.element_size()
        self.x_scale, self.x_scale_addr = (None, 0) if bufs.x_scale is None else \
            flat(bufs.x_scale)
        self.x_scale_row = 0 if bufs.x_scale is None else bufs.x_scale.stride(0) * 4
        self.meta, self.meta_addr = flat(bufs.meta)
        self.result, self.result_addr = bufs.result, bufs.result.data_ptr()
        if bufs.family.top_k:
            self.ids, self.ids_addr = flat(bufs.ids)
            self.weights, self.weights_addr = flat(bufs.weights)


class ExpertExecutor:
    """Runs batches of ffn or moe calls through :class:`FfnGraphs` on the engine's staging."""

    def __init__(self, graphs: FfnGraphs, staging: Staging, top_ks: Sequence[int]) -> None:
        self.graphs = graphs
        self.staging = staging
        self.backend = graphs.backend
        self.device = graphs.device
        self.top_ks = tuple(top_ks)
        self._fp8_name = next(n for n, d in TORCH_DTYPES.items() if d == self.backend.fp8_dtype)
        self._tops: dict[tuple[int, int, int, int], dict[int, int]] = {}

    # -- batching (the engine asks) --------------------------------------------------------------

    def batch_key(self, call) -> tuple:
        """Calls of one key may share a launch: one set, one dtype (one top-k and ids
        dtype for moe), buckets with the same tiles."""
        top = self._class_top(call)
        if call.kind == "ffn":
            return "ffn", id(call.ws), call.dtype, top
        return "moe", id(call.ws), call.dtype, call.top_k, call.ids_dtype, top

    def batch_rows(self, call) -> int:
        """The most rows (moe: expert rows, ``tokens * k``) a batch holding ``call`` may
        have: the top of its tile run (a call past the largest bucket runs alone)."""
        top = self._class_top(call)
        if top is None:
            return 0
        return top * call.top_k if call.kind == "moe" else top

    def _class_top(self, call) -> int | None:
        """The largest bucket whose tiles equal those of ``call``'s own bucket, with every
        bucket between (None: the call runs in chunks)."""
        g, es = self.graphs, call.ws
        k = call.top_k if call.kind == "moe" else 0
        units = call.tokens if k else call.rows
        if units > (g.max_tokens(k) if k else g.max_bucket):
            return None
        key = (es.G, es.H, es.I, k)
        tops = self._tops.get(key)
        if tops is None:
            tops = self._tops[key] = self._tile_runs(es.G, es.H, es.I, k)
        return tops[bucket_for(max(units, 1), g.buckets)]

    def _tile_runs(self, G: int, H: int, I: int, k: int) -> dict[int, int]:
        """Each bucket's run top: buckets in a run launch both GEMMs with the same tiles."""
        g = self.graphs
        cap = g.max_tokens(k) if k else g.max_bucket
        buckets = [b for b in g.buckets if b <= cap]
        tile = self.backend.tile_key

        def tiles(bucket: int):
            if tile is None:  # a backend that does not say: every bucket its own run
                return bucket
            m = bucket * max(k, 1)  # the GEMMs' rows: the bucket (moe: its tokens * k)
            return tile(m, 2 * I, H, G, H_DTYPE), tile(m, H, I, G, torch.bfloat16)

        keys = [tiles(b) for b in buckets]
        tops, top = {}, buckets[-1]
        for i in reversed(range(len(buckets))):
            if i + 1 < len(buckets) and keys[i] != keys[i + 1]:
                top = buckets[i]
            tops[buckets[i]] = top
        return tops

    # -- sets: capture at load, release ----------------------------------------------------------

    def prepare(self, es) -> int:
        """Capture ``es``'s graphs (on the caller's thread and stream: the engine's loader)."""
        return self.graphs.prepare(es, self.top_ks)

    def forget(self, es) -> int:
        """Drop the graphs and buffers no other set needs after ``es`` went away."""
        return self.graphs.forget(es)

    # -- running ---------------------------------------------------------------------------------

    def takes_as_is(self, x_dtype: str) -> bool:
        """Whether the graph reads inputs of this wire dtype without a conversion."""
        return x_dtype == "bfloat16" or x_dtype == self._fp8_name

    def run_calls(self, es, calls) -> tuple[list, Launches]:
        """SPEC 5.1 or 5.2 for every call of one batch: per call its outcome (the output's
        bf16 bytes ``[rows, 2H]``, or its contract error), and the launches made. The
        caller has entered the staging."""
        self.staging.begin()
        launches = Launches()
        moe = calls[0].kind == "moe"
        if self.takes_as_is(calls[0].dtype):
            done = (self._graph_moe if moe else self._graph_ffn)(es, calls)
            if done is not None:
                launches.graph += 1
                return done, launches
        return (self._general_moe if moe else self._general_ffn)(es, calls, launches), launches

    # -- the graph path ----------------------------------------------------------------------------

    def _lane(self, bufs: FfnBuffers) -> _Lane:
        if bufs.lane is None:
            bufs.lane = _Lane(bufs)
        return bufs.lane

    def _graph_ffn(self, es, calls):
        g, st = self.graphs, self.staging
        offsets = [0, *itertools.accumulate(c.rows for c in calls)]
        rows = offsets[-1]
        if not 0 < rows <= g.max_bucket:
            return None
        bufs = g.held(g.family(es, calls[0].dtype == "bfloat16"))
        if bufs is None:
            return None
        launched = g.launch_rows(rows)
        with bufs.lock:
            graph = g.graph(bufs.family, launched, es)
            if graph is None or not g.holds(bufs):  # (forgotten while this batch waited)
                return None
            sizes, gather = group_order([c.m_sizes for c in calls])
            lane = self._lane(bufs)
            for call, at in zip(calls, offsets):  # (offsets has one more)
                self._rows_up(lane, call, at, call.rows)
            meta = bufs.host_words()
            meta[: es.G] = sizes
            g.fill_tables(bufs, es)
            meta[bufs.word_at["live"]] = rows
            _fill_order(bufs, meta, gather, rows, launched)
            st.htod(lane.meta, 0, lane.meta_addr, meta, 8 * bufs.meta_words(launched))
            graph.replay()
            g.replays += 1
            host = self._download(lane, bufs.packed_bytes(launched, rows))
        out, flags, _ = unpack(host, launched, rows, es.H)
        return [_answer(out[a:b], flags[a:b]) for a, b in itertools.pairwise(offsets)]

    def _graph_moe(self, es, calls):
        g, st = self.graphs, self.staging
        k = calls[0].top_k
        starts = [0, *itertools.accumulate(c.tokens for c in calls)]
        tokens = starts[-1]
        bufs = g.held(g.family(es, calls[0].dtype == "bfloat16", k))
        if bufs is None or not 0 < tokens <= bufs.units:
            return None
        launched = g.launch_rows(tokens)
        id_bytes = 8 if calls[0].ids_dtype == "int64" else 4
        with bufs.lock:
            graph = g.graph(bufs.family, launched, es)
            if graph is None or not g.holds(bufs):  # (forgotten while this batch waited)
                return None
            lane = self._lane(bufs)
            for call, t0 in zip(calls, starts):
                n = call.tokens
                self._rows_up(lane, call, t0, n)
                off = t0 * k * id_bytes
                st.htod(lane.ids, off, lane.ids_addr + off, call.ids, n * k * id_bytes)
                off = t0 * k * 4
                st.htod(lane.weights, off, lane.weights_addr + off, call.weights, n * k * 4)
            meta = bufs.host_words()
            g.fill_tables(bufs, es)
            at = bufs.word_at
            meta[at["tokens"]] = tokens
            meta[at["wide"]] = int(id_bytes == 8)
            st.htod(lane.meta, 0, lane.meta_addr, meta, 8 * bufs.meta_words(launched))
            graph.replay()
            g.replays += 1
            host = self._download(lane, bufs.packed_bytes(launched, tokens))
        out, x_flags, routing = unpack(host, launched, tokens, es.H)
        return [_answer(out[a:b], x_flags[a:b], routing[a:b])
                for a, b in itertools.pairwise(starts)]

    def _rows_up(self, lane: _Lane, call, at: int, n: int) -> None:
        """Copy a call's ``n`` x rows (and scales) to buffer row ``at``, on the stream."""
        if n == 0:
            return
        st = self.staging
        off = at * lane.x_row
        st.htod(lane.x, off, lane.x_addr + off, call.x, n * lane.x_row)
        if call.x_scale is not None:
            off = at * lane.x_scale_row
            st.htod(lane.x_scale, off, lane.x_scale_addr + off, call.x_scale,
                    n * lane.x_scale_row)

    def _download(self, lane: _Lane, nbytes: int) -> np.ndarray:
        """The packed result on the host after the stream's work, in memory the next
        batch does not reuse."""
        st = self.staging
        small = nbytes < COPY_OUT_BELOW
        host = st.take(nbytes) if small else st.host_empty((nbytes,), torch.uint8).numpy()
        st.dtoh(host, lane.result, lane.result_addr, nbytes)
        st.wait()
        return host.copy() if small else host

    # -- the general path --------------------------------------------------------------------------

    def _inputs(self, es, calls, units: int):
        """The calls' x (and scales) on the device in a dtype the graphs take, and the
        rows' flags where a conversion could hide them (else None)."""
        dtype = TORCH_DTYPES[calls[0].dtype]
        x = self.staging.gather_rows([body_view(c.x, dtype, (n, es.H))
                                      for c, n in zip(calls, units)])
        xs = None
        if calls[0].x_scale is not None:
            xs = self.staging.gather_rows([body_view(c.x_scale, torch.float32, (n, es.H // 128))
                                           for c, n in zip(calls, units)])
        x = x.to(self.device, non_blocking=True)
        xs = None if xs is None else xs.to(self.device, non_blocking=True)
        if dtype in (torch.bfloat16, self.backend.fp8_dtype):
            return x, xs, None
        # fp16/fp32 are quantized, the other fp8 format converted: check first (their values,
        # or the fp8 rows' scales, as the graphs' prologue checks bf16 and fp8 rows).
        flags = bad_rows(x, xs)
        x, xs = to_device_fp8(x, xs, self.backend.fp8_dtype)
        return x, xs, flags

    def _general_ffn(self, es, calls, launches: Launches) -> list:
        g = self.graphs
        plan = plan_merge([c.m_sizes for c in calls])
        x, xs, raw = self._inputs(es, calls, [c.rows for c in calls])
        rows = plan.total
        bufs = g.batch_buffers(g.family(es, x.dtype == torch.bfloat16), rows)
        with bufs.lock:
            if rows <= g.max_bucket:
                # One launch: the body regroups the rows per expert and puts them back.
                gather = None if plan.is_identity else plan.gather
                out, flags = self._ffn_launch(bufs, es, x, xs, plan.m_sizes, gather, launches)
            else:
                # Chunks of the largest bucket, each already in expert order.
                if not plan.is_identity:
                    order = torch.from_numpy(plan.gather).to(self.device)
                    x = x.index_select(0, order)
                    xs = None if xs is None else xs.index_select(0, order)
                out = np.empty((rows, 2 * es.H), dtype=np.uint8)
                flags = np.zeros(rows, dtype=np.int8)
                for start in range(0, rows, g.max_bucket):
                    stop = min(rows, start + g.max_bucket)
                    out[start:stop], flags[start:stop] = self._ffn_launch(
                        bufs, es, x[start:stop], None if xs is None else xs[start:stop],
                        chunk_sizes(plan.m_sizes, start, stop), None, launches)
                if not plan.is_identity:
                    out, flags = out[plan.scatter], flags[plan.scatter]
        if raw is not None:
            flags = flags | raw.cpu().numpy()
        return [_answer(out[a:b], flags[a:b]) for a, b in itertools.pairwise(plan.offsets)]

    def _ffn_launch(self, bufs: FfnBuffers, es, x, xs, sizes: np.ndarray, gather,
                    launches: Launches):
        """One launch over ``len(x)`` rows (``<= max_bucket_m``) in the callers' order, whose
        expert order is ``gather`` (None: the identity) with group sizes ``sizes``: host
        (bf16 bytes ``[n, 2H]``, int8 flags ``[n]``) in the callers' order."""
        g, n = self.graphs, x.shape[0]
        if n == 0:
            return np.empty((0, 2 * es.H), dtype=np.uint8), np.zeros(0, dtype=np.int8)
        launched = g.launch_rows(n)
        bufs.x[:n].copy_(x)
        if xs is not None:
            bufs.x_scale[:n].copy_(xs)
        meta = bufs.host_words()
        meta[: es.G] = sizes
        g.fill_tables(bufs, es)
        meta[bufs.word_at["live"]] = n
        _fill_order(bufs, meta, gather, n, launched)
        words = bufs.meta_words(launched)
        bufs.meta[:words].copy_(bufs.meta_host[:words])
        launches.add(g.launch(bufs, es, launched))
        # A synchronous copy (a copy on the CPU too: the next batch reuses ``result``), so
        # the next launch of this batch may rewrite the host words.
        host = bufs.result[: bufs.packed_bytes(launched, n)].to("cpu", copy=True).numpy()
        out, flags, _ = unpack(host, launched, n, es.H)
        return out, flags

    def _general_moe(self, es, calls, launches: Launches) -> list:
        g = self.graphs
        k = calls[0].top_k
        starts = [0, *itertools.accumulate(c.tokens for c in calls)]
        tokens = starts[-1]
        x, xs, raw = self._inputs(es, calls, [c.tokens for c in calls])
        id_dtype = torch.int64 if calls[0].ids_dtype == "int64" else torch.int32
        ids = torch.cat([body_view(c.ids, id_dtype, (c.rows,)) for c in calls])
        weights = torch.cat([body_view(c.weights, torch.float32, (c.rows,)) for c in calls])
        bufs = g.batch_buffers(g.family(es, x.dtype == torch.bfloat16, k), tokens)
        out = np.empty((tokens, 2 * es.H), dtype=np.uint8)
        x_flags = np.zeros(tokens, dtype=np.int8)
        routing = np.zeros(tokens, dtype=np.int8)
        at = bufs.word_at
        with bufs.lock:
            for start in range(0, tokens, bufs.units):
                stop = min(tokens, start + bufs.units)
                n = stop - start
                launched = g.launch_rows(n)
                bufs.x[:n].copy_(x[start:stop])
                if xs is not None:
                    bufs.x_scale[:n].copy_(xs[start:stop])
                # int32 ids widen in the copy to the device's int64 words (wide = 1).
                bufs.ids[: n * k].copy_(ids[start * k: stop * k])
                bufs.weights[: n * k].copy_(weights[start * k: stop * k])
                meta = bufs.host_words()
                g.fill_tables(bufs, es)
                meta[at["tokens"]] = n
                meta[at["wide"]] = 1
                words = bufs.meta_words(launched)
                bufs.meta[:words].copy_(bufs.meta_host[:words])
                launches.add(g.launch(bufs, es, launched))
                host = bufs.result[: bufs.packed_bytes(launched, n)].to("cpu", copy=True).numpy()
                out[start:stop], x_flags[start:stop], routing[start:stop] = \
                    unpack(host, launched, n, es.H)
        if raw is not None:
            x_flags |= raw.cpu().numpy()
        return [_answer(out[a:b], x_flags[a:b], routing[a:b])
                for a, b in itertools.pairwise(starts)]


def _fill_order(bufs: FfnBuffers, meta: np.ndarray, gather, rows: int, launched: int) -> None:
    """Write an ffn launch's (gather, scatter) pairs into host ``meta`` (the identity only
    when the host words do not hold it already)."""
    at = bufs.word_at["pairs"]
    pairs = meta[at : at + 2 * launched].reshape(launched, 2)
    if gather is None:
        if bufs.host_identity < launched:
            pairs[:] = np.arange(launched, dtype=np.int64)[:, None]
            bufs.host_identity = launched
        return
    pairs[:rows, 0] = gather
    pairs[gather, 1] = np.arange(rows, dtype=np.int64)
    # Padding rows (past the calls, up to the bucket) map to themselves.
    pairs[rows:] = np.arange(rows, launched, dtype=np.int64)[:, None]
    bufs.host_identity = 0


def _answer(out: np.ndarray, x_flags: np.ndarray, routing: np.ndarray | None = None):
    """A call's outcome: its output bytes, or not_finite (bad rows), or bad_routing."""
    error = not_finite_error(x_flags)
    if error is not None:
        return error
    if routing is not None and routing.any():
        return BadRouting(_ROUTING)
    return out
