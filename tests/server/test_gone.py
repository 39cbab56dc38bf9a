"""A call whose client went away before it ran never runs: its place in the queue and its
body's share of the in-flight budget go back when the connection closes, with the server
alone and through acceptor processes (which tell the owner, "gone").

Real ``moegemm serve`` processes on the CPU (the demo set, G 8, N 256, K 512). One long
call holds the device while clients send calls and hang up; the device's launches count
(``moegemm_launches_total``) then shows which calls ran.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from moegemm.client._wire import encode_tensor, packb
from server_support import metric_sum
from test_acceptors import _read_answer, _Server
from test_direct import TOKEN

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="SO_REUSEPORT and /proc: Linux only")

G, K = 8, 512
ROWS = 65536  # one call long enough to hold the device while the others come and go
ABANDONED = 3


def _body(rows: int) -> bytes:
    x = np.random.default_rng(rows).standard_normal((rows, K), dtype=np.float32)
    sizes = np.full(G, rows // G, dtype=np.int64)
    return packb({"x": encode_tensor(x), "m_sizes": encode_tensor(sizes)})


def _head(length: int) -> bytes:
    return (f"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n"
            f"content-type: application/msgpack\r\ncontent-length: {length}\r\n\r\n").encode()


def _metric(port: int, sample: str, **labels: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics",
                     headers={"authorization": f"Bearer {TOKEN}"}).text
    return metric_sum(text, sample, **labels)


@pytest.mark.parametrize("acceptors", [0, 2])
def test_a_call_whose_client_left_never_runs_and_frees_its_budget(acceptors):
    body = _body(ROWS)
    request = _head(len(body)) + body
    # Room for two bodies in flight: the long call's and one more.
    args = ("--max-body-bytes", str(len(body)), "--max-m", str(ROWS),
            "--max-inflight-bytes", str(len(body) * 5 // 2))
    # A keep-alive of 2 s: the sweep that looks for clients gone runs every 0.5 s.
    env = {"MOEGEMM_HTTP_KEEP_ALIVE_S": "2"}
    if acceptors:
        env["MOEGEMM_OWNER_CONNECTIONS"] = "0"
    server = _Server(acceptors, args, **env)
    try:
        server.wait_ready()
        launches = "moegemm_launches_total"
        before = _metric(server.port, launches)
        with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
            sock.sendall(request)
            assert _answer_status(sock) == 200
        one_call = _metric(server.port, launches) - before
        assert one_call >= 1

        first = {}

        def long_call() -> None:
            with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
                sock.sendall(request)
                first["status"] = _answer_status(sock)
                first["done"] = time.monotonic()

        before = _metric(server.port, launches)
        runner = threading.Thread(target=long_call)
        runner.start()
        time.sleep(0.3)  # the long call runs
        left = []
        for _ in range(ABANDONED):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=120)
            left.append(sock)
            with contextlib.suppress(OSError):  # past the budget: refused, and closed
                sock.sendall(request)
        time.sleep(0.5)  # the server has them (queued, or refused for the budget)
        for sock in left:
            sock.close()
        gone_at = time.monotonic()
        # Reading is paused while a call runs: the server's sweep (once a second) sees them go.
        deadline = time.monotonic() + 10
        while _metric(server.port, "moegemm_requests_total", status="499") < 1:
            assert time.monotonic() < deadline, "no call was counted as left by its client"
            time.sleep(0.05)
        # That 499 may be a body cut off mid-upload: the queued call is seen gone once it has
        # left the queue (under load, its "gone" came later and a batch took it first).
        while _metric(server.port, "moegemm_queue_depth") > 0:
            assert time.monotonic() < deadline, "a call whose client left stayed queued"
            time.sleep(0.05)
        assert runner.is_alive(), "the long call ended before the others were seen gone"
        # A live call of the same size after them: the budget the gone calls held is back.
        with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
            sock.sendall(request)
            assert _answer_status(sock) == 200
        runner.join(120)
        assert first["status"] == 200
        assert first["done"] > gone_at, "the long call ended before the others left: too short"
        # Only the long call and the live one ran.
        assert _metric(server.port, launches) - before == 2 * one_call
    finally:
        assert server.stop() == 0


def _answer_status(sock: socket.socket) -> int:
    head, _ = _read_answer(sock)
    return int(head.split(b" ", 2)[1])


@pytest.mark.parametrize("acceptors", [0, 2])
def test_a_load_whose_client_only_shut_its_side_is_answered(acceptors):
    """A client that sends a load and shuts its sending side (``shutdown(SHUT_WR)``, as
    ``nc -N`` does) still gets its answer: only calls are dropped when their client goes."""
    w = np.random.default_rng(0).standard_normal((16, 1024, 2048), dtype=np.float32)
    body = packb({"w": encode_tensor(w)})
    head = (f"PUT /v1/weights/halfway HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n"
            f"content-type: application/msgpack\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    env = {"MOEGEMM_HTTP_KEEP_ALIVE_S": "2"}  # the sweep every 0.5 s
    if acceptors:
        env["MOEGEMM_OWNER_CONNECTIONS"] = "0"
    server = _Server(acceptors, ("--max-body-bytes", str(len(body))), **env)
    try:
        server.wait_ready()
        with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
            sock.sendall(head + body)
            sent = time.monotonic()
            sock.shutdown(socket.SHUT_WR)
            status = _answer_status(sock)
        assert time.monotonic() - sent > 0.6, "the load was too short to meet a sweep"
        assert status == 201
    finally:
        assert server.stop() == 0


def test_the_owner_drops_a_call_whose_gone_came_with_it():
    """An acceptor's "gone" read in the same turn as its request (before the call began, where
    tasks do not start eagerly; or just after, where they do): the call never completes, and
    the owner still answers the request, empty, so the acceptor's wait ends."""
    import asyncio

    from moegemm.server._acceptor_link import _frame, _read_frame
    from moegemm.server._acceptors import Owner, _Link
    from moegemm.server._http_gate import call_route

    completed = []

    class Direct:  # the owner's DirectCalls: a call that waits long
        match = staticmethod(call_route)

        async def __call__(self, route, headers, body, arrived):
            await asyncio.sleep(30)
            completed.append(route)
            return 200, b"", [b"x"]

    class Writer:
        def __init__(self):
            self.sent = bytearray()

        def write(self, data):
            self.sent += data

        def writelines(self, parts):
            for part in parts:
                self.sent += part

        def is_closing(self):
            return False

        def close(self):
            pass

    async def scenario():
        server = type("Server", (), {"active": 0, "direct": Direct(), "grace_s": 1.0})()
        owner = Owner(server, 0, "warning")
        owner.loop = asyncio.get_running_loop()
        owner.links.append(_Link(0))
        try:
            reader, writer = asyncio.StreamReader(), Writer()
            request = {"t": "req", "id": 1, "m": "POST", "p": "/v1/weights/w/gemm", "r": b"",
                       "q": b"", "v": "1.1", "h": [], "a": 0.0, "c": None, "sv": None}
            reader.feed_data(_frame({"t": "hello", "i": 0}, 0) + _frame(request, 1) + b"x"
                             + _frame({"t": "gone", "id": 1}, 0))
            serving = asyncio.ensure_future(owner._serve_link(reader, writer))
            for _ in range(500):  # (the answer, before the link ends)
                await asyncio.sleep(0.01)
                if writer.sent:
                    break
            reader.feed_eof()
            await serving
            answers = asyncio.StreamReader()
            answers.feed_data(bytes(writer.sent))
            answers.feed_eof()
            meta, _ = await _read_frame(answers)
            return meta, server.active, owner.links[0].calls
        finally:
            owner.links[0].unlink()
            owner.close()

    meta, active, calls = asyncio.run(scenario())
    assert (meta["t"], meta["id"], meta["st"]) == ("res", 1, None)
    assert not completed and active == 0 and not calls
