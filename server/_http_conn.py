"""One HTTP/1.1 connection of the fast transport (``_http.py``), from its bytes to the
ASGI app or the direct routes and back, and the connections' housekeeping:

- heads are parsed by httptools (llhttp) with its strict RFC 9112 rules: bare
  LF, obs-fold, CR/NUL in values, bad header names, duplicate or signed
  Content-Length, Transfer-Encoding other than a final ``chunked``, CL with TE,
  and chunk sizes that are not plain hex are all refused (400, then close);
- a head that declares a body is judged before a byte of the body is read
  (``_http_gate.py``: token, media type, body limit, in-flight budget), so a
  refused client is answered and its body never received;
- each request's body is received straight into one buffer allocated for its
  ``Content-Length`` (``asyncio.BufferedProtocol``: the kernel copies into it,
  nothing is accumulated), page-locked when a GPU is present so the engine
  uploads from it without another host copy; chunked bodies are decoded by
  llhttp from the receive buffer where they land (no per-chunk memmove);
- the app gets the whole body in one ``http.request`` message, as a memoryview;
- response parts go to the socket as they are (``transport.writelines``, ``write_answer``);
- a connection stops being read while its answers are not drained
  (``pause_writing``), so a client that pipelines and never reads holds one
  answer here, not all of them; and a pipelined request waits while more than
  ``_UNREAD_MAX`` bytes of the answers before it wait in the socket for the
  client to make room, so such a client of many small answers gets the server's
  work only as it reads;
- request bodies count in the in-flight limit as their bytes arrive, and only
  the bodies within that limit get buffers taken whole (page-locked): heads
  alone neither hold the limit nor take memory;
- answers that wait for their clients to read them are bounded by a budget of the
  same size (``MOEGEMM_MAX_INFLIGHT_BYTES``) per process: past it, the connections whose
  answers have waited longest (over a second; the newest never) are dropped
  (:func:`bound_unread`), so clients that never read cannot make the server hold their
  answers without bound;
- timeouts and limits (``HttpLimits``, settings ``MOEGEMM_HTTP_*``): the head's
  arrival (also a new connection's first), the body's rate (each head timeout of a
  body brings at least that many seconds of the minimum rate, so bytes sent early buy
  no silence later), idle keep-alive, connections per process (at the cap a head
  arriving, or a new connection silent, for over a second makes room, else the
  connection idle longest).

HTTP/1.0: a connection is kept alive only when the request asks for it
(``Connection: keep-alive``; llhttp's rule, as uvicorn), and the answer then
says ``connection: keep-alive``. Absolute-form targets (``GET http://h/p``) are
served as their path, as uvicorn does. Upgrades (``Upgrade: h2c``) are ignored
and the request served over HTTP/1.1; CONNECT and HTTP/0.9 are refused.
Deliberate limits: one request at a time per connection (pipelined ones wait
in the receive buffer), no TLS (terminate it in front); a request pipelined
behind a chunked upload is not served (the connection closes after the
upload's answer: llhttp gives no position where the next one starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import mmap
import re
import select
import socket
import struct
import sys
import time
from typing import TYPE_CHECKING
from urllib.parse import unquote

import httptools
import numpy as np
from moegemm.client._errors import (
    APIError,
    BadField,
    NotReady,
    Overloaded,
    TooLarge,
    error_for,
)

from ._asgi import (
    Response,
    _run_now,
    _start,
    http_scope,
    status_line,
    whole_body_receive,
)
from ._http_gate import HttpLimits, echoed_id, error_bytes, judge, over_budget, request_id

if TYPE_CHECKING:
    from ._http import FastHttpServer

# The standard library's socket transport on Python 3.12+ (the loop where uvloop is missing)
# writes a list without pausing its protocol (its writelines never checks the high-water
# mark), so answers a client does not read would pile up past every bound here; its write()
# pauses, and keeps the parts uncopied. uvloop's writelines pauses.
_UNPAUSED_WRITELINES = (asyncio.selector_events._SelectorSocketTransport.writelines
                        if sys.version_info >= (3, 12) else None)

log = logging.getLogger("moegemm.server.http")

_HEAD_LIMIT = 64 * 1024
# Bytes of a chunked body decoded per loop turn: llhttp calls on_body once per chunk, so a
# 64 KiB read of one-byte chunks is ~11,000 Python callbacks (~15 ms with the other
# connections waiting); 16 KiB bounds a turn near 4 ms whatever the chunks.
_CHUNKED_TURN = 16 * 1024
# A chunked body's framing is bounded as its head is: at most _HEAD_LIMIT bytes decoded in a
# row without a body byte (chunk-size lines, extensions, the trailers, which are read and
# dropped; llhttp hands a trailer to Python whole, so an unbounded one grew the process by 12
# times its size), and past _FREE_CHUNKS chunks an average of _MIN_CHUNK body bytes a chunk
# (each chunk is a Python callback: a body in one-byte chunks held the loop and the GIL for
# seconds, every caller waiting; session 54's probe).
_FREE_CHUNKS = 4096
_MIN_CHUNK = 64
_SOCKET_BUFFER = 4 << 20
# A refused connection: the answer is sent, our side half-closed, and what the
# client still sends is read and dropped for this long (or this much), so the
# answer is not destroyed by the reset a close with unread data makes.
_DRAIN_S = 1.0
_DRAIN_BYTES = 4 << 20
_SCRATCH = memoryview(bytearray(64 << 10))  # where dropped bytes land (one loop)
# A pipelined request waits while this much of the answers before it waits for the client
# to make room for it (``_next``), looked at again every _UNREAD_POLL_S.
_UNREAD_MAX = 64 << 10
_UNREAD_POLL_S = 0.02
# A head arriving (or a new connection silent) this long is the first to make room at the cap.
_SLOW_HEAD_S = 1.0
# An answer that paused (more of it than the socket took) counts for dropping in the bound of
# the answers waiting (``bound_unread``) once it has waited this long.
_UNREAD_GRACE_S = 1.0
_SIOCOUTQNSD = 0x894B  # Linux: a TCP socket's bytes queued and not yet sent
_INT = bytes(4)
_RAW_ID = re.compile(rb"(?im)^x-request-id:([^\r\n]*)")

# A connection's states.
_IDLE, _HEAD, _BODY, _CHUNKED, _RUN, _DRAIN = range(6)


def _plain_body(size: int) -> memoryview:
    # Not bytearray(size): zero-filling a megabyte costs more than receiving it.
    return memoryview(np.empty(size, dtype=np.uint8))


def _error_bytes(status: int, code: str, message: str) -> bytes:
    """An answer for the transport's own failures (500 ``internal``), closing."""
    return error_bytes(error_for(status, code, message))


