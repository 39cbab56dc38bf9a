"""From validated host calls to host results: staging, merging, chunking, graphs.

The engine's worker thread hands :meth:`Executor.run` a batch of calls for one
weight set; this module does everything between the host tensors and the
output rows, on one code path for a GPU (graphs, pinned memory, copy stream)
and a CPU (eager, plain memory):

1. stage the calls' rows side by side in one pinned buffer (none for a lone
   call whose body already sits in pinned memory) and upload it on the
   engine stream, with the group sizes, the weight table and the merge order
   (:mod:`._merge`) in one small copy;
2. run the family's graph for the smallest bucket holding the rows: it
   regroups the rows per expert, runs one grouped GEMM and puts the output
   rows back in the callers' order (in chunks of the largest bucket, through
   device scratch, when there are more rows);
3. download into a pinned buffer (the flags and the output rows in one copy)
   and hand each caller a view of its rows.

The common case -- calls in the device's fp8 format or bf16, at most one
bucket -- uploads straight into the graph's static buffers: three copies up,
one replay, one copy down, so the worker thread gives up and retakes the GIL
only a few times per batch (each time can cost it a GIL switch interval while
the event loop is busy).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from moegemm.kernels import quantize_activations

from ._checks import bad_rows
from ._graphs import Buffers, Family, GraphPool, unpack_result
from ._merge import MergePlan, plan_merge
from ._staging import _COPY_OUT_BELOW, Staging
from ._tensors import to_backend_fp8


@dataclass(frozen=True)
class Part:
    """One caller's validated inputs (host tensors) and its group sizes."""

    x: torch.Tensor
    x_scale: torch.Tensor | None
    m_sizes: Sequence[int]


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
    """A family's static buffers as raw addresses and row sizes (for ``_run_lone``)."""

    def __init__(self, bufs: Buffers) -> None:
        self.bufs = bufs
        self.x = bufs.x.data_ptr()
        self.x_row = bufs.x.stride(0) * bufs.x.element_size()
        self.x_scale = bufs.x_scale.data_ptr() if bufs.x_scale is not None else 0
        self.x_scale_row = bufs.x_scale.stride(0) * 4 if bufs.x_scale is not None else 0
        self.meta = bufs.meta.data_ptr()
        self.meta_host = bufs.meta_host.numpy()
        self.meta_host_ptr = bufs.meta_host.data_ptr()
        self.result = bufs.result.data_ptr()


