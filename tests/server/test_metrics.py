"""The per-call metrics' lock-free storage renders exactly as prometheus-client's own."""

from __future__ import annotations

import math
import random

import prometheus_client
import pytest
from moegemm.server import metrics as metrics_mod
from prometheus_client import Counter, Histogram


def _updates(m: metrics_mod.Metrics, seed: int) -> None:
    """The same mixed updates for any Metrics: labelled children, bucket bounds hit
    exactly, values between and past them, zero, NaN, integers and floats."""
    rng = random.Random(seed)
    bounds = list(metrics_mod._LATENCY_BUCKETS)
    values = bounds + [b * 0.999 for b in bounds] + [b * 1.001 for b in bounds] + \
        [0.0, 11.0, 1e9, math.nan] + [rng.random() * 0.01 for _ in range(50)]
    endpoints = ["/v1/weights/{name}/gemm", "/v1/experts/{name}/moe", "unmatched"]
    for i, v in enumerate(values):
        endpoint = endpoints[i % 3]
        m.requests.labels(endpoint=endpoint, status=str(200 + 100 * (i % 4))).inc()
        m.request_seconds.labels(endpoint=endpoint).observe(v)
        m.queue_seconds.observe(v)
        m.kernel_seconds.observe(v / 3)
        m.batch_calls.observe(1 + i % 70)
        m.bytes_in.inc(rng.randrange(1, 1 << 20))
        m.bytes_out.inc(rng.random() * 1000)
        m.launches.labels(mode="graph" if i % 2 else "eager").inc(1 + i % 3)
        m.inline_batches.inc()
    m.watch(lambda: 12345.0, lambda: 0.0, lambda: 3)


def _library_metrics(monkeypatch) -> metrics_mod.Metrics:
    """Metrics built from prometheus-client's own Counter and Histogram."""
    with monkeypatch.context() as patch:
        patch.setattr(metrics_mod, "FastCounter", Counter)
        patch.setattr(metrics_mod, "FastHistogram", Histogram)
        return metrics_mod.Metrics()


@pytest.mark.parametrize("created", [True, False])
def test_exposition_is_the_librarys_line_for_line(monkeypatch, created):
    # One clock for both: the _created series then agree to the digit.
    monkeypatch.setattr(prometheus_client.metrics.time, "time", lambda: 1767225600.25)
    monkeypatch.setattr(prometheus_client.metrics, "_use_created", created)
    ours, theirs = metrics_mod.Metrics(), _library_metrics(monkeypatch)
    assert isinstance(ours.requests, metrics_mod.FastCounter)
    assert type(theirs.requests) is Counter
    for m in (ours, theirs):
        _updates(m, seed=7)
    mine, want = ours.render().decode().splitlines(), theirs.render().decode().splitlines()
    assert len(mine) == len(want) > 100
    for a, b in zip(mine, want):
        assert a == b
    assert ("moegemm_request_seconds_bucket{endpoint=\"unmatched\",le=\"5e-05\"} "
            in ours.render().decode())


def test_collect_gives_the_librarys_samples(monkeypatch):
    monkeypatch.setattr(prometheus_client.metrics.time, "time", lambda: 5.0)
    ours, theirs = metrics_mod.Metrics(), _library_metrics(monkeypatch)
    for m in (ours, theirs):
        for v in (1, 2, 2, 3, 64, 65, 1000):
            m.batch_calls.observe(v)
        m.requests.labels(endpoint="e", status="200").inc(3)
    assert ours.batch_calls.collect()[0].samples == theirs.batch_calls.collect()[0].samples
    assert ours.requests.collect()[0].samples == theirs.requests.collect()[0].samples


def test_counters_refuse_what_the_library_refuses():
    m = metrics_mod.Metrics()
    with pytest.raises(ValueError):
        m.bytes_in.inc(-1)
    with pytest.raises(ValueError):
        m.requests.labels(endpoint="e")  # a label missing
    m.requests.labels(endpoint="e", status="200").inc(0)
    assert m.requests.labels(endpoint="e", status="200")._value.get() == 0.0
