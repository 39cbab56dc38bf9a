"""The engine's one entry (``Engine.submit``) on the CPU: batching, merging, the loop and
the worker, deadlines, bad rows, jobs and shutdown.

On a GPU small calls run on the event loop's thread (SPEC 3); on the CPU every
call goes to the worker. The tests that are about the loop set the engine's
loop bound as a GPU has it (``_loop_rows``), so the same batching runs here with
the reference kernel.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from moegemm.client._errors import DeadlineExceeded, NotFinite, NotReady, OutOfMemory
from moegemm.kernels.reference import create as reference_backend
from moegemm.kernels.testing import random_m_sizes, random_problem
from moegemm.server._priority import LOADER_NICE
from moegemm.server.engine import SMALL_ROWS, Engine
from moegemm.server.metrics import Metrics
from server_support import bf16_rows, gemm_call

N, K, G = 256, 256, 4


def _engine(*, loop: bool, merge_window_us: int = 500, max_bucket_m: int = 64) -> Engine:
    engine = Engine(reference_backend(torch.device("cpu")), max_bucket_m=max_bucket_m,
                    merge_window_us=merge_window_us)
    if loop:
        engine._loop_rows = SMALL_ROWS  # as on a GPU
    engine.start()
    return engine


def _set(gen, name="w"):
    p = random_problem(1, N, K, G, generator=gen)
    return SimpleNamespace(name=name, G=G, N=N, K=K, wq=p.wq, w_scale=p.w_scale)


def _calls(gen, sets, count, rows=lambda i: 1 + (i * 7) % 40, deadline=None):
    """``count`` fresh validated calls, on ``sets`` in turn."""
    out = []
    for i in range(count):
        m = rows(i)
        p = random_problem(m, N, K, G, generator=gen)
        out.append(gemm_call(sets[i % len(sets)], p.xq, p.x_scale,
                             random_m_sizes(G, m, generator=gen), deadline=deadline))
    return out


def _again(call):
    """A fresh call of the same inputs (calls are used once)."""
    return gemm_call(call.ws, *call.tensors)


def _spy_batches(engine):
    """Record (on the main thread?, calls) for every batch the engine runs."""
    seen = []
    executor = engine._executor
    real = executor.run

    def spy(ws, batch):
        seen.append((threading.current_thread() is threading.main_thread(), len(batch)))
        return real(ws, batch)

    executor.run = spy
    return seen


async def _gather(engine, calls, **kw):
    return await asyncio.gather(*(engine.submit(c, **kw) for c in calls), return_exceptions=True)


def _run(engine, coro_fn):
    try:
        return asyncio.run(coro_fn())
    finally:
        engine.close()


def _one_by_one(calls):
    """Each call's answer from an engine that never merges (the reference)."""
    ref = _engine(loop=False, merge_window_us=0)
    try:
        async def each():
            return [await ref.submit(_again(c)) for c in calls]
        return asyncio.run(each())
    finally:
        ref.close()


def _queue_seconds(metrics) -> tuple[float, float]:
    """``moegemm_queue_seconds``' count and sum."""
    samples = {s.name: s.value for s in metrics.queue_seconds.collect()[0].samples}
    return samples["moegemm_queue_seconds_count"], samples["moegemm_queue_seconds_sum"]