class _Pipelined(Exception):
    """Raised from the parser's callbacks at a request behind a chunked upload."""


class _Connection(asyncio.BufferedProtocol):
    """One client connection: parse a head, receive the body in place, run the app."""

    def __init__(self, server: FastHttpServer) -> None:
        self.server = server
        self.limits: HttpLimits = server.limits
        # The receive buffer of heads (and of chunked bodies): an anonymous map,
        # so an idle connection's untouched pages cost no memory. [start, head_used)
        # is unparsed; [start, fed) was given to the parser already.
        self.head: mmap.mmap | None = None
        self.head_view: memoryview | None = None
        self.start = self.fed = self.head_used = 0
        self.state = _IDLE
        self.since = self.began = time.monotonic()  # when the current state / request began
        self.parser: httptools.HttpRequestParser | None = None
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = self.message_done = False
        self.body: memoryview | None = None
        self.body_used = 0
        self.chunked: bytearray | None = None
        self.pieces = self.framing = 0  # a chunked body's on_body calls, framing bytes in a row
        # The body's rate window (``check``): when it began and the body's bytes then.
        self.window_at = 0.0
        self.window_got = 0
        self.received = 0  # body bytes received so far, counted in server.receiving
        self.committed = 0  # the size of a body buffer from server.allocate (server.committed)
        self.served = False  # a request has begun on this connection
        self.scope: dict | None = None
        self.method = self.version = ""
        self.keep_alive = True
        self.http10 = False
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task | None = None
        # Whether ``task`` is a call (gemm, ffn, moe) to cancel if the client goes away: its
        # place in the queue and its body's budget go back, and it never runs for nobody. A
        # load, a delete or anything else the app serves runs to its end.
        self.cancel_on_loss = False
        self.disconnected: asyncio.Event | None = None
        self.write_paused = False
        self.drained = 0
        # The largest answer part written since the transport last held nothing (``held``).
        self.largest_part = 0
        # Whether this connection's current request counts in ``server.active``.
        self.counted = False
        self.peer = self.local = None
        self.fd: int | None = None  # the socket's (for _unread)
        self.held_back: asyncio.TimerHandle | None = None  # a pipelined request waiting (_next)

    # -- asyncio callbacks ------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        # Once per connection: each lookup can be a system call.
        self.peer = transport.get_extra_info("peername")
        self.local = transport.get_extra_info("sockname")
        self.write_by_part = type(transport).writelines is _UNPAUSED_WRITELINES
        self.disconnected = asyncio.Event()
        self.since = time.monotonic()
        full = len(self.server.connections) >= self.limits.max_connections
        if full:  # an idle connection makes room: only connections at work hold the cap
            full = not _close_idlest(self.server.connections)
        self.server.connections.add(self)
        if full:
            self._refuse(Overloaded(
                f"this server holds {self.limits.max_connections} connections "
                f"(MOEGEMM_HTTP_MAX_CONNECTIONS); retry later", retry_after=1))
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.fd = sock.fileno()
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
            except OSError:
                pass  # e.g. a Unix socket: nothing to tune
        # Answers of megabytes are common: pause reading only past one of them.
        transport.set_write_buffer_limits(high=1 << 20)

    def connection_lost(self, exc) -> None:
        if self.held_back is not None:
            self.held_back.cancel()
        if self.state in (_BODY, _CHUNKED):
            # The client left mid-body (e.g. its deadline passed): nobody to answer. Logged
            # and counted as the app counts it when a body it reads ends so (499).
            path = self.scope and self.scope["path"]
            log.info("request %s %r: the client disconnected (request id %s)", self.method,
                     path, self._given_id())
            self.server.count_refusal(499, self.method, path, time.monotonic() - self.began, 0)
        if self.state == _RUN and self.cancel_on_loss and self.task is not None:
            self.task.cancel()
        self._end()
        self._unreserve()
        self.server.connections.discard(self)
        self.server.unread.pop(self, None)
        self.disconnected.set()
        self.transport = None

    def pause_writing(self) -> None:
        self.write_paused = True
        now = time.monotonic()
        if self.state == _IDLE:
            self.since = now
        self.server.unread[self] = now  # (ordered: the longest waiting first)
        bound_unread(self.server.unread, self.limits.max_inflight_bytes, now)

    def resume_writing(self) -> None:
        self.write_paused = False
        self.server.unread.pop(self, None)
        if self.state == _IDLE:  # the keep-alive counts from when its answer went out
            self.since = time.monotonic()
        transport = self.transport
        if (self.state == _IDLE and self.task is None and transport is not None
                and not transport.is_closing()):
            self._next()

    def write_answer(self, parts: list) -> None:
        """Write answer parts (never copied here), if the client is still there: every answer's
        one way out. A part the transport has sent in part stays whole in memory, so what a
        paused connection holds is at most its unsent bytes and its largest part written since
        the transport last held nothing (:meth:`held`)."""
        transport = self.transport
        if transport is None:
            return
        if not transport.get_write_buffer_size():
            self.largest_part = 0
        self.largest_part = max(self.largest_part,
                                max((memoryview(part).nbytes for part in parts), default=0))
        if self.write_by_part:
            for part in parts:  # each write() pauses the protocol past the high-water mark
                transport.write(part)
        else:
            transport.writelines(parts)

    def held(self) -> int:
        """The answer bytes this connection holds, at most (:meth:`write_answer`); none once
        it is closing (dropped: what it holds is freed)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return 0
        return transport.get_write_buffer_size() + self.largest_part

    def get_buffer(self, sizehint: int) -> memoryview:
        state = self.state
        if state == _BODY:
            return self.body[self.body_used:]
        if state == _DRAIN:
            return _SCRATCH
        if self.head is None:
            self.head = mmap.mmap(-1, _HEAD_LIMIT)
            self.head_view = memoryview(self.head)
        if self.head_used >= _HEAD_LIMIT and self.start:
            self._compact()
        if self.head_used >= _HEAD_LIMIT:
            # A full buffer is parsed (and a head over the limit refused) as it
            # fills; reading is paused while a request runs, so this is a guard.
            self._refuse(TooLarge(f"the request head is over {_HEAD_LIMIT} bytes"))
            return _SCRATCH
        return self.head_view[self.head_used:]

    def buffer_updated(self, nbytes: int) -> None:
        state = self.state
        if state == _BODY:
            self.body_used += nbytes
            refusal = self._count(nbytes)
            if refusal is not None:
                self._refuse(refusal)
            elif self.body_used == len(self.body):
                self._dispatch()
            return
        if state == _DRAIN:
            self.drained += nbytes
            if self.drained > _DRAIN_BYTES:
                self.transport.abort()
            return
        self.head_used += nbytes
        if state == _IDLE:
            self._begin_head()
        elif state == _HEAD:
            self._parse_head()
        elif state == _CHUNKED:
            self._turn_chunked()

    def eof_received(self) -> bool:
        return False  # close our side too

    # -- timeouts (called by the server's sweep, about once a second) ----------------------

    def check(self, now: float) -> None:
        limits, state, elapsed = self.limits, self.state, now - self.since
        if state == _IDLE:
            # A connection that never sent a request gets a head's time, not a keep-alive's.
            late = elapsed > (limits.keep_alive_s if self.served else limits.head_timeout_s)
        elif state == _HEAD:
            late = elapsed > limits.head_timeout_s
        elif state in (_BODY, _CHUNKED):
            # Each window of a head timeout brings that many seconds of the minimum rate: a
            # client that sent most of a body fast and then stops holds its bytes (and the
            # in-flight limit) one window, not the time its early bytes would have bought.
            got = self.body_used if state == _BODY else len(self.chunked)
            window = now - self.window_at
            late = False
            if window >= limits.head_timeout_s:
                late = got - self.window_got < window * limits.min_body_rate
                self.window_at, self.window_got = now, got
        elif state == _DRAIN:
            late = elapsed > _DRAIN_S
        else:
            # The app is answering: its own deadlines apply. Reading is paused meanwhile, so
            # a call's client leaving is looked for here: its connection is dropped and the
            # call cancelled (connection_lost) instead of holding its place until answered.
            # (Anything else runs to its end and answers a client that only shut its side.)
            if (self.cancel_on_loss and self.fd is not None and self.transport is not None
                    and _hung_up(self.fd)):
                self.transport.abort()
            return
        if late and self.transport is not None:
            # abort: nothing more is owed to a client that does not read (close
            # would wait to flush its answers first).
            if state == _DRAIN or self.write_paused:
                self.transport.abort()
            else:
                self.transport.close()

    # -- parsing ------------------------------------------------------------------------

    def _begin_head(self) -> None:
        self.state, self.since = _HEAD, time.monotonic()
        self.served = True
        self.began = self.since
        self.parser = httptools.HttpRequestParser(self)
        self.url, self.headers, self.method = b"", [], ""
        self.headers_done = self.message_done = False
        self.fed = self.start
        self._parse_head()

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.headers_done:  # (a chunked body's trailers are dropped)
            self.headers.append((name.lower(), value.strip(b" \t")))

    def on_headers_complete(self) -> None:
        # Read here: llhttp clears its flags once the message is complete.
        parser = self.parser
        self.headers_done = True
        self.keep_alive = parser.should_keep_alive()
        self.version = parser.get_http_version()
        self.method = parser.get_method().decode("ascii")

    def on_message_begin(self) -> None:
        if self.message_done:
            raise _Pipelined

    def on_body(self, data: bytes) -> None:
        self.pieces += 1
        chunked = self.chunked
        if len(chunked) + len(data) > self.limits.max_body_bytes:
            raise TooLarge(f"the body is over {self.limits.max_body_bytes} bytes, the limit "
                           f"of this server")
        chunked += data

    def on_message_complete(self) -> None:
        self.message_done = True

    def _parse_head(self) -> None:
        head = self.head
        while not self.headers_done:
            end = head.find(b"\r\n\r\n", max(self.start, self.fed - 3), self.head_used)
            stop = self.head_used if end < 0 else end + 4
            if stop > self.fed:
                try:
                    self.parser.feed_data(self.head_view[self.fed:stop])
                except httptools.HttpParserUpgrade:
                    pass  # the head is complete; the upgrade is not taken (see above)
                except httptools.HttpParserError as exc:
                    # A length past 2^64 is a body over any limit (llhttp's own words for it).
                    over = "Content-Length overflow" in str(exc)
                    self._refuse(TooLarge(f"the declared body is over the limit ({exc})") if over
                                 else BadField(f"malformed HTTP request: {exc}"))
                    return
                self.fed = stop
            if end < 0:
                if self.head_used - self.start >= _HEAD_LIMIT:
                    # SPEC 2.2 has no code of its own for this: too_large.
                    self._refuse(TooLarge(f"the request head is over {_HEAD_LIMIT} bytes"))
                return
        self._begin_request()

    def _begin_request(self) -> None:
        version, method = self.version, self.method
        if version not in ("1.1", "1.0") or method == "CONNECT":
            self._refuse(BadField(f"HTTP/{version} {method} is not served (HTTP/1.1 or 1.0)"))
            return
        self.http10 = version == "1.0"
        target = self.url
        if target[:1] != b"/":
            if target == b"*":
                path, query = b"*", b""
            else:  # absolute form: its path, as uvicorn serves it
                try:
                    url = httptools.parse_url(target)
                except httptools.HttpParserInvalidURLError:
                    self._refuse(BadField("malformed request target"))
                    return
                path, query = url.path or b"/", url.query or b""
        else:
            path, _, query = target.partition(b"?")
        length: int | None = 0
        expect_continue = False
        for name, value in self.headers:
            if name == b"content-length":
                length = int(value)  # llhttp took only plain digits, and only once
            elif name == b"transfer-encoding":
                length = None  # llhttp took only a final "chunked" (and never with CL)
                if value.lower() != b"chunked":  # e.g. "gzip, chunked": a coding not decoded here
                    self._refuse(BadField(
                        f"Transfer-Encoding {value[:100].decode('latin-1')!r}: only chunked "
                        f"is taken (no other coding is decoded)"))
                    return
            elif name == b"expect" and value.lower() == b"100-continue":
                expect_continue = True
        if length is None and self.http10:
            # RFC 9112 6.1: Transfer-Encoding in an HTTP/1.0 request is faulty.
            self._refuse(BadField("Transfer-Encoding in an HTTP/1.0 request"))
            return
        decoded = unquote(path.decode("latin-1"))
        self.scope = http_scope(version, method, decoded, path, query, self.headers, self.peer,
                                self.local, self.server.state, self.began)
        self._begin()
        if self.server.stopping:
            self._refuse(NotReady("the server is stopping: send the request to another "
                                  "server, or again once this one is back"))
            return
        if length != 0:
            # Judged by the bodies held now; this one counts as its bytes arrive (_count).
            refusal = judge(self.limits, method, decoded, self.headers, length,
                            self.server.held())
            if refusal is not None:
                self._refuse(refusal)
                return
        start = self.fed  # the body's first byte
        if length is None:
            self.state, self.since = _CHUNKED, time.monotonic()
            self.window_at, self.window_got = self.since, 0
            self.chunked = bytearray()
            self.pieces = self.framing = 0
            self.start = start
            if expect_continue:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._turn_chunked()
            return
        self.parser = None  # a Content-Length body never goes through the parser
        self.body = self._body_buffer(length)
        have = min(length, self.head_used - start)
        if have:
            self.body[:have] = self.head_view[start:start + have]
            refusal = self._count(have)
            if refusal is not None:
                self._refuse(refusal)
                return
        self.body_used = have
        self.start = start + have
        if self.start == self.head_used:
            self.start = self.head_used = 0
        if have == length:
            self._dispatch()
            return
        self.state, self.since = _BODY, time.monotonic()
        self.window_at, self.window_got = self.since, have
        if expect_continue:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _body_buffer(self, length: int) -> memoryview:
        """Where a Content-Length body is received: the server's buffer (page-locked on a GPU, a
        shared-memory slot in an acceptor: memory taken whole at once) while the bodies given
        such buffers stay within the in-flight limit (``server.may_commit``), else plain memory
        whose pages are taken only as the bytes arrive. So heads that declare bodies and send
        none take no memory, and hold nothing of the limit (their bytes count as they come)."""
        if not length:
            return memoryview(b"")
        server = self.server
        if server.may_commit(length):
            try:
                body, whole = self._allocate(length)
            except Exception:  # noqa: BLE001 -- e.g. pinned memory exhausted: plain memory
                return _plain_body(length)
            if whole:
                self.committed = length
                server.committed += length
            return body
        return _plain_body(length)

    def _allocate(self, length: int) -> tuple[memoryview, bool]:
        """The server's buffer for a body, and whether its memory is taken whole."""
        return self.server.allocate(length), True

    def _count(self, nbytes: int) -> APIError | None:
        """``nbytes`` more of the body received: counted as held (``server.receiving``). The
        refusal (503 overloaded) when the bodies held pass the in-flight limit with others
        held beside this one (a lone body is always let in), else None."""
        self.received += nbytes
        server = self.server
        server.receiving += nbytes
        return over_budget(server.held() - self.received, self.received,
                           self.limits.max_inflight_bytes)

    def _turn_chunked(self) -> None:
        """Decode up to ``_CHUNKED_TURN`` bytes of the chunked body in the receive buffer, then
        give the loop back: reading stays paused until the buffer is decoded. (uvloop reads a
        readable socket up to 32 times in a row, and decoding a buffer of tiny chunks takes
        milliseconds: whole buffers starved the other connections for ~200 ms, then ~15 ms.)"""
        self._feed_chunked()
        if self.state == _CHUNKED and self.transport is not None:
            self.transport.pause_reading()
            asyncio.get_running_loop().call_soon(self._resume_chunked)

    def _feed_chunked(self) -> None:
        """Decode the next ``_CHUNKED_TURN`` bytes of the chunked body in the receive buffer
        (once all of it is decoded the buffer is free again from its start)."""
        start, used = self.start, self.head_used
        stop = min(used, start + _CHUNKED_TURN)
        if stop == used:
            self.start = self.head_used = 0
        else:
            self.start = stop
        decoded = len(self.chunked)
        try:
            self.parser.feed_data(self.head_view[start:stop])
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, APIError):
                self._refuse(cause)
                return
            if not (isinstance(cause, _Pipelined) and self.message_done):
                raise
            self.keep_alive = False  # see the module's docstring
        except httptools.HttpParserError as exc:
            self._refuse(BadField(f"malformed chunked body: {exc}"))
            return
        refusal = self._count(len(self.chunked) - self.received)  # the bytes decoded this turn
        self.framing = 0 if len(self.chunked) > decoded else self.framing + stop - start
        if refusal is None and self.framing > _HEAD_LIMIT:
            refusal = TooLarge(f"the chunked body has over {_HEAD_LIMIT} bytes of framing "
                               f"(chunk-size lines, extensions, trailers) with no body byte")
        if (refusal is None and self.pieces > _FREE_CHUNKS
                and len(self.chunked) < self.pieces * _MIN_CHUNK):
            refusal = BadField(f"malformed chunked body: {self.pieces} chunks for "
                               f"{len(self.chunked)} bytes; past {_FREE_CHUNKS} chunks, they "
                               f"must hold {_MIN_CHUNK} bytes each on average")
        if refusal is not None:
            self._refuse(refusal)
            return
        if self.message_done:
            if stop < used:  # bytes behind the upload, not decoded: as a request behind it
                self.keep_alive = False
            self.start = self.head_used = 0
            self.parser = None
            self.body, self.chunked = memoryview(self.chunked), None
            self._dispatch()

    def _resume_chunked(self) -> None:
        if (self.state == _CHUNKED and self.transport is not None
                and not self.transport.is_closing()):
            if self.start < self.head_used:
                self._turn_chunked()
            else:
                self.transport.resume_reading()

    def _compact(self) -> None:
        """Move the unparsed bytes to the buffer's start (once per pipelined request)."""
        start, used = self.start, self.head_used
        self.head_view[:used - start] = self.head_view[start:used]
        self.fed = max(0, self.fed - start)
        self.start, self.head_used = 0, used - start

    def _refuse(self, exc: APIError) -> None:
        """Answer ``exc`` and close, reading nothing more of the request."""
        self._unreserve()
        self._end()
        transport = self.transport
        took = time.monotonic() - self.began
        given = self._given_id()
        self.state, self.since = _DRAIN, time.monotonic()
        self.parser = self.body = self.chunked = None
        if transport is None:
            return
        answer = error_bytes(exc, head_only=self.method == "HEAD", request_id=given)
        transport.write(answer)
        body = len(answer) - answer.index(b"\r\n\r\n") - 4
        self.server.count_refusal(exc.status, self.method, self.scope and self.scope["path"], took,
                                  body)
        if transport.can_write_eof():
            transport.write_eof()  # the client reads the answer and an end; we drop the rest
        else:
            transport.close()

    def _given_id(self) -> str:
        """The X-Request-Id to answer with: the head's, also of a head refused before the
        parser gave its headers (a malformed line after it), read from the raw bytes."""
        if self.state == _HEAD and self.head is not None and not any(
                name == b"x-request-id" for name, _ in self.headers):
            end = self.head.find(b"\r\n\r\n", self.start, self.head_used)
            found = _RAW_ID.search(self.head[self.start:self.head_used if end < 0 else end])
            if found is not None:
                return echoed_id(found.group(1).strip(b" \t").decode("latin-1"))
        return request_id(self.headers)

    def _unreserve(self) -> None:
        if self.received:
            self.server.receiving -= self.received
            self.received = 0
        if self.committed:
            self.server.committed -= self.committed
            self.committed = 0

    # -- running the app ------------------------------------------------------------------

    def _dispatch(self) -> None:
        self.transport.pause_reading()
        self.state = _RUN
        self._unreserve()  # the app's budget holds it from here (BodyBudget, DirectCalls)
        scope, direct = self.scope, self.server.direct
        name = None if direct is None else direct.match(scope["method"], scope["path"])
        body = self.body
        # Cleared first: the request may be answered before the call below returns, and
        # a pipelined one begun.
        self.scope, self.body, self.body_used = None, None, 0
        self.cancel_on_loss = name is not None
        if name is None:
            task = _start(self._run(scope, body))
            if not task.done():
                self.task = task
        else:
            self.task = _run_now(self._run_direct(name, scope, body))

    def _connection_line(self) -> bytes:
        if self.server.stopping:  # the last answer on this connection
            self.keep_alive = False
        if not self.keep_alive:
            return b"connection: close\r\n"
        return b"connection: keep-alive\r\n" if self.http10 else b""

    async def _run_direct(self, name: str, scope: dict, body: memoryview) -> None:
        """A route the server answers without the ASGI app (``_direct.py``)."""
        try:
            status, head, parts = await self.server.direct(name, scope["headers"], body,
                                                           scope["state"]["arrived"])
        except Exception:  # the handler answers its own errors; this is a bug in it
            log.exception("the direct route failed on %s %r", scope["method"],
                          scope["path"][:200])
            self.write_answer([_error_bytes(500, "internal", "unexpected server error")])
            self.keep_alive = False
        else:
            self.write_answer([status_line(status) + head + self._connection_line() + b"\r\n",
                               *parts])
        self._finish()

    async def _run(self, scope: dict, body: memoryview) -> None:
        response = Response(self)
        receive = whole_body_receive(body, self.disconnected)
        try:
            await self.server.app(scope, receive, response.send)
        except Exception:
            log.exception("the app failed on %s %r", scope["method"], scope["path"][:200])
            if not response.started:
                self.write_answer([_error_bytes(500, "internal", "unexpected server error")])
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
        self.state, self.since = _IDLE, time.monotonic()
        if self.transport is None:
            return
        if not self.keep_alive:
            self.transport.close()
            return
        if not self.write_paused:  # else resume_writing goes on
            self._next()

    def _next(self) -> None:
        """Read the next request: one already pipelined, or wait for one. A request pipelined
        while more than ``_UNREAD_MAX`` bytes of the answers before it wait for the client to
        make room for them (``_unread``) waits too: a client that pipelines and never reads
        gets answers only as fast as it reads them, not as fast as the server makes them."""
        if self.transport.is_closing():
            return
        if self.head_used and self._unread() > _UNREAD_MAX:
            self.held_back = asyncio.get_running_loop().call_later(_UNREAD_POLL_S,
                                                                   self._read_on)
            return
        if self.start:
            self._compact()
        self.transport.resume_reading()
        if self.head_used:
            # From the loop, not from here: an answer finished eagerly (Python 3.12
            # tasks) may be inside the previous request's parse, and a buffer of
            # pipelined requests would otherwise nest one call deeper each.
            asyncio.get_running_loop().call_soon(self._pipelined)

    def _pipelined(self) -> None:
        if (self.state == _IDLE and self.task is None and self.head_used
                and self.transport is not None and not self.transport.is_closing()):
            self._begin_head()

    def _read_on(self) -> None:
        self.held_back = None
        if (self.state == _IDLE and self.task is None and not self.write_paused
                and self.transport is not None and not self.transport.is_closing()):
            self._next()

    def _unread(self) -> int:
        """Answer bytes the client has not made room for: not yet sent from the socket's
        queue (SIOCOUTQNSD: they wait for the client's receive window, which a client that
        does not read keeps closed; bytes in flight are not counted) and in the
        transport's buffer."""
        unread = self.transport.get_write_buffer_size()
        if self.fd is not None:
            with contextlib.suppress(OSError):
                unread += struct.unpack("i", fcntl.ioctl(self.fd, _SIOCOUTQNSD, _INT))[0]
        return unread


