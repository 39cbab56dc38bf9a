"""Acceptor processes: the public port served by N+1 processes, the device by one.

One Python process tops out where its event loop thread is saturated by HTTP
I/O and per-call Python (``bench/SERVICE_NOTES.md``). With
``MOEGEMM_ACCEPTORS=N`` (default 0: none of this runs) the server process, the
*owner*, binds the public port with SO_REUSEPORT and spawns N acceptor
processes that bind it too, so the kernel spreads connections over N+1
processes. An acceptor parses HTTP with the same transport (``_http.py``) and
forwards every request it reads to the owner over a private Unix socket; the
owner answers it with its own ``DirectGemm`` or app, exactly as if it had read
the request itself, and the acceptor writes the answer. Acceptors import no
torch and never touch the device; metrics, the body budget and the engine stay
in the owner.

The Unix socket carries frames: ``<meta length u32><inline length u32>``, a
msgpack map, then the inline bytes. Acceptor -> owner: ``req`` (method, path,
query, headers, keep-alive, and the body either inline or as a slot of the
acceptor's request arena), ``free`` (an answer slot the acceptor is done with),
``refused`` (a request it answered from the head, for the owner's metrics).
Owner -> acceptor: ``res`` (status, header lines, close flag, the body inline
or as a slot of the owner's answer arena), ``rel`` (a request slot the owner no
longer references), ``ping`` (answered with ``pong``).

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
once. Bodies over a quarter of an arena, or met with a full arena, travel
inline (as do chunked uploads); so does everything when /dev/shm is missing
or full. Requests of one acceptor share one socket: a large inline body
delays the requests behind it.

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
import bisect
import contextlib
import errno
import logging
import mmap
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import struct
import tempfile
import time
import weakref
from collections import deque
from typing import Any

import msgpack
import numpy as np

from ._http import (
    _REASONS,
    _RUN,
    FastHttpServer,
    _Connection,
    _error_bytes,
    _plain_body,
    sweep,
    whole_body_receive,
)
from ._http_gate import HttpLimits

log = logging.getLogger("moegemm.server.acceptors")

_FRAME = struct.Struct("<II")
_ARENA_BYTES = 64 << 20  # per direction and acceptor
_SLOT_MAX = _ARENA_BYTES // 4  # larger bodies travel inline
_SLOT_ALIGN = 4096
_INLINE_ANSWER = 16 << 10  # smaller answers travel inline
_SHM_DIR = "/dev/shm"
_RESTART_GAP_S = 1.0
_PING_EVERY_S = 1.0  # the owner's heartbeat to each acceptor
_CONNECT_ALLOWANCE_S = 5.0  # a new acceptor's start, on top of the heartbeat timeout


# -- shared arenas ------------------------------------------------------------------


class _Slots:
    """First-fit allocation of one arena's byte ranges (only one process allocates)."""

    def __init__(self, size: int) -> None:
        self.free: list[tuple[int, int]] = [(0, size)]  # sorted, coalesced
        self.used: dict[int, int] = {}

    def take(self, size: int) -> int | None:
        size = -(-max(size, 1) // _SLOT_ALIGN) * _SLOT_ALIGN
        for i, (offset, length) in enumerate(self.free):
            if length >= size:
                if length == size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + size, length - size)
                self.used[offset] = size
                return offset
        return None

    def give(self, offset: int) -> None:
        size = self.used.pop(offset)
        i = bisect.bisect(self.free, (offset, 0))
        if i < len(self.free) and offset + size == self.free[i][0]:
            size += self.free.pop(i)[1]
        if i > 0 and sum(self.free[i - 1]) == offset:
            offset, before = self.free.pop(i - 1)
            size += before
            i -= 1
        self.free.insert(i, (offset, size))


