"""A small HTTP/1.1 server for the ASGI app, built for megabyte msgpack bodies.

Why not uvicorn: measured on the H200 machine (``shared/bench/http_baseline.json``),
uvicorn's body path costs ~1.9 ms for a 0.9 MB request and tops out near 630
calls/s, while the GPU copies of the same bytes take ~60 us. Its protocol
appends every 64 KB socket read to the previous ones and pauses and resumes the
socket at each, a round trip through the event loop per chunk. Here:

- each request's body is received straight into one buffer allocated for its
  ``Content-Length`` (``asyncio.BufferedProtocol``: the kernel copies into it,
  nothing is accumulated), page-locked when a GPU is present so the engine
  uploads from it without another host copy;
- the app gets the whole body in one ``http.request`` message, as a memoryview
  (Starlette and our routes read bytes-like bodies);
- response parts go to the socket as they are (``transport.writelines``), so a
  route can answer with a memoryview of a pinned output buffer;
- sockets get TCP_NODELAY and large buffers.

The app, its routes, middleware and error handling are unchanged: this is only
the transport, selected with ``MOEGEMM_HTTP=fast`` (``uvicorn`` stays available).
Deliberate limits: HTTP/1.1 and 1.0 only, one request at a time per connection
(pipelined requests wait in the socket), no TLS (terminate it in front).
Chunked uploads work on a slower path (accumulated, bounded by the body limit).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import numpy as np

log = logging.getLogger("moegemm.server.http")

_HEAD_LIMIT = 64 * 1024
_SOCKET_BUFFER = 4 << 20
_REASONS = {
    100: "Continue", 200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request",
    401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
    413: "Content Too Large", 415: "Unsupported Media Type", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 503: "Service Unavailable", 504: "Gateway Timeout",
    507: "Insufficient Storage",
}


def _plain_body(size: int) -> memoryview:
    # Not bytearray(size): zero-filling a megabyte costs more than receiving it.
    return memoryview(np.empty(size, dtype=np.uint8))


def _error_bytes(status: int, code: str, message: str) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return (
        f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


class _Connection(asyncio.BufferedProtocol):
    """One client connection: parse a head, receive the body in place, run the app."""

    def __init__(self, server: FastHttpServer) -> None:
        self.server = server
        self.head = bytearray(_HEAD_LIMIT)
        self.head_view = memoryview(self.head)
        self.head_used = 0
        self.body: memoryview | None = None
        self.body_used = 0
        self.scope: dict | None = None
        self.keep_alive = True
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task | None = None
        self.disconnected: asyncio.Event | None = None
        # Chunked uploads: the body so far, and the bytes left of the current chunk
        # (None while a chunk-size line is expected).
        self.chunked: bytearray | None = None
        self.chunk_left: int | None = None
        # Whether this connection's current request counts in ``server.active``.
        self.counted = False
        self.peer = self.local = None

    # -- asyncio callbacks ------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        # Once per connection: each lookup can be a system call.
        self.peer = transport.get_extra_info("peername")
        self.local = transport.get_extra_info("sockname")
        self.disconnected = asyncio.Event()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
            except OSError:
                pass  # e.g. a Unix socket: nothing to tune
        self.server.connections.add(self)

    def connection_lost(self, exc) -> None:
        self._end()
        self.server.connections.discard(self)
        self.disconnected.set()
        self.transport = None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.body is not None and self.body_used < len(self.body):
            return self.body[self.body_used:]
        if self.head_used >= _HEAD_LIMIT:
            # Only reachable while a request runs and the client pipelines a lot.
            self.transport.pause_reading()
            return memoryview(bytearray(1))
        return self.head_view[self.head_used:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.body is not None and self.body_used < len(self.body):
            self.body_used += nbytes
            if self.body_used == len(self.body):
                self._dispatch()
            return
        self.head_used += nbytes
        if self.task is None:
            if self.chunked is not None:
                self._feed_chunked()
            else:
                self._parse_head()

    def eof_received(self) -> bool:
        return False  # close our side too

    # -- parsing ------------------------------------------------------------------------

    def _parse_head(self) -> None:
        end = self.head.find(b"\r\n\r\n", 0, self.head_used)
        if end < 0:
            if self.head_used >= _HEAD_LIMIT:
                self._refuse(431, "bad_request", "the request head is over 64 KiB")
            return
        try:
            scope, length, expect_continue = self._scope(bytes(self.head_view[:end]))
        except ValueError as exc:
            self._refuse(400, "bad_request", str(exc))
            return
        self.scope = scope
        self._begin()
        start = end + 4
        if length is None:
            self._consume(start)
            self.chunked, self.chunk_left = bytearray(), None
            if expect_continue:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._feed_chunked()
            return
        if length > self.server.max_body_bytes:
            # The app answers 413 from the declared length; the unread body
            # means the connection cannot be reused.
            self.keep_alive = False
            length = 0
        try:
            self.body = self.server.allocate(length)
        except Exception:  # noqa: BLE001 -- e.g. pinned memory exhausted: answer from plain memory
            self.body = _plain_body(length)
        have = min(length, self.head_used - start)
        self.body[:have] = self.head_view[start:start + have]
        self.body_used = have
        rest = self.head_used - start - have
        self.head_view[:rest] = self.head_view[start + have:self.head_used]
        self.head_used = rest
        if expect_continue and have < length:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.body_used == length:
            self._dispatch()

    def _consume(self, n: int) -> None:
        """Drop the first ``n`` bytes of the head buffer."""
        rest = self.head_used - n
        self.head_view[:rest] = self.head_view[n:self.head_used]
        self.head_used = rest

    def _feed_chunked(self) -> None:
        """Decode chunked framing from the head buffer into ``self.chunked``."""
        while True:
            if self.chunk_left is None:
                eol = self.head.find(b"\r\n", 0, self.head_used)
                if eol < 0:
                    if self.head_used >= _HEAD_LIMIT:
                        self._refuse(400, "bad_request", "malformed chunked body")
                    return
                line = bytes(self.head_view[:eol]).partition(b";")[0].strip()
                try:
                    size = int(line, 16)
                except ValueError:
                    self._refuse(400, "bad_request", "malformed chunk size")
                    return
                if size == 0:
                    # The last chunk: skip trailer lines up to the empty one.
                    stop = self.head.find(b"\r\n\r\n", eol, self.head_used)
                    if stop < 0:
                        return
                    self._consume(stop + 4)
                    self.body, self.chunked = memoryview(self.chunked), None
                    self.body_used = len(self.body)
                    self._dispatch()
                    return
                self._consume(eol + 2)
                self.chunk_left = size
            take = min(self.chunk_left, self.head_used)
            self.chunked += self.head_view[:take]
            self._consume(take)
            self.chunk_left -= take
            if len(self.chunked) > self.server.max_body_bytes:
                # The app sees a body over its limit and answers 413; the rest
                # of the upload is never read, so the connection closes after.
                self.keep_alive = False
                self.body, self.chunked = memoryview(self.chunked), None
                self._dispatch()
                return
            if self.chunk_left:
                return
            if self.head_used < 2:
                return  # wait for the CRLF after the chunk data
            if bytes(self.head_view[:2]) != b"\r\n":
                self._refuse(400, "bad_request", "malformed chunked body")
                return
            self._consume(2)
            self.chunk_left = None

    def _scope(self, head: bytes) -> tuple[dict, int | None, bool]:
        lines = head.split(b"\r\n")
        try:
            method, target, version = lines[0].split(b" ")
        except ValueError:
            raise ValueError("malformed request line") from None
        if version not in (b"HTTP/1.1", b"HTTP/1.0"):
            raise ValueError("only HTTP/1.1 and HTTP/1.0 are served")
        headers = []
        length: int | None = 0
        lengths: set[bytes] = set()
        chunked = False
        expect_continue = False
        keep_alive = version == b"HTTP/1.1"
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise ValueError("malformed header line")
            name = name.lower()
            value = value.strip()
            headers.append((name, value))
            if name == b"content-length":
                if not value.isdigit():
                    raise ValueError("Content-Length is not a number")
                length = int(value)
                lengths.add(value)
            elif name == b"transfer-encoding" and value.lower() != b"identity":
                length = None
                chunked = True
            elif name == b"connection":
                tokens = value.lower()
                if b"close" in tokens:
                    keep_alive = False
                elif b"keep-alive" in tokens:
                    keep_alive = True
            elif name == b"expect" and value.lower() == b"100-continue":
                expect_continue = True
        # RFC 9112 6.3: a body framed two ways, or by disagreeing lengths, is
        # a request-smuggling shape; refuse it rather than pick one.
        if len(lengths) > 1 or (lengths and chunked):
            raise ValueError("conflicting Content-Length / Transfer-Encoding framing")
        if chunked:
            length = None
        self.keep_alive = keep_alive
        path, _, query = target.partition(b"?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version[5:].decode(),
            "method": method.decode("ascii"),
            "scheme": "http",
            "path": unquote(path.decode("latin-1")),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": self.peer,
            "server": self.local,
            "state": dict(self.server.state),
        }
        return scope, length, expect_continue

    def _refuse(self, status: int, code: str, message: str) -> None:
        if self.transport is not None:
            self.transport.write(_error_bytes(status, code, message))
            self.transport.close()

    # -- running the app ------------------------------------------------------------------

    def _dispatch(self) -> None:
        self.transport.pause_reading()
        scope, direct = self.scope, self.server.direct
        name = None if direct is None else direct.match(scope["method"], scope["path"])
        if name is None:
            run = self._run(scope, self.body)
        else:
            run = self._run_direct(name, scope, self.body)
        # Cleared first: an eager task may finish this request, and start on a
        # pipelined one, before it returns here.
        self.scope, self.body, self.body_used = None, None, 0
        task = _start(run)
        if not task.done():
            self.task = task

    async def _run_direct(self, name: str, scope: dict, body: memoryview) -> None:
        """A route the server answers without the ASGI app (``_direct.py``)."""
        try:
            status, head, parts = await self.server.direct(name, scope["headers"], body)
        except Exception:  # the handler answers its own errors; this is a bug in it
            log.exception("the direct route failed on %s %s", scope["method"], scope["path"])
            if self.transport is not None:
                self.transport.write(_error_bytes(500, "internal", "unexpected server error"))
            self.keep_alive = False
        else:
            if self.transport is not None:
                line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, "").encode())
                close = b"" if self.keep_alive else b"connection: close\r\n"
                self.transport.writelines([line + head + close + b"\r\n", *parts])
        self._finish()

    async def _run(self, scope: dict, body: memoryview) -> None:
        response = _Response(self)
        receive = whole_body_receive(body, self.disconnected)
        try:
            await self.server.app(scope, receive, response.send)
        except Exception:
            log.exception("the app failed on %s %s", scope["method"], scope["path"])
            if not response.started and self.transport is not None:
                self.transport.write(_error_bytes(500, "internal", "unexpected server error"))
            self.keep_alive = False
        if not response.finished:
            self.keep_alive = False
        self._finish()

    def _begin(self) -> None:
        """A request's head has arrived: it counts as in progress until answered."""
        if not self.counted:
            self.counted = True
            self.server.active += 1

    def _end(self) -> None:
        if self.counted:
            self.counted = False
            self.server.active -= 1

    def _finish(self) -> None:
        """After an answer: close, or read the next request on this connection."""
        self.task = None
        self._end()
        if self.transport is None:
            return
        if not self.keep_alive:
            self.transport.close()
            return
        self.transport.resume_reading()
        if self.head_used:
            self._parse_head()  # a pipelined request already waits in the head buffer


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