@pytest.mark.parametrize("rows", [5, SMALL_ROWS + 1], ids=["loop", "worker"])
def test_the_queue_time_counts_the_calls_that_left_the_queue_unrun(rows):
    """Every call that waited is in ``queue_seconds``, with the time it waited: one that ran,
    one whose deadline passed in the queue and one whose caller went away from it (those two
    are the calls that waited longest; counting only the calls that ran hid them)."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    metrics = Metrics()
    engine = Engine(reference_backend(torch.device("cpu")), max_bucket_m=512, metrics=metrics)
    engine._loop_rows = SMALL_ROWS  # as on a GPU
    engine.start()
    release = threading.Event()
    late, gone, patient = _calls(gen, [ws], 3, rows=lambda i: rows)
    late.deadline = time.monotonic() + 3600  # set for real below, once the device is held

    async def scenario():
        hold = asyncio.ensure_future(engine.run(lambda: release.wait(30)))
        while not engine._busy:
            await asyncio.sleep(0.001)
        late.deadline = time.monotonic() + 0.2
        for call in (late, gone, patient):  # made just before they are sent, as the server does
            call.enqueued = time.monotonic()
        tasks = [asyncio.ensure_future(engine.submit(c)) for c in (late, gone, patient)]
        await asyncio.sleep(0.3)
        tasks[1].cancel()
        await asyncio.wait(tasks[:2], timeout=5)
        counted = _queue_seconds(metrics)
        await asyncio.sleep(0.2)
        release.set()
        await hold
        return counted, await asyncio.gather(*tasks, return_exceptions=True)

    (count_unrun, sum_unrun), got = _run(engine, scenario)
    assert isinstance(got[0], DeadlineExceeded) and isinstance(got[1], asyncio.CancelledError)
    assert not isinstance(got[2], BaseException)
    assert count_unrun == 2 and 0.5 <= sum_unrun < 5  # 0.2 s and 0.3 s in the queue
    count, total = _queue_seconds(metrics)
    assert count == 3 and total - sum_unrun >= 0.5  # the patient call: 0.5 s or more
    # A lone call run at once on the loop's thread waited for nothing, and counts too.
    engine = Engine(reference_backend(torch.device("cpu")), metrics=metrics)
    engine._loop_rows = SMALL_ROWS
    engine.start()
    alone = _calls(gen, [ws], 1, rows=lambda i: 5)[0]
    _run(engine, lambda: engine.submit(alone, alone=True))
    assert metrics.inline_batches._value.get() == 1
    assert _queue_seconds(metrics)[0] == 4 and _queue_seconds(metrics)[1] - total < 0.5


@pytest.mark.parametrize("loop", [True, False])
def test_merged_batches_equal_one_by_one_bit_for_bit(loop):
    gen = torch.Generator().manual_seed(torch.seed())
    a, b = _set(gen, "a"), _set(gen, "b")
    calls = _calls(gen, [a, a, b], 12)
    want = _one_by_one(calls)
    engine = _engine(loop=loop)
    seen = _spy_batches(engine)
    got = _run(engine, lambda: _gather(engine, calls))
    for x, y in zip(got, want):
        assert torch.equal(bf16_rows(x), bf16_rows(y))
    assert sum(n for _, n in seen) == len(calls)
    assert max(n for _, n in seen) > 1 and len(seen) < len(calls)  # merged
    assert all(on_loop == loop for on_loop, _ in seen)


def test_without_a_window_every_call_is_its_own_batch():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    calls = _calls(gen, [ws], 5)
    engine = _engine(loop=True, merge_window_us=0)
    seen = _spy_batches(engine)
    _run(engine, lambda: _gather(engine, calls))
    assert [n for _, n in seen] == [1] * 5


def test_a_lone_call_runs_at_once_on_the_callers_thread():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    [call] = _calls(gen, [ws], 1)
    engine = _engine(loop=True)
    seen = _spy_batches(engine)

    async def scenario():
        task = asyncio.ensure_future(engine.submit(call, alone=True))
        # Ran before the task was first awaited past its first step: no waiter made.
        await asyncio.sleep(0)
        assert task.done() and call.waiter is None
        return await task

    out = _run(engine, scenario)
    assert seen == [(True, 1)]
    assert torch.equal(bf16_rows(out), bf16_rows(_one_by_one([call])[0]))


def test_one_call_runs_at_once_per_turn_and_the_rest_of_the_turn_merge():
    """The transport reads the requests whose bytes arrive in one turn of the loop one after
    another, running each from the callback that read it: each finds itself alone. The first
    runs at once; the others wait for the next turn and run as one batch; a lone call in a
    later turn runs at once again."""
    from moegemm.server._asgi import _run_now

    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    calls = _calls(gen, [ws], 4)
    engine = _engine(loop=True)
    seen = _spy_batches(engine)

    async def scenario():
        # Three callbacks of one turn: no await between them.
        started = [_run_now(engine.submit(c, alone=True)) for c in calls[:3]]
        assert started[0] is None and seen == [(True, 1)]  # answered from its callback
        assert all(task is not None and not task.done() for task in started[1:])
        for task in started[1:]:
            await task
        assert seen == [(True, 1), (True, 2)]
        await asyncio.sleep(0)
        assert _run_now(engine.submit(calls[3], alone=True)) is None  # a later turn: at once

    _run(engine, scenario)
    assert seen == [(True, 1), (True, 2), (True, 1)]


def test_a_batch_never_passes_the_bucket_limit():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    calls = _calls(gen, [ws], 9, rows=lambda i: 20)
    engine = _engine(loop=True, max_bucket_m=64)
    seen = []
    real = engine._executor.run

    def spy(ws_, batch):
        seen.append(sum(c.rows for c in batch))
        return real(ws_, batch)

    engine._executor.run = spy
    _run(engine, lambda: _gather(engine, calls))
    assert sum(seen) == 180 and max(seen) <= 64


def test_large_calls_go_to_the_worker_and_small_ones_stay_on_the_loop():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    small = _calls(gen, [ws], 3, rows=lambda i: 5)
    large = _calls(gen, [ws], 2, rows=lambda i: SMALL_ROWS + 1)
    engine = _engine(loop=True, max_bucket_m=512)
    seen = []
    real = engine._executor.run

    def spy(ws_, batch):
        seen.append((threading.current_thread() is threading.main_thread(),
                     {c.rows for c in batch}))
        return real(ws_, batch)

    engine._executor.run = spy
    got = _run(engine, lambda: _gather(engine, small + large))
    assert all(not isinstance(g, BaseException) for g in got)
    for on_loop, rows in seen:
        assert on_loop == (rows == {5})


def test_a_bad_row_or_a_passed_deadline_fails_only_its_own_call():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    calls = _calls(gen, [ws], 6)
    x, xs, m = calls[2].tensors
    xs = xs.clone()
    xs[0, 0] = float("nan")
    calls[2] = gemm_call(ws, x, xs, m)
    calls[4] = gemm_call(ws, *calls[4].tensors, deadline=time.monotonic() - 1)
    want = _one_by_one([c for i, c in enumerate(calls) if i not in (2, 4)])
    engine = _engine(loop=True)
    got = _run(engine, lambda: _gather(engine, calls))
    assert isinstance(got[2], NotFinite) and isinstance(got[4], DeadlineExceeded)
    for g, w in zip([g for i, g in enumerate(got) if i not in (2, 4)], want):
        assert torch.equal(bf16_rows(g), bf16_rows(w))


@pytest.mark.parametrize("rows", [5, SMALL_ROWS + 1], ids=["loop", "worker"])
def test_a_queued_call_is_answered_at_its_deadline_and_frees_its_place(rows):
    """A call still queued when its deadline passes gets DeadlineExceeded then, not when the
    device comes free, and its place in the queue is free again; the calls queued with it
    without a deadline still run."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    engine = _engine(loop=True, max_bucket_m=512)
    release = threading.Event()
    late, patient = _calls(gen, [ws], 2, rows=lambda i: rows)
    late.deadline = time.monotonic() + 3600  # set for real below, once the device is held
    seen = _spy_batches(engine)

    async def scenario():
        hold = asyncio.ensure_future(engine.run(lambda: release.wait(30)))
        while not engine._busy:
            await asyncio.sleep(0.001)
        late.deadline = time.monotonic() + 0.05
        started = time.monotonic()
        tasks = [asyncio.ensure_future(engine.submit(c)) for c in (late, patient)]
        done, _ = await asyncio.wait(tasks[:1], timeout=5)
        answered = time.monotonic() - started
        queued = engine.queued()
        release.set()
        await hold
        return done, answered, queued, await asyncio.gather(*tasks, return_exceptions=True)

    done, answered, queued, (got_late, got_patient) = _run(engine, scenario)
    assert done and isinstance(got_late, DeadlineExceeded) and answered < 2.0
    assert queued == 1  # the patient call alone holds a place
    assert not isinstance(got_patient, BaseException)
    assert sum(n for _, n in seen) == 1  # the late call never ran


