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
job). Everything else -- https, a proxy from the environment, a custom httpx
transport, the asyncio client -- stays on httpx. Failures are raised as httpx's
own exceptions, so retries, deadlines and error mapping stay in one place
(``_client.py``).

A pooled socket the server has closed (idle timeout, restart) is noticed before
it is reused -- it reads as ready -- and replaced; a request is never sent twice.
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

import httpx

try:
    import httptools
except ImportError:  # pragma: no cover - httptools is a dependency; be safe anyway
    httptools = None

_RECV = 1 << 20
_POOL = 8  # idle sockets kept per client


class Answer:
    """What ``_client.py`` reads of an answer (the subset of ``httpx.Response`` it uses)."""

    __slots__ = ("content", "headers", "reason_phrase", "status_code")

    def __init__(self, status: int, headers: httpx.Headers, content: bytes, reason: str = "") -> None:
        self.status_code = status
        self.headers = headers
        self.content = content
        self.reason_phrase = reason

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self):
        import json

        return json.loads(self.content)


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

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        # llhttp answers this reliably only before the message completes.
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.parser.get_status_code() < 200:  # 100 Continue, 103 Early Hints: wait on
            self.headers, self.chunks, self.reason = [], [], b""
            self.headers_done = False
            return
        self.done = True

    def ends_at_close(self) -> bool:
        """Whether this answer's body runs until the server closes (no length, not chunked)."""
        names = {name.lower() for name, _ in self.headers}
        return self.headers_done and b"content-length" not in names \
            and b"transfer-encoding" not in names


def usable(url: str, transport: object, trust_env: bool = True) -> bool:
    """Whether calls to ``url`` can take the lane (else they stay on httpx)."""
    if httptools is None or transport is not None:
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


class Lane:
    """Keep-alive sockets to one ``http://host:port`` (thread-safe: one socket per call)."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        # Per-call headers replace these by name (case-insensitively).
        self._fixed = {"host": ("Host", parts.netloc), "user-agent": ("User-Agent", "moegemm-client")}
        for key, value in headers.items():
            self._fixed[key.lower()] = (key, value)
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

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
            # the server closed it; or junk) is dropped. A peek, not select():
            # select() fails on descriptors past 1023.
            try:
                sock.settimeout(0)  # with a timeout set, Python would wait for data first
                sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return sock
            except OSError:
                pass
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
        body = body or b""
        fields = dict(self._fixed)
        for key, value in headers.items():
            fields[key.lower()] = (key, value)
        head = [f"{method} {self.prefix}{path} HTTP/1.1\r\n"]
        for key, value in fields.values():
            value = str(value)
            if any(c in key or c in value for c in "\r\n\0"):
                raise httpx.LocalProtocolError(f"illegal header {key!r}: CR, LF or NUL")
            head.append(f"{key}: {value}\r\n")
        if body or method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Length: {len(body)}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1")
        sock = self._take(timeout, deadline)
        keep = False
        try:
            sent = self._send(sock, data, body, timeout, deadline)
            answer, keep = self._receive(sock, timeout, deadline, sent)
            return answer
        finally:
            if keep:
                self._give_back(sock)
            else:
                sock.close()

    def _send(self, sock, data: bytes, body: bytes, timeout, deadline) -> OSError | None:
        """Write the request; a failed write is returned, not raised: a server may
        answer (413, 401, 503) and close before reading a large body, and that
        answer is what the caller must see."""
        sock.settimeout(_left(timeout.write, deadline))
        try:
            if len(body) <= 1 << 16:
                sock.sendall(data + body)  # one segment for a small call
            else:
                sock.sendall(data)
                sock.sendall(body)
        except TimeoutError as exc:
            raise httpx.WriteTimeout(f"sending to {self.host}:{self.port}: {exc}") from exc
        except OSError as exc:
            return exc
        return None

    def _receive(self, sock, timeout, deadline, send_error: OSError | None) -> tuple[Answer, bool]:
        reader = _Reader()
        parser = reader.parser = httptools.HttpResponseParser(reader)
        while not reader.done:
            recv_error = None
            try:
                sock.settimeout(_left(timeout.read, deadline))
                chunk = sock.recv(_RECV)
            except TimeoutError as exc:
                raise httpx.ReadTimeout(f"reading from {self.host}:{self.port}: {exc}") from exc
            except OSError as exc:  # e.g. reset after the server answered early
                chunk, recv_error = b"", exc
            if not chunk:
                if reader.ends_at_close():
                    reader.done = True  # the body ran until the close: that is its end
                    break
                if send_error is not None:
                    raise httpx.WriteError(
                        f"sending to {self.host}:{self.port}: {send_error}") from send_error
                if recv_error is not None:
                    raise httpx.ReadError(
                        f"reading from {self.host}:{self.port}: {recv_error}") from recv_error
                raise httpx.RemoteProtocolError(
                    f"{self.host}:{self.port} closed the connection before a full answer")
            try:
                parser.feed_data(chunk)
            except httptools.HttpParserError as exc:
                raise httpx.RemoteProtocolError(f"malformed answer: {exc}") from exc
        status = parser.get_status_code()
        content = reader.chunks[0] if len(reader.chunks) == 1 else b"".join(reader.chunks)
        answer = Answer(status, httpx.Headers(reader.headers), content,
                        reader.reason.decode("latin-1"))
        # An answer read after a failed write leaves the request half sent: never reuse.
        return answer, reader.keep_alive and send_error is None and not reader.ends_at_close()


def _left(limit: float | None, deadline: float | None) -> float | None:
    """A socket timeout: ``limit`` seconds, but never past ``deadline``."""
    if deadline is None:
        return limit
    left = deadline - time.monotonic()
    if left <= 0:
        raise httpx.ReadTimeout("the call's deadline passed")
    return left if limit is None else min(limit, left)
