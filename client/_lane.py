"""A lean HTTP/1.1 lane for the blocking Client: keep-alive sockets, httptools parsing.

Why: a router pays the client's cost on every call. Measured on this repo's
CPU box against the same server (``bench/SERVICE_NOTES.md``, v2), one small
gemm call cost the calling process ~1.4 ms of CPU through httpx (h11, its
models and URL handling), ~0.4 ms through ``http.client``, and ~0.05 ms over a
plain socket. The service's own target for a one-row call is 0.25 ms in all.

So plain ``http://`` calls from :class:`~moegemm.client.Client` go over this
lane: a small pool of keep-alive TCP sockets (TCP_NODELAY), the request written
with one ``sendall``, the answer parsed by ``httptools`` (llhttp, the parser
uvicorn uses: chunked bodies, keep-alive rules and malformed answers are its
job); :class:`AsyncLane` does the same on asyncio streams for ``AsyncClient``.
Everything else -- https, a proxy from the environment, a custom httpx
transport -- stays on httpx. Failures are raised as httpx's
own exceptions, so retries, deadlines and error mapping stay in one place
(``_client.py``).

A pooled socket the server has closed (idle timeout, restart) is noticed before
it is reused -- it reads as ready -- and replaced; a request is never sent twice.
A pool is never shared: in a process forked from the one that filled it, every
lane lets go of the parent's sockets, pooled or in calls in progress, and starts
empty (both reading answers off one socket would swap them); an ``AsyncLane``
used from another event loop than the one its sockets belong to opens its own.
Calls that stay on httpx (https, a proxy) get a fresh httpx pool in a forked
child (``_client.py``), unless the client was given its own ``transport``: the
parent's pooled connections are let go of; a call in flight at the fork in an
async child's copy of the parent's event loop is not covered.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import socket
import threading
import time
import weakref
from urllib.parse import urlsplit

import httptools
import httpx
import numpy as np

_RECV = 1 << 20
# The first read of an answer: its head and, for small answers, the whole body.
_RECV_HEAD = 1 << 16
_HEAD_LIMIT = 1 << 20
# Bodies this large are received into their own buffer (smaller ones: bytes).
_DIRECT_FROM = 1 << 16
_IOV_MAX = 1024  # buffers per sendmsg (Linux's IOV_MAX)
_POOL = 8  # idle sockets kept per client
_ILLEGAL = re.compile("[\r\n\0]")  # never inside a header field


class AnswerHeaders:
    """An answer's header fields, read by name (case-insensitive), as ``httpx.Headers.get``.

    Built from the parser's raw pairs without copying them into an
    ``httpx.Headers`` (which costs a small call more than reading two fields).
    """

    __slots__ = ("by_name", "raw")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        self.by_name: dict[str, str] | None = None

    def get(self, name: str, default: str | None = None) -> str | None:
        by_name = self.by_name
        if by_name is None:  # built on the first read: answers carry a few fields
            by_name = self.by_name = {}
            for k, v in self.raw:
                key, value = k.decode("latin-1").lower(), v.decode("latin-1")
                by_name[key] = f"{by_name[key]}, {value}" if key in by_name else value
        return by_name.get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def multi_items(self) -> list[tuple[str, str]]:
        return [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in self.raw]


class Answer:
    """What ``_client.py`` reads of an answer (the subset of ``httpx.Response`` it uses)."""

    __slots__ = ("content", "headers", "reason_phrase", "status_code")

    def __init__(self, status: int, headers: AnswerHeaders, content: bytes | memoryview,
                 reason: str = "") -> None:
        self.status_code = status
        self.headers = headers
        self.content = content
        self.reason_phrase = reason

    @property
    def text(self) -> str:
        return bytes(self.content).decode("utf-8", "replace")

    def json(self):
        import json

        return json.loads(bytes(self.content))


class _Reader:
    """httptools callbacks for one answer (interim 1xx answers are skipped)."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.reason = b""
        self.done = False
        self.headers_done = False
        self.keep_alive = False
        self.parser = None
        # Bytes came after the final answer (another message or junk): the socket
        # is out of step with its requests and must not be reused.
        self.extra = False

    def on_message_begin(self) -> None:
        if self.done:
            self.extra = True

    def on_status(self, reason: bytes) -> None:
        if not self.extra:
            self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.extra:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.extra:
            return
        self.headers_done = True
        # llhttp answers this reliably only before the message completes.
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if not self.extra:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.extra:
            return
        if self.parser.get_status_code() < 200:  # 100 Continue, 103 Early Hints: wait on
            self.headers, self.chunks, self.reason = [], [], b""
            self.headers_done = False
            return
        self.done = True

    def content_length(self) -> int | None:
        """The answer's declared body length; None when it is chunked or runs until close."""
        length = None
        for name, value in self.headers:
            name = name.lower()
            if name == b"transfer-encoding":
                return None
            if name == b"content-length":
                try:
                    length = int(value.strip())
                except ValueError:
                    raise httpx.RemoteProtocolError(
                        f"malformed answer: content-length {value!r:.40}") from None
        return length

    def ends_at_close(self) -> bool:
        """Whether this answer's body runs until the server closes (no length, not chunked)."""
        names = {name.lower() for name, _ in self.headers}
        return self.headers_done and b"content-length" not in names \
            and b"transfer-encoding" not in names