async def drain(server, until: float) -> bool:
    """Wait until ``until`` for ``server``'s requests in progress (``active``: from a head
    read, or forwarded, to its answer; a body still arriving included) to be answered.
    Whether some are left (to be cut off). The sweep still ends bodies that stall."""
    if server.active:
        log.info("stopping: %d request(s) in flight get up to %.1f s", server.active,
                 max(0.0, until - time.monotonic()))
    while server.active and time.monotonic() < until:
        await asyncio.sleep(0.02)
    return bool(server.active)


async def sweep(connections: set, limits: HttpLimits, unread: dict) -> None:
    """Apply every connection's timeouts and the bound of the answers waiting to be read
    (``unread``, :func:`bound_unread`), about once a second, forever."""
    every = min(1.0, limits.head_timeout_s / 4, limits.keep_alive_s / 4)
    while True:
        await asyncio.sleep(every)
        now = time.monotonic()
        _check_all(connections, now)
        bound_unread(unread, limits.max_inflight_bytes, now)


def _hung_up(fd: int) -> bool:
    """Whether the peer of socket ``fd`` has closed its side or reset it: what reading would
    find (EOF, an error), found without reading. A call's client that only shuts its sending
    side counts as gone, as an EOF read counts (``eof_received``)."""
    if _RDHUP is None:
        return False
    poller = select.poll()
    poller.register(fd, _RDHUP)
    return bool(poller.poll(0))


