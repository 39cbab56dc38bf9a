"""A small HTTP/1.1 server for the ASGI app, built for megabyte msgpack bodies.

Why not uvicorn: measured on the H200 machine (``shared/bench/http_baseline.json``),
uvicorn's body path costs ~1.9 ms for a 0.9 MB request and tops out near 630
calls/s, while the GPU copies of the same bytes take ~60 us. Its protocol
appends every 64 KB socket read to the previous ones and pauses and resumes the
socket at each, a round trip through the event loop per chunk. Here (the connection,
``_http_conn.py``, says each in full):

- heads parsed by httptools (llhttp), strictly; a head that declares a body judged
  before a byte of the body is read (``_http_gate.py``);
- each body received straight into one buffer of its size (page-locked on a GPU);
- the app given the whole body in one message; answers written as their parts;
- timeouts, limits and write backpressure per connection.

This module is the server: it listens, accepts, sweeps the connections' timeouts, stops on
signals with a grace period for what is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from ._asgi import leaf_routes
from ._http_conn import _Connection, _plain_body, drain, log, sweep
from ._http_gate import HttpLimits, fit_to_descriptors

# At a stop, the least time the answers already made get to reach their clients, even when
# the requests used the whole grace period.
FLUSH_S = 2.0


def _endpoint_of(app, method: str, path: str | None) -> str:
    """The metrics label of a request to ``path``: its route's path format, as the app's
    own counting (``app.py``) labels it; "unmatched" for no route."""
    from starlette.routing import Match

    from ._direct import DirectCalls

    if path is None:
        return "unmatched"
    route = DirectCalls.match(method, path)
    if route is not None:
        return route.endpoint
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    for candidate in leaf_routes(getattr(app, "routes", ())):
        if candidate.matches(scope)[0] == Match.FULL:
            return getattr(candidate, "path_format", "unmatched")
    return "unmatched"


class ListenError(OSError):
    """The server's address cannot be listened on: taken, or not this host's."""


def _refuse_if_taken(host: str, port: int) -> None:
    """Raise :class:`ListenError` if ``host:port`` cannot be bound (something listens there).

    Checked before the app starts, so a taken port is refused before the weights load
    (minutes for a checkpoint). With SO_REUSEPORT (acceptors) a second server on the same port
    would bind without an error and share the clients of this one; a plain bind first fails as
    a server without acceptors would.
    """
    if not port:
        return
    try:
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
    except OSError as exc:  # socket.gaierror too: a host that is not this machine's
        raise ListenError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc


def stop_on_signals(loop, stop: asyncio.Event, before_exit: Callable[[], None] | None = None) -> None:
    """SIGINT/SIGTERM set ``stop`` (an orderly stop: the requests in flight get the grace
    period); a second one while stopping exits at once (128 + its number, as a shell reports
    a signal), as an operator's second Ctrl-C asks, after ``before_exit``. Not in the main
    thread (tests), the caller sets ``stop`` itself."""

    def on_signal(sig: int) -> None:
        if stop.is_set():
            log.warning("a second signal while stopping: exiting now, cutting what is in flight")
            if before_exit is not None:
                with contextlib.suppress(Exception):
                    before_exit()
            os._exit(128 + sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, on_signal, sig)


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
        limits: HttpLimits | None = None,
    ) -> None:
        self.app = app
        # Routes answered without the app (``_direct.DirectCalls``): an object with
        # match(method, path) -> key | None and an async call(key, headers, body)
        # -> (status, header lines, body parts).
        self.direct = direct
        # Requests begun (head read, or forwarded by an acceptor) and not yet
        # answered. The engine runs a call on the loop's thread at once only when it
        # is the only one (``Engine.submit``'s ``alone``). A direct connection's
        # request runs from the callback that read it, before the loop reads the
        # other connections whose bytes arrived in the same turn; the engine runs at
        # most one call at once per turn, so those merge in the next one.
        self.active = 0
        if direct is not None:
            direct.in_progress = lambda: self.active
        self.host = host
        self.port = port
        self.max_body_bytes = max_body_bytes
        if limits is None:  # the app's settings (tokens, MOEGEMM_HTTP_*)
            settings = getattr(getattr(app, "state", None), "settings", None)
            limits = HttpLimits() if settings is None else HttpLimits.from_settings(settings)
        # The transport's body limit is the one it was given.
        self.limits = dataclasses.replace(limits, max_body_bytes=max_body_bytes)
        # Body bytes received of requests whose body is still arriving (the app's budget
        # holds them once they run), and the sizes of such bodies' buffers taken whole
        # (``allocate``: page-locked on a GPU), bounded by the in-flight limit.
        self.receiving = 0
        self.committed = 0
        self._budget = None
        self.allocate = allocate or _plain_body
        self.grace_s = grace_s
        # Set at the stop: requests begun after it are refused (503 not_ready) and answers
        # close their connection, so no request is read that the drain would then drop.
        self.stopping = False
        # SO_REUSEPORT: other processes may bind the same port (``_acceptors.py``).
        self.reuse_port = reuse_port
        # Set once the port is bound (``self.port`` is then the real one).
        self.listening = asyncio.Event()
        self.connections: set[_Connection] = set()
        # The connections whose answers wait for their clients to read them, and since when
        # (oldest first): bounded together by the in-flight limit (``_http_conn.bound_unread``).
        self.unread: dict[_Connection, float] = {}
        self.state: dict = {}
        self._server: asyncio.base_events.Server | None = None

    def count_refusal(self, status: int, method: str, path: str | None, seconds: float,
                      body: int) -> None:
        """A request the transport answered itself (``_Connection._refuse``), in the
        request metrics (count and total time, from its head's first byte) under the
        endpoint the app would have counted it under (its route's path format, e.g. a
        refused upload under ``/v1/weights/{name}``), else as "unmatched"; ``body``: the
        answer's body bytes (bytes out)."""
        metrics = getattr(getattr(self.app, "state", None), "metrics", None)
        if metrics is None:
            return
        endpoint = _endpoint_of(self.app, method, path)
        metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        metrics.request_seconds.labels(endpoint=endpoint).observe(seconds)
        metrics.bytes_out.inc(body)

    def held(self) -> int:
        """Request body bytes held: received here so far, plus those the app's budget holds."""
        return self.receiving + self._app_held()

    def may_commit(self, size: int) -> bool:
        """Whether a body of ``size`` bytes may get a buffer from ``allocate`` (memory taken
        whole): the bodies given one and those the app holds stay within the in-flight
        limit with it, or there are none."""
        held = self.committed + self._app_held()
        return not held or held + size <= self.limits.max_inflight_bytes

    def _app_held(self) -> int:
        budget = self._budget
        if budget is None:
            budget = self._budget = _find_budget(self.app)
        return budget.held if budget is not False else 0

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
        stop_on_signals(loop, stop)
        _refuse_if_taken(self.host, self.port)
        self.limits = fit_to_descriptors(self.limits)
        task, to_app, from_app = await self._lifespan()
        self._server = await loop.create_server(
            lambda: _Connection(self), self.host, self.port, backlog=1024, reuse_address=True,
            reuse_port=self.reuse_port or None,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self.listening.set()
        sweeping = loop.create_task(sweep(self.connections, self.limits, self.unread))
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address in a URL
        log.info("listening on http://%s:%d (fast HTTP transport)", host, self.port)
        try:
            await stop.wait()
        finally:
            self._server.close()
            self.stopping = True
            # One grace for the whole drain: the requests in flight, then the answers' flush
            # with what is left of it (a couple of seconds at least, to write what is done).
            until = time.monotonic() + self.grace_s
            if await drain(self, until):
                log.warning("stopping: %d request(s) still running after %.1f s are cut off",
                            self.active, self.grace_s)
            sweeping.cancel()
            # close() flushes what is still buffered, asynchronously: wait for
            # every connection to be gone, or an answer in flight is cut short.
            closing = [c.disconnected.wait() for c in list(self.connections)]
            for conn in list(self.connections):
                if conn.transport is not None:
                    conn.transport.close()
            if closing:
                await asyncio.wait([asyncio.ensure_future(w) for w in closing],
                                   timeout=max(min(self.grace_s, FLUSH_S), until - time.monotonic()))
            await to_app.put({"type": "lifespan.shutdown"})
            await from_app.get()
            await task


def _find_budget(app: Any):
    """The app's BodyBudget middleware (``_direct._find_budget``), or False for an
    app without one (a bare ASGI app in the tests)."""
    try:
        from ._direct import _find_budget as find

        return find(app)
    except (RuntimeError, AttributeError, ImportError):
        return False
