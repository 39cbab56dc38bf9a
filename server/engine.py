"""The engine: the only owner of the device's calls.

One entry, :meth:`Engine.submit`, takes a validated call of any kind -- a
gemm call (``_request.GemmCall``), an expert set's ``ffn`` or ``moe`` call
(``FfnCall``, ``MoeCall``, SPEC 5) -- and batches it with whatever else is
pending:

- a call of at most ``SMALL_ROWS`` rows (SPEC 3: a small call may launch and
  complete on the event loop) runs on the loop's thread: at once when it is
  the server's only request and the device is free (``alone``: nothing could
  merge with it) and no call ran at once in this turn of the loop, else in the
  loop's next turn, merged with the calls that arrived in this one (a "loop
  batch"); when a worker batch or job holds the device, they wait on the
  loop and get the device before the worker's next item (fair turns). (The
  transport counts a request when it has read its head, and the requests
  whose bytes arrive in one turn are read one after another, each run before
  the next is read: only the first of them can find itself alone, and the
  others merge behind it.)
- a larger call queues for the worker thread, which loops "collect a batch,
  run it, wake the callers", merging the calls for the same weight set that
  arrive within ``merge_window_us`` while calls are arriving together.

Why the loop: the worker and the loop share one GIL, and each of a batch's
driver calls gives it up; under load the worker then waits up to a switch
interval to win it back from the busy loop, every time. On the H200 at 32
clients a merged batch of 9 small calls took 6.7 ms on the worker for
~0.3 ms of device work, and 0.86 ms on the loop (``bench/SERVICE_NOTES.md``,
v5). The 256-row bound is per call: a loop batch merges every small call of
its key that arrived in one turn, up to the key's row bound (the largest
bucket), so 32 calls of 256 rows hold the loop for one 8192-row launch, its
copies included: capping a loop batch at 256 rows, the rest given to the
worker, was no faster (mixed traffic and a one-row call beside 31 clients of
1024-row calls, rotated rounds; ``bench/SERVICE_NOTES.md``, session 46).
That holds for the small calls that wait for a worker batch too: run by the
worker right after its batch, they were no faster than the loop's drain
scheduled directly by the worker's release (a one-row call beside 31 clients of
1024-row calls; ``bench/SERVICE_NOTES.md``, session 45).

A call object has ``kind``, ``ws``, ``rows`` (the rows the device runs: a
moe call's tokens times its top-k), ``deadline``, ``enqueued``, ``taken``,
``outcome`` and ``waiter``; its kind's executor (``_executor.py`` for gemm,
``_ffn_executor.py`` for ffn and moe) gives its batch key and a batch's row
bound, and runs a batch (calls of one key) through its graph path or, when
the calls need a conversion or chunks, its general path. The batching here
does not look inside: merging, fair turns, the queue bound, deadlines and the
loop-thread rule are the same for every kind. The queue is bounded
(``queue_size`` calls): a full queue answers ``Overloaded`` at once rather
than letting latency grow without bound.

Weight sets and expert sets are built and their graphs captured off the
calls' path, on a loader thread with its own CUDA stream (:meth:`Engine.load`):
loads never hold the device against calls (SPEC 3). The kernels of a shape new
to the engine are compiled first in a spawned process (``_ahead.py``), so that
the compiler's Python does not hold the GIL against the calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar

import numpy as np
import torch
from moegemm.client._errors import (
    APIError,
    DeadlineExceeded,
    InternalError,
    NotReady,
    OutOfMemory,
    Overloaded,
)
from moegemm.kernels._backend import Backend

from . import _ahead
from ._executor import Executor
from ._ffn_executor import ExpertExecutor
from ._ffn_graphs import FfnGraphs
from ._graphs import GraphPool
from ._priority import yield_cpu
from ._staging import Staging
from .experts import ExpertSet
from .store import WeightSet

log = logging.getLogger("moegemm.server.engine")

T = TypeVar("T")

# SPEC 3: the event loop never waits on a call of more than this many rows.
SMALL_ROWS = 256

# The measured best merge window (bench/SERVICE_NOTES.md, v2-v5: 200 us merged
# 1.3-1.6x more calls/s at 32 clients than no merging and kept the paced p99
# lowest; loop batches merge without waiting).
MERGE_WINDOW_US = 200

# The moe top-k whose graphs an expert set captures when it loads: those of the
# public MoE models in bench/real_models.json (DeepSeek-V3, Kimi-K2, Qwen3, GLM:
# 8; Mixtral: 2; Llama 4: 1). Another k runs eagerly, on the same kernels.
MOE_TOP_K = (1, 2, 8)

# A full queue tells the caller to come back after this many seconds.
_RETRY_AFTER_S = 1

# Set once any engine of this process has lost its device (cli: the exit status).
DEVICE_LOST = threading.Event()
EXIT_DEVICE_LOST = 70

# X-Deadline-Ms counts from the request's arrival: it can pass during the upload too.
_PASSED = "the request's deadline passed before it ran (while its body arrived or it was queued)"


@dataclass(eq=False)
class _Job:
    """Device work that must not overlap a batch (e.g. dropping graphs)."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class Engine:
    """Owns the device: batching on the loop and a worker, a loader, graphs."""

    def __init__(
        self,
        backend: Backend,
        *,
        queue_size: int = 256,
        max_m: int = 65536,
        max_bucket_m: int = 65536,
        merge_window_us: int = MERGE_WINDOW_US,
        graphs: bool = True,
        metrics: Any = None,
        switch_interval_us: int = 1000,
        moe_top_k: Sequence[int] = MOE_TOP_K,
    ) -> None:
        self.backend = backend
        self.device = backend.device
        self.queue_size = queue_size
        self.max_m = max_m
        self.max_bucket_m = max_bucket_m
        self.merge_window_s = merge_window_us / 1e6
        self.metrics = metrics
        self.switch_interval_s = switch_interval_us / 1e6
        self.moe_top_k = tuple(moe_top_k)
        self._executor = Executor(GraphPool(backend, max_bucket_m, graphs=graphs),
                                  Staging(backend.device))
        # Expert calls share the gemm calls' staging: one stream, one batch at a time.
        self._experts = ExpertExecutor(FfnGraphs(backend, max_bucket_m, graphs=graphs),
                                       self._executor.staging, moe_top_k)
        self._executors = {"gemm": self._executor, "ffn": self._experts, "moe": self._experts}
        # On a GPU a small call is a launch and a short wait, which the loop may
        # make (SPEC 3); on the CPU the reference kernel computes it there and then,
        # for milliseconds: every call goes to the worker.
        self._loop_rows = SMALL_ROWS if self.device.type == "cuda" else 0
        self._graph_launches = None if metrics is None else metrics.launches.labels(mode="graph")
        self._eager_launches = None if metrics is None else metrics.launches.labels(mode="eager")
        self._items: deque[Any] = deque()  # calls (of any kind) and jobs
        self._pending_calls = 0
        # The condition's lock (not re-entrant: no path takes it twice), entered directly
        # where nothing waits: entering a Condition is a Python-level call, and a lone
        # call entered it twice (~1 us of ~20 in the handler, bench/overhead_cpu.py).
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._closed = False
        self._closing = threading.Event()  # set by close(): a load stops waiting on a child
        self._thread: threading.Thread | None = None
        # Calls in the last worker batch: more than one means callers arrive together.
        self._last_batch_calls = 1
        # True while a batch or job runs, on the worker or the loop (one at a time).
        self._busy = False
        # True from a call run at once (``submit``'s ``alone``) to the loop's next turn: the
        # requests read in one turn are parsed one after another, each at once when it can
        # be, so the first cannot know of the others; they wait for the next turn and merge.
        self._ran_at_once = False
        # Calls waiting for the event loop's next drain, and its handle.
        self._loop_calls: list = []
        self._drain_handle: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # True while loop calls wait for a worker batch or job to release the device.
        self._loop_waiting = False
        # Loads and captures: one at a time, on their own thread and stream, at a lower CPU
        # priority than the calls (_priority.yield_cpu).
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moegemm-load",
                                                             initializer=yield_cpu)
        self._loader_jobs: set[concurrent.futures.Future] = set()  # not yet ended (_on_loader)
        self._load_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Weight-set shapes whose graphs are captured (or being captured: then the
        # capture holds the family's buffers and calls of it wait).
        self._shapes: set[tuple[int, int, int]] = set()
        # Per shape, the sets (their wq, weakly, by id) loaded with it, registered on the
        # loader as each loads: its graphs and buffers go when the last is forgotten.
        self._holders: dict[tuple[int, int, int], dict[int, weakref.ref]] = {}
        # Set once the device fails for good (see _device_alive); on_lost is called then.
        self.lost: str | None = None
        self.on_lost: Callable[[str], None] | None = None

    # -- life cycle ------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread (and shorten the interpreter's GIL switch interval)."""
        # The worker releases the GIL in every torch call and must win it back
        # from the event loop thread, which at CPython's default 5 ms interval
        # starves it under load: on the H200, one batch took 0.8 ms with one
        # client and 34 ms with 32 (M=128, bench/results/service_h200.json).
        # Process-wide on purpose: this process exists to serve the engine.
        sys.setswitchinterval(self.switch_interval_s)
        self._thread = threading.Thread(target=self._work_loop, name="moegemm-engine",
                                        daemon=True)
        self._thread.start()

    def close(self, timeout: float = 30.0) -> bool:
        """Refuse new work, fail what is queued, and wait up to ``timeout`` seconds for the
        running batch; whether nothing runs any more (False: a batch or a load still does)."""
        self._closing.set()  # a load waiting on a compiling child stops waiting
        with self._cv:
            self._closed = True
            dropped = list(self._items)
            self._items.clear()
            self._pending_calls = 0
            self._cv.notify_all()
        for item in dropped:
            if isinstance(item, _Job):
                if item.future.set_running_or_notify_cancel():
                    item.future.set_exception(NotReady("the server is shutting down"))
            else:
                item.outcome = NotReady("the server is shutting down")
                self._wake_threadsafe(item)
        self._schedule_drain()  # calls waiting on the loop are refused there
        if self._thread is not None:
            self._thread.join(timeout)
        self._loader.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            batch = self._busy and self._thread is not None and self._thread.is_alive()
        return not batch and not self._loader_jobs  # the cancelled ones left it as they ended

    # -- the one entry for calls -----------------------------------------------------

    async def submit(self, call, *, alone: bool = False) -> np.ndarray:
        """A validated call's answer: its output's bf16 bytes ``[rows, 2 width]`` (uint8;
        ``call.out_shape`` is ``[rows, width]``), or its contract error raised.

        ``call.deadline`` is a ``time.monotonic()`` instant: a call still queued then
        fails with DeadlineExceeded instead of running. ``alone``: the caller
        knows of no other request in progress (the transport counts them), so a
        small call that finds the device free runs at once, on this thread.
        """
        if call.rows == 0:  # nothing to run; validated like any other call
            return np.empty((0, 2 * call.out_shape[1]), dtype=np.uint8)
        now = False
        with self._lock:
            if self._closed:
                raise NotReady("the server is shutting down")
            self._check_room()
            on_loop = call.rows <= self._loop_rows
            if on_loop and alone and not (self._busy or self._items or self._loop_calls
                                          or self._ran_at_once):
                self._busy = now = self._ran_at_once = True
            else:
                self._pending_calls += 1  # until a batch takes it
                # Before the worker can see it: the worker wakes the caller through it.
                call.waiter = asyncio.get_running_loop().create_future()
                if on_loop:
                    self._loop_calls.append(call)
                    # Fair turns from now: the worker starts nothing more before the loop's
                    # drain has run this call (see _drain).
                    self._loop_waiting = self._loop_waiting or self._busy
                else:
                    self._items.append(call)
                    self._cv.notify()
        if now:
            asyncio.get_running_loop().call_soon(self._next_turn)
            try:
                self._run_batch([call])
            finally:
                self._release()
            if self.metrics is not None:
                self.metrics.inline_batches.inc()
                self.metrics.queue_seconds.observe(call.taken - call.enqueued)
        else:
            if on_loop:
                loop = self._loop = call.waiter.get_loop()
                if self._drain_handle is None:
                    # No wait: the calls that arrive while a batch holds the loop are
                    # read in its next turn and merge then. On the H200, waiting the
                    # merge window here (as the worker does) made the p99 at 1300
                    # calls/s worse (bench/SERVICE_NOTES.md, v5).
                    self._drain_handle = loop.call_soon(self._drain)
            expiry = None if call.deadline is None else call.waiter.get_loop().call_later(
                max(0.0, call.deadline - time.monotonic()), self._expire, call)
            try:
                await call.waiter
            except asyncio.CancelledError:
                # Its client went away (the transport cancels the wait): a call still
                # queued gives its place back now; one a batch has runs for nobody.
                call.outcome = _GONE
                self._withdraw(call)
                raise
            finally:
                if expiry is not None:
                    expiry.cancel()
                if self.metrics is not None:
                    # On the loop's thread, once for every call that waited: those that left
                    # the queue unrun (deadline, client gone) waited too, the longest often.
                    taken = call.taken
                    self.metrics.queue_seconds.observe(
                        (time.monotonic() if taken is None else taken) - call.enqueued)
        out = call.outcome
        if isinstance(out, BaseException):
            raise out
        return out

    def _expire(self, call) -> None:
        """On the loop, at ``call.deadline``: a call still queued is taken out of the queue (its
        place freed) and answered DeadlineExceeded now, not when its turn would have come."""
        if self._withdraw(call):
            call.outcome = DeadlineExceeded(_PASSED)
            _wake(call)

    def _withdraw(self, call) -> bool:
        """Take ``call`` out of the queue, its place freed; False if a batch has it already
        (it runs, or has run, or fails its own check)."""
        with self._lock:
            if _take(self._loop_calls, call):
                if not self._loop_calls:
                    self._stop_waiting()  # nothing waits for the device any more
            elif not _take(self._items, call):
                return False
            if not self._closed:  # (close emptied the count)
                self._pending_calls -= 1
        return True

    def _next_turn(self) -> None:
        """The loop's next turn: a lone call may run at once again."""
        with self._lock:
            self._ran_at_once = False

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

    def _release(self) -> None:
        """The device is free again: small calls waiting on the loop get it first (their
        drain is scheduled; the worker waits for it), else the worker."""
        with self._lock:
            self._busy = False
            yield_to_loop = self._loop_waiting
            if self._items and not yield_to_loop:
                self._cv.notify_all()  # the worker has items waiting for the device
        if yield_to_loop:
            self._schedule_drain()

    def _stop_waiting(self) -> None:
        """Under the lock, once no loop call waits: the worker goes on (it waits while
        ``_loop_waiting``; a flag left set by calls that expired would stop it for good)."""
        if self._loop_waiting:
            self._loop_waiting = False
            if not self._busy and self._items:
                self._cv.notify_all()

    def _schedule_drain(self) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            # The drain itself, not a callback that schedules it: under load each turn of
            # the loop carries every connection's reads and writes, and the device waits
            # (bench/SERVICE_NOTES.md, session 45).
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # its loop is closed: nobody waits any more
            pass

    # Fair turns (SPEC 3: loads and large calls never hold up small calls for long):
    # small calls that find the device held by a worker batch or job wait on the loop, and
    # the worker starts no other item before this drain has run them, so a small call
    # waits for one batch or job at most. Marking them waiting at submit (not when this
    # drain first sees them, as before session 46, which let the worker start more
    # batches in between) also ran more calls a second on the H100: small calls beside 31
    # clients of 1024-row calls 9.4 ms p50 against 16.9, their calls/s 1256 against 1013;
    # mixed traffic 3424 calls/s against 3165 (bench/SERVICE_NOTES.md, session 46).
    def _drain(self) -> None:
        """Run the calls waiting for the loop, merged per batch key (in arrival order,
        within the key's row bound), or, when the worker holds the device, leave them
        waiting for its release."""
        self._drain_handle = None
        with self._lock:
            if not self._loop_calls:
                if not self._busy:
                    self._stop_waiting()  # the calls it was set for expired
                return
            closed = self._closed
            if self._busy and not closed:
                self._loop_waiting = True
                return
            waiting, self._loop_calls = self._loop_calls, []
            if not closed:  # (close emptied the count)
                self._busy, self._loop_waiting = True, False
                self._pending_calls -= len(waiting)
        if closed:
            for call in waiting:
                call.outcome = NotReady("the server is shutting down")
                _wake(call)
            return
        try:
            for batch in self._batches([c for c in waiting if not _gone(c)]):
                self._run_batch(batch)
        finally:
            self._release()
            for call in waiting:
                _wake(call)

    def _key(self, call) -> tuple:
        """Calls of one key may share a launch (their executor says which)."""
        return self._executors[call.kind].batch_key(call)

    def _limit(self, call) -> int:
        """The most rows a batch holding ``call`` may have (the same for its whole key)."""
        return self._executors[call.kind].batch_rows(call)

    def _batches(self, calls: list) -> list[list]:
        """``calls`` as batches: per key (kind, set, dtype...), in arrival order, within
        the key's row bound; one call a batch without a merge window."""
        if self.merge_window_s <= 0:
            return [[call] for call in calls]
        batches: list[list] = []
        open_: dict[Any, tuple[list, list[int]]] = {}
        for call in calls:
            key = self._key(call)
            batch, rows = open_.get(key, (None, [0]))
            if batch is None or rows[0] + call.rows > self._limit(call):
                batch, rows = [], [0]
                batches.append(batch)
                open_[key] = (batch, rows)
            batch.append(call)
            rows[0] += call.rows
        return batches

    def _run_batch(self, batch: list) -> None:
        """Run one batch (calls of one key) on this thread; each call gets its ``outcome``."""
        started = time.monotonic()
        live = []
        for call in batch:
            call.taken = started
            if call.deadline is not None and started > call.deadline:
                call.outcome = DeadlineExceeded(_PASSED)
            else:
                live.append(call)
        if not live:
            return
        executor = self._executors[live[0].kind]
        try:
            executor.staging.enter()
            outcomes, launches = executor.run_calls(live[0].ws, live)
        except Exception as exc:  # noqa: BLE001 -- each caller gets it (_device_error logs)
            # Copies of a failed batch may still be queued on the engine stream;
            # the next batch reuses their pinned sources, so wait for them first.
            executor.staging.settle()
            error = self._device_error(exc, len(live))
            for call in live:
                call.outcome = error
            return
        if self.metrics is not None:
            m = self.metrics
            if launches.graph:
                self._graph_launches.inc(launches.graph)
            if launches.eager:
                self._eager_launches.inc(launches.eager)
            m.kernel_seconds.observe(time.monotonic() - started)
            m.batch_calls.observe(len(live))
        for call, outcome in zip(live, outcomes):
            call.outcome = outcome

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

    # -- jobs, loads ------------------------------------------------------------------

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the worker thread, between batches (device work that must
        not overlap a call)."""
        job = _Job(fn)
        with self._cv:
            if self._closed:
                raise NotReady("the server is shutting down")
            self._items.append(job)
            self._cv.notify()
        return await asyncio.wrap_future(job.future)

    async def load(self, build: Callable[[], T]) -> T:
        """Build a weight set (or an expert set: its two matrices' gemm graphs, and its
        ffn and moe graphs) and capture the graphs its shapes need, off the calls'
        path: on the loader thread and its own CUDA stream, while calls go on (SPEC 3)."""
        return await self._on_loader(self._load, build)

    def weight_graph_bytes(self, G: int, N: int, K: int) -> int:
        """The device memory a weight set of this shape adds beside its weights when it loads:
        its graphs' buffers and temporaries (0 for a shape a loaded set has). The weight
        store counts it before anything is read (507 ``out_of_memory``, SPEC 2)."""
        return self._executor.pool.shape_bytes(G, N, K)

    def expert_graph_bytes(self, G: int, H: int, I: int) -> int:
        """The same for an expert set's ffn and moe graphs (its matrices' gemm graphs count
        as weight sets')."""
        return self._experts.graphs.shape_bytes(SimpleNamespace(G=G, H=H, I=I), self.moe_top_k)

    def _on_loader(self, fn: Callable[..., T], *args) -> asyncio.Future:
        """``fn(*args)`` on the loader thread, to be awaited (:meth:`_loader_job`)."""
        return asyncio.wrap_future(self._loader_job(fn, *args))

    def _loader_job(self, fn: Callable[..., T], *args) -> concurrent.futures.Future:
        """``fn(*args)`` on the loader thread, kept in ``_loader_jobs`` until it ends or is
        cancelled (``close`` tells whether one still runs)."""
        job = self._loader.submit(fn, *args)
        self._loader_jobs.add(job)
        job.add_done_callback(self._loader_jobs.discard)
        return job

    def _load(self, build: Callable[[], T]) -> T:
        """On the loader thread (one load at a time). A shape already served only
        checks its graphs are there (sets of one shape share them through the
        weight table); a new shape is captured here, in thread-local capture mode,
        on buffers no call sees until its graphs are captured (a deleted set's calls of a
        released shape run on buffers of their own). Only a served shape whose graphs
        are bound to each set's own memory (no weight table) captures as a worker
        job, between batches, since calls use that family's buffers."""
        if self._load_stream is None:
            built = build()
        else:
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(self._load_stream):
                built = build()
            self._load_stream.synchronize()
        try:
            ahead = self._compile_ahead(built)
            if ahead is not None:
                compiled = self.backend.ahead.compiles()
            for ws in getattr(built, "weight_sets", (built,)):
                self._graphs_for(ws)
            if isinstance(built, ExpertSet):
                self._expert_graphs(built)
        except BaseException:
            # It never goes live: what it captured goes if no other set has its shapes.
            for ws in getattr(built, "weight_sets", (built,)):
                self._unhold(ws)
                self._release_if_unused((ws.G, ws.N, ws.K))
            if isinstance(built, ExpertSet):
                self._experts.forget(built)
            raise
        if ahead is not None and (late := self.backend.ahead.compiles() - compiled):
            log.warning("%d kernels compiled in the serving process while capturing %s, after "
                        "compiling them ahead: the ahead specialisations differ (%s)", late,
                        ahead.describe(), "; ".join(self.backend.ahead.compiled_since(compiled)))
        return built

    def _compile_ahead(self, built) -> _ahead.Job | None:
        """On the loader thread: compile the kernels of ``built``'s shapes that are new to this
        engine in a child process (``_ahead.py``); the job, or None when there was nothing to
        compile ahead or the child failed (the captures then compile here)."""
        if not self._executor.pool.use_graphs:
            return None
        new_sets = [ws for ws in getattr(built, "weight_sets", (built,))
                    if (ws.G, ws.N, ws.K) not in self._shapes
                    and not self._executor.captured(ws.G, ws.N, ws.K, ws.wq, ws.w_scale)]
        new_experts = [built] if isinstance(built, ExpertSet) and not \
            self._experts.graphs.prepared(built, self.moe_top_k) else []
        job = _ahead.make_job(self.backend, self.max_bucket_m, self.moe_top_k, new_sets,
                              new_experts)
        if job is None or _ahead.compile_ahead(job, stop=self._closing) is None:
            return None
        return job

    def _expert_graphs(self, es: ExpertSet) -> None:
        """On the loader thread: the ffn and moe graphs of ``es``'s shape. A family
        served already is complete (sets of one shape share its graphs through the
        address words) and captures nothing; a new one is used by no call yet."""
        try:
            if self._load_stream is None:
                self._experts.prepare(es)
            else:
                torch.cuda.set_device(self.device)
                with torch.cuda.stream(self._load_stream):
                    self._experts.prepare(es)
        except torch.OutOfMemoryError as exc:
            raise OutOfMemory(
                f"the device cannot hold the graphs of expert set {es.name!r}: {exc}"
            ) from exc

    def _graphs_for(self, ws: WeightSet) -> None:
        """On the loader thread: the graphs of ``ws``'s shape, captured if need be."""
        shape = (ws.G, ws.N, ws.K)
        self._hold(ws)
        if self._executor.captured(*shape, ws.wq, ws.w_scale):
            self._shapes.add(shape)
            return
        if shape not in self._shapes:
            self._capture(ws)
            self._shapes.add(shape)
            return
        self._between_batches(lambda: self._capture(ws))

    def _between_batches(self, fn: Callable[[], Any]) -> None:
        """On the loader thread: ``fn`` run by the worker between batches, waited for."""
        job = _Job(fn)
        with self._cv:
            if self._closed:
                raise NotReady("the server is shutting down")
            self._items.append(job)
            self._cv.notify()
        job.future.result()

    def _capture(self, ws: WeightSet) -> WeightSet:
        """Capture ``ws``'s graphs (a no-op on the CPU); return ``ws``."""
        try:
            if self._load_stream is None:
                self._executor.prepare(ws.G, ws.N, ws.K, ws.wq, ws.w_scale)
            else:
                torch.cuda.set_device(self.device)
                with torch.cuda.stream(self._load_stream):
                    self._executor.prepare(ws.G, ws.N, ws.K, ws.wq, ws.w_scale)
        except torch.OutOfMemoryError as exc:
            raise OutOfMemory(
                f"the device cannot hold the graphs of weight set {ws.name!r}: {exc}"
            ) from exc
        return ws

    def prepare(self, ws: WeightSet) -> WeightSet:
        """Capture the graphs ``ws``'s shape needs on this thread (tests; the server loads
        through :meth:`load`)."""
        self._shapes.add((ws.G, ws.N, ws.K))
        self._hold(ws)
        return self._capture(ws)

    def forget(self, ws: WeightSet) -> None:
        """After ``ws`` was replaced or deleted (or failed to go live): drop graphs bound to
        its memory, and, on the loader in turn with loads, its shape's graphs and buffers
        if no other set has the shape (a set of it loaded before this runs keeps them)."""
        self._executor.pool.forget(ws.wq)
        self._unhold(ws)
        with contextlib.suppress(RuntimeError):  # closed: nothing serves the shape any more
            self._loader_job(self._release_if_unused, (ws.G, ws.N, ws.K))

    def _hold(self, ws: WeightSet) -> None:
        """Register ``ws`` (weakly) as a set of its shape."""
        self._holders.setdefault((ws.G, ws.N, ws.K), {})[id(ws.wq)] = weakref.ref(ws.wq)

    def _unhold(self, ws: WeightSet) -> None:
        holders = self._holders.get((ws.G, ws.N, ws.K))
        if holders is not None and (ref := holders.get(id(ws.wq))) is not None \
                and ref() is ws.wq:
            del holders[id(ws.wq)]

    def _release_if_unused(self, shape: tuple[int, int, int]) -> None:
        """On the loader thread: drop ``shape``'s graphs and buffers if no set holds it,
        between batches (the worker's lanes and routes are not being made meanwhile)."""
        holders = self._holders.get(shape, {})
        if self._closed or any(ref() is not None for ref in list(holders.values())):
            return
        self._holders.pop(shape, None)
        self._shapes.discard(shape)
        with contextlib.suppress(NotReady):  # closed meanwhile: nothing runs any more
            self._between_batches(lambda: self._executor.release(*shape))

    async def forget_experts(self, es: ExpertSet) -> None:
        """After ``es`` was replaced or deleted (or failed to go live): drop its matrices'
        gemm graphs, and the ffn/moe graphs and buffers no other loaded set uses, judged
        on the loader thread, in turn with loads and their captures (a set of the shape
        loaded before this runs keeps them, swapped in yet or not)."""
        self.forget(es.w13)
        self.forget(es.w2)
        await self._on_loader(self._experts.forget, es)

    @property
    def graphs(self) -> bool:
        """Whether calls replay captured CUDA graphs (False on the CPU)."""
        return self._executor.pool.use_graphs

    def queued(self) -> int:
        """Calls waiting for the device."""
        with self._lock:
            return self._pending_calls

    # -- the worker ---------------------------------------------------------------

    def _work_loop(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            try:
                self._work(item)
            finally:
                self._release()

    def _work(self, item) -> None:
        if isinstance(item, _Job):
            if item.future.set_running_or_notify_cancel():
                try:
                    item.future.set_result(item.fn())
                except Exception as exc:  # noqa: BLE001 -- handed to the awaiting request
                    item.future.set_exception(exc)
            return
        batch = [item]
        try:
            self._collect(batch)
            for part in self._batches([call for call in batch if not _gone(call)]):
                self._run_batch(part)
        except Exception:  # a bug here fails the calls collected so far, never the worker
            log.exception("the engine failed a batch of %d calls", len(batch))
            for call in batch:
                if call.outcome is None:
                    call.outcome = InternalError("the engine failed this call")
        finally:
            for call in batch:
                self._wake_threadsafe(call)

    def _next(self):
        with self._cv:
            while (not self._items or self._busy or self._loop_waiting) and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            item = self._items.popleft()
            if not isinstance(item, _Job):
                self._pending_calls -= 1
            self._busy = True
            return item

    def _collect(self, batch: list) -> None:
        """Add to ``batch`` (its first call) the calls of its key that arrive with it, within
        the key's rows.

        Calls already queued always join (they would wait anyway). The worker
        waits up to ``merge_window_us`` for more only while calls are arriving
        together -- the previous batch merged several -- so a lone caller never
        pays the window. A window of zero disables merging.
        """
        if self.merge_window_s <= 0:
            return
        first = batch[0]
        rows, key, limit = first.rows, self._key(first), self._limit(first)
        wait = self._last_batch_calls > 1
        close_at = time.monotonic() + self.merge_window_s
        with self._cv:
            while rows < limit:
                for item in list(self._items):
                    if (
                        not isinstance(item, _Job)
                        and self._key(item) == key
                        and rows + item.rows <= limit
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

    @staticmethod
    def _wake_threadsafe(call) -> None:
        waiter = getattr(call, "waiter", None)
        if waiter is not None:
            try:
                waiter.get_loop().call_soon_threadsafe(_wake, call)
            except RuntimeError:  # its loop is closed: nobody waits any more
                pass


_GONE = object()  # a call's outcome once its caller went away before it ran


def _gone(call) -> bool:
    """Whether the call's caller went away (its wait cancelled) before it ran."""
    waiter = call.waiter
    return call.outcome is _GONE or (waiter is not None and waiter.cancelled())


def _take(queue, call) -> bool:
    """Remove ``call`` (this very object: calls hold tensors, no equality) from ``queue``."""
    for i, queued in enumerate(queue):
        if queued is call:
            del queue[i]
            return True
    return False


def _wake(call) -> None:
    waiter = getattr(call, "waiter", None)
    if waiter is not None and not waiter.done():
        if call.outcome is None:  # never ran (a bug): never leave a caller hanging
            call.outcome = InternalError("the engine failed this call")
        waiter.set_result(None)


