"""The engine: the only owner of the device.

Requests are validated on the caller's side (cheap host checks). On a GPU,
small calls run on the event loop's thread whenever no job holds the device
(a lone call at once, others in "loop batches": merged with the calls that
arrived in the same turn of the loop; see ``Engine._loop_takes`` for why).
Everything else is queued for one worker thread, which loops "collect a
batch, run it, complete the futures":

- a batch is one call, or, with ``merge_window_us > 0``, the calls for the same
  weight set that arrive within the window: their rows are regrouped per expert
  into one launch and the result rows are handed back to each caller (SPEC 3);
- the batch runs through the executor (``_executor.py``): staging, regrouping,
  chunks of at most ``max_bucket_m`` rows, a CUDA graph per total_M bucket;
- other device work (building weight sets) is queued as a plain job, so it
  never races a kernel.

The queue is bounded (``queue_size`` gemm calls): a full queue answers
``Overloaded`` at once rather than letting latency grow without bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from moegemm.client._errors import (
    APIError,
    BadField,
    BadMSizes,
    BadShape,
    DeadlineExceeded,
    InternalError,
    NotReady,
    OutOfMemory,
    Overloaded,
    TooLarge,
)
from moegemm.kernels._backend import Backend

from ._checks import not_finite_error
from ._executor import Executor, Part
from ._graphs import GraphPool
from ._lone import LoneInputs, address, wire_inputs
from ._staging import Staging
from ._tensors import (
    BLOCK,
    FLOATS,
    FP8,
    WIRE_NAMES,
    require_dtype,
    require_shape,
)
from .store import WeightSet

log = logging.getLogger("moegemm.server.engine")

T = TypeVar("T")

# The input dtype of the families that quantize in the graph.
_QUANTIZED = torch.bfloat16

# A full queue tells the caller to come back after this many seconds.
_RETRY_AFTER_S = 1


@dataclass(eq=False)  # identity, not field-wise (tensor) comparison, in the queue
class GemmCall:
    """One validated gemm request waiting for the worker (host tensors)."""

    ws: WeightSet
    x: torch.Tensor
    x_scale: torch.Tensor | None
    m_sizes: list[int]
    deadline: float | None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def rows(self) -> int:
        return self.x.shape[0]


@dataclass(eq=False)
class _WireCall:
    """A plain valid gemm body (``_lone.py``) waiting for a loop batch: its raw inputs,
    and once the batch ran, its outcome (output bytes ``[M, 2N]`` or an error), or
    ``_GENERAL`` when the general path is to answer it instead."""

    ws: WeightSet
    lone: LoneInputs
    deadline: float | None
    waiter: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)
    outcome: Any = None

    @property
    def rows(self) -> int:
        return self.lone.rows


_GENERAL = object()  # a wire call's outcome: take the general path

# Set once any engine of this process has lost its device (cli: the exit status).
DEVICE_LOST = threading.Event()
EXIT_DEVICE_LOST = 70


@dataclass(eq=False)
class _Job:
    """Any other device work (e.g. building a weight set)."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class Engine:
    """Owns the device: a worker thread, a bounded queue, batching, graphs."""

    def __init__(
        self,
        backend: Backend,
        *,
        queue_size: int = 256,
        max_m: int = 65536,
        max_bucket_m: int = 8192,
        merge_window_us: int = 0,
        graphs: bool = True,
        metrics: Any = None,
        switch_interval_us: int = 1000,
        inline_when_idle: bool = False,
        raw_copies: bool = True,
        loop_batches: bool = False,
        loop_max_rows: int = 256,
    ) -> None:
        self.backend = backend
        self.device = backend.device
        self.queue_size = queue_size
        self.max_m = max_m
        self.max_bucket_m = max_bucket_m
        self.merge_window_s = merge_window_us / 1e6
        self.metrics = metrics
        self.switch_interval_s = switch_interval_us / 1e6
        self.inline_when_idle = inline_when_idle
        self.loop_batches = loop_batches
        self.loop_max_rows = loop_max_rows
        # Staging, merging, chunking and CUDA graphs live in the executor; the
        # engine decides what runs when, the executor how.
        self._executor = Executor(
            GraphPool(backend, max_bucket_m, graphs=graphs),
            Staging(backend.device, driver=raw_copies),
        )
        self._fp8_name = WIRE_NAMES[backend.fp8_dtype]
        self._graph_launches = None if metrics is None else metrics.launches.labels(mode="graph")
        self._items: deque[GemmCall | _Job] = deque()
        self._pending_calls = 0
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        # Calls in the last batch: more than one means callers arrive together.
        self._last_batch_calls = 1
        # True while a batch or job runs, on the worker or inline (one at a time).
        self._busy = False
        # Loop batches: calls waiting for the event loop's next drain, and its handle.
        self._loop_calls: list[tuple[GemmCall, asyncio.Future] | _WireCall] = []
        self._drain_handle: asyncio.Handle | None = None
        # Set once the device fails for good (see _device_alive); on_lost is called then.
        self.lost: str | None = None
        self.on_lost: Callable[[str], None] | None = None

    # -- life cycle ------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread (and shorten the interpreter's GIL switch interval)."""
        # The worker releases the GIL in every torch call and must win it back
        # from the event loop thread, which at CPython's default 5 ms interval
        # starves it under load: on the H200, one batch took 0.8 ms with one
        # client and 34 ms with 32 (M=128, bench/results/service_h200.json),
        # and still 5 ms at a 200 us interval. Process-wide on purpose: this
        # process exists to serve the engine.
        sys.setswitchinterval(self.switch_interval_s)
        self._thread = threading.Thread(target=self._loop, name="moegemm-engine", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new work, fail what is queued, and wait for the running batch."""
        with self._cv:
            self._closed = True
            dropped = list(self._items)
            self._items.clear()
            self._pending_calls = 0
            self._cv.notify_all()
        for item in dropped:
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(NotReady("the server is shutting down"))
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the public calls --------------------------------------------------------

    def validate(
        self,
        ws: WeightSet,
        x: torch.Tensor,
        x_scale: torch.Tensor | None,
        m_sizes: torch.Tensor,
    ) -> list[int]:
        """Check a gemm request against SPEC 2.2 and ``ws``; return the group sizes."""
        require_dtype(x, FP8 + FLOATS, "x")
        require_dtype(m_sizes, (torch.int64, torch.int32), "m_sizes")
        if x.dim() != 2:
            raise BadShape(f"x has shape {list(x.shape)}; expected 2-D [M, K]")
        M, K = x.shape
        if K != ws.K:
            raise BadShape(f"x has K={K}; weight set {ws.name!r} has K={ws.K}")
        require_shape(m_sizes, (ws.G,), "m_sizes", f"[G], G={ws.G} groups")
        if M > self.max_m:
            raise TooLarge(f"x has M={M} rows; this server takes at most {self.max_m} per call")
        if x.dtype in FP8:
            if x_scale is None:
                raise BadField("fp8 x needs x_scale (float32 [M, K/128])")
            require_dtype(x_scale, (torch.float32,), "x_scale")
            require_shape(x_scale, (M, K // BLOCK), "x_scale", "[M, K/128]")
        elif x_scale is not None:
            raise BadField("x_scale is only for fp8 x; bf16/fp16/fp32 x is quantized by the server")
        # What the tensors hold (NaN, Inf, scales <= 0: SPEC 2.2 not_finite) is
        # checked on the device with the launch (_checks.bad_rows), not here on
        # the event loop.
        sizes = [int(m) for m in m_sizes.tolist()]
        if any(m < 0 for m in sizes):
            raise BadMSizes(f"m_sizes {sizes} holds a negative size")
        if sum(sizes) != M:
            raise BadMSizes(f"m_sizes sum to {sum(sizes)}; x has M={M} rows")
        return sizes

    async def gemm(
        self,
        ws: WeightSet,
        x: torch.Tensor,
        x_scale: torch.Tensor | None,
        m_sizes: torch.Tensor,
        *,
        deadline: float | None = None,
        alone: bool = False,
    ) -> torch.Tensor:
        """SPEC 1 on ``ws``: validate, queue, await; bf16 ``[M, N]`` on the host.

        ``deadline`` is a ``time.monotonic()`` instant: a call still queued then
        fails with DeadlineExceeded instead of running. ``alone``: the caller
        knows of no other request in progress (the transport counts them), so
        with ``inline_when_idle`` a small call may run on this thread.
        """
        sizes = self.validate(ws, x, x_scale, m_sizes)
        call = GemmCall(ws, x, x_scale, sizes, deadline)
        inline = on_loop = False
        with self._cv:
            if self._closed:
                raise NotReady("the server is shutting down")
            self._check_room()
            if alone and self._can_run_inline(call):
                self._busy = inline = True
            elif self._loop_takes(call):
                on_loop = True
                self._pending_calls += 1  # until the drain takes it
            else:
                self._items.append(call)
                self._pending_calls += 1
                self._cv.notify()
        if inline:
            return self._run_inline(call)
        if on_loop:
            return await self._on_loop(call)
        return await asyncio.wrap_future(call.future)

    def _check_room(self) -> None:
        """Under the lock: a full queue answers Overloaded at once (a lost device,
        NotReady)."""
        if self.lost is not None:
            raise NotReady("the device is lost; the server is exiting")
        if self._pending_calls >= self.queue_size:
            raise Overloaded(
                f"{self._pending_calls} calls are queued (the limit); retry later",
                retry_after=_RETRY_AFTER_S,
            )

    # A call runs on the event loop's thread only when it is the server's only
    # request, nothing else is there to do on the device and it is small: then
    # its batch (~0.3 ms on the H200) costs the loop less than the two thread
    # hand-offs it saves. "Only request" matters: without it, on the H200 at 32
    # clients, every call ran inline one after the other (the loop never saw
    # two at once), merging stopped and throughput fell from 1253 to 922
    # calls/s (bench/SERVICE_NOTES.md, v3).
    _INLINE_ROWS = 256

    def _can_run_inline(self, call: GemmCall) -> bool:
        """Under the lock: the device is idle, nothing waits, no merging streak."""
        return self._idle_for(call.rows)

    def _idle_for(self, rows: int) -> bool:
        # (A merging streak keeps calls for the worker, where they can merge; loop
        # batches merge without it.)
        return (
            self.inline_when_idle
            and not self._busy
            and not self._items
            and (self.loop_batches or self._last_batch_calls <= 1)
            and rows <= self._INLINE_ROWS
        )

    # Loop batches (``loop_batches``): calls that arrive while the device is free of
    # jobs run on the event loop's thread too, merged per weight set with the others
    # that arrived in the same turn of the loop (with a merge window > 0; the
    # window is not waited there). The worker thread then only runs jobs and
    # large calls. Why: the worker and the loop share one GIL, and each of the
    # batch's torch and driver calls gives it up; under load the worker then waits
    # up to a switch interval to win it back from the busy loop, every time. On the
    # H200 at 32 clients a merged batch of 9 calls took 6.7 ms on the worker for
    # ~0.3 ms of device work (bench/SERVICE_NOTES.md, v5). On the loop, a batch
    # holds the loop for its own host work and device wait only (a batch of
    # ``loop_max_rows`` rows or fewer per call: sub-millisecond to a few milliseconds),
    # while the acceptor processes go on reading requests. Larger calls stay on the
    # worker, so no one batch holds the loop for long (1024-row calls at 32 clients
    # measured the same either way on the H200: ~261 calls/s; bench/SERVICE_NOTES.md, v5).

    def _loop_takes(self, call: GemmCall) -> bool:
        """Under the lock: the call may run in a loop batch (no job or worker batch
        running or queued)."""
        return (self.loop_batches and not self._busy and not self._items
                and call.rows <= self.loop_max_rows)

    async def _on_loop(self, call: GemmCall) -> torch.Tensor:
        """Queue ``call`` for the loop's next drain and wait for its outcome."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._loop_calls.append((call, waiter))
        self._schedule_drain(loop)
        await waiter
        return call.future.result()

    def _schedule_drain(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._drain_handle is None:
            # No wait: the calls that arrive while a batch holds the loop are read in
            # its next turn and merge then. On the H200, waiting the merge window
            # for more (as the worker does) made the p99 at 1300 calls/s worse
            # (bench/SERVICE_NOTES.md, v5).
            self._drain_handle = loop.call_soon(self._drain)

    async def gemm_wire(self, ws: WeightSet, body: Any,
                        deadline: float | None) -> np.ndarray | None:
        """A decoded gemm body that is the lane's plain valid case (``_lone.py``) run in
        a loop batch, merged with the others of its turn straight from their wire
        fields: the output's bf16 bytes ``[M, 2N]`` (uint8). None when the general
        path is to answer it (:meth:`gemm`: not that case, no loop batches or
        graphs here, the device held by a job), which answers everything, errors
        included. Raises what :meth:`gemm` would raise for a call that ran."""
        executor = self._executor
        if not (self.loop_batches and executor.staging.raw and executor.pool.use_graphs):
            return None
        lone = wire_inputs(body, ws.G, ws.K, self._fp8_name,
                           min(self.loop_max_rows, self.max_m, self.max_bucket_m))
        if lone is None:
            return None
        with self._cv:
            if self._closed or self._busy or self._items:
                return None
            self._check_room()
            self._pending_calls += 1  # until the drain takes it
        loop = asyncio.get_running_loop()
        call = _WireCall(ws, lone, deadline, loop.create_future())
        self._loop_calls.append(call)
        self._schedule_drain(loop)
        await call.waiter
        out = call.outcome
        if out is _GENERAL or out is None:
            return None
        if isinstance(out, BaseException):
            raise out
        return out

    def _drain(self) -> None:
        """Run the calls waiting for the loop: merged per weight set (in arrival order,
        at most ``max_bucket_m`` rows a batch; one call a batch without a merge
        window), each caller woken with its outcome in ``call.future``."""
        self._drain_handle = None
        waiting, self._loop_calls = self._loop_calls, []
        with self._cv:
            self._pending_calls -= len(waiting)
            closed, busy = self._closed, self._busy
            if not (closed or busy):
                self._busy = True
        wires = [c for c in waiting if type(c) is _WireCall]
        if wires:
            waiting = [c for c in waiting if type(c) is not _WireCall]
        if closed:
            for call, waiter in waiting:
                if call.future.set_running_or_notify_cancel():
                    call.future.set_exception(NotReady("the server is shutting down"))
                _wake(waiter)
            for wire in wires:
                wire.outcome = NotReady("the server is shutting down")
                _wake(wire.waiter)
            return
        if busy:
            # A job or a worker batch took the device since these calls arrived:
            # they queue for the worker behind it (wire calls by the general path).
            for call, waiter in waiting:
                self._to_worker(call, waiter)
            for wire in wires:
                wire.outcome = _GENERAL
                _wake(wire.waiter)
            return
        try:
            for batch in self._loop_batches([c for c, w in waiting if not w.cancelled()]):
                try:
                    self._run_batch(batch)
                except Exception:  # a bug here must fail the batch, not the loop
                    log.exception("the engine failed a loop batch of %d calls", len(batch))
                    for call in batch:
                        if not call.future.done():
                            call.future.set_exception(InternalError("the engine failed this call"))
                self._last_batch_calls = len(batch)
            for batch in self._loop_batches([w for w in wires if not w.waiter.cancelled()],
                                            key=_wire_key):
                try:
                    self._run_wire_batch(batch)
                except Exception:  # a bug here must fail the batch, not the loop
                    log.exception("the engine failed a loop batch of %d calls", len(batch))
                    for wire in batch:
                        wire.outcome = InternalError("the engine failed this call")
                self._last_batch_calls = len(batch)
        finally:
            with self._cv:
                self._busy = False
                if self._items:
                    self._cv.notify_all()  # the worker has items waiting for the device
            for call, waiter in waiting:
                if not call.future.done():  # its caller went away before it ran
                    call.future.cancel()
                _wake(waiter)
            for wire in wires:
                _wake(wire.waiter)

    def _run_wire_batch(self, batch: list[_WireCall]) -> None:
        """Run wire calls of one weight set and input kind as one launch; each gets
        its outcome (``_GENERAL`` for all when no graph covers them)."""
        started = time.monotonic()
        live = []
        for wire in batch:
            if wire.deadline is not None and started > wire.deadline:
                wire.outcome = DeadlineExceeded("the request's deadline passed while it was queued")
            else:
                live.append(wire)
        if not live:
            return
        ws, quantize = live[0].ws, live[0].lone.quantize
        executor = self._executor
        staging = executor.staging
        try:
            family = executor.family(ws.G, ws.N, ws.K,
                                     _QUANTIZED if quantize else self.backend.fp8_dtype)
            staging.enter()
            staging.begin()
            done = executor.run_raw_many(ws, family, [
                (w.lone.rows, address(w.lone.x),
                 0 if w.lone.x_scale is None else address(w.lone.x_scale), w.lone.m_sizes)
                for w in live])
        except Exception as exc:  # noqa: BLE001 -- each caller gets it (_device_error logs)
            staging.settle()
            error = self._device_error(exc, len(live))
            for wire in live:
                wire.outcome = error
            return
        if done is None:  # no graph for this bucket: the general path runs them eagerly
            for wire in live:
                wire.outcome = _GENERAL
            return
        host, at, offsets = done
        if self.metrics is not None:
            m = self.metrics
            self._graph_launches.inc()
            for wire in live:
                m.queue_seconds.observe(started - wire.enqueued)
            m.kernel_seconds.observe(time.monotonic() - started)
            m.batch_calls.observe(len(live))
        row_bytes = 2 * ws.N
        for wire, (a, b) in zip(live, itertools.pairwise(offsets)):
            error = not_finite_error(host[a:b])
            wire.outcome = error if error is not None else \
                host[at + a * row_bytes: at + b * row_bytes].reshape(b - a, row_bytes)

    def _loop_batches(self, calls: list, key: Callable[[Any], Any] = lambda c: id(c.ws)) -> list[list]:
        """``calls`` as batches: per ``key`` (the weight set), in arrival order, within
        the row limit; one call a batch without a merge window."""
        if self.merge_window_s <= 0:
            return [[call] for call in calls]
        batches: list[list] = []
        open_: dict[Any, tuple[list, list[int]]] = {}
        for call in calls:
            key_of = key(call)
            batch, rows = open_.get(key_of, (None, [0]))
            if batch is None or rows[0] + call.rows > self.max_bucket_m:
                batch, rows = [], [0]
                batches.append(batch)
                open_[key_of] = (batch, rows)
            batch.append(call)
            rows[0] += call.rows
        return batches

    def _to_worker(self, call: GemmCall, waiter: asyncio.Future) -> None:
        """Hand a loop call to the worker; its waiter wakes when the worker is done."""
        loop = waiter.get_loop()
        call.future.add_done_callback(lambda _: loop.call_soon_threadsafe(_wake, waiter))
        with self._cv:
            self._items.append(call)
            self._pending_calls += 1
            self._cv.notify()

    def gemm_lone(self, ws: WeightSet, body: Any, deadline: float | None,
                  alone: bool) -> np.ndarray | None:
        """A decoded gemm body run at once on this thread, when it is the lone-call
        case (``_lone.py``): the output's bf16 bytes ``[M, 2N]`` (uint8). None when it
        is not that case -- not alone, the device busy, an input the lane does not
        take, no graph for it -- and the caller then takes :meth:`gemm`, which
        answers everything, errors included. Raises what :meth:`gemm` would raise
        for a call that did run (not_finite rows, the device's failures).
        """
        staging = self._executor.staging
        if not (alone and self.inline_when_idle and staging.raw) or self._busy or self._items or (
                self.lost is not None) or (
                deadline is not None and time.monotonic() > deadline):
            return None  # (the device's state is read again under the lock below)
        lone = wire_inputs(body, ws.G, ws.K, self._fp8_name,
                           min(self._INLINE_ROWS, self.max_m, self.max_bucket_m))
        if lone is None:
            return None
        with self._cv:
            if self._closed or not self._idle_for(lone.rows):
                return None
            self._busy = True
        started = time.monotonic()
        try:
            family = self._executor.family(ws.G, ws.N, ws.K, _QUANTIZED if lone.quantize
                                           else self.backend.fp8_dtype)
            staging.enter()
            staging.begin()
            done = self._executor.run_raw(
                ws, family, lone.rows, address(lone.x),
                0 if lone.x_scale is None else address(lone.x_scale), lone.m_sizes)
        except Exception as exc:
            staging.settle()
            raise self._device_error(exc, 1) from exc
        finally:
            with self._cv:
                self._busy = False
                if self._items:
                    self._cv.notify_all()  # the worker has items waiting for the device
        if done is None:
            return None  # no graph for this bucket: the general path runs it eagerly
        host, at = done
        if self.metrics is not None:
            m = self.metrics
            m.inline_batches.inc()
            self._graph_launches.inc()
            m.queue_seconds.observe(0.0)
            m.kernel_seconds.observe(time.monotonic() - started)
            m.batch_calls.observe(1)
        error = not_finite_error(host[: lone.rows])
        if error is not None:
            raise error
        return host[at:].reshape(lone.rows, 2 * ws.N)

    def _device_error(self, exc: Exception, calls: int) -> APIError:
        """The answer for a batch that failed on the device (an API error passes as it is)."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, torch.OutOfMemoryError):
            return OutOfMemory(f"the device ran out of memory for this call: {exc}")
        log.exception("a batch of %d calls failed", calls)
        if not self._device_alive():
            self._lose_device(f"{type(exc).__name__}: {exc}")
            return InternalError("the device failed and is lost; the server is restarting")
        return InternalError(f"the kernel failed: {type(exc).__name__}")

    def _device_alive(self) -> bool:
        """Whether the device still runs work after a failure. A sticky error (an
        illegal address, a lost context) fails every later call on every weight
        set, so the server must not go on answering as if healthy."""
        if self.device.type != "cuda":
            return True
        try:
            torch.cuda.synchronize(self.device)
            probe = torch.ones(1, device=self.device)
            return float(probe.add_(1).item()) == 2.0
        except Exception:  # noqa: BLE001 -- any failure here means the device is gone
            return False

    def _lose_device(self, reason: str) -> None:
        """Mark the device lost (health answers 503 from now on) and tell ``on_lost``
        (the app: stop the process so its supervisor restarts it)."""
        if self.lost is not None:
            return
        self.lost = reason
        DEVICE_LOST.set()
        log.critical("the device is lost (%s): health now fails and the process exits", reason)
        if self.on_lost is not None:
            self.on_lost(reason)

    def _run_inline(self, call: GemmCall) -> torch.Tensor:
        """Run a lone call's batch on the calling (event loop) thread: no future,
        no thread hand-off; its answer or error is returned or raised here."""
        if self.metrics is not None:
            self.metrics.inline_batches.inc()
        try:
            [(_, outcome)] = self._outcomes([call])
        except Exception:  # a bug here: the same answer as on the worker
            log.exception("the engine failed an inline call")
            outcome = InternalError("the engine failed this call")
        finally:
            with self._cv:
                self._busy = False
                if self._items:
                    self._cv.notify_all()  # the worker has items waiting for the device
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the worker thread (device work other than gemm calls)."""
        job = _Job(fn)
        with self._cv:
            if self._closed:
                raise NotReady("the server is shutting down")
            self._items.append(job)
            self._cv.notify()
        return await asyncio.wrap_future(job.future)

    @property
    def graphs(self) -> bool:
        """Whether calls replay captured CUDA graphs (False on the CPU)."""
        return self._executor.pool.use_graphs

    def queued(self) -> int:
        """Gemm calls waiting for the worker."""
        with self._cv:
            return self._pending_calls

    # -- the worker ---------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            try:
                self._work(item)
            finally:
                with self._cv:
                    self._busy = False

    def _work(self, item: GemmCall | _Job) -> None:
        if isinstance(item, _Job):
            if item.future.set_running_or_notify_cancel():
                try:
                    item.future.set_result(item.fn())
                except Exception as exc:  # noqa: BLE001 -- handed to the awaiting request
                    item.future.set_exception(exc)
            return
        batch = [item]
        try:
            batch = self._collect(item)
            self._run_batch(batch)
        except Exception:  # a bug here must not kill the device's only thread
            log.exception("the engine failed a batch of %d calls", len(batch))
            for call in batch:
                if not call.future.done():
                    call.future.set_exception(InternalError("the engine failed this call"))

    def _next(self) -> GemmCall | _Job | None:
        with self._cv:
            while (not self._items or self._busy) and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            item = self._items.popleft()
            if isinstance(item, GemmCall):
                self._pending_calls -= 1
            self._busy = True
            return item

    def _collect(self, first: GemmCall) -> list[GemmCall]:
        """``first`` plus the calls for the same weight set that arrive with it.

        Calls already queued always join (they would wait anyway). The worker
        waits up to ``merge_window_us`` for more only while calls are arriving
        together -- the previous batch merged several -- so a lone caller never
        pays the window. A window of zero disables merging.
        """
        batch = [first]
        if self.merge_window_s <= 0:
            return batch
        rows = first.rows
        wait = self._last_batch_calls > 1
        close_at = time.monotonic() + self.merge_window_s
        with self._cv:
            while rows < self.max_bucket_m:
                for item in list(self._items):
                    if (
                        isinstance(item, GemmCall)
                        and item.ws is first.ws
                        and rows + item.rows <= self.max_bucket_m
                    ):
                        self._items.remove(item)
                        self._pending_calls -= 1
                        batch.append(item)
                        rows += item.rows
                left = close_at - time.monotonic()
                if not wait or left <= 0 or self._closed:
                    break
                self._cv.wait(left)
        self._last_batch_calls = len(batch)
        return batch
    def _run_batch(self, batch: list[GemmCall]) -> None:
        """Run a batch on the worker and complete its callers' futures."""
        live = [call for call in batch if call.future.set_running_or_notify_cancel()]
        for call, outcome in self._outcomes(live):  # (calls whose client went away are gone)
            if isinstance(outcome, BaseException):
                call.future.set_exception(outcome)
            else:
                call.future.set_result(outcome)

    def _outcomes(self, batch: list[GemmCall]) -> list[tuple[GemmCall, Any]]:
        """Each call's output (bf16 host tensor) or the error it gets."""
        started = time.monotonic()
        done: list[tuple[GemmCall, Any]] = []
        live = []
        for call in batch:
            if call.deadline is not None and started > call.deadline:
                done.append((call, DeadlineExceeded(
                    "the request's deadline passed while it was queued")))
                continue
            live.append(call)
            if self.metrics is not None:
                self.metrics.queue_seconds.observe(started - call.enqueued)
        if not live:
            return done
        try:
            outs, flags = self._compute(live)
        except Exception as exc:  # noqa: BLE001 -- each caller gets it (_device_error logs)
            # Copies of a failed batch may still be queued on the engine stream;
            # the next batch reuses their pinned sources, so wait for them first.
            self._executor.staging.settle()
            error = self._device_error(exc, len(live))
            return done + [(call, error) for call in live]
        if self.metrics is not None:
            self.metrics.kernel_seconds.observe(time.monotonic() - started)
            self.metrics.batch_calls.observe(len(live))
        for call, out, flag in zip(live, outs, flags):
            error = not_finite_error(flag)
            done.append((call, out if error is None else error))
        return done

    def _compute(self, calls: list[GemmCall]) -> tuple[list[torch.Tensor], list]:
        """Run one batch on the device; each caller's bf16 rows on the host, and
        its rows' content flags."""
        parts = [Part(call.x, call.x_scale, call.m_sizes) for call in calls]
        outs, flags, launches = self._executor.run(calls[0].ws, parts)
        if self.metrics is not None:
            if launches.graph:
                self.metrics.launches.labels(mode="graph").inc(launches.graph)
            if launches.eager:
                self.metrics.launches.labels(mode="eager").inc(launches.eager)
        return outs, flags

    # -- weight sets (call these on the worker, through ``run``) -----------------------

    def prepare(self, ws: WeightSet) -> WeightSet:
        """Capture the graphs ``ws``'s shape needs (a no-op on the CPU); return ``ws``."""
        try:
            self._executor.prepare(ws.G, ws.N, ws.K, ws.wq, ws.w_scale)
        except torch.OutOfMemoryError as exc:
            raise OutOfMemory(
                f"the device cannot hold the graphs of weight set {ws.name!r}: {exc}"
            ) from exc
        return ws

    def forget(self, ws: WeightSet) -> None:
        """Drop graphs bound to ``ws``'s memory (after it was replaced or deleted)."""
        self._executor.pool.forget(ws.wq)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _wire_key(wire: _WireCall) -> tuple[int, bool]:
    """Wire calls merge per weight set and input kind (fp8 or bf16: one graph family)."""
    return id(wire.ws), wire.lone.quantize