def test_mixed_dtypes_and_sets_batch_apart_and_each_caller_gets_its_rows():
    gen = torch.Generator().manual_seed(torch.seed())
    a, b = _set(gen, "a"), _set(gen, "b")
    calls = []
    for i in range(9):
        m = 3 + i
        ws = (a, b)[i % 2]
        sizes = random_m_sizes(G, m, generator=gen)
        if i % 3 == 0:
            calls.append(gemm_call(ws, torch.randn(m, K, generator=gen).bfloat16(), None, sizes))
        elif i % 3 == 1:
            calls.append(gemm_call(ws, torch.randn(m, K, generator=gen).half(), None, sizes))
        else:
            p = random_problem(m, N, K, G, generator=gen)
            calls.append(gemm_call(ws, p.xq, p.x_scale, sizes))
    want = _one_by_one(calls)
    for loop in (True, False):
        engine = _engine(loop=loop)
        got = _run(engine, lambda e=engine: _gather(e, [_again(c) for c in calls]))
        for g, w in zip(got, want):
            assert torch.equal(bf16_rows(g), bf16_rows(w))


def test_calls_and_jobs_never_overlap_on_the_device():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    engine = _engine(loop=True)
    lock, overlaps = threading.Lock(), []

    def exclusive(fn):
        def run(*args):
            if not lock.acquire(blocking=False):
                overlaps.append(fn)
                return fn(*args)
            try:
                return fn(*args)
            finally:
                lock.release()
        return run

    engine._executor.run = exclusive(engine._executor.run)
    job = exclusive(lambda: time.sleep(0.002))

    async def scenario():
        work = [engine.submit(c) for c in _calls(gen, [ws], 30, rows=lambda i: 1 + i * 13 % 300)]
        work += [engine.run(job) for _ in range(5)]
        return await asyncio.gather(*work, return_exceptions=True)

    got = _run(engine, scenario)
    assert not overlaps
    assert all(not isinstance(g, BaseException) for g in got), got