def sweep_stale_arenas(directory: str = _SHM_DIR) -> list[str]:
    """Remove arena files whose owner process is gone; return their names.

    An owner killed before its acceptors mapped their arenas (they unlink them
    once mapped) leaves the files behind; the next owner on the machine
    removes them. A file whose pid is alive (or not ours to remove) stays.
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "moegemm" or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid() or _pid_alive(pid):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    if removed:
        log.info("removed %d shared-memory arenas of owners that are gone", len(removed))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _create_arena(tag: str) -> str | None:
    """A new /dev/shm file of ``_ARENA_BYTES``, its pages reserved; None when impossible."""
    path = os.path.join(_SHM_DIR, f"moegemm-{os.getpid()}-{tag}-{secrets.token_hex(4)}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        log.warning("no shared memory for the acceptors (%s); bodies travel inline", exc)
        return None
    try:
        os.posix_fallocate(fd, 0, _ARENA_BYTES)
    except OSError as exc:
        log.warning("cannot reserve %d bytes of shared memory (%s); bodies travel inline",
                    _ARENA_BYTES, exc)
        os.close(fd)
        _unlink(path)
        return None
    os.close(fd)
    return path


def _map_arena(path: str | None, unlink: bool = False) -> np.ndarray | None:
    """The arena at ``path``, mapped; ``unlink``: its name removed once mapped (the
    acceptor maps last, so no file outlives both processes, whichever dies first)."""
    if path is None:
        return None
    fd = os.open(path, os.O_RDWR)
    try:
        return np.frombuffer(mmap.mmap(fd, _ARENA_BYTES), dtype=np.uint8)
    finally:
        os.close(fd)
        if unlink:
            _unlink(path)


def _unlink(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _address(view: Any) -> int | None:
    obj = getattr(view, "obj", None)
    return obj.ctypes.data if isinstance(obj, np.ndarray) else None


def _frame(meta: dict, size: int) -> bytes:
    packed = msgpack.packb(meta)
    return _FRAME.pack(len(packed), size) + packed


async def _read_frame(reader: asyncio.StreamReader) -> tuple[dict, bytes]:
    meta_size, size = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    meta = msgpack.unpackb(await reader.readexactly(meta_size))
    return meta, (await reader.readexactly(size) if size else b"")


def _fd_path(socket_path: str) -> str:
    """The owner's socket for handed-over connections, beside its main socket."""
    return os.path.join(os.path.dirname(socket_path), "fds.sock")


