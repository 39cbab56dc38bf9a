"""Prometheus collectors (SPEC 2.3), one registry per app.

A registry per app (not prometheus-client's global one) lets several apps live
in one process, as they do in the tests.

The per-call counters and histograms keep their values in plain Python numbers
(:class:`_Cell`) instead of prometheus-client's locked values: a lone gemm call
updates nine of them, and the library's ``inc``/``observe`` (a lock, label and
observability checks, a linear bucket scan) cost ~5 us of the handler's ~40 on
the CPU box (``bench/overhead_cpu.py``). Only the storage and the two update
methods change: names, labels, children and the exposition are the library's own
code (``collect``), so ``/metrics`` reads line for line as before
(``tests/server/test_metrics.py`` renders both side by side). No lock is needed:
request metrics are written on the event loop's thread only, and the engine's
batch metrics by whichever thread holds the device (``Engine._busy``: one batch
at a time); a scrape reading a value mid-update sees the old or the new number.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)


class _Cell:
    """One lock-free value in place of prometheus-client's ``MutexValue`` (what the
    library's ``collect`` reads: ``get`` and ``get_exemplar``)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float) -> None:
        self.value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self.value = value

    def get(self) -> float:
        return self.value

    def get_exemplar(self) -> None:
        return None


class FastCounter(Counter):
    """A prometheus-client ``Counter`` whose children count in a :class:`_Cell`
    (no exemplars: the service sets none)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _Cell()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._value.value += amount


class FastHistogram(Histogram):
    """A prometheus-client ``Histogram`` whose children count in :class:`_Cell`s and
    find an observation's bucket by bisection (the library scans them in order)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._sum = _Cell()
        self._buckets = [_Cell() for _ in self._upper_bounds]

    def observe(self, amount: float) -> None:
        self._sum.value += amount
        if amount == amount:  # noqa: PLR0124 -- a NaN lands in no bucket, as in the library
            self._buckets[bisect_left(self._upper_bounds, amount)].value += 1


# Seconds: from 10 us (a one-token call's device time on a GPU) to 5 minutes (an expert set
# loaded from a checkpoint: 33-103 s for a DeepSeek-V3 layer on the H200, README).
_LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
    0.5, 1, 2.5, 10, 30, 120, 300,
)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


class Metrics:
    """The server's collectors, registered in their own registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = FastCounter(
            "moegemm_requests", "HTTP requests by endpoint and status",
            ["endpoint", "status"], registry=r,
        )
        self.request_seconds = FastHistogram(
            "moegemm_request_seconds",
            "Total time of a request in the server, from its head's first bytes (its body's "
            "upload included, as its deadline counts) to its answer",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_seconds = FastHistogram(
            "moegemm_queue_seconds",
            "Time a call (gemm, ffn or moe) waited for the engine: until a batch took it, or "
            "until it left the queue unrun (its deadline passed, its client went away)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.kernel_seconds = FastHistogram(
            "moegemm_kernel_seconds",
            "Device time of one batch (launches and copies back); calls the device's check "
            "refuses (not_finite, bad_routing) ran too",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.batch_calls = FastHistogram(
            "moegemm_batch_calls", "Calls (gemm, ffn or moe) merged into one batch",
            buckets=_BATCH_BUCKETS, registry=r,
        )
        self.bytes_in = FastCounter("moegemm_bytes_in", "Request body bytes received", registry=r)
        self.bytes_out = FastCounter("moegemm_bytes_out",
                                     "Response body bytes sent (/metrics answers included)", registry=r)
        self.launches = FastCounter(
            "moegemm_launches",
            "Batch runs on the device, one per chunk of the largest bucket: CUDA graph "
            "replays (an ffn or moe chunk's kernels in one graph) vs eager runs",
            ["mode"], registry=r,
        )
        for mode in ("graph", "eager"):
            self.launches.labels(mode=mode)
        self.inline_batches = FastCounter(
            "moegemm_inline_batches",
            "Calls run at once on the event loop's thread (alone, the device free; GPU only)",
            registry=r,
        )
        self.weight_bytes = Gauge(
            "moegemm_weight_bytes", "Device bytes held by loaded weight sets", registry=r
        )
        self.device_memory_bytes = Gauge(
            "moegemm_device_memory_bytes",
            "Device memory in use by the allocator (0 on the CPU, which has no pool)",
            registry=r,
        )

        self.queue_depth = Gauge(
            "moegemm_queue_depth", "Calls (gemm, ffn or moe) waiting for the engine", registry=r
        )

    def watch(
        self,
        weight_bytes: Callable[[], float],
        device_memory: Callable[[], float],
        queue_depth: Callable[[], float],
    ) -> None:
        """Read the gauges from these functions at every scrape."""
        self.weight_bytes.set_function(weight_bytes)
        self.device_memory_bytes.set_function(device_memory)
        self.queue_depth.set_function(queue_depth)

    def render(self) -> bytes:
        """The text exposition of every collector."""
        return generate_latest(self.registry)