def whole_body_receive(body: memoryview, disconnected: asyncio.Event):
    """An ASGI ``receive``: the whole body in one message, then a disconnect once
    ``disconnected`` is set."""
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    return receive


class _Response:
    """The ASGI ``send`` of one request: status line and headers, then body parts.

    Parts are collected and written with one ``writelines`` when the response
    ends (or once a streamed body has collected 1 MiB): one syscall per answer,
    the body parts never copied on our side.
    """

    _FLUSH_BYTES = 1 << 20

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.started = False
        self.finished = False
        self.chunked = False
        self.pending: list = []
        self.pending_bytes = 0

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            status = message["status"]
            lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n".encode()]
            has_length = False
            for name, value in message.get("headers", ()):
                if name.lower() == b"content-length":
                    has_length = True
                lines += [name, b": ", value, b"\r\n"]
            if not has_length and status not in (204, 304):
                self.chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
            if not self.conn.keep_alive:
                lines.append(b"connection: close\r\n")
            lines.append(b"\r\n")
            self.pending = [b"".join(lines)]
            self.started = True
        elif kind == "http.response.body":
            body = message.get("body", b"")
            more = message.get("more_body", False)
            size = len(body)
            if self.chunked:
                if size:
                    self.pending += [b"%x\r\n" % size, body, b"\r\n"]
                if not more:
                    self.pending.append(b"0\r\n\r\n")
            elif size:
                self.pending.append(body)
            self.pending_bytes += size
            if not more or self.pending_bytes >= self._FLUSH_BYTES:
                transport = self.conn.transport
                if transport is not None and self.pending:
                    transport.writelines(self.pending)
                self.pending, self.pending_bytes = [], 0
            if not more:
                self.finished = True


