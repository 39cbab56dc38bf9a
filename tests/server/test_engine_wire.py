"""Wire calls (``Engine.gemm_wire``): plain valid bodies merged in loop batches straight
from their wire fields. The device part (``Executor.run_raw_many``) needs a GPU and
is checked there (``test_engine_gpu.py``); here a stand-in runs it on the host, so
what the engine does around it -- grouping, each caller's rows, errors, deadlines,
fallbacks to the general path -- is checked on the CPU.

The stand-in answers each row with its own input bytes (the first 2N bytes of the
x row, flags from a marker byte), so a caller that got another caller's rows, or
rows in the wrong order, fails the comparison."""

from __future__ import annotations

import asyncio
import ctypes
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch
from moegemm.client._errors import DeadlineExceeded, NotFinite, NotReady
from moegemm.kernels.reference import create as reference_backend
from moegemm.server._graphs import Buffers
from moegemm.server.engine import Engine

G, N, K = 4, 64, 256  # an fp8 row (256 B) and a bf16 row (512 B) hold an output row (128 B)
BAD = 0x5A  # a row whose first byte is this is "not finite" for the stand-in


class FakeRaw:
    """``run_raw_many`` on the host: output row = the first 2N bytes of its x row."""

    def __init__(self, *, graph: bool = True) -> None:
        self.graph = graph
        self.launches: list[list[int]] = []

    def __call__(self, ws, family, calls):
        if not self.graph:
            return None
        rows = sum(c[0] for c in calls)
        row_bytes = K * (2 if family.quantize else 1)
        at = Buffers.out_offset(rows)
        host = np.zeros(at + 2 * rows * ws.N, np.uint8)
        offsets, r = [0], 0
        for n, x, _xs, m_sizes in calls:
            assert int(np.sum(m_sizes)) == n
            src = np.frombuffer(ctypes.string_at(x, n * row_bytes), np.uint8).reshape(n, row_bytes)
            host[at + 2 * ws.N * r: at + 2 * ws.N * (r + n)] = src[:, : 2 * ws.N].reshape(-1)
            host[r: r + n] = src[:, 0] == BAD
            r += n
            offsets.append(r)
        self.launches.append([c[0] for c in calls])
        return host, at, offsets


def _engine(fake: FakeRaw, *, merge_window_us: int = 200) -> Engine:
    engine = Engine(reference_backend(torch.device("cpu")), max_bucket_m=64,
                    merge_window_us=merge_window_us, loop_batches=True)
    staging, pool = engine._executor.staging, engine._executor.pool
    staging._driver = object()  # "raw copies available": the stand-in makes none
    staging.enter = staging.begin = staging.settle = lambda: None
    pool.use_graphs = True
    engine._executor.run_raw_many = fake
    engine.start()
    return engine


def _ws(name: str):
    return SimpleNamespace(name=name, G=G, N=N, K=K)


def _wire(a: np.ndarray, dtype: str) -> dict:
    return {"dtype": dtype, "shape": list(a.shape), "data": a.tobytes()}