def test_a_caller_that_goes_away_before_its_turn_is_not_run():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    calls = _calls(gen, [ws], 3)
    engine = _engine(loop=True)
    seen = _spy_batches(engine)

    async def scenario():
        tasks = [asyncio.ensure_future(engine.submit(c)) for c in calls]
        await asyncio.sleep(0)  # each waits for the loop's next turn
        tasks[1].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    got = _run(engine, scenario)
    assert isinstance(got[1], asyncio.CancelledError)
    assert sum(n for _, n in seen) == 2


def test_calls_waiting_at_close_are_refused():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    calls = _calls(gen, [ws], 3)
    engine = _engine(loop=True)

    async def scenario():
        tasks = [asyncio.ensure_future(engine.submit(c)) for c in calls]
        await asyncio.sleep(0)
        engine.close()
        return await asyncio.gather(*tasks, return_exceptions=True)

    got = asyncio.run(scenario())
    assert all(isinstance(g, NotReady) for g in got)
    with pytest.raises(NotReady):
        asyncio.run(engine.submit(_again(calls[0])))


def test_a_call_that_expires_after_close_leaves_the_count_at_zero():
    """close() refuses what is queued and counts nothing queued; a small call whose deadline
    fires before the loop refuses it is answered DeadlineExceeded and takes nothing off that
    count (it went to -1)."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    first = _calls(gen, [ws], 1, rows=lambda i: SMALL_ROWS + 10)[0]
    small = _calls(gen, [ws], 1, rows=lambda i: 3, deadline=time.monotonic() + 60)[0]
    engine = _engine(loop=True, max_bucket_m=512, merge_window_us=0)
    _, entered, go = _gated(engine, first)

    async def scenario():
        tasks = [asyncio.ensure_future(engine.submit(first))]
        await _until(entered[id(first)])
        tasks.append(asyncio.ensure_future(engine.submit(small)))
        await asyncio.sleep(0.01)  # queued on the loop: the worker holds the device
        engine.close(timeout=0)
        engine._expire(small)  # its deadline, before the loop's drain refuses it
        queued = engine.queued()
        go[id(first)].set()
        return await asyncio.gather(*tasks, return_exceptions=True), queued

    got, queued = _run(engine, scenario)
    assert queued == 0
    assert isinstance(got[1], DeadlineExceeded)


def test_small_calls_get_the_device_between_large_ones():
    """Fair turns: small calls that arrive while a large call's batch holds the device
    run on the loop as soon as it ends, before the next large call, never queued
    behind all of them."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    large = _calls(gen, [ws], 3, rows=lambda i: SMALL_ROWS + 10)
    small = _calls(gen, [ws], 4, rows=lambda i: 3)
    engine = _engine(loop=True, max_bucket_m=256, merge_window_us=0)
    order, gate, entered = [], threading.Event(), threading.Event()
    real = engine._executor.run

    def spy(ws_, batch):
        kind = "large" if batch[0].rows > SMALL_ROWS else "small"
        order.append((kind, threading.current_thread() is threading.main_thread()))
        if kind == "large" and len(order) == 1:
            entered.set()
            gate.wait(30)
        return real(ws_, batch)

    engine._executor.run = spy

    async def scenario():
        tasks = [asyncio.ensure_future(engine.submit(c)) for c in large]
        while not entered.is_set():
            await asyncio.sleep(0.001)
        tasks += [asyncio.ensure_future(engine.submit(c)) for c in small]
        await asyncio.sleep(0.05)
        gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    got = _run(engine, scenario)
    assert all(not isinstance(g, BaseException) for g in got), got
    kinds = [k for k, _ in order]
    assert kinds[0] == "large" and kinds[1] == "small", kinds  # right after the first
    assert kinds[1:5] == ["small"] * 4  # all four before the next large one (no merging)
    assert all(on_loop == (k == "small") for k, on_loop in order)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_loads_run_below_the_calls_cpu_priority(tmp_path):
    """SPEC 3: other sets' calls keep their latency while a set loads. The loader's thread and
    the file readers (and the OpenMP workers their torch ops start, which inherit it) yield the
    CPU to the calls: their nice value is LOADER_NICE; the worker that runs calls keeps the
    process's."""
    from moegemm.server.store import _FileGroups

    process = os.getpriority(os.PRIO_PROCESS, 0)
    if process >= LOADER_NICE:
        pytest.skip(f"the tests already run at nice {process}")

    def nice():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    engine = _engine(loop=False)
    try:
        assert engine._loader.submit(nice).result() == LOADER_NICE
        worker = engine._thread.native_id
        assert os.getpriority(os.PRIO_PROCESS, worker) == process
    finally:
        engine.close()
    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(256)) * 64)
    fd = os.open(path, os.O_RDONLY)
    try:
        readers = _FileGroups(fd, 0)
        got = bytearray(4096)
        readers.read(0, 1, 4096, got)
        assert bytes(got) == path.read_bytes()[:4096]
        assert readers._pool.submit(nice).result() == LOADER_NICE
    finally:
        os.close(fd)