def _byte_view(part: Any) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


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
        self.writer: asyncio.StreamWriter | None = None
        self.connected = False  # the acceptor has said hello (its link may end later)
        # Heartbeat: when the oldest unanswered ping went out (None: all answered).
        self.ping_sent: float | None = None
        self.last_ping = 0.0

    def unlink(self) -> None:
        """The arenas' names, if the acceptor has not removed them (it died first)."""
        _unlink(self.request_path)
        _unlink(self.answer_path)

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
        self.directory = tempfile.mkdtemp(prefix="moegemm-owner-")
        self.socket_path = os.path.join(self.directory, "owner.sock")
        self.links: list[_Link] = []
        self.stopping = False
        self.never = asyncio.Event()  # what a forwarded app waits on for a disconnect
        self._unix: asyncio.base_events.Server | None = None
        self._watch: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
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
                    task = self.loop.create_task(self._answer(link, meta, data))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                elif kind == "free":
                    link.answer_slots.give(meta["o"])
                elif kind == "refused":  # answered by the acceptor from the head
                    self.server.count_refusal(meta["st"], meta["m"], meta["p"])
                elif kind == "pong":
                    link.ping_sent = None
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:  # a bug: drop the link; the acceptor exits and is replaced
            log.exception("acceptor %d sent something unexpected", link.index)
        finally:
            if link.writer is writer:
                link.writer = None
            writer.close()

    def _request_body(self, link: _Link, meta: dict, data: bytes) -> memoryview:
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
            await self._answer_or_fail(link, meta, data)
        except Exception:  # a bug here: the acceptor must not wait forever
            log.exception("answering a forwarded %s %s failed", meta.get("m"), meta.get("p"))
            status, head, parts = _internal_error()
            link.send({"t": "res", "id": meta["id"], "st": status, "hd": head, "cl": True}, parts)
        finally:
            self.server.active -= 1

    async def _answer_or_fail(self, link: _Link, meta: dict, data: bytes) -> None:
        body = self._request_body(link, meta, data)
        headers = [(bytes(k), bytes(v)) for k, v in meta["h"]]
        method, path = meta["m"], meta["p"]
        direct = self.server.direct
        name = None if direct is None else direct.match(method, path)
        close = False
        if name is not None:
            try:
                status, head, parts = await direct(name, headers, body)
            except Exception:  # as the transport's _run_direct
                log.exception("the direct route failed on %s %s", method, path)
                status, head, parts = _internal_error()
                close = True
        else:
            status, head, parts, close = await self._run_app(meta, headers, body)
        del body
        answer = {"t": "res", "id": meta["id"], "st": status, "hd": head, "cl": close}
        size = sum(_byte_view(p).nbytes for p in parts)
        offset = None
        if link.answers is not None and _INLINE_ANSWER <= size <= _SLOT_MAX:
            offset = link.answer_slots.take(size)
        if offset is None:
            link.send(answer, [_byte_view(p) for p in parts])
            return
        try:
            at = offset
            for part in parts:
                view = np.frombuffer(_byte_view(part), dtype=np.uint8)
                link.answers[at:at + view.size] = view
                at += view.size
        except BaseException:
            link.answer_slots.give(offset)
            raise
        answer["s"] = [offset, size]
        link.send(answer, [])

    async def _run_app(self, meta: dict, headers: list, body: memoryview):
        """The app's answer as (status, header lines, body parts, close); status None
        when nothing may be written (as ``_http._Connection._run``)."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": meta["v"],
            "method": meta["m"],
            "scheme": "http",
            "path": meta["p"],
            "raw_path": meta["r"],
            "query_string": meta["q"],
            "root_path": "",
            "headers": headers,
            "client": tuple(meta["c"]) if meta["c"] else None,
            "server": tuple(meta["sv"]) if meta["sv"] else None,
            "state": dict(self.server.state),
        }
        out: dict = {"status": None, "head": [], "parts": [], "chunked": False, "done": False}
        receive = whole_body_receive(body, self.never)

        async def send(message: dict) -> None:  # _http._Response, collected
            if message["type"] == "http.response.start":
                status = out["status"] = message["status"]
                has_length = False
                for key, value in message.get("headers", ()):
                    if key.lower() == b"content-length":
                        has_length = True
                    out["head"] += [key, b": ", value, b"\r\n"]
                if not has_length and status not in (204, 304):
                    out["chunked"] = True
                    out["head"].append(b"transfer-encoding: chunked\r\n")
            elif message["type"] == "http.response.body":
                data = message.get("body", b"")
                more = message.get("more_body", False)
                if out["chunked"]:
                    if data:
                        out["parts"] += [b"%x\r\n" % len(data), data, b"\r\n"]
                    if not more:
                        out["parts"].append(b"0\r\n\r\n")
                elif data:
                    out["parts"].append(data)
                out["done"] = not more

        try:
            await self.server.app(scope, receive, send)
        except Exception:
            log.exception("the app failed on %s %s", meta["m"], meta["p"])
            if out["status"] is None:
                return (*_internal_error(), True)
            return None, b"", [], True
        if not out["done"]:
            return None, b"", [], True
        return out["status"], b"".join(out["head"]), out["parts"], False

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


def _internal_error() -> tuple[int, bytes, list]:
    """``_error_bytes(500, ...)`` split as (status, header lines, body); the
    acceptor adds the ``connection: close`` line it carries."""
    head, _, body = _error_bytes(500, "internal", "unexpected server error").partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")[1:]
    return 500, b"".join(line + b"\r\n" for line in lines if line != b"connection: close"), [body]


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
    if serving.done():
        listening.cancel()
        await serving
        return
    # serve() handled the signals so far; now they stop the acceptors first.
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, outer.set)
    owner = Owner(server, count, log_level, pin, hung_after_s, direct_limit)
    owner.acceptor_grace_s = acceptor_grace_s  # before start(): the acceptors get it
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


# -- the acceptor's side ------------------------------------------------------------------


class _ForwardConnection(_Connection):
    """A transport connection that forwards each request to the owner."""

    def _dispatch(self) -> None:
        # The body stays reserved (``_Acceptor.held``) until the owner has answered.
        self.transport.pause_reading()
        self.state = _RUN
        self.task = asyncio.get_running_loop().create_task(self._forward(self.scope, self.body))
        self.scope, self.body, self.body_used = None, None, 0

    async def _forward(self, scope: dict, body: memoryview) -> None:
        try:
            status, head, data, close = await self.server.forward(scope, body)
        except Exception:  # the owner is gone, or a bug: as _run_direct answers its failures
            log.exception("forwarding %s %r failed", scope["method"], scope["path"][:200])
            if self.transport is not None:
                self.transport.write(_error_bytes(500, "internal", "unexpected server error"))
            self.keep_alive = False
        else:
            if close:
                self.keep_alive = False
            if status is not None and self.transport is not None:
                line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, "").encode())
                if scope["http_version"] == "1.0" and b"transfer-encoding: chunked" in head:
                    # _http._Response's rule for a 1.0 client: no chunks, the end of
                    # the body is the end of the connection (the owner chunked it).
                    self.keep_alive = False
                end = self._connection_line() + b"\r\n"
                parts = [line + head + end]
                if scope["method"] != "HEAD":  # a HEAD answer has no body
                    parts.append(data)
                self.transport.writelines(parts)
        del body
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
        # Body bytes of this acceptor's requests, from their head until the owner
        # answered them: what the head gate judges the in-flight limit against
        # here (the owner's budget bounds what it runs).
        self.receiving = 0
        self.grace_s = grace_s
        self.app = self.direct = None
        self.active = 0  # what _Connection counts (the owner counts forwarded requests)
        self.state: dict = {}
        self.connections: set = set()
        self.requests = _map_arena(request_path, unlink=True)
        self.answers = _map_arena(answer_path, unlink=True)
        self.base = None if self.requests is None else self.requests.ctypes.data
        self.slots = _Slots(_ARENA_BYTES)
        self.holders: dict[int, int] = {}  # slot -> holders (this process, the owner)
        self.dropped: list[int] = []  # slots whose last local reference died
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

    def count_refusal(self, status: int, method: str, path: str | None) -> None:
        """The owner keeps the metrics: tell it of a request answered here (its path
        only when short: a long one is no route's)."""
        if self.writer is not None and not self.lost and not self.writer.is_closing():
            path = path if path is not None and len(path) <= 1024 else None
            self.writer.write(_frame({"t": "refused", "st": status, "m": method, "p": path}, 0))

    # _Connection's body allocator: a slot of the request arena when one is free.
    def allocate(self, size: int) -> memoryview:
        self._collect()
        if self.requests is not None and 0 < size <= _SLOT_MAX:
            offset = self.slots.take(size)
            if offset is not None:
                array = self.requests[offset:offset + size]
                self.holders[offset] = 1
                # list.append only: a finalizer may run inside any allocation.
                done = weakref.finalize(array, self.dropped.append, offset)
                done.atexit = False
                return memoryview(array)
        return _plain_body(size)

    def _collect(self) -> None:
        while self.dropped:
            self._unhold(self.dropped.pop())

    def _unhold(self, offset: int) -> None:
        self.holders[offset] -= 1
        if not self.holders[offset]:
            del self.holders[offset]
            self.slots.give(offset)

    async def forward(self, scope: dict, body: memoryview):
        """The owner's answer to one request: (status, header lines, body, close)."""
        if self.writer is None or self.lost or self.writer.is_closing():
            # Raised, not queued: a request after the link is gone must get an
            # answer (500), not wait for a reply that cannot come.
            raise ConnectionError("not connected to the owner")
        request_id = self.next_id = self.next_id + 1
        client, server = scope["client"], scope["server"]
        meta = {
            "t": "req", "id": request_id, "m": scope["method"], "p": scope["path"],
            "r": scope["raw_path"], "q": scope["query_string"], "v": scope["http_version"],
            "h": scope["headers"],
            "c": list(client[:2]) if client else None, "sv": list(server[:2]) if server else None,
        }
        address = _address(body) if self.base is not None and len(body) else None
        offset = None if address is None else address - self.base
        parts: list = [body]
        if offset is not None and offset in self.holders:
            self.holders[offset] += 1
            meta["s"] = [offset, len(body)]
            parts = []
        future = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        size = sum(len(p) for p in parts)
        self.writer.writelines([_frame(meta, size), *parts])
        del body, parts
        try:
            answer, data = await future
        finally:
            self.pending.pop(request_id, None)
        slot = answer.get("s")
        if slot is not None:
            offset, size = slot
            data = self.answers[offset:offset + size].tobytes()
            self.writer.write(_frame({"t": "free", "o": offset}, 0))
        return answer["st"], answer["hd"], data, answer["cl"]

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
        sweeping = loop.create_task(sweep(self.connections, self.limits))
        self._listen()
        log.debug("acceptor %d listening on %s:%d", self.index, self.host, self.port)
        await stop.wait()
        listeners, self.listeners = self.listeners, []
        for listener in listeners:
            loop.remove_reader(listener)
            listener.close()
        await self._settle_offers(min(1.0, self.grace_s))
        if self.handing:  # connections just handed back: counted below once connected
            await asyncio.wait(list(self.handing), timeout=min(1.0, self.grace_s))
        running = [c.task for c in self.connections if c.task is not None]
        if running:
            await asyncio.wait(running, timeout=self.grace_s)
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


__all__ = ["Owner", "acceptor_main", "serve_with_acceptors"]