def _body(rng, rows: int, kind: str = "fp8", bad: bool = False):
    sizes = rng.multinomial(rows, np.full(G, 1 / G)).astype(np.int64)
    if kind == "fp8":
        x = rng.integers(0, 0x50, (rows, K), dtype=np.uint8)  # never BAD
        if bad:
            x[-1, 0] = BAD
        body = {"x": _wire(x.view(ml_dtypes.float8_e4m3fn), "float8_e4m3fn"),
                "x_scale": _wire(rng.uniform(0.5, 1, (rows, K // 128)).astype(np.float32),
                                 "float32"),
                "m_sizes": _wire(sizes, "int64")}
        raw = x
    else:
        x = rng.standard_normal((rows, K)).astype(ml_dtypes.bfloat16)
        x.view(np.uint8).reshape(rows, 2 * K)[:, 0] &= 0x3F  # never BAD
        body = {"x": _wire(x, "bfloat16"), "m_sizes": _wire(sizes, "int64")}
        raw = x.view(np.uint8).reshape(rows, 2 * K)
    return body, raw[:, : 2 * N]


def test_each_caller_gets_exactly_its_rows_from_merged_launches():
    rng = np.random.default_rng()
    a, b = _ws("a"), _ws("b")
    work = [(a if i % 3 else b, *_body(rng, 1 + (i * 5) % 17, "bf16" if i % 4 == 1 else "fp8"))
            for i in range(10)]
    fake = FakeRaw()
    engine = _engine(fake)

    async def calls():
        return await asyncio.gather(*(engine.gemm_wire(ws, body, None) for ws, body, _ in work))

    try:
        got = asyncio.run(calls())
    finally:
        engine.close()
    for (_, _, want), out in zip(work, got):
        assert out is not None and out.shape == want.shape
        assert np.array_equal(out, want)
    # merged: fewer launches than calls, one per (weight set, input kind) and row limit
    assert len(fake.launches) < len(work)
    assert sum(map(sum, fake.launches)) == sum(w.shape[0] for _, _, w in work)
    assert all(sum(rows) <= 64 for rows in fake.launches)
    assert engine.queued() == 0


def test_without_a_window_each_wire_call_is_its_own_launch():
    rng = np.random.default_rng()
    ws = _ws("a")
    work = [_body(rng, 3) for _ in range(4)]
    fake = FakeRaw()
    engine = _engine(fake, merge_window_us=0)

    async def calls():
        return await asyncio.gather(*(engine.gemm_wire(ws, body, None) for body, _ in work))

    try:
        got = asyncio.run(calls())
    finally:
        engine.close()
    assert fake.launches == [[3]] * 4
    for (_, want), out in zip(work, got):
        assert np.array_equal(out, want)


def test_a_bad_row_and_a_passed_deadline_fail_only_their_own_calls():
    rng = np.random.default_rng()
    ws = _ws("a")
    good, bad, late = _body(rng, 5), _body(rng, 4, bad=True), _body(rng, 2)
    fake = FakeRaw()
    engine = _engine(fake)

    async def calls():
        return await asyncio.gather(engine.gemm_wire(ws, good[0], None),
                                    engine.gemm_wire(ws, bad[0], None),
                                    engine.gemm_wire(ws, late[0], 0.0),  # long past
                                    return_exceptions=True)

    try:
        got = asyncio.run(calls())
    finally:
        engine.close()
    assert np.array_equal(got[0], good[1])
    assert isinstance(got[1], NotFinite)
    assert isinstance(got[2], DeadlineExceeded)
    assert fake.launches == [[5, 4]]


def test_the_general_path_answers_what_the_lane_does_not_take():
    """No graph for the bucket, a device held by a job, or a body the lane does not
    take: None (the general path answers), and nothing queued is left behind."""
    rng = np.random.default_rng()
    ws = _ws("a")
    body, _ = _body(rng, 3)
    engine = _engine(FakeRaw(graph=False))
    try:
        assert asyncio.run(engine.gemm_wire(ws, body, None)) is None
        assert engine.queued() == 0
    finally:
        engine.close()

    fake = FakeRaw()
    engine = _engine(fake)
    odd = dict(body, extra=1)  # an unknown field: only the general path answers it
    too_many = _body(rng, engine.loop_max_rows + 1)[0]

    async def scenario():
        assert await engine.gemm_wire(ws, odd, None) is None
        assert await engine.gemm_wire(ws, too_many, None) is None
        engine._busy = True  # as while a job builds a weight set
        try:
            assert await engine.gemm_wire(ws, body, None) is None
        finally:
            engine._busy = False

    try:
        asyncio.run(scenario())
    finally:
        engine.close()
    assert fake.launches == []


def test_a_job_that_takes_the_device_before_the_drain_sends_calls_the_general_way():
    rng = np.random.default_rng()
    ws = _ws("a")
    body, _ = _body(rng, 3)
    fake = FakeRaw()
    engine = _engine(fake)

    async def scenario():
        task = asyncio.ensure_future(engine.gemm_wire(ws, body, None))
        await asyncio.sleep(0)  # queued for the drain
        engine._busy = True  # a job took the device meanwhile
        try:
            return await task
        finally:
            engine._busy = False

    try:
        assert asyncio.run(scenario()) is None
    finally:
        engine.close()
    assert fake.launches == []


def test_wire_calls_waiting_at_close_are_refused():
    rng = np.random.default_rng()
    ws = _ws("a")
    engine = _engine(FakeRaw())

    async def scenario():
        task = asyncio.ensure_future(engine.gemm_wire(ws, _body(rng, 2)[0], None))
        await asyncio.sleep(0)
        engine.close()
        with pytest.raises(NotReady):
            await task

    asyncio.run(scenario())