def _gated(engine, *holders):
    """Record (first call, on the loop's thread?) of every batch; a batch whose first call is
    one of ``holders`` signals its ``entered`` event and waits for its ``go`` event."""
    entered = {id(c): threading.Event() for c in holders}
    go = {id(c): threading.Event() for c in holders}
    order, real = [], engine._executor.run

    def spy(ws_, batch):
        order.append((batch[0], threading.current_thread() is threading.main_thread()))
        if id(batch[0]) in entered:
            entered[id(batch[0])].set()
            go[id(batch[0])].wait(30)
        return real(ws_, batch)

    engine._executor.run = spy
    return order, entered, go


async def _until(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.001)


def test_a_small_call_that_expires_waiting_for_the_device_does_not_stop_the_worker():
    """A small call that came while the worker held the device and passed its deadline
    before its turn leaves nothing waiting: the worker goes on with its next item (the
    engine before session 44 kept waiting for the loop's calls, and took no item until
    another small call came)."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    first, later = _calls(gen, [ws], 2, rows=lambda i: SMALL_ROWS + 10)
    engine = _engine(loop=True, max_bucket_m=512, merge_window_us=0)
    _, entered, go = _gated(engine, first)

    async def scenario():
        tasks = [asyncio.ensure_future(engine.submit(first))]
        await _until(entered[id(first)])
        small = _calls(gen, [ws], 1, rows=lambda i: 3, deadline=time.monotonic() + 0.02)[0]
        tasks.append(asyncio.ensure_future(engine.submit(small)))
        await asyncio.sleep(0.1)  # its drain found the device held; then it expired
        go[id(first)].set()
        got = await asyncio.gather(*tasks, return_exceptions=True)
        got.append(await asyncio.wait_for(engine.submit(later), 5))
        return got, engine.queued()

    got, queued = _run(engine, scenario)
    assert isinstance(got[1], DeadlineExceeded)
    assert not isinstance(got[0], BaseException) and not isinstance(got[2], BaseException)
    assert queued == 0


def test_a_small_call_waits_for_one_worker_batch_at_most():
    """A small call that arrives while a worker batch holds the device runs right after that
    batch, before the large calls queued ahead of it, even when the batch ends before the
    loop's next turn (the engine before session 46 marked it waiting only when its drain
    first ran, and the worker started the queued batches in between: first, later, later,
    later, small)."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    first, *later = _calls(gen, [ws], 4, rows=lambda i: SMALL_ROWS + 10)
    small = _calls(gen, [ws], 1, rows=lambda i: 3)[0]
    engine = _engine(loop=True, max_bucket_m=512, merge_window_us=0)
    order, entered, go = _gated(engine, first)

    async def scenario():
        tasks = [asyncio.ensure_future(engine.submit(first))]
        await _until(entered[id(first)])
        tasks += [asyncio.ensure_future(engine.submit(c)) for c in (*later, small)]
        await asyncio.sleep(0)  # each submitted; the small call's drain not yet run
        assert engine._loop_calls == [small]
        go[id(first)].set()
        time.sleep(0.2)  # noqa: ASYNC251 -- the loop held: the worker ends its batch first
        return await asyncio.gather(*tasks, return_exceptions=True)

    got = _run(engine, scenario)
    assert all(not isinstance(g, BaseException) for g in got), got
    names = {id(first): "first", id(small): "small", **{id(c): "later" for c in later}}
    assert [(names[id(c)], on_loop) for c, on_loop in order] == [
        ("first", False), ("small", True), ("later", False), ("later", False), ("later", False)]


