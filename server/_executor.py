"""From validated calls to host results: staging, merging, chunking, graphs.

The engine hands :meth:`Executor.run` a batch of calls (``_request.GemmCall``)
for one weight set and one input dtype; this module does everything between
their wire bytes and their output rows. Two ways, chosen by what the calls
need, not by a setting:

- **the graph path** (:meth:`Executor._run_graph`): inputs the graph takes as
  they are (the device's fp8 format with scales, or bf16, which the graph
  quantizes), at most one bucket of rows, a captured graph. Each caller's rows
  go by one copy from where its body lies to their place in the family's
  static buffers, the launch's words (group sizes, weight table, merge order)
  by one more, the graph regroups the rows per expert, runs the GEMM and puts
  the output back in the callers' order; one copy brings flags and output
  back. No torch calls: each costs ~5-15 us of host time on the H200's
  machine, and the general path's ~20 per batch made a one-row call's
  bookkeeping cost more than its graph (``bench/SERVICE_NOTES.md``, v4-v5);
- **the general path** (:meth:`Executor._run_general`): anything that needs a
  conversion first (fp16/fp32 quantized, fp8 of the other format converted,
  SPEC 1.1-1.2), or more rows than the largest bucket (chunks), or no graph
  (the CPU, graphs off): torch views on the bodies, staged in pinned memory,
  converted on the device, run bucket by bucket.

Both give each caller its bf16 output as bytes ``[rows, 2N]`` (uint8) and its
rows' content flags (``_checks.bad_rows``); :meth:`Executor.run_calls` turns
them into each call's outcome, as the expert calls' executor
(``_ffn_executor.py``) answers its own.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from moegemm.kernels import quantize_activations
from moegemm.kernels._backend import weight_addresses

from ._checks import bad_rows, not_finite_error
from ._graphs import Buffers, Family, GraphPool
from ._merge import MergePlan, group_order, plan_merge
from ._staging import Staging
from ._tensors import TORCH_DTYPES, to_backend_fp8

_UNKNOWN = object()  # a graph not looked up yet (None: looked up, there is none)

# Graph-path results smaller than this are copied out of the batch arena (which
# the next batch reuses); larger ones land in their own page-locked buffer.
COPY_OUT_BELOW = 64 << 10


@dataclass
class Launches:
    """What one :meth:`Executor.run` did: graph replays and eager launches."""

    graph: int = 0
    eager: int = 0

    def add(self, mode: str) -> None:
        if mode == "graph":
            self.graph += 1
        elif mode == "eager":
            self.eager += 1


class _Lane:
    """A family's static buffers as flat byte views, their addresses and row sizes."""

    def __init__(self, bufs: Buffers, family: Family) -> None:
        self.bufs = bufs
        self.family = family
        self.x = bufs.x.view(-1).view(torch.uint8)
        self.x_addr = bufs.x.data_ptr()
        self.x_row = bufs.x.stride(0) * bufs.x.element_size()
        self.x_scale = None if bufs.x_scale is None else bufs.x_scale.view(-1).view(torch.uint8)
        self.x_scale_addr = bufs.x_scale.data_ptr() if bufs.x_scale is not None else 0
        self.x_scale_row = bufs.x_scale.stride(0) * 4 if bufs.x_scale is not None else 0
        self.meta = bufs.meta.view(torch.uint8)
        self.meta_addr = bufs.meta.data_ptr()
        self.meta_host = bufs.meta_host.numpy()
        self.result = bufs.result
        self.result_addr = bufs.result.data_ptr()