def usable(url: str, transport: object, trust_env: bool = True) -> bool:
    """Whether calls to ``url`` can take the lane (else they stay on httpx)."""
    if transport is not None:
        return False
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.username or parts.password:
        return False  # https, or credentials in the URL (httpx sends them as Basic auth)
    if trust_env:
        import urllib.request

        proxies = urllib.request.getproxies()
        if ("http" in proxies or "all" in proxies) and not urllib.request.proxy_bypass(
            parts.hostname
        ):
            return False  # httpx would go through the proxy: so do we, on httpx
    return True


_AT_FORK: weakref.WeakSet = weakref.WeakSet()  # every live lane and client on httpx, for a fork


def reset_at_fork(owner) -> None:
    """``owner._forked()`` runs in every child forked while ``owner`` lives: a lane, or a
    client whose calls go through an httpx pool of its own (``_client.py``)."""
    _AT_FORK.add(owner)


def _after_fork_in_child() -> None:
    for owner in list(_AT_FORK):
        owner._forked()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere there is no fork to share sockets
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _disown(fds) -> None:
    """A forked child's copies of the parent's connections, each pointed at /dev/null in
    place: the parent's sockets stay open and registered in its event loop (an asyncio
    close here would remove them from the epoll the two processes share), and whatever
    later closes these descriptor numbers here closes /dev/null."""
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            if fd >= 0:
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class Lane:
    """Keep-alive sockets to one ``http://host:port`` (thread-safe: one socket per call)."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._fixed = _fixed_headers(parts, headers)
        self._head = _Heads(self._fixed)
        self._idle: list[socket.socket] = []
        self._busy: set[socket.socket] = set()  # sockets of calls in progress
        self._lock = threading.Lock()
        self._closed = False
        reset_at_fork(self)

    def _forked(self) -> None:
        """In a child forked from this lane's process: the parent still uses the sockets,
        pooled or in calls its other threads are making. This process's copies of their
        descriptors are closed (the parent's connections stay open, and end when the
        parent closes them); the lock, which another of the parent's threads may have held
        at the fork, is made anew."""
        self._lock = threading.Lock()
        inherited = [*self._idle, *self._busy]
        self._idle, self._busy = [], set()
        for sock in inherited:
            sock.close()

    # -- sockets ---------------------------------------------------------------------

    def _connect(self, timeout: httpx.Timeout, deadline: float | None) -> socket.socket:
        limit = _left(timeout.connect, deadline)
        try:
            sock = socket.create_connection((self.host, self.port), timeout=limit)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connect to {self.host}:{self.port}: {exc}") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"connect to {self.host}:{self.port}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _take(self, timeout: httpx.Timeout, deadline: float | None) -> socket.socket:
        while True:
            with self._lock:
                sock = self._idle.pop() if self._idle else None
            if sock is None:
                return self._connect(timeout, deadline)
            # An idle keep-alive socket has nothing to read; one that has (EOF:
            # the server closed it; or junk) or an error is dropped. poll(), not
            # select(): select() fails on descriptors past 1023. Not a peek
            # either: that needs the socket non-blocking, then its timeout back
            # (a syscall each way) and raises on the healthy path.
            if not _readable(sock):
                return sock
            sock.close()

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < _POOL:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    # -- one exchange ------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes | None,
        timeout: httpx.Timeout,
        deadline: float | None = None,
    ) -> Answer:
        """Send one request and read its whole answer.

        ``deadline`` (a ``time.monotonic()`` instant) bounds the whole exchange,
        not each read: past it, ``httpx.ReadTimeout`` (the caller tells a passed
        deadline from a slow server by the clock).
        """
        parts = _parts(body)
        data = self._head(method, self.prefix + path, headers, sum(map(len, parts)))
        sock = self._take(timeout, deadline)
        self._busy.add(sock)
        keep = False
        try:
            sent = self._send(sock, data, parts, timeout, deadline)
            answer, keep = self._receive(sock, timeout, deadline, sent)
            return answer
        finally:
            self._busy.discard(sock)
            if keep:
                self._give_back(sock)
            else:
                sock.close()

    def _send(self, sock, data: bytes, parts: list, timeout, deadline) -> OSError | None:
        """Write the request; a failed write is returned, not raised: a server may
        answer (413, 401, 503) and close before reading a large body, and that
        answer is what the caller must see."""
        _settimeout(sock, _left(timeout.write, deadline))
        try:
            if sum(map(len, parts)) <= 1 << 16:
                sock.sendall(b"".join((data, *parts)))  # one segment for a small call
            else:
                _send_parts(sock, [memoryview(data), *map(memoryview, parts)])
        except TimeoutError as exc:
            raise httpx.WriteTimeout(f"sending to {self.host}:{self.port}: {exc}") from exc
        except OSError as exc:
            return exc
        return None

    def _receive(self, sock, timeout, deadline, send_error: OSError | None) -> tuple[Answer, bool]:
        parse, where = _Parse(), f"{self.host}:{self.port}"
        done = False
        while not done:
            if parse.body is not None:
                self._read_body(sock, parse, timeout, deadline, send_error, where)
                # Read to its exact length: bytes already behind it are extra.
                parse.reader.extra = parse.reader.extra or _readable(sock)
                break
            recv_error = None
            try:
                _settimeout(sock, _left(timeout.read, deadline))
                chunk = sock.recv(_RECV_HEAD)
            except TimeoutError as exc:
                raise httpx.ReadTimeout(f"reading from {where}: {exc}") from exc
            except OSError as exc:  # e.g. reset after the server answered early
                chunk, recv_error = b"", exc
            done = parse.feed(chunk, where, send_error, recv_error)
        return parse.answer(send_error)

    @staticmethod
    def _read_body(sock, parse: _Parse, timeout, deadline, send_error, where: str) -> None:
        """The rest of a body of known length, received straight into its buffer."""
        view = memoryview(parse.body)
        while parse.got < len(view):
            recv_error = None
            try:
                _settimeout(sock, _left(timeout.read, deadline))
                n = sock.recv_into(view[parse.got:])
            except TimeoutError as exc:
                raise httpx.ReadTimeout(f"reading from {where}: {exc}") from exc
            except OSError as exc:
                n, recv_error = 0, exc
            if not n:
                parse.feed(b"", where, send_error, recv_error)  # raises: the answer is cut short
            parse.got += n
        parse.reader.done = True


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has bytes (or an EOF, or an error) waiting to be read now."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except OSError:
        return True


def _parts(body: bytes | list | None) -> list:
    """A body as parts (``_wire.pack_tensors`` lists pass through)."""
    if body is None:
        return []
    return body if isinstance(body, list) else [body]


def _send_parts(sock: socket.socket, views: list[memoryview]) -> None:
    """``sendall`` of several buffers with scatter-gather writes (no joined copy)."""
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def _fixed_headers(parts, headers: dict[str, str]) -> dict[str, tuple[str, str]]:
    """The headers of every request, by lower-case name (per-call ones replace them)."""
    fixed = {"host": ("Host", parts.netloc), "user-agent": ("User-Agent", "moegemm-client")}
    for key, value in headers.items():
        fixed[key.lower()] = (key, value)
    return fixed


def _head(method: str, target: str, fixed: dict, headers: dict[str, str], size: int) -> bytes:
    """The request line and headers, CR/LF-checked, as bytes."""
    fields = dict(fixed)
    for key, value in headers.items():
        fields[key.lower()] = (key, value)
    length = f"Content-Length: {size}\r\n" if size or method in ("POST", "PUT", "PATCH") else ""
    return f"{method} {target} HTTP/1.1\r\n{_lines(fields.values())}{length}\r\n".encode(
        "latin-1")


def _lines(fields) -> str:
    """``key: value`` lines of (key, value) pairs; LocalProtocolError for CR, LF or NUL."""
    lines = []
    for key, value in fields:
        line = f"{key}: {value}\r\n"
        if _ILLEGAL.search(line, 0, len(line) - 2):
            raise httpx.LocalProtocolError(f"illegal header {key!r}: CR, LF or NUL")
        lines.append(line)
    return "".join(lines)


class _Heads:
    """Request heads of one lane: the fixed headers' lines built and checked once.

    A call's own headers (request id, media type, deadline) are checked and
    added per call; one that names a fixed header replaces it, as in ``_head``.
    """

    def __init__(self, fixed: dict) -> None:
        self.fixed = fixed
        self.lines: str | None = None

    def __call__(self, method: str, target: str, headers: dict[str, str], size: int) -> bytes:
        fixed = self.fixed
        for key in headers:
            if key.lower() in fixed:
                return _head(method, target, fixed, headers, size)
        if self.lines is None:
            self.lines = _lines(fixed.values())  # raises (every call) while a fixed one is bad
        length = f"Content-Length: {size}\r\n" if size or method in ("POST", "PUT", "PATCH") else ""
        return (f"{method} {target} HTTP/1.1\r\n{self.lines}{_lines(headers.items())}"
                f"{length}\r\n").encode("latin-1")


class _Parse:
    """Reading one answer: the head through httptools, then the body.

    A final answer that declares a length of 64 KiB or more has its body
    received into one buffer of that size (``body``; :class:`Lane` reads into it with
    ``recv_into``), which the answer then holds (the caller's array is a view on it): the
    body's bytes are copied once, by the kernel. Chunked answers and answers
    that run until close go through httptools whole.
    """

    def __init__(self) -> None:
        self.reader = _Reader()
        self.parser = self.reader.parser = httptools.HttpResponseParser(self.reader)
        self.head = b""  # the start of a head whose end has not arrived
        self.whole = False  # feed everything to httptools (chunked, until close)
        self.body: np.ndarray | None = None  # the known-length body's buffer
        self.got = 0
        self.length: int | None = None  # the final answer's declared length

    def feed(self, chunk: bytes, where: str, send_error: OSError | None,
             recv_error: OSError | None) -> bool:
        """Take ``chunk`` (b"" at the end of the stream); True once the answer is whole."""
        reader = self.reader
        if not chunk:
            if reader.ends_at_close():
                reader.done = True  # the body ran until the close: that is its end
                return True
            if send_error is not None:
                raise httpx.WriteError(f"sending to {where}: {send_error}") from send_error
            if recv_error is not None:
                raise httpx.ReadError(f"reading from {where}: {recv_error}") from recv_error
            raise httpx.RemoteProtocolError(f"{where} closed the connection before a full answer")
        if self.body is not None:
            take = min(len(chunk), len(self.body) - self.got)
            self.body[self.got:self.got + take] = np.frombuffer(chunk, np.uint8, take)
            self.got += take
            reader.extra = take < len(chunk)  # past the declared length: out of step
            reader.done = self.got == len(self.body)
            return reader.done
        if self.whole:
            self._feed_parser(chunk)
            return reader.done
        data = self.head + chunk if self.head else chunk
        while True:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > _HEAD_LIMIT:
                    raise httpx.RemoteProtocolError(f"malformed answer: a head over {_HEAD_LIMIT} bytes")
                self.head = data
                return False
            self._feed_parser(data[:end + 4])
            data = data[end + 4:]
            if reader.done:
                reader.extra = reader.extra or bool(data)
                return True  # a final answer without a body
            if reader.headers_done:
                break
            # An interim 1xx answer (skipped by the reader): the next head follows.
        self.head = b""
        length = self.length = reader.content_length()
        if length is None or length < _DIRECT_FROM:
            self.whole = True
            if data:
                self._feed_parser(data)
            return reader.done
        self.body = np.empty(length, dtype=np.uint8)
        return self.feed(data, where, send_error, recv_error) if data else False

    def _feed_parser(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.reader.done:  # junk after a whole answer: the answer stands
                self.reader.extra = True
                return
            raise httpx.RemoteProtocolError(f"malformed answer: {exc}") from exc

    def answer(self, send_error: OSError | None) -> tuple[Answer, bool]:
        reader = self.reader
        if self.body is not None:
            content = memoryview(self.body)  # the answer's own buffer: the caller's to write
        else:
            content = reader.chunks[0] if len(reader.chunks) == 1 else b"".join(reader.chunks)
        answer = Answer(self.parser.get_status_code(), AnswerHeaders(reader.headers), content,
                        reader.reason.decode("latin-1"))
        # An answer read after a failed write leaves the request half sent: never reuse.
        closes = self.length is None and reader.ends_at_close()
        # Bytes after the answer (reader.extra): closed, never back to the pool.
        return answer, (reader.keep_alive and send_error is None and not closes
                        and not reader.extra)


class AsyncLane:
    """The asyncio twin of :class:`Lane`, for ``AsyncClient`` (one event loop)."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname
        self.port = parts.port or 80
        self.where = f"{self.host}:{self.port}"
        self.prefix = parts.path.rstrip("/")
        self._fixed = _fixed_headers(parts, headers)
        self._idle: list[tuple] = []  # (reader, writer, the event loop they belong to)
        self._busy: set = set()  # the writers of calls in progress
        self._closed = False
        reset_at_fork(self)

    def _forked(self) -> None:
        """In a child forked from this lane's process: its streams belong to the parent's
        event loop, pooled or in calls in progress there; they are disowned in place
        (:func:`_disown`), never closed through that loop."""
        writers = [entry[1] for entry in self._idle] + list(self._busy)
        self._idle, self._busy = [], set()
        _disown(_fd(writer) for writer in writers)

    async def _connect(self, timeout: httpx.Timeout, deadline: float | None):
        # The time left first: past the deadline it raises before a connection is begun
        # (not with an open_connection coroutine made and never awaited).
        limit = _left(timeout.connect, deadline)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, limit=_RECV), limit)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise httpx.ConnectTimeout(f"connect to {self.where}: timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"connect to {self.where}: {exc}") from exc
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def _take(self, timeout, deadline):
        loop = asyncio.get_running_loop()
        while self._idle:
            reader, writer, owner = self._idle.pop()
            if owner is loop:
                # Idle and healthy: nothing buffered, no EOF (the server closing it), and
                # nothing the loop has not read yet (it may not have run since the close).
                sock = writer.get_extra_info("socket")
                if (not reader.at_eof() and not writer.is_closing() and not _buffered(reader)
                        and sock is not None and not _readable(sock)):
                    return reader, writer
            _drop(writer)
        return await self._connect(timeout, deadline)

    def _give_back(self, conn) -> None:
        if not self._closed and len(self._idle) < _POOL:
            self._idle.append((*conn, asyncio.get_running_loop()))
        else:
            conn[1].close()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for _, writer, _ in idle:
            _drop(writer)

    async def request(self, method: str, path: str, headers: dict[str, str], body: bytes | None,
                      timeout: httpx.Timeout, deadline: float | None = None) -> Answer:
        """As :meth:`Lane.request`, awaited."""
        parts = _parts(body)
        data = _head(method, self.prefix + path, self._fixed, headers, sum(map(len, parts)))
        conn = await self._take(timeout, deadline)
        self._busy.add(conn[1])
        keep = False
        try:
            send_error = await self._send(conn[1], data, parts, timeout, deadline)
            answer, keep = await self._receive(conn[0], timeout, deadline, send_error)
            return answer
        finally:
            self._busy.discard(conn[1])
            if keep:
                self._give_back(conn)
            else:
                # Not close(), which sends what the transport still buffers: a body whose
                # write failed or timed out (or was cancelled) would go on in the background,
                # and a load the caller was told failed could land later (after a delete,
                # say). Cut short, the server sees the body end early and refuses it. (An
                # answer that closes the connection leaves nothing buffered: the same.)
                conn[1].transport.abort()

    async def _send(self, writer, data, parts, timeout, deadline) -> OSError | None:
        try:
            if sum(map(len, parts)) <= 1 << 16:
                writer.write(b"".join((data, *parts)))
            else:
                writer.writelines([data, *parts])
            limit = _left(timeout.write, deadline)  # (before the coroutine: it may raise)
            await asyncio.wait_for(writer.drain(), limit)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise httpx.WriteTimeout(f"sending to {self.where}: timed out") from exc
        except OSError as exc:
            return exc  # the server may have answered early: read that answer
        return None

    async def _receive(self, reader, timeout, deadline, send_error) -> tuple[Answer, bool]:
        parse = _Parse()
        done = False
        if send_error is not None:
            # The failed write closed the transport, and the stream now raises
            # on every read: an answer the server sent before closing is only
            # in the stream's buffer.
            pending = bytes(getattr(reader, "_buffer", b""))
            done = parse.feed(pending, self.where, send_error, None) if pending else False
        while not done:
            recv_error = None
            try:
                limit = _left(timeout.read, deadline)
                chunk = await asyncio.wait_for(reader.read(_RECV), limit)
            except (TimeoutError, asyncio.TimeoutError) as exc:
                raise httpx.ReadTimeout(f"reading from {self.where}: timed out") from exc
            except OSError as exc:
                chunk, recv_error = b"", exc
            done = parse.feed(chunk, self.where, send_error, recv_error)
        return parse.answer(send_error)


def _fd(writer) -> int:
    sock = writer.get_extra_info("socket")
    return -1 if sock is None else sock.fileno()


def _drop(writer) -> None:
    """Close a pooled stream, whose event loop may be closed already (then the transport,
    unreachable, closes its socket when it is collected)."""
    try:
        writer.close()
    except RuntimeError:  # "Event loop is closed"
        pass


def _buffered(reader) -> int:
    """Bytes an asyncio StreamReader holds unread (0 when unknown)."""
    return len(getattr(reader, "_buffer", b""))


def _settimeout(sock: socket.socket, value: float | None) -> None:
    """``sock.settimeout(value)``, skipped when it is already set (each is a syscall)."""
    if sock.gettimeout() != value:
        sock.settimeout(value)


def _left(limit: float | None, deadline: float | None) -> float | None:
    """A socket timeout: ``limit`` seconds, but never past ``deadline``."""
    if deadline is None:
        return limit
    left = deadline - time.monotonic()
    if left <= 0:
        raise httpx.ReadTimeout("the call's deadline passed")
    return left if limit is None else min(limit, left)
