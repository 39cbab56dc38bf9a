"""Prometheus collectors (SPEC 2.3), one registry per app.

A registry per app (not prometheus-client's global one) lets several apps live
in one process, as they do in the tests.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# Seconds: from 50 us (a small call on a GPU) to 10 s (a long queue).
_LATENCY_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 10,
)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


class Metrics:
    """The server's collectors, registered in their own registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "moegemm_requests", "HTTP requests by endpoint and status",
            ["endpoint", "status"], registry=r,
        )
        self.request_seconds = Histogram(
            "moegemm_request_seconds", "Total time of a request in the server",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_seconds = Histogram(
            "moegemm_queue_seconds", "Time a gemm call waited for the engine",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.kernel_seconds = Histogram(
            "moegemm_kernel_seconds", "Device time of one batch (launches and copies back)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.batch_calls = Histogram(
            "moegemm_batch_calls", "Calls (gemm, ffn or moe) merged into one batch",
            buckets=_BATCH_BUCKETS, registry=r,
        )
        self.bytes_in = Counter("moegemm_bytes_in", "Request body bytes received", registry=r)
        self.bytes_out = Counter("moegemm_bytes_out", "Response body bytes sent", registry=r)
        self.launches = Counter(
            "moegemm_launches", "Kernel launches: CUDA graph replays vs eager runs",
            ["mode"], registry=r,
        )
        for mode in ("graph", "eager"):
            self.launches.labels(mode=mode)
        self.inline_batches = Counter(
            "moegemm_inline_batches",
            "Calls run at once on the event loop's thread (alone, the device free)", registry=r,
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
            "moegemm_queue_depth", "Gemm calls waiting for the engine", registry=r
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
