"""Calls of other kinds (expert FFN and MoE) share the gemm calls' queue bound and deadlines."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from moegemm.client._errors import DeadlineExceeded, Overloaded
from moegemm.kernels.reference import create as reference_backend
from moegemm.server.engine import Engine


def test_run_call_is_bound_by_the_queue_and_its_deadline():
    engine = Engine(reference_backend(torch.device("cpu")), queue_size=2)
    engine.start()
    release = threading.Event()

    async def scenario():
        held = asyncio.ensure_future(engine.run(release.wait))  # the worker is busy
        await asyncio.sleep(0.05)
        first = asyncio.ensure_future(engine.run_call(lambda: "a"))
        second = asyncio.ensure_future(engine.run_call(lambda: "b", time.monotonic() + 0.01))
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded):
            await engine.run_call(lambda: "c")
        await asyncio.sleep(0.05)  # the second call's deadline passes while it waits
        release.set()
        await held
        assert await first == "a"
        with pytest.raises(DeadlineExceeded):
            await second
        assert engine.queued() == 0
        assert await engine.run_call(lambda: "d") == "d"

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        engine.close()
