"""Acceptor processes: the public port served by N+1 processes, the device by one.

One Python process tops out where its event loop thread is saturated by HTTP
I/O and per-call Python (``bench/SERVICE_NOTES.md``). With
``MOEGEMM_ACCEPTORS=N`` (default 0: none of this runs) the server process, the
*owner*, binds the public port with SO_REUSEPORT and spawns N acceptor
processes that bind it too, so the kernel spreads connections over N+1
processes. An acceptor parses HTTP with the same connection (``_http_conn.py``) and
forwards every request it reads to the owner over a private Unix socket; the
owner answers it with its own ``DirectCalls`` or app, exactly as if it had read
the request itself, and the acceptor writes the answer. Acceptors import no
torch and never touch the device; metrics, the body budget and the engine stay
in the owner.

The Unix socket carries frames: ``<meta length u32><inline length u32>``, a
msgpack map, then the inline bytes. Acceptor -> owner: ``req`` (method, path,
query, headers, keep-alive, and the body: inline, a slot of the acceptor's
request arena, or a spill), ``free`` (an answer slot or spill the acceptor is
done with), ``refused`` (a request it answered from the head, for the owner's
metrics). Owner -> acceptor: ``res`` (status, header lines, close flag, the
body: inline, a slot of the owner's answer arena, or a spill), ``rel`` (a
request slot the owner no longer references), ``ping`` (answered with ``pong``).

A lone client should not pay the forwarding hop (on the H200 it cost a
one-client M=1 call ~0.6 ms): each acceptor accepts connections itself and
first offers the socket to the owner (``SCM_RIGHTS`` over a second Unix
socket, ``fds.sock``, before reading a byte); the owner takes it while it
serves fewer than ``MOEGEMM_OWNER_CONNECTIONS`` connections and answers ``T``,
else ``K`` and the acceptor serves it. So one or two routers talk to the owner
directly, and many are spread over the acceptors.

Bodies cross through shared memory: two files in /dev/shm per acceptor
(``_ARENA_BYTES`` each, reserved with posix_fallocate so a full tmpfs fails
here, not later with SIGBUS), created by the owner, mapped by both, and
unlinked by the acceptor once it has mapped them (by the owner if the acceptor
died first), so no file outlives both processes. The acceptor's transport
receives request bodies straight into slots of its arena (the ``allocate``
hook); the owner wraps the slot in a numpy array whose finalizer tells the
acceptor to free it, so a slot is reused only once nothing in the owner (the
engine included) references it. Answers of 16 KiB and more are copied into a
slot of the answer arena and copied out by the acceptor, which frees it at
once. A body or answer of 64 KiB or more that finds no slot (larger than a
quarter of an arena, or met with a full arena, or a chunked upload) goes in a
spill, a /dev/shm file of its own (``_acceptor_shm.Spill``): requests of one
acceptor share one socket, and a large body inline on it delayed every request
behind it (the ~1 s p99 of 32 clients' 1024-row calls on the H200, v3-v6).
Only small bodies travel inline, and everything when /dev/shm is missing or
full.

Rooms: this module is the owner's side (spawning and watching the acceptors,
taking handed-over connections, answering forwarded requests);
``_acceptor.py`` is the acceptor process, ``_acceptor_shm.py`` the shared
arenas, ``_acceptor_link.py`` the frames between them.

Lifecycle: acceptors exit when the owner's socket closes; on SIGTERM/SIGINT the
owner stops accepting, signals its acceptors (they stop accepting and finish
what they forwarded, which the owner still serves) and waits for them within
the grace period, then shuts down itself. An acceptor that dies is logged and
started again (at most once a second per acceptor); so is one that leaves
the owner's heartbeat (a ping a second) unanswered for
``MOEGEMM_ACCEPTOR_TIMEOUT_S``: it is killed first, since the kernel would
keep handing a hung acceptor new connections.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
import weakref
from typing import Any

import numpy as np
from moegemm.client._errors import InternalError

from ._acceptor import acceptor_main
from ._acceptor_link import _byte_view, _fd_path, _frame, _read_frame
from ._acceptor_shm import (
    _ARENA_BYTES,
    _INLINE_MAX,
    _SLOT_MAX,
    Spill,
    _create_arena,
    _map_arena,
    _Slots,
    _unlink,
    sweep_stale_arenas,
    sweep_stale_owner_directories,
)
from ._asgi import _start, body_parts, header_lines, http_scope, whole_body_receive
from ._http import FastHttpServer, stop_on_signals
from ._http_conn import _Connection
from ._http_gate import error_head

log = logging.getLogger("moegemm.server.acceptors")

_INLINE_ANSWER = 16 << 10  # smaller answers travel inline
# Answers this large are copied into shared memory on a helper thread (numpy lets
# go of the GIL for the copy) while the event loop serves on: a 1024-row call's
# 4 MB answer held the loop ~0.5 ms, a quarter of it at 500 calls/s.
_COPY_ASIDE = 1 << 20
_RESTART_GAP_S = 1.0
_PING_EVERY_S = 1.0  # the owner's heartbeat to each acceptor
_CONNECT_ALLOWANCE_S = 5.0  # a new acceptor's start, on top of the heartbeat timeout


# -- the owner's side ------------------------------------------------------------------


class _Link:
    """One acceptor process as the owner sees it: the process, its arenas, its socket.
    A restarted acceptor gets a new one (the old arenas may still be referenced)."""

    def __init__(self, index: int, pin: Any = None) -> None:
        self.index = index
        self.process: multiprocessing.process.BaseProcess | None = None
        self.started = time.monotonic()
        self.reported = False
        self.request_path = _create_arena(f"a{index}-req")
        self.answer_path = _create_arena(f"a{index}-ans") if self.request_path else None
        if self.answer_path is None:
            _unlink(self.request_path)
            self.request_path = None
        try:
            self.requests = _map_arena(self.request_path)
            if pin is not None and self.requests is not None:
                pin(self.requests)  # the engine uploads request bodies straight from here
            self.answers = _map_arena(self.answer_path)
        except BaseException:  # e.g. out of memory or descriptors: no file left behind
            self.unlink()
            raise
        self.answer_slots = _Slots(_ARENA_BYTES)
        # Answers sent in spills the acceptor has not yet taken (it says "free").
        self.spills: set[str] = set()
        self.writer: asyncio.StreamWriter | None = None
        self.connected = False  # the acceptor has said hello (its link may end later)
        # Heartbeat: when the oldest unanswered ping went out (None: all answered).
        self.ping_sent: float | None = None
        self.last_ping = 0.0
        # The requests it forwarded that are not yet answered, by id: a call (gemm, ffn, moe)
        # running here by its task, which a "gone" cancels (its client left the acceptor);
        # None until then, or _GONE once a "gone" came first.
        self.calls: dict[int, asyncio.Task | object | None] = {}

    def unlink(self) -> None:
        """The arenas' names, if the acceptor has not removed them (it died first), and
        the spills it did not take."""
        _unlink(self.request_path)
        _unlink(self.answer_path)
        for path in self.spills:
            _unlink(path)
        self.spills.clear()

    def release(self) -> None:
        """Let go of the arenas of an acceptor that is gone: their memory (and the request
        arena's page lock) returns once no body still running holds a view of them, not
        when the collector gets to this object (minutes: four acceptors killed by the
        heartbeat in a minute filled a 1 GiB /dev/shm, session 54's probe)."""
        self.requests = self.answers = None

    def send(self, meta: dict, parts: list) -> None:
        if self.writer is None or self.writer.is_closing():
            return
        size = sum(len(p) for p in parts)
        self.writer.writelines([_frame(meta, size), *parts])


class Owner:
    """Spawns and watches the acceptors and serves their forwarded requests."""

    def __init__(
        self, server: FastHttpServer, count: int, log_level: str, pin: Any = None,
        hung_after_s: float = 10.0, direct_limit: int = 0,
    ) -> None:
        self.server = server
        # An acceptor that leaves a ping unanswered this long is killed and replaced.
        self.hung_after_s = hung_after_s
        # Connections an acceptor accepts are handed to this process (the socket
        # itself, SCM_RIGHTS) while it serves fewer than this many: a lone
        # client then pays no forwarding hop (see ``_take_offers``).
        self.direct_limit = direct_limit
        self._fd_server: socket.socket | None = None
        self._fd_channels: set[socket.socket] = set()
        self._taking = 0
        # Page-locks an acceptor's request arena in this process (``pin(array)``,
        # ``_staging.pin_host_array`` on a GPU), or None.
        self.pin = pin
        self.count = count
        self.log_level = log_level
        self.loop: asyncio.AbstractEventLoop | None = None
        sweep_stale_owner_directories()
        # Named by this pid, so that the next owner removes it should every process of this
        # server be killed at once (the acceptors remove it when the owner alone dies).
        self.directory = tempfile.mkdtemp(prefix=f"moegemm-owner-{os.getpid()}-")
        self.socket_path = os.path.join(self.directory, "owner.sock")
        self.links: list[_Link] = []
        self.stopping = False
        self.never = asyncio.Event()  # what a forwarded app waits on for a disconnect
        self._unix: asyncio.base_events.Server | None = None
        self._watch: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._copier = concurrent.futures.ThreadPoolExecutor(2, "moegemm-answers")
        self.acceptor_grace_s = server.grace_s  # what each acceptor gets to drain

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        sweep_stale_arenas()
        self._unix = await asyncio.start_unix_server(self._serve_link, self.socket_path,
                                                     limit=1 << 20)
        if self.direct_limit > 0:
            self._fd_server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._fd_server.bind(_fd_path(self.socket_path))
            self._fd_server.listen(64)
            self._fd_server.setblocking(False)
            self.loop.add_reader(self._fd_server, self._accept_fd_channel)
        for index in range(self.count):
            self.links.append(self._spawn(index))
        self._watch = self.loop.create_task(self._watch_processes())

    def _spawn(self, index: int) -> _Link:
        link = _Link(index, self.pin)
        server = self.server
        link.process = multiprocessing.get_context("spawn").Process(
            target=acceptor_main, name=f"moegemm-acceptor-{index}", daemon=True,
            args=(index, server.host, server.port, self.socket_path, link.request_path,
                  link.answer_path, server.limits, self.acceptor_grace_s, self.log_level,
                  self.direct_limit > 0),
        )
        try:
            link.process.start()
        except BaseException:
            link.unlink()
            raise
        log.info("acceptor %d started (pid %d)", index, link.process.pid)
        return link

    async def _watch_processes(self) -> None:
        tick = time.monotonic()
        while not self.stopping:
            await asyncio.sleep(0.2)
            # After a stall of this loop, pongs may wait unread: judge nobody then.
            now, stalled = time.monotonic(), time.monotonic() - tick > 1.0
            tick = now
            for index, link in enumerate(self.links):
                if self.stopping:
                    continue
                if link.process.is_alive():
                    self._heartbeat(index, link, now, judge=not stalled)
                    continue
                if not link.reported:
                    link.reported = True
                    log.error("acceptor %d (pid %d) exited with status %s; starting another",
                              index, link.process.pid, link.process.exitcode)
                if time.monotonic() - link.started >= _RESTART_GAP_S:
                    link.unlink()
                    link.release()
                    link.process.join(0)
                    try:
                        self.links[index] = self._spawn(index)
                    except Exception:  # e.g. out of memory: try again after the gap
                        log.exception("starting acceptor %d failed", index)
                        link.started = time.monotonic()

    # -- connections handed over by the acceptors ----------------------------------------

    def _accept_fd_channel(self) -> None:
        try:
            channel, _ = self._fd_server.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        channel.setblocking(False)
        self._fd_channels.add(channel)
        self.loop.add_reader(channel, self._take_offers, channel)

    def _take_offers(self, channel: socket.socket) -> None:
        """An acceptor offers a connection it just accepted (one packet: a byte and
        the socket). Take it while this process serves fewer than ``direct_limit``
        connections, else hand it back; answer ``T`` (taken) or ``K`` (keep it)."""
        try:
            message, fds, _, _ = socket.recv_fds(channel, 16, 4)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            message, fds = b"", []
        if not message:  # the acceptor is gone
            for fd in fds:
                os.close(fd)
            self._drop_fd_channel(channel)
            return
        answers, taken = bytearray(), []
        for fd in fds:
            busy = len(self.server.connections) + self._taking + len(taken)
            if self.stopping or busy >= self.direct_limit:
                os.close(fd)
                answers += b"K"
                continue
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                os.close(fd)
                answers += b"K"
                continue
            taken.append(sock)
            answers += b"T"
        # One answer per offer, also for an offer whose descriptor did not arrive
        # (MSG_CTRUNC, e.g. out of descriptors here): the acceptor keeps that one.
        answers += b"K" * (len(message) - len(fds))
        try:
            channel.send(bytes(answers))
        except OSError:  # e.g. EAGAIN: the acceptor is behind on reading its answers
            # Unconfirmed: the acceptor serves every offer it has no answer for once
            # the channel closes, so this process must not serve them too.
            for sock in taken:
                sock.close()
            self._drop_fd_channel(channel)
            return
        for sock in taken:
            self._taking += 1
            task = self.loop.create_task(self._serve_handed(sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve_handed(self, sock: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: _Connection(self.server), sock)
        except Exception:  # the client went away meanwhile
            log.debug("a handed-over connection could not be served", exc_info=True)
            sock.close()
        finally:
            self._taking -= 1

    def _drop_fd_channel(self, channel: socket.socket) -> None:
        if channel in self._fd_channels:
            self._fd_channels.discard(channel)
            self.loop.remove_reader(channel)
            channel.close()

    def _heartbeat(self, index: int, link: _Link, now: float, judge: bool) -> None:
        """Ping a connected acceptor; kill one that left a ping unanswered too long
        (hung: the kernel would keep handing it connections). The watch loop then
        starts another, as for one that died."""
        if link.writer is None:
            # Not connected yet: spawning and importing take a second or two. (A
            # link that ended leaves an acceptor that exits by itself.)
            if (judge and not link.connected
                    and now - link.started > self.hung_after_s + _CONNECT_ALLOWANCE_S):
                log.error("acceptor %d (pid %d) has not connected in %.1f s; killing it",
                          index, link.process.pid, now - link.started)
                link.process.kill()
            return
        if link.writer.is_closing():
            return
        if judge and link.ping_sent is not None and now - link.ping_sent > self.hung_after_s:
            log.error("acceptor %d (pid %d) has not answered for %.1f s; killing it",
                      index, link.process.pid, now - link.ping_sent)
            link.process.kill()
            link.ping_sent = None
            return
        if now - link.last_ping >= _PING_EVERY_S:
            link.last_ping = now
            if link.ping_sent is None:
                link.ping_sent = now
            link.send({"t": "ping"}, [])

    async def _serve_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            meta, _ = await _read_frame(reader)
            index = meta["i"]
            if not isinstance(index, int) or not 0 <= index < len(self.links):
                raise KeyError(f"no acceptor {index!r}")
            link = self.links[index]
            if link.writer is not None:
                raise KeyError("a second hello")
        except (asyncio.IncompleteReadError, ConnectionError, KeyError, IndexError, TypeError):
            writer.close()
            return
        link.writer = writer
        link.connected = True
        link.unlink()
        try:
            while True:
                meta, data = await _read_frame(reader)
                kind = meta["t"]
                if kind == "req":
                    self.server.active += 1  # in progress until answered (see _http)
                    link.calls[meta["id"]] = None
                    # Started here (as the transport starts a call): a call is in
                    # link.calls before the next frame, a "gone" for it, is read.
                    task = _start(self._answer(link, meta, data))
                    if not task.done():
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                elif kind == "gone" and meta["id"] in link.calls:
                    call = link.calls[meta["id"]]
                    if isinstance(call, asyncio.Task):
                        call.cancel()
                    else:  # not begun yet (a task is eager only from Python 3.12)
                        link.calls[meta["id"]] = _GONE
                elif kind == "free":
                    if "f" in meta:
                        link.spills.discard(meta["f"])
                    else:
                        link.answer_slots.give(meta["o"])
                elif kind == "refused":  # answered by the acceptor from the head
                    self.server.count_refusal(meta["st"], meta["m"], meta["p"], meta["s"],
                                              meta["b"])
                elif kind == "pong":
                    link.ping_sent = None
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:  # a bug: drop the link; the acceptor exits and is replaced
            log.exception("acceptor %d sent something unexpected", link.index)
        finally:
            if link.writer is writer:
                link.writer = None
                link.unlink()  # spills the acceptor will not take now
            writer.close()

    def _request_body(self, link: _Link, meta: dict, data: bytes) -> memoryview:
        spill = meta.get("f")
        if spill is not None:
            return memoryview(Spill.open(*spill))  # mapped here until the body is dropped
        slot = meta.get("s")
        if slot is None:
            return memoryview(data)  # already a private copy of the bytes
        offset, size = slot
        array = link.requests[offset:offset + size]
        # The slot goes back to the acceptor when nothing here holds it any
        # more, on whatever thread drops the last reference (the engine's too).
        done = weakref.finalize(array, self._release, link, offset)
        done.atexit = False
        return memoryview(array)

    def _release(self, link: _Link, offset: int) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: so is the acceptor
            self.loop.call_soon_threadsafe(link.send, {"t": "rel", "o": offset}, [])

    async def _answer(self, link: _Link, meta: dict, data: bytes) -> None:
        try:
            if meta.get("s") is not None and link.requests is None:
                return  # sent as its acceptor died: released, its arena and client are gone
            await self._answer_or_fail(link, meta, data)
        except Exception:  # a bug here: the acceptor must not wait forever
            log.exception("answering a forwarded %s %s failed", meta.get("m"), meta.get("p"))
            status, head, parts = _internal_error()
            link.send({"t": "res", "id": meta["id"], "st": status, "hd": head, "cl": True}, parts)
        finally:
            self.server.active -= 1
            link.calls.pop(meta["id"], None)

    async def _answer_or_fail(self, link: _Link, meta: dict, data: bytes) -> None:
        body = self._request_body(link, meta, data)
        headers = [(bytes(k), bytes(v)) for k, v in meta["h"]]
        method, path = meta["m"], meta["p"]
        direct = self.server.direct
        name = None if direct is None else direct.match(method, path)
        close = False
        if name is not None and link.calls.get(meta["id"]) is _GONE:
            status, head, parts, close = None, b"", [], True  # its client left before it began
        elif name is not None:
            link.calls[meta["id"]] = asyncio.current_task()
            try:
                status, head, parts = await direct(name, headers, body, meta["a"])
            except asyncio.CancelledError:  # its client left ("gone"): nothing to write
                status, head, parts, close = None, b"", [], True
            except Exception:  # as the transport's _run_direct
                log.exception("the direct route failed on %s %s", method, path)
                status, head, parts = _internal_error()
                close = True
        else:
            status, head, parts, close = await self._run_app(meta, headers, body)
        del body
        answer = {"t": "res", "id": meta["id"], "st": status, "hd": head, "cl": close}
        size = sum(_byte_view(p).nbytes for p in parts)
        if link.answers is None or size < _INLINE_ANSWER:
            link.send(answer, [_byte_view(p) for p in parts])
            return
        offset = link.answer_slots.take(size) if size <= _SLOT_MAX else None
        spill = None
        if offset is None:
            spill = Spill.create(os.getpid(), size) if size >= _INLINE_MAX else None
            if spill is None:  # small, or no shared memory left: inline
                link.send(answer, [_byte_view(p) for p in parts])
                return
        target = link.answers[offset:offset + size] if spill is None else spill.array
        try:
            if size >= _COPY_ASIDE:
                await self.loop.run_in_executor(self._copier, _fill, target, parts)
            else:
                _fill(target, parts)
        except BaseException:
            if spill is None:
                link.answer_slots.give(offset)
            else:
                spill.unlink()
            raise
        if spill is None:
            answer["s"] = [offset, size]
        else:
            answer["f"] = [spill.path, size]
            link.spills.add(spill.path)
        link.send(answer, [])

    async def _run_app(self, meta: dict, headers: list, body: memoryview):
        """The app's answer as (status, header lines, body parts, close); status None
        when nothing may be written (as ``_http_conn._Connection._run``)."""
        scope = http_scope(meta["v"], meta["m"], meta["p"], meta["r"], meta["q"], headers,
                           tuple(meta["c"]) if meta["c"] else None,
                           tuple(meta["sv"]) if meta["sv"] else None, self.server.state,
                           meta["a"])
        out: dict = {"status": None, "head": [], "parts": [], "chunked": False, "ends": False,
                     "done": False}
        receive = whole_body_receive(body, self.never)
        bodiless = meta["m"] == "HEAD"

        async def send(message: dict) -> None:  # _asgi.Response's framing, collected
            if message["type"] == "http.response.start":
                out["status"] = message["status"]
                out["head"], out["chunked"], out["ends"] = header_lines(
                    message, http10=meta["v"] == "1.0", bodiless=bodiless)
            elif message["type"] == "http.response.body":
                if not bodiless:
                    out["parts"] += body_parts(message, out["chunked"])
                out["done"] = not message.get("more_body", False)

        try:
            await self.server.app(scope, receive, send)
        except Exception:
            log.exception("the app failed on %s %s", meta["m"], meta["p"])
            if out["status"] is None:
                return (*_internal_error(), True)
            return None, b"", [], True
        if not out["done"]:
            return None, b"", [], True
        # An HTTP/1.0 body without a length ends with the connection.
        return out["status"], b"".join(out["head"]), out["parts"], out["ends"]

    async def stop(self, grace_s: float) -> None:
        """Signal every acceptor, wait up to ``grace_s`` for them to exit, kill the rest."""
        self.stopping = True
        if self._watch is not None:
            self._watch.cancel()
        alive = [link.process for link in self.links if link.process is not None]
        for process in alive:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(p.is_alive() for p in alive) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for process in alive:
            if process.is_alive():
                log.warning("acceptor pid %d did not stop within %.1f s; killing it",
                            process.pid, grace_s)
                process.kill()
        for process in alive:  # killed or exited: reaped without blocking the loop long
            deadline = time.monotonic() + 1
            while process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            process.join(0)

    def close(self) -> None:
        self._copier.shutdown(wait=False)
        if self._unix is not None:
            self._unix.close()
        for channel in list(self._fd_channels):
            self._drop_fd_channel(channel)
        if self._fd_server is not None:
            self.loop.remove_reader(self._fd_server)
            self._fd_server.close()
            self._fd_server = None
        for link in self.links:
            link.unlink()
            if link.writer is not None:
                link.writer.close()
        shutil.rmtree(self.directory, ignore_errors=True)


_GONE = object()  # a forwarded call whose client left before it began (_Link.calls)


def _fill(target: np.ndarray, parts: list) -> None:
    """Copy an answer's parts back to back into ``target`` (shared memory)."""
    at = 0
    for part in parts:
        view = np.frombuffer(_byte_view(part), dtype=np.uint8)
        target[at:at + view.size] = view
        at += view.size


def _internal_error() -> tuple[int, bytes, list]:
    """500 ``internal`` (``_http_gate.error_head``) as (status, header lines, body); the
    acceptor adds the ``connection: close`` line it carries."""
    lines, body = error_head(InternalError("unexpected server error"))
    return 500, lines, [body]


async def serve_with_acceptors(
    server: FastHttpServer, count: int, log_level: str, grace_s: float, pin: Any = None,
    hung_after_s: float = 10.0, direct_limit: int = 0,
) -> None:
    """``server.serve()`` with ``count`` acceptor processes on its port (SO_REUSEPORT).

    On SIGTERM/SIGINT the acceptors get ``grace_s`` to finish and exit, this
    process what is left of it (at least a second) for its own requests."""
    server.grace_s = grace_s
    # One grace period for everything: an acceptor drains in two phases of at
    # most 0.4 of it (its requests, then its connections), the owner waits 0.85
    # of it for them, then serves what they forwarded and drains itself in the rest.
    acceptor_grace_s = 0.4 * grace_s
    loop = asyncio.get_running_loop()
    inner, outer = asyncio.Event(), asyncio.Event()
    serving = loop.create_task(server.serve(inner))
    listening = loop.create_task(server.listening.wait())
    await asyncio.wait([serving, listening], return_when=asyncio.FIRST_COMPLETED)
    if serving.done() or inner.is_set():  # failed, or stopped while starting: no acceptors
        listening.cancel()
        await serving
        return
    owner = Owner(server, count, log_level, pin, hung_after_s, direct_limit)
    owner.acceptor_grace_s = acceptor_grace_s  # before start(): the acceptors get it
    # serve() handled the signals so far; now they stop the acceptors first (and a second
    # one, exiting at once, still removes the owner's sockets).
    stop_on_signals(loop, outer, before_exit=owner.close)
    try:
        await owner.start()
        stopped = loop.create_task(outer.wait())
        await asyncio.wait([serving, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
    finally:  # also when starting the acceptors failed: stop what did start
        started = time.monotonic()
        if server._server is not None:
            server._server.close()  # stop accepting here while the acceptors finish
        await owner.stop(0.85 * grace_s)
        left = grace_s - (time.monotonic() - started)
        if owner._tasks:  # answers to what the acceptors forwarded before they stopped
            await asyncio.wait(list(owner._tasks), timeout=max(0.1, left))
        server.grace_s = max(0.1, grace_s - (time.monotonic() - started))
        inner.set()
        try:
            await serving
        finally:
            owner.close()


__all__ = ["Owner", "serve_with_acceptors"]
