"""Calls that run inline (on the event loop's thread, the device idle) answer exactly
what the worker answers, and never overlap the worker's batches or jobs."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch
from moegemm.client._errors import DeadlineExceeded, NotFinite
from moegemm.kernels.reference import create as reference_backend
from moegemm.kernels.testing import random_m_sizes, random_problem
from moegemm.server.engine import Engine

N, K, G = 256, 256, 4


def _engine(inline: bool, merge_window_us: int = 0) -> Engine:
    engine = Engine(reference_backend(torch.device("cpu")), max_bucket_m=64,
                    merge_window_us=merge_window_us, inline_when_idle=inline)
    engine.start()
    return engine


def _set(gen):
    p = random_problem(1, N, K, G, generator=gen)
    return SimpleNamespace(name="w", G=G, N=N, K=K, wq=p.wq, w_scale=p.w_scale)


def _calls(gen, count):
    out = []
    for i in range(count):
        m = 1 + (i * 7) % 40
        p = random_problem(m, N, K, G, generator=gen)
        out.append((p.xq, p.x_scale, random_m_sizes(G, m, generator=gen)))
    return out


def test_inline_equals_worker_bit_for_bit():
    gen = torch.Generator().manual_seed(torch.seed())
    ws, calls = _set(gen), _calls(gen, 6)
    results = {}
    for inline in (True, False):
        engine = _engine(inline)
        inline_thread = []
        real = engine._outcomes

        def spy(batch, real=real, inline_thread=inline_thread):
            inline_thread.append(threading.current_thread() is threading.main_thread())
            return real(batch)

        engine._outcomes = spy

        async def run_all(engine=engine):
            return [await engine.gemm(ws, x, xs, m, alone=True) for x, xs, m in calls]

        try:
            results[inline] = asyncio.run(run_all())
        finally:
            engine.close()
        # one call at a time, the device idle: all inline, or all on the worker
        assert all(inline_thread) if inline else not any(inline_thread)
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)


def test_inline_errors_and_deadlines():
    gen = torch.Generator().manual_seed(torch.seed())
    ws, [(x, xs, m)] = _set(gen), _calls(gen, 1)
    engine = _engine(True)
    bad = xs.clone()
    bad[0, 0] = float("nan")

    async def scenario():
        with pytest.raises(NotFinite):
            await engine.gemm(ws, x, bad, m, alone=True)
        with pytest.raises(DeadlineExceeded):
            await engine.gemm(ws, x, xs, m, deadline=0.0, alone=True)  # long past
        return await engine.gemm(ws, x, xs, m, alone=True)

    try:
        out = asyncio.run(scenario())
    finally:
        engine.close()
    assert out.shape == (x.shape[0], N)


def test_concurrent_calls_and_jobs_never_overlap_on_the_device():
    """Many calls at once (some inline, most queued) and device jobs: every result
    right, and no two batches or jobs ever run at the same time."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws, calls = _set(gen), _calls(gen, 24)
    reference = _engine(False)
    try:
        want = asyncio.run(_gather(reference, ws, calls))
    finally:
        reference.close()
    engine = _engine(True, merge_window_us=500)
    running, overlaps = [0], []
    lock = threading.Lock()
    real = engine._executor.run

    def guarded(*args, **kwargs):
        with lock:
            running[0] += 1
            overlaps.append(running[0] > 1)
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    engine._executor.run = guarded

    async def with_jobs():
        job = asyncio.ensure_future(engine.run(lambda: guarded_job(lock, running, overlaps)))
        got = await _gather(engine, ws, calls)
        await job
        return got

    try:
        got = asyncio.run(with_jobs())
    finally:
        engine.close()
    assert not any(overlaps)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def guarded_job(lock, running, overlaps):
    with lock:
        running[0] += 1
        overlaps.append(running[0] > 1)
    try:
        threading.Event().wait(0.01)
    finally:
        with lock:
            running[0] -= 1


async def _gather(engine, ws, calls):
    # Some callers say they are alone (as a transport with one request would).
    return await asyncio.gather(*(engine.gemm(ws, x, xs, m, alone=i % 3 == 0)
                                  for i, (x, xs, m) in enumerate(calls)))


def test_a_call_that_is_not_alone_never_runs_inline():
    """The transport counts other requests in progress: then the call queues for the
    worker (where merging can happen), even with the device idle."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws, calls = _set(gen), _calls(gen, 4)
    engine = _engine(True)
    threads = []
    real = engine._outcomes

    def spy(batch):
        threads.append(threading.current_thread() is threading.main_thread())
        return real(batch)

    engine._outcomes = spy

    async def run_all():
        return [await engine.gemm(ws, x, xs, m, alone=False) for x, xs, m in calls]

    try:
        asyncio.run(run_all())
    finally:
        engine.close()
    assert threads == [False] * len(calls)
