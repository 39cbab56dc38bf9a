"""The fast transport counts the requests it has begun and not answered, which
is what lets the engine run a lone call on the loop's thread (``alone``)."""

from __future__ import annotations

import asyncio
import socket
import time

from moegemm.server._http import FastHttpServer
from server_support import _free_port, fast_server_thread


async def _lifespan_app(scope, receive, send):
    """An ASGI app with nothing but a lifespan (every call here is direct)."""
    assert scope["type"] == "lifespan"
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        else:
            await send({"type": "lifespan.shutdown.complete"})
            return


class _Probe:
    """A direct route that records ``in_progress()`` when each call starts; the call
    named ``wait`` answers only after a later call has started."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.later: asyncio.Event | None = None
        self.in_progress = lambda: -1  # the transport replaces it

    def match(self, method: str, path: str) -> str | None:
        return path.removeprefix("/") if method == "POST" else None

    async def __call__(self, name, headers, body, arrived):
        if self.later is None:
            self.later = asyncio.Event()
        self.seen.append((name, self.in_progress()))
        if name == "wait":
            # No wait_for: a direct route runs outside any task up to its first wait, where
            # Python 3.12's timeouts raise (the clients' socket timeouts bound the test).
            await self.later.wait()
        else:
            self.later.set()
        return 200, b"content-length: 2\r\n", [b"ok"]


def _request(name: str, body: bytes = b"x") -> bytes:
    return (b"POST /%s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
            % (name.encode(), len(body))) + body


def _answer(sock: socket.socket) -> bytes:
    got = b""
    while not got.endswith(b"ok"):
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    return got


def _wait_for(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_requests_in_progress_are_counted_from_head_to_answer():
    probe = _Probe()
    port = _free_port()
    server = FastHttpServer(_lifespan_app, "127.0.0.1", port, max_body_bytes=1 << 20,
                            direct=probe)
    with fast_server_thread(server):
        _wait_for(server.listening.is_set)
        a = socket.create_connection(("127.0.0.1", port), timeout=10)
        b = socket.create_connection(("127.0.0.1", port), timeout=10)
        a.sendall(_request("wait"))
        _wait_for(lambda: len(probe.seen) == 1)
        b.sendall(_request("go"))
        assert b"200" in _answer(b)
        assert b"200" in _answer(a)
        a.sendall(_request("alone"))
        assert b"200" in _answer(a)
        # A head whose body never comes counts until the connection goes.
        c = socket.create_connection(("127.0.0.1", port), timeout=10)
        c.sendall(_request("never", b"0123456789")[:-4])
        _wait_for(lambda: server.active == 1)
        c.close()
        _wait_for(lambda: server.active == 0)
        a.close()
        b.close()
    # The first call began alone; the second began while the first was unanswered;
    # the third began after both were answered.
    assert probe.seen == [("wait", 1), ("go", 2), ("alone", 1)]
    assert server.active == 0
