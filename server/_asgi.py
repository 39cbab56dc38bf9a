"""The ASGI bridge of the fast transport (``_http.py``, ``_acceptors.py``): a request's
``receive`` (the whole body in one message), its response's ``send`` (collected, then one
``writelines``), and a route's coroutine run from the protocol callback that received it.
"""

from __future__ import annotations

import asyncio
import sys
import types
from typing import Any

from ._http_gate import REASONS


def status_line(status: int) -> bytes:
    """``HTTP/1.1 <status> <reason>`` and CRLF, made once per status."""
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, "").encode())
        if 100 <= status <= 999:  # a bounded table: statuses are three digits
            _STATUS_LINES[status] = line
    return line


_STATUS_LINES: dict[int, bytes] = {}


def http_scope(version: str, method: str, path: str, raw_path: bytes, query: bytes,
               headers: list, client, server, state: dict, arrived: float) -> dict:
    """An ASGI 3 ``http`` scope (``path`` decoded, ``raw_path`` as sent); its state holds
    ``arrived``, when the request's head arrived (``time.monotonic()``: a call's deadline
    counts from there)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": version,
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": client,
        "server": server,
        "state": {**state, "arrived": arrived},
    }


def header_lines(message: dict, *, http10: bool, bodiless: bool) -> tuple[list, bool, bool]:
    """An ``http.response.start``'s headers as wire lines (no status line, no end), and
    (chunked, ends_with_connection): a body without a Content-Length is chunked for an
    HTTP/1.1 client and ends with the connection for an HTTP/1.0 one; a 204, a 304 and a
    HEAD answer have no body. Every transport's one framing."""
    lines: list = []
    has_length = False
    for name, value in message.get("headers", ()):
        if name.lower() == b"content-length":
            has_length = True
        lines += [name, b": ", value, b"\r\n"]
    open_ended = not has_length and message["status"] not in (204, 304) and not bodiless
    chunked = open_ended and not http10
    if chunked:
        lines.append(b"transfer-encoding: chunked\r\n")
    return lines, chunked, open_ended and http10


def body_parts(message: dict, chunked: bool) -> list:
    """An ``http.response.body``'s bytes as wire parts (chunks where ``chunked``)."""
    body = message.get("body", b"")
    if chunked:
        parts = [b"%x\r\n" % len(body), body, b"\r\n"] if body else []
        if not message.get("more_body", False):
            parts.append(b"0\r\n\r\n")
        return parts
    return [body] if body else []


def _start(coro) -> asyncio.Task:
    """A task for ``coro`` that runs at once, up to its first wait (Python 3.12+).

    A lone call that the engine runs inline never waits, so its whole answer is
    written from here, without a trip through the event loop's queue.
    """
    loop = asyncio.get_running_loop()
    if _EAGER:
        return asyncio.Task(coro, loop=loop, eager_start=True)
    return loop.create_task(coro)


_EAGER = sys.version_info >= (3, 12)


def _run_now(coro) -> asyncio.Task | None:
    """Run a direct route's ``coro`` here and now, up to its first wait; a task carries
    it on from there, and is returned (None: it finished without waiting).

    A lone call that the engine runs inline never waits: it is answered from this
    protocol callback with no task at all (the ASGI app runs in one, as anyio needs a
    current task). On the H200 the eager task of a lone call cost ~12 us of its
    ~170 in the server (``bench/results/session9/trace_h200_default.log``, archived in
    ``bench/results/archive_sessions_1-22.tar.xz``, "task").
    """
    try:
        waited = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_rest(coro, waited))


async def _rest(coro, waited):
    return await _carry_on(coro, waited)


@types.coroutine
def _carry_on(coro, waited):
    """The rest of ``coro``, which has yielded ``waited`` (what it awaits, e.g. a future)
    at its first step: each later wait is passed to the running task as it is, each
    resumption (or a cancellation thrown in) passed back to ``coro``."""
    while True:
        try:
            yield waited
        except GeneratorExit:  # closed unfinished (as ``yield from`` does: close coro too)
            coro.close()
            raise
        except BaseException as exc:  # noqa: BLE001 -- a cancellation: coro handles it
            resume, value = coro.throw, exc
        else:
            resume, value = coro.send, None
        try:
            waited = resume(value)
        except StopIteration as done:
            return done.value


def whole_body_receive(body: memoryview, disconnected: asyncio.Event):
    """An ASGI ``receive``: the whole body in one message, then a disconnect once
    ``disconnected`` is set. Its ``whole_body`` is that body, received before the app
    runs (the request metrics count it whether or not the app reads it)."""
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    receive.whole_body = body
    return receive


class Response:
    """The ASGI ``send`` of one request: status line and headers, then body parts.

    Parts are collected and written with one ``writelines`` when the response
    ends (or once a streamed body has collected 1 MiB): one syscall per answer,
    the body parts never copied on our side. A HEAD request's answer has its
    headers and no body; an HTTP/1.0 one is never chunked (it ends with the
    connection instead).
    """

    _FLUSH_BYTES = 1 << 20

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.started = False
        self.finished = False
        self.chunked = False
        self.bodiless = conn.method == "HEAD"
        self.pending: list = []
        self.pending_bytes = 0

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            conn = self.conn
            lines, self.chunked, ends = header_lines(message, http10=conn.http10,
                                                     bodiless=self.bodiless)
            if ends:
                conn.keep_alive = False  # the body ends with the connection
            lines = [status_line(message["status"]), *lines, conn._connection_line(), b"\r\n"]
            self.pending = [b"".join(lines)]
            self.started = True
        elif kind == "http.response.body":
            body = message.get("body", b"")
            more = message.get("more_body", False)
            size = len(body)
            if not self.bodiless:
                self.pending += body_parts(message, self.chunked)
            self.pending_bytes += size
            if not more or self.pending_bytes >= self._FLUSH_BYTES:
                if self.pending:
                    self.conn.write_answer(self.pending)
                self.pending, self.pending_bytes = [], 0
            if not more:
                self.finished = True


def leaf_routes(routes):
    """The routes themselves, through the routers the app included (FastAPI keeps each
    included router as one entry whose ``original_router`` holds its routes)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from leaf_routes(inner.routes)
        else:
            yield route
