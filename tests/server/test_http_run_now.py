"""The direct routes run in the protocol callback, with a task only once they wait."""

from __future__ import annotations

import asyncio
import functools

import pytest
from moegemm.server._asgi import _run_now
from moegemm.server._direct import DirectCalls
from moegemm.server._http import FastHttpServer
from moegemm.server._http_conn import _Connection


def _in_loop(test):
    """Run an async test in a fresh event loop."""

    @functools.wraps(test)
    def run():
        asyncio.run(test())

    return run


class _Transport:
    """What ``_Connection`` asks of a transport; keeps what is written."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closed = False

    def get_extra_info(self, key, default=None):
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(
            key, default)

    def set_write_buffer_limits(self, high=None):
        pass

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def writelines(self, parts):
        self.out.append(b"".join(parts))

    def get_write_buffer_size(self):
        return 0  # everything written is sent at once

    def write(self, data):
        self.out.append(bytes(data))

    def is_closing(self):
        return False

    def close(self):
        self.closed = True


def _request(n: int) -> bytes:
    body = b"%d" % n
    return (b"POST /v1/weights/main/gemm HTTP/1.1\r\nHost: h\r\n"
            b"Content-Type: application/vnd.msgpack\r\nContent-Length: %d\r\n\r\n"
            % len(body)) + body


class _Route:
    """A direct route answering its body back; it waits on ``gate`` first when set."""

    match = staticmethod(DirectCalls.match)

    def __init__(self) -> None:
        self.gate: asyncio.Future | None = None
        self.in_task: list[bool] = []

    async def __call__(self, route, headers, body, arrived):
        self.in_task.append(asyncio.current_task() is not None)
        if self.gate is not None:
            await self.gate
        data = bytes(body)
        return 200, b"content-length: %d\r\n" % len(data), [data]


def _connection(route):
    async def app(scope, receive, send):
        raise AssertionError("not the direct route")

    server = FastHttpServer(app, "127.0.0.1", 0, max_body_bytes=1 << 20, direct=route)
    server._budget = False  # a bare app: no BodyBudget to find
    conn = _Connection(server)
    transport = _Transport()
    conn.connection_made(transport)
    return conn, transport, server


def _send(conn, data: bytes) -> None:
    conn.get_buffer(65536)[:len(data)] = data
    conn.buffer_updated(len(data))


@_in_loop
async def test_an_answer_that_never_waits_is_written_from_the_callback():
    route = _Route()
    conn, transport, server = _connection(route)
    answered = []
    # From a callback of the loop, as the socket's data arrives (outside any task).
    asyncio.get_running_loop().call_soon(
        lambda: (_send(conn, _request(7)), answered.append(len(transport.out))))
    await asyncio.sleep(0)
    # Answered before buffer_updated returned: no task, no turn of the loop.
    assert answered == [1] and conn.task is None and route.in_task == [False]
    assert transport.out[-1].startswith(b"HTTP/1.1 200 OK\r\n") and transport.out[-1].endswith(b"7")
    assert server.active == 0
    _send(conn, _request(8))  # and the connection serves the next request as before
    assert transport.out[-1].endswith(b"8") and len(transport.out) == 2


@_in_loop
async def test_an_answer_that_waits_goes_on_in_a_task():
    route = _Route()
    route.gate = asyncio.get_running_loop().create_future()
    conn, transport, server = _connection(route)
    _send(conn, _request(5))
    assert conn.task is not None and not transport.out and server.active == 1
    route.gate.set_result(None)
    await conn.task
    assert transport.out[-1].endswith(b"5") and conn.task is None and server.active == 0


@_in_loop
async def test_a_route_that_fails_answers_500_and_closes():
    """A direct route that raises (a bug in it) gets the client a 500 ``internal`` through the
    one answer path, and the connection closes."""

    async def failing(route_name, headers, body, arrived):
        raise RuntimeError("a bug")

    failing.match = _Route.match
    conn, transport, server = _connection(failing)
    _send(conn, _request(3))
    await asyncio.sleep(0)
    assert transport.out[-1].startswith(b"HTTP/1.1 500 ") and b'"internal"' in transport.out[-1]
    assert transport.closed and server.active == 0


@_in_loop
async def test_run_now_carries_results_waits_and_cancellation():
    loop = asyncio.get_running_loop()
    seen = []

    async def never_waits():
        seen.append("ran")
        return 1

    assert _run_now(never_waits()) is None and seen == ["ran"]

    first, second = loop.create_future(), loop.create_future()

    async def waits_twice():
        a = await first
        await asyncio.sleep(0)  # a bare yield passes through too
        b = await second
        return a + b

    task = _run_now(waits_twice())
    assert isinstance(task, asyncio.Task)
    first.set_result(2)
    await asyncio.sleep(0)
    assert not task.done()
    second.set_result(3)
    assert await task == 5

    gate = loop.create_future()

    async def cancelled():
        try:
            await gate
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    task = _run_now(cancelled())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen[-1] == "cancelled" and gate.cancelled()

    async def fails():
        await asyncio.sleep(0)
        raise KeyError("x")

    with pytest.raises(KeyError):
        await _run_now(fails())

    closed = []

    async def holds():
        try:
            await loop.create_future()
        finally:
            closed.append(True)

    rest = _carry_on_of(holds())
    rest.close()  # a task dropped unfinished (e.g. at loop shutdown): coro is closed too
    assert closed == [True]


def _carry_on_of(coro):
    """``coro`` stepped to its first wait, its rest as the generator a task would run."""
    from moegemm.server._asgi import _carry_on

    rest = _carry_on(coro, coro.send(None))
    next(rest)  # at its first yield, as a task holds it
    return rest
