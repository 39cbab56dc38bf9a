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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from moegemm.kernels import quantize_activations

from ._checks import bad_rows
from ._graphs import Family, GraphPool, unpack_result
from ._merge import MergePlan, plan_merge
from ._staging import Staging
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
        plan = plan_merge([p.m_sizes for p in parts])
        family = self.family(ws.G, ws.N, ws.K, parts[0].x.dtype)
        # The callers' rows side by side (a lone call's pinned body as it is);
        # the launch regroups them per expert on the device.
        x_host = self.staging.gather_rows([p.x for p in parts])
        xs_host = None
        if parts[0].x_scale is not None:
            xs_host = self.staging.gather_rows([p.x_scale for p in parts])
        direct = plan.total <= self.pool.max_bucket and (
            family.quantize or x_host.dtype == self.backend.fp8_dtype
        )
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