_RDHUP = getattr(select, "POLLRDHUP", None)  # Linux


def _check_all(connections: set, now: float) -> None:
    # A function of its own: a loop variable left in sweep's frame would keep the last
    # connection checked (and the body it held) alive while the sweep sleeps.
    for conn in list(connections):
        conn.check(now)


def _close_idlest(connections: set) -> bool:
    """At the connection cap, make room for a new one: close a connection whose head has been
    arriving, or which has sent nothing since it connected, for over ``_SLOW_HEAD_S`` (the
    longest such first), else the one idle longest between requests, if any. A head still
    arriving is no work yet (slow heads held the cap and made the server close a caller's
    keep-alive connection between two of its calls instead: an audit's finding); one with
    requests waiting (pipelined), a body arriving or a request running is at work. Returns
    whether one was closed. (A scan of every connection: at the cap only.)"""
    now = time.monotonic()
    idle = [c for c in connections
            if (c.state == _HEAD or (c.state == _IDLE and c.task is None and not c.head_used))
            and c.transport is not None and not c.transport.is_closing()]
    if not idle:
        return False

    def order(c) -> tuple[bool, float]:
        slow = (c.state == _HEAD or not c.served) and now - c.since > _SLOW_HEAD_S
        return not slow, c.since

    conn = min(idle, key=order)
    if conn.write_paused:
        conn.transport.abort()  # its answers are not being read: nothing more is owed
    else:
        conn.transport.close()
    return True