def _refuse_if_taken(host: str, port: int) -> None:
    """Raise EADDRINUSE if anything listens on ``host:port``.

    With SO_REUSEPORT (acceptors) a second server on the same port would bind
    without an error and share the clients of this one; a plain bind first
    fails as a server without acceptors would.
    """
    if not port:
        return
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    for family, kind, proto, _, address in dict.fromkeys(infos):
        probe = socket.socket(family, kind, proto)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)
        finally:
            probe.close()


class FastHttpServer:
    """Serve an ASGI app on ``host:port`` with :class:`_Connection` until stopped."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        max_body_bytes: int,
        allocate: Callable[[int], memoryview] | None = None,
        direct: Any = None,
        grace_s: float = 30.0,
        reuse_port: bool = False,
    ) -> None:
        self.app = app
        # Routes answered without the app (``_direct.DirectGemm``): an object with
        # match(method, path) -> key | None and an async call(key, headers, body)
        # -> (status, header lines, body parts).
        self.direct = direct
        # Requests begun (head read, or forwarded by an acceptor) and not yet
        # answered. The engine runs a call on the loop's thread only when it is
        # the only one (``Engine.gemm``'s ``alone``): every request whose bytes
        # were ready in the same loop iteration is counted before any handler runs.
        self.active = 0
        if direct is not None:
            direct.in_progress = lambda: self.active
        self.host = host
        self.port = port
        self.max_body_bytes = max_body_bytes
        self.allocate = allocate or _plain_body
        self.grace_s = grace_s
        # SO_REUSEPORT: other processes may bind the same port (``_acceptors.py``).
        self.reuse_port = reuse_port
        # Set once the port is bound (``self.port`` is then the real one).
        self.listening = asyncio.Event()
        self.connections: set[_Connection] = set()
        self.state: dict = {}
        self._server: asyncio.base_events.Server | None = None

    async def _lifespan(self) -> tuple[asyncio.Task, asyncio.Queue, asyncio.Queue]:
        to_app: asyncio.Queue = asyncio.Queue()
        from_app: asyncio.Queue = asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                 "state": self.state}
        task = asyncio.get_running_loop().create_task(self.app(scope, to_app.get, from_app.put))
        await to_app.put({"type": "lifespan.startup"})
        message = await from_app.get()
        if message["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app failed to start: {message.get('message', message)}")
        return task, to_app, from_app

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Start the app, accept connections until ``stop`` (or SIGINT/SIGTERM), shut down.

        Shutting down stops accepting, gives the requests in flight ``grace_s``
        seconds to finish, closes every connection and ends the app's lifespan.
        """
        loop = asyncio.get_running_loop()
        stop = stop or asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread (tests): the caller sets ``stop``
        if self.reuse_port:
            _refuse_if_taken(self.host, self.port)
        task, to_app, from_app = await self._lifespan()
        self._server = await loop.create_server(
            lambda: _Connection(self), self.host, self.port, backlog=1024, reuse_address=True,
            reuse_port=self.reuse_port or None,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self.listening.set()
        log.info("listening on http://%s:%d (fast HTTP transport)", self.host, self.port)
        try:
            await stop.wait()
        finally:
            self._server.close()
            running = [c.task for c in self.connections if c.task is not None]
            if running:
                await asyncio.wait(running, timeout=self.grace_s)
            # close() flushes what is still buffered, asynchronously: wait for
            # every connection to be gone, or an answer in flight is cut short.
            closing = [c.disconnected.wait() for c in list(self.connections)]
            for conn in list(self.connections):
                if conn.transport is not None:
                    conn.transport.close()
            if closing:
                await asyncio.wait([asyncio.ensure_future(w) for w in closing],
                                   timeout=self.grace_s)
            await to_app.put({"type": "lifespan.shutdown"})
            await from_app.get()
            await task
