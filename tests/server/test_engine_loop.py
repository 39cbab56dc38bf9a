"""Loop batches: calls that arrive together run merged on the event loop's thread,
answer exactly what the worker answers, and never overlap a job or a worker batch."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch
from moegemm.client._errors import DeadlineExceeded, NotFinite, NotReady
from moegemm.kernels.reference import create as reference_backend
from moegemm.kernels.testing import random_m_sizes, random_problem
from moegemm.server.engine import Engine

N, K, G = 256, 256, 4


def _engine(*, loop: bool, merge_window_us: int = 500, max_bucket_m: int = 64) -> Engine:
    engine = Engine(reference_backend(torch.device("cpu")), max_bucket_m=max_bucket_m,
                    merge_window_us=merge_window_us, loop_batches=loop)
    engine.start()
    return engine


def _set(gen, name="w"):
    p = random_problem(1, N, K, G, generator=gen)
    return SimpleNamespace(name=name, G=G, N=N, K=K, wq=p.wq, w_scale=p.w_scale)


def _calls(gen, count, rows=lambda i: 1 + (i * 7) % 40):
    out = []
    for i in range(count):
        m = rows(i)
        p = random_problem(m, N, K, G, generator=gen)
        out.append((p.xq, p.x_scale, random_m_sizes(G, m, generator=gen)))
    return out


def _spy_batches(engine):
    """Record (on the loop's thread?, calls) for every batch the engine runs."""
    seen = []
    real = engine._outcomes

    def spy(batch):
        seen.append((threading.current_thread() is threading.main_thread(), len(batch)))
        return real(batch)

    engine._outcomes = spy
    return seen


async def _gather(engine, sets_calls):
    return await asyncio.gather(*(engine.gemm(ws, x, xs, m) for ws, (x, xs, m) in sets_calls))


def _run(engine, coro_fn):
    try:
        return asyncio.run(coro_fn())
    finally:
        engine.close()


def test_loop_batches_merge_and_equal_the_worker_bit_for_bit():
    gen = torch.Generator().manual_seed(torch.seed())
    a, b = _set(gen, "a"), _set(gen, "b")
    work = [(a if i % 3 else b, c) for i, c in enumerate(_calls(gen, 12))]
    want = asyncio.run(_gather(_worker_ref, work))
    engine = _engine(loop=True)
    seen = _spy_batches(engine)
    got = _run(engine, lambda: _gather(engine, work))
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    # every batch on the loop's thread; the calls of one turn merged per weight set
    assert all(on_loop for on_loop, _ in seen)
    assert sum(n for _, n in seen) == len(work)
    assert max(n for _, n in seen) > 1
    assert len(seen) < len(work)


# The reference answers come from an engine without loop batches and without merging.
_worker_ref: Engine


@pytest.fixture(autouse=True)
def _reference_engine():
    global _worker_ref
    _worker_ref = _engine(loop=False, merge_window_us=0)
    yield
    _worker_ref.close()


def test_without_a_window_every_call_is_its_own_loop_batch():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    work = [(ws, c) for c in _calls(gen, 5)]
    engine = _engine(loop=True, merge_window_us=0)
    seen = _spy_batches(engine)
    got = _run(engine, lambda: _gather(engine, work))
    want = asyncio.run(_gather(_worker_ref, work))
    assert seen == [(True, 1)] * len(work)
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def test_a_batch_never_passes_the_bucket_limit():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    work = [(ws, c) for c in _calls(gen, 6, rows=lambda i: 30)]
    engine = _engine(loop=True, max_bucket_m=64)
    rows_seen = []
    real = engine._outcomes

    def spy(batch):
        rows_seen.append(sum(c.rows for c in batch))
        return real(batch)

    engine._outcomes = spy
    _run(engine, lambda: _gather(engine, work))
    assert rows_seen and max(rows_seen) <= 64 and sum(rows_seen) == 180


def test_a_bad_row_fails_only_its_own_call_in_a_merged_loop_batch():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    calls = _calls(gen, 4)
    x, xs, m = calls[2]
    bad = xs.clone()
    bad[-1, 0] = float("inf")
    calls[2] = (x, bad, m)
    engine = _engine(loop=True)
    seen = _spy_batches(engine)

    async def scenario():
        return await asyncio.gather(*(engine.gemm(ws, *c) for c in calls),
                                    return_exceptions=True)

    got = _run(engine, scenario)
    assert isinstance(got[2], NotFinite)
    want = asyncio.run(_gather(_worker_ref, [(ws, c) for i, c in enumerate(calls) if i != 2]))
    for x_, y in zip([g for i, g in enumerate(got) if i != 2], want):
        assert torch.equal(x_, y)
    assert max(n for _, n in seen) == len(calls)


def test_large_calls_and_deadlines():
    """A call over the loop's row limit runs on the worker; a passed deadline fails."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    engine = _engine(loop=True, max_bucket_m=2048)
    big = _calls(gen, 1, rows=lambda i: engine.loop_max_rows + 1)[0]
    small = _calls(gen, 1)[0]
    seen = _spy_batches(engine)

    async def scenario():
        out = await engine.gemm(ws, *big)
        with pytest.raises(DeadlineExceeded):
            await engine.gemm(ws, *small, deadline=0.0)
        return out

    out = _run(engine, scenario)
    assert out.shape == (engine.loop_max_rows + 1, N)
    assert seen[0] == (False, 1)  # the big call: on the worker


def test_loop_calls_and_jobs_never_overlap_on_the_device():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    work = [(ws, c) for c in _calls(gen, 24)]
    want = asyncio.run(_gather(_worker_ref, work))
    engine = _engine(loop=True)
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

    def job():
        with lock:
            running[0] += 1
            overlaps.append(running[0] > 1)
        try:
            threading.Event().wait(0.02)
        finally:
            with lock:
                running[0] -= 1

    engine._executor.run = guarded

    async def with_jobs():
        first = asyncio.ensure_future(_gather(engine, work[:12]))
        await asyncio.sleep(0)
        jobs = [asyncio.ensure_future(engine.run(job)) for _ in range(2)]
        await asyncio.sleep(0.005)  # a job holds the device: these go to the worker
        rest = await _gather(engine, work[12:])
        await asyncio.gather(*jobs)
        return (await first) + rest

    got = _run(engine, with_jobs)
    assert overlaps and not any(overlaps)
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def test_a_caller_that_goes_away_before_the_drain_is_not_run():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    calls = _calls(gen, 3)
    engine = _engine(loop=True)
    ran = []
    real = engine._outcomes

    def spy(batch):
        ran.append(len(batch))
        return real(batch)

    engine._outcomes = spy

    async def scenario():
        tasks = [asyncio.ensure_future(engine.gemm(ws, *c)) for c in calls]
        await asyncio.sleep(0)  # all three queued for the drain
        tasks[1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        return done

    got = _run(engine, scenario)
    assert isinstance(got[1], asyncio.CancelledError)
    assert ran == [2]
    assert engine.queued() == 0


def test_calls_waiting_for_the_drain_at_close_are_refused():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    engine = _engine(loop=True)

    async def scenario():
        task = asyncio.ensure_future(engine.gemm(ws, *_calls(gen, 1)[0]))
        await asyncio.sleep(0)  # queued; the drain has not run
        engine.close()
        with pytest.raises(NotReady):
            await task

    _run(engine, scenario)