def test_a_failure_while_collecting_a_batch_fails_its_calls_not_the_worker():
    """A bug met while the worker merges calls (here the key of one call) answers the calls
    it concerns with ``internal`` and leaves the worker serving the others."""
    from moegemm.client._errors import InternalError

    gen = torch.Generator().manual_seed(torch.seed())
    ws = _set(gen)
    bad, good, after = _calls(gen, [ws], 3, rows=lambda i: SMALL_ROWS + 10)
    engine = _engine(loop=True, max_bucket_m=1024)
    real = engine._executor.batch_key

    def batch_key(call):
        if call is bad:
            raise RuntimeError("a bug")
        return real(call)

    engine._executor.batch_key = batch_key

    async def scenario():
        got = await _gather(engine, [bad, good])
        got.append(await asyncio.wait_for(engine.submit(after), 10))
        return got

    got = _run(engine, scenario)  # the old worker died: the first gather never ended
    assert isinstance(got[0], InternalError)
    assert not isinstance(got[1], BaseException) and not isinstance(got[2], BaseException)


def test_a_shape_is_released_with_its_last_set_and_with_a_load_that_failed():
    """``forget`` releases a shape (graphs, buffers, lanes: ``Executor.release``) on the
    loader once no set of it is left; a set of it loaded before keeps it. A load whose
    captures fail releases what it took."""
    gen = torch.Generator().manual_seed(torch.seed())
    engine = _engine(loop=True)
    released = []
    real_release = engine._executor.release
    engine._executor.release = lambda *shape: released.append(shape) or real_release(*shape)

    async def scenario():
        a = await engine.load(lambda: _set(gen, "a"))
        b = await engine.load(lambda: _set(gen, "b"))
        settled = lambda: asyncio.wrap_future(engine._loader.submit(lambda: None))
        engine.forget(a)
        await settled()
        assert released == [] and (G, N, K) in engine._shapes
        engine.forget(b)
        await settled()
        assert released == [(G, N, K)] and (G, N, K) not in engine._shapes

        def failing_capture(ws):
            raise OutOfMemory("no room for its graphs")

        engine._capture = failing_capture
        with pytest.raises(OutOfMemory):
            await engine.load(lambda: _set(gen, "c"))
        assert released == [(G, N, K)] * 2 and not engine._holders

    _run(engine, scenario)
