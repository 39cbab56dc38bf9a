"""An acceptor process: reads HTTP on the public port and forwards to the owner.

It accepts connections itself (offering each to the owner first, when the
owner takes hand-overs), parses them with the fast transport's ``_Connection``
(heads judged by the same gate, bodies received into slots of its request
arena) and forwards every request over the link (``_acceptor_link.py``);
it imports no torch and never touches the device. See ``_acceptors.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import socket
import time
import weakref
from collections import deque

from moegemm.client._errors import Overloaded

from ._acceptor_link import _fd_path, _frame, _read_frame
from ._acceptor_shm import (
    _ARENA_BYTES,
    _INLINE_MAX,
    _SLOT_MAX,
    Spill,
    _address,
    _map_arena,
    _Slots,
    _unlink,
)
from ._asgi import status_line
from ._http_conn import (
    _BODY,
    _HEAD_LIMIT,
    _RUN,
    _SCRATCH,
    _Connection,
    _error_bytes,
    _plain_body,
    drain,
    sweep,
)
from ._http_gate import HttpLimits, call_route, fit_to_descriptors

log = logging.getLogger("moegemm.server.acceptors")


class _ForwardConnection(_Connection):
    """A transport connection that forwards each request to the owner."""

    spill: Spill | None = None  # the lazy spill the body arrives in (pages reserved ahead)
    forwarded: int | None = None  # the id of the request the owner is answering

    def connection_lost(self, exc) -> None:
        if self.state == _RUN and self.cancel_on_loss and self.forwarded is not None:
            # Nobody to answer: the owner cancels the call. The forwarding itself is not
            # cancelled here (as _Connection cancels a call): it waits for the owner's
            # answer, an empty one then, and only then lets the body (its spill) go.
            self.server.abandon(self.forwarded)
        self.cancel_on_loss = False
        super().connection_lost(exc)

    def _allocate(self, length: int) -> tuple[memoryview, bool]:
        # A lazy spill takes memory as its bytes arrive (counted in ``receiving``), not whole.
        body, self.spill = self.server.take(length, lazy=True)
        if self.spill is None:
            return body, True
        # What the head's buffer may already hold of it is copied in at once: reserved now.
        if not self._reserve(min(length, _HEAD_LIMIT), ahead=False):
            return _plain_body(length), False  # no room in /dev/shm: it travels inline
        return body, False

    def get_buffer(self, sizehint: int) -> memoryview:
        spill = self.spill
        if self.state == _BODY and spill is not None:
            used = self.body_used
            if used >= spill.reserved and not self._reserve(used + 1):
                self._refuse(Overloaded(
                    "the server's shared memory (/dev/shm) is full; retry later", retry_after=1))
                return _SCRATCH
            return self.body[used:spill.reserved]
        return super().get_buffer(sizehint)

    def _reserve(self, upto: int, ahead: bool = True) -> bool:
        try:
            self.spill.reserve(upto, ahead)
            return True
        except OSError as exc:
            log.warning("no room in /dev/shm for a request body (%s)", exc)
            self.spill = None
            return False

    def _unreserve(self) -> None:
        super()._unreserve()
        self.spill = None  # a refused body's spill goes with its memory

    def _dispatch(self) -> None:
        # The body stays reserved (``_Acceptor.held``) until the owner has answered.
        self.transport.pause_reading()
        self.state = _RUN
        self.cancel_on_loss = call_route(self.scope["method"], self.scope["path"]) is not None
        self.task = asyncio.get_running_loop().create_task(self._forward(self.scope, self.body))
        self.scope, self.body, self.body_used, self.spill = None, None, 0, None

    async def _forward(self, scope: dict, body: memoryview) -> None:
        try:
            status, head, data, close = await self.server.forward(scope, body, self)
        except ConnectionError as exc:
            # The owner is gone (killed, or a second signal while stopping): no answer, the
            # connection closed, as the server itself would leave it. Not a 500: a client
            # sees no answer and may try another server (MultiClient fails over).
            log.warning("forwarding %s %r: %s; closing without an answer", scope["method"],
                        scope["path"][:200], exc)
            self.keep_alive = False
        except Exception:  # a bug: as _run_direct answers its failures
            log.exception("forwarding %s %r failed", scope["method"], scope["path"][:200])
            self.write_answer([_error_bytes(500, "internal", "unexpected server error")])
            self.keep_alive = False
        else:
            if close:
                self.keep_alive = False
            if status is not None:
                end = self._connection_line() + b"\r\n"
                parts = [status_line(status) + head + end]  # framed by the owner (header_lines)
                if scope["method"] != "HEAD":  # a HEAD answer has no body (an error's neither)
                    parts.append(data)
                self.write_answer(parts)
        del body
        self.forwarded = None
        self._unreserve()
        self._finish()


class _Acceptor:
    """An acceptor process's server: what ``_Connection`` needs of one, and the link."""

    def __init__(self, index, host, port, socket_path, request_path, answer_path,
                 limits: HttpLimits, grace_s, offer: bool = False) -> None:
        self.index, self.host, self.port = index, host, port
        # Offer each accepted connection to the owner first (its direct_limit > 0).
        self.offering = offer
        self.fd_channel: socket.socket | None = None
        self.offers: deque = deque()  # connections waiting for the owner's answer, in order
        self.listeners: list[socket.socket] = []
        self.handing: set[asyncio.Task] = set()  # connections being set up to be served here
        self.socket_path = socket_path
        self.limits = limits
        self.max_body_bytes = limits.max_body_bytes
        # Body bytes received of this acceptor's requests, until the owner answered them:
        # what the head gate judges the in-flight limit against here (the owner's budget
        # bounds what it runs); and the sizes of their buffers from ``allocate`` (arena
        # slots, spills: memory taken whole), bounded by the same limit (``may_commit``).
        self.receiving = 0
        self.committed = 0
        self.grace_s = grace_s
        self.stopping = False  # as FastHttpServer's
        self.app = self.direct = None
        self.active = 0  # what _Connection counts (the owner counts forwarded requests)
        self.state: dict = {}
        self.connections: set = set()
        self.unread: dict = {}  # as FastHttpServer's (``_http_conn.bound_unread``)
        self.requests = _map_arena(request_path, unlink=True)
        self.answers = _map_arena(answer_path, unlink=True)
        self.base = None if self.requests is None else self.requests.ctypes.data
        self.slots = _Slots(_ARENA_BYTES)
        self.holders: dict[int, int] = {}  # slot -> holders (this process, the owner)
        self.dropped: list[int] = []  # slots whose last local reference died
        # Bodies in spills of their own (address -> path), until their memory is gone.
        self.spills: dict[int, str] = {}
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.lost = False  # the owner's socket closed
        self.owner_pid = os.getppid()  # the owner spawned this process
        self.writer: asyncio.StreamWriter | None = None

    # -- accepting, and handing connections to the owner -------------------------------
    #
    # Connections are accepted here, not by loop.create_server: a transport starts
    # reading as soon as it exists (uvloop ignores a pause in connection_made), and
    # an offered connection must reach the owner with its request unread.

    def _listen(self) -> None:
        """Bind what the owner's ``loop.create_server`` binds: every address ``host``
        resolves to (IPv4 and IPv6; all interfaces when empty), IPv6 sockets v6-only."""
        infos = socket.getaddrinfo(self.host or None, self.port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        loop = asyncio.get_running_loop()
        for family, kind, proto, _, address in dict.fromkeys(infos):
            listener = socket.socket(family, kind, proto)
            self.listeners.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            listener.bind(address)
            listener.listen(1024)
            listener.setblocking(False)
            loop.add_reader(listener, self._accept, listener)

    def _resume_accepting(self, listener: socket.socket) -> None:
        if listener in self.listeners:  # not stopped meanwhile
            asyncio.get_running_loop().add_reader(listener, self._accept, listener)

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(64):  # a burst, then back to the loop
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # the client gave up in the backlog
                continue
            except OSError as exc:
                log.warning("acceptor %d: accept failed: %s", self.index, exc)
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors or memory: the listener stays readable, so
                    # pause (as asyncio's own servers do) instead of spinning.
                    loop = asyncio.get_running_loop()
                    loop.remove_reader(listener)
                    loop.call_later(1.0, self._resume_accepting, listener)
                return
            sock.setblocking(False)
            if not self._offer(sock):
                self._serve_here(sock)

    def _offer(self, sock: socket.socket) -> bool:
        """Offer a just-accepted connection to the owner; False: serve it here."""
        if self.fd_channel is None:
            return False
        try:
            socket.send_fds(self.fd_channel, [b"o"], [sock.fileno()])
        except OSError:  # the owner is gone or its queue is full
            return False
        self.offers.append(sock)
        return True

    def _serve_here(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.connect_accepted_socket(lambda: _ForwardConnection(self),
                                                             sock))
        task.add_done_callback(_log_failure)
        self.handing.add(task)
        task.add_done_callback(self.handing.discard)

    def _answers(self) -> None:
        # Read every queued answer (one packet each): ``_accept`` offers up to 64
        # connections per wake-up, and answers left unread fill the owner's send
        # buffer (~280 packets), which makes its answers fail.
        for _ in range(256):
            if self.fd_channel is None:
                return
            try:
                data = self.fd_channel.recv(64)
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionResetError:
                # The owner closed the channel with offers unread; the answers it
                # did send are still queued behind this error (then EOF).
                continue
            except OSError:
                data = b""
            if not data:  # the owner closed the channel: serve everything here
                self._close_fd_channel()
                return
            for taken in data:
                if not self.offers:
                    break
                sock = self.offers.popleft()
                if taken == ord("T"):
                    sock.close()  # our descriptor only: the owner holds the connection now
                else:
                    self._serve_here(sock)

    def _close_fd_channel(self) -> None:
        if self.fd_channel is None:
            return
        asyncio.get_running_loop().remove_reader(self.fd_channel)
        self.fd_channel.close()
        self.fd_channel = None
        while self.offers:
            self._serve_here(self.offers.popleft())

    async def _settle_offers(self, timeout: float) -> None:
        """At stop, before closing the channel: half-close it and wait for the owner's
        answers to the offers in flight (it may have taken some: ``T`` not read yet)."""
        if self.fd_channel is None:
            return
        with contextlib.suppress(OSError):
            self.fd_channel.shutdown(socket.SHUT_WR)  # the owner answers, then sees EOF
        deadline = time.monotonic() + timeout
        while self.fd_channel is not None and self.offers and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self.fd_channel is not None:
            while self.offers:  # unanswered: the owner may hold them; never serve one twice
                self.offers.popleft().close()
            self._close_fd_channel()

    def _open_fd_channel(self) -> None:
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            channel.connect(_fd_path(self.socket_path))
        except OSError as exc:
            log.warning("acceptor %d: cannot reach the owner's connection socket (%s); "
                        "serving every connection here", self.index, exc)
            channel.close()
            return
        channel.setblocking(False)
        self.fd_channel = channel
        asyncio.get_running_loop().add_reader(channel, self._answers)

    def held(self) -> int:
        """Request body bytes this acceptor holds (``_Connection``'s head gate)."""
        return self.receiving

    def may_commit(self, size: int) -> bool:
        """``FastHttpServer.may_commit``: the buffers from ``allocate`` stay within the
        in-flight limit, or there are none."""
        return not self.committed or self.committed + size <= self.limits.max_inflight_bytes

    def count_refusal(self, status: int, method: str, path: str | None, seconds: float,
                      body: int) -> None:
        """The owner keeps the metrics: tell it of a request answered here (its path
        only when short: a long one is no route's)."""
        if self.writer is not None and not self.lost and not self.writer.is_closing():
            path = path if path is not None and len(path) <= 1024 else None
            self.writer.write(_frame({"t": "refused", "st": status, "m": method, "p": path,
                                      "s": seconds, "b": body}, 0))

    # _Connection's body allocator: a slot of the request arena when one is free,
    # else a spill (``_acceptor_shm``): a large body never travels on the link.
    def allocate(self, size: int) -> memoryview:
        return self.take(size)[0]

    def take(self, size: int, lazy: bool = False) -> tuple[memoryview, Spill | None]:
        """``allocate``'s buffer, and with ``lazy`` (a body still to arrive) the spill it is
        when it is one: its pages are reserved as the bytes arrive
        (``_ForwardConnection.get_buffer``), where other spills are reserved whole."""
        self._collect()
        if self.requests is None or size <= 0:
            return _plain_body(size), None
        if size <= _SLOT_MAX:
            offset = self.slots.take(size)
            if offset is not None:
                array = self.requests[offset:offset + size]
                self.holders[offset] = 1
                # list.append only: a finalizer may run inside any allocation.
                done = weakref.finalize(array, self.dropped.append, offset)
                done.atexit = False
                return memoryview(array), None
        if size >= _INLINE_MAX:
            spill = Spill.create(self.owner_pid, size, lazy=lazy)
            if spill is not None:
                address = spill.array.ctypes.data
                self.spills[address] = spill.path
                # The file goes with the memory: once the owner has answered (it maps
                # the file when the request arrives) or the request was abandoned.
                done = weakref.finalize(spill.array, self._spill_gone, address, spill.path,
                                        spill.closer())
                done.atexit = False
                return memoryview(spill.array), spill if lazy else None
        return _plain_body(size), None

    def _spill_gone(self, address: int, path: str, close) -> None:
        close()
        if self.spills.get(address) == path:
            del self.spills[address]
        _unlink(path)

    def _collect(self) -> None:
        while self.dropped:
            self._unhold(self.dropped.pop())

    def _unhold(self, offset: int) -> None:
        self.holders[offset] -= 1
        if not self.holders[offset]:
            del self.holders[offset]
            self.slots.give(offset)

    async def forward(self, scope: dict, body: memoryview, conn: _ForwardConnection | None = None):
        """The owner's answer to one request: (status, header lines, body, close); status
        None when nothing may be written. ``conn``, the connection it came on, is given the
        request's id (``forwarded``) to say when its client is gone (:meth:`abandon`)."""
        if self.writer is None or self.lost or self.writer.is_closing():
            # Raised, not queued: a request after the link is gone must end (closed
            # without an answer), not wait for a reply that cannot come.
            raise ConnectionError("not connected to the owner")
        request_id = self.next_id = self.next_id + 1
        if conn is not None:
            conn.forwarded = request_id
        client, server = scope["client"], scope["server"]
        meta = {
            "t": "req", "id": request_id, "m": scope["method"], "p": scope["path"],
            "r": scope["raw_path"], "q": scope["query_string"], "v": scope["http_version"],
            "h": scope["headers"], "a": scope["state"]["arrived"],
            "c": list(client[:2]) if client else None, "sv": list(server[:2]) if server else None,
        }
        where, body = self._shared(body)
        parts: list = []
        if where is None:
            parts.append(body)
        else:
            meta[where[0]] = where[1]
            if where[0] == "s":
                self.holders[where[1][0]] += 1  # the owner's hold, until it says "rel"
        future = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        size = sum(len(p) for p in parts)
        self.writer.writelines([_frame(meta, size), *parts])
        del parts  # ``body`` stays: a spill's file lives as long as its memory
        try:
            answer, data = await future
        finally:
            self.pending.pop(request_id, None)
        return answer["st"], answer["hd"], self._answer_bytes(answer, data), answer["cl"]

    def abandon(self, request_id: int) -> None:
        """Tell the owner that nobody waits for request ``request_id`` any more."""
        if self.writer is not None and not self.lost and not self.writer.is_closing():
            self.writer.write(_frame({"t": "gone", "id": request_id}, 0))

    def _shared(self, body: memoryview) -> tuple[tuple[str, list] | None, memoryview]:
        """Where the owner finds ``body`` (``_place``; None: inline), and the body. A large
        body received elsewhere (a chunked upload) is copied to a slot or spill first."""
        if self.requests is None or not len(body):
            return None, body
        where = self._place(body)
        if where is None and len(body) >= _INLINE_MAX:
            copy = self.allocate(len(body))
            copy[:] = body
            where = self._place(copy)
            if where is not None:
                body = copy
        return where, body

    def _place(self, view: memoryview) -> tuple[str, list] | None:
        """``("s", [offset, size])`` for a slot of the request arena, ``("f", [path,
        size])`` for a spill, None for memory of this process alone."""
        address = _address(view)
        if address is None:
            return None
        if address - self.base in self.holders:
            return "s", [address - self.base, len(view)]
        path = self.spills.get(address)
        return None if path is None else ("f", [path, len(view)])

    def _answer_bytes(self, answer: dict, data: bytes):
        """An answer's body: inline, or out of the owner's answer arena (its slot freed at
        once) or spill."""
        slot = answer.get("s")
        if slot is not None:
            offset, size = slot
            data = self.answers[offset:offset + size].tobytes()
            self.writer.write(_frame({"t": "free", "o": offset}, 0))
            return data
        spill = answer.get("f")
        if spill is not None:
            path, size = spill
            try:
                data = memoryview(Spill.open(path, size))
            finally:
                self.writer.write(_frame({"t": "free", "f": path}, 0))
        return data

    async def _read_owner(self, reader: asyncio.StreamReader, stop: asyncio.Event) -> None:
        try:
            while True:
                meta, data = await _read_frame(reader)
                if meta["t"] == "res":
                    future = self.pending.get(meta["id"])
                    if future is not None and not future.done():
                        future.set_result((meta, data))
                    elif "s" in meta:  # nobody waits for it any more: free its slot
                        self.writer.write(_frame({"t": "free", "o": meta["s"][0]}, 0))
                    elif "f" in meta:  # or its spill
                        _unlink(meta["f"][0])
                        self.writer.write(_frame({"t": "free", "f": meta["f"][0]}, 0))
                elif meta["t"] == "rel":
                    self._collect()
                    self._unhold(meta["o"])
                elif meta["t"] == "ping":
                    self.writer.write(_frame({"t": "pong"}, 0))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:  # a bug: answer what is pending, then exit (the owner restarts us)
            log.exception("acceptor %d: unexpected message from the owner", self.index)
        self.lost = True
        lost = ConnectionError("the owner closed its socket")
        for future in self.pending.values():
            if not future.done():
                future.set_exception(lost)
        if not stop.is_set():
            log.info("acceptor %d: the owner's socket closed; exiting", self.index)
            # Did the owner die without cleaning up (SIGKILL)? Its private
            # directory (the Unix socket) would outlive everyone otherwise. The
            # socket closes before the kernel reparents us: give it a moment,
            # before stopping (the process ends soon after ``stop``).
            for _ in range(40):
                if os.getppid() != self.owner_pid:
                    shutil.rmtree(os.path.dirname(self.socket_path), ignore_errors=True)
                    break
                await asyncio.sleep(0.05)
            stop.set()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.limits = fit_to_descriptors(self.limits)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            reader, self.writer = await asyncio.open_unix_connection(self.socket_path,
                                                                     limit=1 << 20)
        except OSError:
            if os.getppid() != self.owner_pid:  # the owner died before we connected
                shutil.rmtree(os.path.dirname(self.socket_path), ignore_errors=True)
            raise
        self.writer.write(_frame({"t": "hello", "i": self.index}, 0))
        if self.offering:
            self._open_fd_channel()
        owner = loop.create_task(self._read_owner(reader, stop))
        sweeping = loop.create_task(sweep(self.connections, self.limits, self.unread))
        self._listen()
        log.debug("acceptor %d listening on %s:%d", self.index, self.host, self.port)
        await stop.wait()
        self.stopping = True
        listeners, self.listeners = self.listeners, []
        for listener in listeners:
            loop.remove_reader(listener)
            listener.close()
        await self._settle_offers(min(1.0, self.grace_s))
        if self.handing:  # connections just handed back: counted below once connected
            await asyncio.wait(list(self.handing), timeout=min(1.0, self.grace_s))
        await drain(self, time.monotonic() + self.grace_s)
        closing = [asyncio.ensure_future(c.disconnected.wait()) for c in list(self.connections)]
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if closing:
            await asyncio.wait(closing, timeout=self.grace_s)
        sweeping.cancel()
        self.writer.close()
        owner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await owner


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("a connection could not be served", exc_info=task.exception())


def acceptor_main(index, host, port, socket_path, request_path, answer_path,
                  limits: HttpLimits, grace_s, log_level, offer: bool = False) -> None:
    """An acceptor process (multiprocessing "spawn" target): no torch, no device."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    acceptor = _Acceptor(index, host, port, socket_path, request_path, answer_path,
                         limits, grace_s, offer)
    try:
        import uvloop
    except ImportError:
        asyncio.run(acceptor.serve())
    else:
        uvloop.run(acceptor.serve())


__all__ = ["acceptor_main"]