class _Route:
    """What the graph path launches one weight set's calls of one input dtype with, looked
    up once instead of per call (``bench/overhead_cpu.py --in-process``: the lookups
    were a third of the path's host time): the family's lane, the weight table words,
    and each (bucket, merged) graph as found. Valid while the set's two tensors live
    (a set found again at the same ``id`` is the same one only if its ``wq`` and
    ``w_scale`` are: a replaced set's are new) and the pool's ``generation`` is
    unchanged (captures, forgets and a dropped weight table bump it)."""

    __slots__ = ("generation", "graphs", "lane", "table", "w_scale", "wq")

    def __init__(self, ws, generation: int, lane: _Lane, table: tuple[int, int] | None) -> None:
        # Weak: a route never keeps a deleted set's device memory alive.
        self.wq, self.w_scale = weakref.ref(ws.wq), weakref.ref(ws.w_scale)
        self.generation = generation
        self.lane = lane
        self.table = table
        self.graphs: dict[tuple[int, bool], object] = {}


_ROUTES_MAX = 256  # routes kept before the dead sets' ones are swept


def chunk_sizes(m_sizes: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Group sizes of rows ``[start, stop)`` of a launch with group sizes ``m_sizes``."""
    ends = np.cumsum(m_sizes)
    begins = ends - m_sizes
    return np.clip(np.minimum(ends, stop) - np.maximum(begins, start), 0, None)


def body_view(data, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU torch view of a call's wire bytes (no copy; never written)."""
    if not all(shape):
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only bodies: never written
        return torch.frombuffer(data, dtype=dtype).view(shape)


def to_device_fp8(x: torch.Tensor, x_scale: torch.Tensor | None, fp8: torch.dtype):
    """Rows in the device's fp8 ``fp8``: fp16/fp32 (``x_scale`` None) quantized, fp8 of the
    other format converted (SPEC 1.1, 1.2)."""
    if x_scale is None:
        return quantize_activations(x, fp8)
    return to_backend_fp8(x, x_scale, fp8)


class Executor:
    """Runs batches of calls on the device through a :class:`GraphPool`."""

    def __init__(self, pool: GraphPool, staging: Staging) -> None:
        self.pool = pool
        self.staging = staging
        self.backend = pool.backend
        self.device = pool.device
        self._fp8_name = next(n for n, d in TORCH_DTYPES.items() if d == self.backend.fp8_dtype)
        self._routes: dict[tuple[int, str], _Route] = {}  # by (id(ws), wire dtype)

    def family(self, G: int, N: int, K: int, x_dtype: str) -> Family:
        """The family that runs inputs of wire dtype ``x_dtype``: bf16 is quantized in the
        graph, everything else becomes the device's fp8 format first."""
        return Family(G, N, K, quantize=x_dtype == "bfloat16")

    def takes_as_is(self, x_dtype: str) -> bool:
        """Whether the graph reads inputs of this wire dtype without a conversion."""
        return x_dtype == "bfloat16" or x_dtype == self._fp8_name

    def prepare(self, G: int, N: int, K: int, wq: torch.Tensor, w_scale: torch.Tensor) -> int:
        """Capture the graphs a weight set of this shape needs (fp8 and bf16 inputs)."""
        return self.pool.prepare(G, N, K, wq, w_scale)

    def captured(self, G: int, N: int, K: int, wq: torch.Tensor, w_scale: torch.Tensor) -> bool:
        """Whether every graph a weight set of this shape needs is there already."""
        pool = self.pool
        return all(pool.graph(f, bucket, wq, w_scale, merged) is not None
                   for f in (Family(G, N, K, q) for q in (False, True))
                   for bucket in pool.buckets for merged in pool.variants(f, bucket))

    def batch_key(self, call) -> tuple:
        """Calls merge per weight set and input dtype (one graph family, one conversion)."""
        return "gemm", id(call.ws), call.dtype

    def batch_rows(self, call) -> int:
        """The most rows a batch may hold: the largest bucket."""
        return self.pool.max_bucket

    def run_calls(self, ws, calls) -> tuple[list, Launches]:
        """What the engine runs: per call its outcome (output bytes ``[rows, 2N]``, or
        ``not_finite`` for bad rows), and the launches made."""
        results, launches = self.run(ws, calls)
        return [out if (error := not_finite_error(flags)) is None else error
                for out, flags in results], launches

    def run(self, ws, calls) -> tuple[list[tuple[np.ndarray, np.ndarray]], Launches]:
        """SPEC 1 for every call (one weight set, one input dtype): per call its output
        bytes ``[rows, 2N]`` and row flags (non-zero: the call's output is not to be
        used), and the launches made. The caller has entered the staging."""
        self.staging.begin()
        launches = Launches()
        done = None
        if self.takes_as_is(calls[0].dtype):
            done = self._run_graph(ws, calls)
        if done is not None:
            launches.graph += 1
            return done, launches
        return self._run_general(ws, calls, launches), launches

    # -- the graph path -------------------------------------------------------------------

    def _run_graph(self, ws, calls):
        """The calls as one launch of the family's captured graph, or None when their rows
        are not one bucket with a graph (then the general path runs them)."""
        first = calls[0]
        if len(calls) == 1:
            offsets = (0, first.rows)
            sizes, gather = first.m_sizes, None
        else:
            offsets = [0]
            for call in calls:
                offsets.append(offsets[-1] + call.rows)
            sizes, gather = group_order([c.m_sizes for c in calls])
        rows = offsets[-1]
        pool = self.pool
        if not 0 < rows <= pool.max_bucket:
            return None
        route = self._route(ws, first.dtype)
        if route is None:
            return None
        launched = pool.launch_rows(rows)
        merged = gather is not None
        graph = route.graphs.get((launched, merged), _UNKNOWN)
        if graph is _UNKNOWN:
            graph = route.graphs[launched, merged] = pool.graph(
                route.lane.family, launched, ws.wq, ws.w_scale, merged=merged)
        if graph is None:
            return None
        lane = route.lane
        staging, bufs = self.staging, lane.bufs
        for call, at in zip(calls, offsets):  # (offsets has one more)
            n = call.rows
            if n == 0:
                continue
            off = at * lane.x_row
            staging.htod(lane.x, off, lane.x_addr + off, call.x, n * lane.x_row)
            if call.x_scale is not None:
                off = at * lane.x_scale_row
                staging.htod(lane.x_scale, off, lane.x_scale_addr + off, call.x_scale,
                             n * lane.x_scale_row)
        pool.fill_words(bufs, lane.meta_host, sizes, gather, rows, launched, route.table)
        staging.htod(lane.meta, 0, lane.meta_addr, lane.meta_host, 8 * bufs.meta_words(launched))
        graph.replay()
        pool.replays += 1
        host, at = self._download(lane, launched, rows * ws.N)
        row_bytes = 2 * ws.N
        return [(host[at + a * row_bytes: at + b * row_bytes].reshape(b - a, row_bytes),
                 host[a:b].view(np.int8)) for a, b in itertools.pairwise(offsets)]

    def _lane(self, family: Family) -> _Lane | None:
        """The lane of the family's static buffers (kept on them); None where no capture
        made them."""
        bufs = self.pool.held(family)
        if bufs is None:
            return None
        if bufs.lane is None:
            bufs.lane = _Lane(bufs, family)
        return bufs.lane

    def _route(self, ws, dtype: str) -> _Route | None:
        """The memoised lookups of ``ws``'s graph-path calls in wire dtype ``dtype``; None
        where its family has no captures."""
        key = (id(ws), dtype)
        route = self._routes.get(key)
        if (route is None or route.generation != self.pool.generation
                or route.wq() is not ws.wq or route.w_scale() is not ws.w_scale):
            lane = self._lane(self.family(ws.G, ws.N, ws.K, dtype))
            if lane is None:
                self._routes.pop(key, None)
                return None
            if len(self._routes) >= _ROUTES_MAX:  # sets come and go: drop the dead ones
                self._routes = {k: r for k, r in self._routes.items() if r.wq() is not None}
            route = self._routes[key] = _Route(
                ws, self.pool.generation, lane,
                weight_addresses(ws.wq, ws.w_scale) if self.pool.run_table is not None else None)
        return route

    def release(self, G: int, N: int, K: int) -> None:
        """Drop shape ``(G, N, K)``'s graphs and buffers (its last set is gone); between
        batches (a worker job)."""
        self.pool.release(G, N, K)
        # Routes hold their lane and graphs: a dead set's would keep them alive.
        families = {Family(G, N, K, quantize) for quantize in (False, True)}
        self._routes = {k: r for k, r in self._routes.items() if r.lane.family not in families}

    def _download(self, lane: _Lane, launched: int, out_elems: int):
        """The packed result (flags, then ``out_elems`` bf16) on the host after the
        stream's work: ``(host bytes, out_offset)``, in memory the next batch does not
        reuse."""
        staging = self.staging
        at = Buffers.out_offset(launched)
        nbytes = at + 2 * out_elems
        small = nbytes < COPY_OUT_BELOW
        host = staging.take(nbytes) if small else \
            staging.host_empty((nbytes,), torch.uint8).numpy()
        staging.dtoh(host, lane.result, lane.result_addr, nbytes)
        staging.wait()
        if small:
            host = host.copy()  # out of the arena, which the next batch reuses
        return host, at

    # -- the general path -------------------------------------------------------------------

    def _run_general(self, ws, calls, launches: Launches):
        """Format conversion, several chunks or no graph: through device scratch."""
        dtype = TORCH_DTYPES[calls[0].dtype]
        family = self.family(ws.G, ws.N, ws.K, calls[0].dtype)
        plan = plan_merge([c.m_sizes for c in calls])
        x_host = self.staging.gather_rows([body_view(c.x, dtype, (c.rows, ws.K)) for c in calls])
        xs_host = None
        if calls[0].x_scale is not None:
            xs_host = self.staging.gather_rows(
                [body_view(c.x_scale, torch.float32, (c.rows, ws.K // 128)) for c in calls])
        out_dev, flags_dev = self._general(ws, family, x_host, xs_host, plan, launches)
        out, flags = self.staging.download(out_dev, flags_dev)
        out = out.view(torch.uint8).numpy()
        flags = flags.numpy()
        return [(out[a:b], flags[a:b]) for a, b in itertools.pairwise(plan.offsets)]

    def _general(self, ws, family, x_host, xs_host, plan: MergePlan, launches):
        rows = plan.total
        x_dev = torch.empty(x_host.shape, dtype=x_host.dtype, device=self.device)
        self.staging.upload(x_dev, x_host)
        xs_dev = None
        if xs_host is not None:
            xs_dev = torch.empty(xs_host.shape, dtype=xs_host.dtype, device=self.device)
            self.staging.upload(xs_dev, xs_host)
        # Checked as sent, before any conversion (fp16/fp32 values, fp8 scales).
        flags_dev = bad_rows(x_dev, xs_dev)
        if not family.quantize:
            x_dev, xs_dev = to_device_fp8(x_dev, xs_dev, self.backend.fp8_dtype)
        if not plan.is_identity:  # per-expert order before chunking
            gather = torch.from_numpy(plan.gather).to(self.device, non_blocking=True)
            x_dev = x_dev.index_select(0, gather)
            xs_dev = None if xs_dev is None else xs_dev.index_select(0, gather)
        bufs = self.pool.batch_buffers(family, rows)
        out_dev = torch.empty((rows, ws.N), dtype=torch.bfloat16, device=self.device)
        step = self.pool.max_bucket
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            n = stop - start
            bufs.x[:n].copy_(x_dev[start:stop])
            if xs_dev is not None:
                bufs.x_scale[:n].copy_(xs_dev[start:stop])
            sizes = chunk_sizes(plan.m_sizes, start, stop)
            launches.add(self.pool.launch(family, ws.wq, ws.w_scale, sizes, fresh_host=True,
                                          bufs=bufs))
            out_dev[start:stop].copy_(bufs.out(self.pool.launch_rows(n))[:n])
        if not plan.is_identity:  # back to the callers' order
            scatter = torch.from_numpy(plan.scatter).to(self.device, non_blocking=True)
            out_dev = out_dev.index_select(0, scatter)
        return out_dev, flags_dev