def chunk_sizes(m_sizes: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Group sizes of rows ``[start, stop)`` of a launch with group sizes ``m_sizes``."""
    ends = np.cumsum(m_sizes)
    begins = ends - m_sizes
    return np.clip(np.minimum(ends, stop) - np.maximum(begins, start), 0, None)


class Executor:
    """Runs batches of calls on the device through a :class:`GraphPool`."""

    def __init__(self, pool: GraphPool, staging: Staging) -> None:
        self.pool = pool
        self.staging = staging
        self.backend = pool.backend
        self.device = pool.device
        self._lanes: dict[Family, _Lane] = {}

    def family(self, G: int, N: int, K: int, x_dtype: torch.dtype) -> Family:
        """The family that runs inputs of ``x_dtype``: bf16 is quantized in the graph,
        everything else becomes the device's fp8 format first."""
        return Family(G, N, K, quantize=x_dtype == torch.bfloat16)

    def prepare(self, G: int, N: int, K: int, wq: torch.Tensor, w_scale: torch.Tensor) -> int:
        """Capture the graphs a weight set of this shape needs (fp8 and bf16 inputs)."""
        self.staging.enter()
        return sum(
            self.pool.capture(Family(G, N, K, quantize), wq, w_scale) for quantize in (False, True)
        )

    def run(
        self, ws, parts: Sequence[Part]
    ) -> tuple[list[torch.Tensor], list[np.ndarray], Launches]:
        """SPEC 1 for every part on weight set ``ws``: bf16 ``[M_i, N]`` host tensors,
        each part's per-row content flags (``_checks.bad_rows``: non-zero means the
        part's output is not to be used), and the launches made.

        Parts may differ in dtype: each dtype runs as its own merged launch.
        """
        self.staging.enter()
        self.staging.begin()
        launches = Launches()
        outs: list[torch.Tensor | None] = [None] * len(parts)
        flags: list[np.ndarray | None] = [None] * len(parts)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, part in enumerate(parts):
            by_dtype.setdefault(part.x.dtype, []).append(i)
        for idx in by_dtype.values():
            got = self._run_same_dtype(ws, [parts[i] for i in idx], launches)
            for i, (out, flag) in zip(idx, zip(*got)):
                outs[i], flags[i] = out, flag
        return outs, flags, launches

    # -- one dtype --------------------------------------------------------------------

    def _run_same_dtype(self, ws, parts: list[Part], launches: Launches):
        if self.staging.raw:
            done = (self._run_lone(ws, parts[0], launches) if len(parts) == 1
                    else self._run_merged_raw(ws, parts, launches))
            if done is not None:
                return done
        plan = plan_merge([p.m_sizes for p in parts])
        family = self.family(ws.G, ws.N, ws.K, parts[0].x.dtype)
        direct = plan.total <= self.pool.max_bucket and (
            family.quantize or parts[0].x.dtype == self.backend.fp8_dtype
        )
        # The callers' rows side by side (a lone call's pinned body as it is);
        # the launch regroups them per expert on the device.
        x_host = self.staging.gather_rows([p.x for p in parts])
        xs_host = None
        if parts[0].x_scale is not None:
            xs_host = self.staging.gather_rows([p.x_scale for p in parts])
        if direct:
            # The flags and the output come back in one copy.
            packed, launched = self._run_direct(ws, family, x_host, xs_host, plan, launches)
            (host,) = self.staging.download(packed)
            out, flags = unpack_result(host, launched, plan.total, ws.N)
        else:
            out_dev, flags_dev = self._run_general(ws, family, x_host, xs_host, plan, launches)
            out, flags = self.staging.download(out_dev, flags_dev)
        flags = flags.numpy()
        spans = list(zip(plan.offsets[:-1], plan.offsets[1:]))
        return [out[a:b] for a, b in spans], [flags[a:b] for a, b in spans]

    def _run_lone(self, ws, part: Part, launches: Launches):
        """One call in one bucket with a captured graph, by raw driver copies: ([out], [flags]),
        or None when the call is not that case (the general path takes it).

        The same words, buffers and graph as :meth:`_run_direct`, without its
        ~20 torch calls: each costs ~5-15 us of host time on the H200's machine,
        which made the copies' bookkeeping cost a lone one-row call more than
        its graph (``bench/SERVICE_NOTES.md``, v4). Rows go to the device from
        where the body put them (page-locked bodies by DMA, small pageable ones
        staged by the driver); the flags and output come back in one copy.
        """
        x, xs = part.x, part.x_scale
        rows = x.shape[0]
        family = self.family(ws.G, ws.N, ws.K, x.dtype)
        if not 0 < rows <= self.pool.max_bucket or not (
                family.quantize or x.dtype == self.backend.fp8_dtype):
            return None
        if not x.is_contiguous() or (xs is not None and not xs.is_contiguous()):
            return None
        done = self.run_raw(ws, family, rows, x.data_ptr(),
                            0 if xs is None else xs.data_ptr(), part.m_sizes)
        if done is None:
            return None
        launches.graph += 1
        host, at = done
        flags = host[:rows].view(np.int8)
        out = torch.from_numpy(host[at:]).view(torch.bfloat16).view(rows, ws.N)
        return [out], [flags]

    def _run_merged_raw(self, ws, parts: list[Part], launches: Launches):
        """Several calls in one bucket with a captured graph, by raw driver copies:
        (outs, flags) per part, or None when the batch is not that case
        (:meth:`run_raw_many` says how)."""
        x0 = parts[0].x
        family = self.family(ws.G, ws.N, ws.K, x0.dtype)
        if not (family.quantize or x0.dtype == self.backend.fp8_dtype):
            return None
        for p in parts:
            if not p.x.is_contiguous() or (p.x_scale is not None and not p.x_scale.is_contiguous()):
                return None
        done = self.run_raw_many(ws, family, [
            (p.x.shape[0], p.x.data_ptr(), 0 if p.x_scale is None else p.x_scale.data_ptr(),
             p.m_sizes) for p in parts])
        if done is None:
            return None
        launches.graph += 1
        host, at, offsets = done
        rows = offsets[-1]
        out = torch.from_numpy(host[at:]).view(torch.bfloat16).view(rows, ws.N)
        flags = host[:rows].view(np.int8)
        spans = list(itertools.pairwise(offsets))
        return [out[a:b] for a, b in spans], [flags[a:b] for a, b in spans]

    def run_raw_many(self, ws, family: Family, calls):
        """Calls ``(rows, x, x_scale, m_sizes)`` (host addresses in the family's layout,
        ``x_scale`` 0 for none) as one launch of the family's captured graph:
        ``(host bytes, out_offset, offsets)`` -- :meth:`Buffers.packed`'s layout with
        the rows in the calls' order, call ``i`` owning rows ``offsets[i]:offsets[i+1]``
        -- or None when their rows are not one bucket with a graph. The caller has
        entered the staging (:meth:`Staging.enter`, :meth:`Staging.begin`); this
        waits for the result.

        Each caller's rows go from where its body put them straight to their
        place in the static buffers (page-locked bodies by DMA, pageable ones
        staged by the driver): no host gather, no torch calls, each of which
        costs ~5-15 us of host time on the H200's machine (``bench/SERVICE_NOTES.md``,
        v4). The graph regroups the rows per expert from the merge plan's order
        and puts the output back in the callers' order.
        """
        offsets = [0]
        for rows, *_ in calls:
            offsets.append(offsets[-1] + rows)
        rows = offsets[-1]
        if not 0 < rows <= self.pool.max_bucket:
            return None
        launched = self.pool.launch_rows(rows)
        graph = self.pool.graph(family, launched, ws.wq, ws.w_scale)
        if graph is None:
            return None
        if len(calls) == 1:
            sizes, gather = calls[0][3], None
        else:
            plan = plan_merge([c[3] for c in calls])
            sizes, gather = plan.m_sizes, None if plan.is_identity else plan.gather
        lane = self._lane(family)
        staging, bufs = self.staging, lane.bufs
        for (n, x, x_scale, _), at in zip(calls, offsets):  # (offsets has one more)
            if n == 0:
                continue
            staging.htod(lane.x + at * lane.x_row, x, n * lane.x_row)
            if x_scale:
                staging.htod(lane.x_scale + at * lane.x_scale_row, x_scale, n * lane.x_scale_row)
        self.pool.fill_words(bufs, lane.meta_host, sizes, gather, rows, launched,
                             ws.wq, ws.w_scale)
        staging.htod(lane.meta, lane.meta_host_ptr, 8 * bufs.meta_words(launched))
        graph.replay()
        self.pool.replays += 1
        host, at = self._download_raw(lane, launched, rows * ws.N)
        return host, at, offsets

    def _lane(self, family: Family) -> _Lane:
        lane = self._lanes.get(family)
        if lane is None:
            lane = self._lanes[family] = _Lane(self.pool.buffers(family))
        return lane

    def _download_raw(self, lane: _Lane, launched: int, out_elems: int):
        """The packed result (flags, then ``out_elems`` bf16) on the host after the
        stream's work: ``(host bytes, out_offset)``, in memory the next batch does not
        reuse."""
        staging = self.staging
        at = Buffers.out_offset(launched)
        nbytes = at + 2 * out_elems
        small = nbytes < _COPY_OUT_BELOW
        host = staging.take(nbytes) if small else \
            staging.host_empty((nbytes,), torch.uint8).numpy()
        staging.dtoh(host.ctypes.data, lane.result, nbytes)
        staging.wait()
        if small:
            host = host.copy()  # out of the arena, which the next batch reuses
        return host, at

    def run_raw(self, ws, family: Family, rows: int, x: int, x_scale: int, m_sizes):
        """One call of ``rows`` rows (``0 < rows <= max_bucket``) at host addresses ``x``
        and ``x_scale`` (0: none) in the family's layout, through its captured graph;
        ``(host bytes, out_offset)`` as :meth:`Buffers.packed` lays them out, or None
        when no graph is captured for it. The caller has entered the staging
        (:meth:`Staging.enter`, :meth:`Staging.begin`); this waits for the result.
        """
        done = self.run_raw_many(ws, family, [(rows, x, x_scale, m_sizes)])
        return None if done is None else done[:2]

    def _run_direct(self, ws, family, x_host, xs_host, plan: MergePlan, launches):
        """One bucket: upload straight into the static buffers (three copies, one replay);
        the packed result's bytes on the device and the rows the launch covered."""
        bufs = self.pool.buffers(family)
        rows = plan.total
        self.staging.upload(bufs.x[:rows], x_host)
        if xs_host is not None:
            self.staging.upload(bufs.x_scale[:rows], xs_host)
        gather = None if plan.is_identity else plan.gather
        launches.add(self.pool.launch(family, ws.wq, ws.w_scale, plan.m_sizes, gather))
        launched = self.pool.launch_rows(rows)
        return bufs.packed(launched, rows), launched

    def _run_general(self, ws, family, x_host, xs_host, plan: MergePlan, launches):
        """Format conversion or several chunks: go through device scratch."""
        rows = plan.total
        x_dev = torch.empty(x_host.shape, dtype=x_host.dtype, device=self.device)
        self.staging.upload(x_dev, x_host)
        xs_dev = None
        if xs_host is not None:
            xs_dev = torch.empty(xs_host.shape, dtype=xs_host.dtype, device=self.device)
            self.staging.upload(xs_dev, xs_host)
        # Checked before any conversion: fn -> fnuz keeps the bits, and fn's NaN
        # patterns are valid fnuz numbers.
        flags_dev = bad_rows(x_dev, xs_dev)
        if not family.quantize:
            x_dev, xs_dev = self._to_device_fp8(x_dev, xs_dev)
        if not plan.is_identity:  # per-expert order before chunking
            gather = torch.from_numpy(plan.gather).to(self.device, non_blocking=True)
            x_dev = x_dev.index_select(0, gather)
            xs_dev = None if xs_dev is None else xs_dev.index_select(0, gather)
        bufs = self.pool.buffers(family)
        out_dev = torch.empty((rows, ws.N), dtype=torch.bfloat16, device=self.device)
        step = self.pool.max_bucket
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            n = stop - start
            bufs.x[:n].copy_(x_dev[start:stop])
            if xs_dev is not None:
                bufs.x_scale[:n].copy_(xs_dev[start:stop])
            sizes = chunk_sizes(plan.m_sizes, start, stop)
            launches.add(self.pool.launch(family, ws.wq, ws.w_scale, sizes, fresh_host=True))
            out_dev[start:stop].copy_(bufs.out(self.pool.launch_rows(n))[:n])
        if not plan.is_identity:  # back to the callers' order
            scatter = torch.from_numpy(plan.scatter).to(self.device, non_blocking=True)
            out_dev = out_dev.index_select(0, scatter)
        return out_dev, flags_dev

    def _to_device_fp8(self, x_dev, xs_dev):
        """fp16/fp32 quantized, fp8 of the other format converted (SPEC 1.1, 1.2)."""
        fp8 = self.backend.fp8_dtype
        if xs_dev is None:
            return quantize_activations(x_dev, fp8)
        return to_backend_fp8(x_dev, xs_dev, fp8)