def bound_unread(unread: dict, limit: int, now: float) -> None:
    """Keep the answers waiting for their clients to read them (what the connections whose
    writing is paused hold, ``_Connection.held``; ``unread``: connection -> when it paused,
    oldest first) within ``limit`` bytes: past it, drop the connections whose answers have
    waited longest, of those that have waited at least ``_UNREAD_GRACE_S``. Nothing more is
    owed to a client that does not read. Answers written together pause together whether or
    not their clients read, so one within its grace is judged at a later sweep, by when a
    client that reads has taken it; the newest is never dropped (a lone answer is always let
    out, as a lone body is let in). (Each connection's own wait is bounded by the keep-alive
    timeout; this bounds their sum, which clients that never read could otherwise grow to the
    connection cap times the largest answer: an audit's finding.) Run at each pause and each
    sweep."""
    if len(unread) < 2:
        return
    sizes = {conn: conn.held() for conn in unread}
    total = sum(sizes.values())
    for conn, since in list(unread.items())[:-1]:
        if total <= limit or now - since < _UNREAD_GRACE_S:
            return  # (the rest paused later still)
        total -= sizes[conn]
        log.info("dropping a connection whose answer (%d bytes) has waited %.1f s for its client "
                 "to read it: the answers waiting pass MOEGEMM_MAX_INFLIGHT_BYTES", sizes[conn],
                 now - since)
        del unread[conn]
        if conn.transport is not None:
            conn.transport.abort()
