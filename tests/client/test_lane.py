"""The blocking client's lean HTTP/1.1 lane (client/_lane.py) against real sockets.

What httpx did for the client and the lane must do too: keep-alive reuse, a
socket the server closed replaced without resending, chunked and
Content-Length answers, a proxy or https left to httpx, failures raised as
the client's error tree, a deadline bounding the whole exchange.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import select
import signal
import socket
import struct
import threading
import time
import typing

import httpx
import numpy as np
import pytest
from moegemm.client import APIError, Client, DeadlineExceeded, InternalError, TransportError
from moegemm.client._lane import usable


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: typing.ClassVar[list] = []
    ids: typing.ClassVar[list] = []  # each request's X-Request-Id headers, all of them

    def do_GET(self):
        self.seen.append((self.path, self.client_address[1], dict(self.headers)))
        self.ids.append(self.headers.get_all("X-Request-Id"))
        body = json.dumps({"path": self.path, "peer": self.client_address[1]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if self.path.endswith("chunked"):
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(body), 7):
                piece = body[i:i + 7]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_header("Content-Length", str(len(body)))
        if self.path.endswith("close"):
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Handler.seen = []
    _Handler.ids = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", srv
    srv.shutdown()
    srv.server_close()


def test_plain_http_takes_the_lane_and_others_do_not(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    assert usable("http://127.0.0.1:8000", None)
    assert not usable("https://example.com", None)
    assert not usable("http://127.0.0.1:8000", httpx.MockTransport(lambda r: None))
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    assert not usable("http://10.1.2.3:8000", None)
    assert usable("http://10.1.2.3:8000", None, trust_env=False)


def test_keep_alive_and_headers(server):
    url, _ = server
    with Client(url, token="t0k", headers={"X-Extra": "1"}) as c:
        a, b = c.info(), c.info()
    assert a["peer"] == b["peer"]
    (_, _, headers), _ = _Handler.seen[0], None
    assert headers["Authorization"] == "Bearer t0k"
    assert headers["X-Extra"] == "1"
    assert headers["Host"] == url.removeprefix("http://")
    assert len(headers["X-Request-Id"]) == 32


def test_chunked_answer(server):
    url, _ = server
    with Client(url + "/pre") as c:
        # the path prefix of the base URL is kept, and the chunked body reassembled
        answer = c._lane.request("GET", "/x/chunked", {}, None, httpx.Timeout(5))
    assert answer.status_code == 200
    assert json.loads(answer.content) == {"path": "/pre/x/chunked", "peer": _Handler.seen[0][1]}


def test_close_answers_are_not_pooled(server):
    url, _ = server
    with Client(url) as c:
        first = c._lane.request("GET", "/a/close", {}, None, httpx.Timeout(5))
        assert not c._lane._idle  # "Connection: close" answers are not pooled
        second, third = c.info(), c.info()
    assert json.loads(first.content)["peer"] != second["peer"] == third["peer"]


def _closing_server() -> tuple[str, list]:
    """Answers two requests, each on its own connection, closing each one soon
    after answering (while the client holds it idle); returns the URL and the
    requests seen."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    requests = []

    def serve():
        for _ in range(2):
            conn, peer = listener.accept()
            with conn:
                requests.append(conn.recv(65536))
                body = json.dumps({"peer": peer[1]}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n" % len(body) + body)
                time.sleep(0.05)
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", requests


def test_a_socket_the_server_closed_is_replaced():
    """A keep-alive socket the server closed while idle is noticed before reuse:
    the call goes out once, on a new connection."""
    url, requests = _closing_server()
    with Client(url, timeout=5) as c:
        first = c.info()
        time.sleep(0.3)
        second = c.info()
    assert first["peer"] != second["peer"]
    assert len(requests) == 2


def _child_answer(work, after_fork=None):
    """Forks: the child runs ``work()`` and reports its JSON answer through a pipe, then leaves
    without cleanup; the parent runs ``after_fork()`` (if given), waits up to 20 s for the
    answer (a child hung past that is killed) and returns it, or None if none came."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, json.dumps(work()).encode())
        finally:
            os._exit(0)
    if after_fork is not None:
        after_fork()
    os.close(write)
    ready, _, _ = select.select([read], [], [], 20)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    with os.fdopen(read) as pipe:
        answer = json.loads(pipe.read() or "null")
    os.waitpid(pid, 0)
    return answer


def _through_proxy(monkeypatch, url: str) -> None:
    """Calls to ``url`` go through httpx, by way of a proxy: the test server itself, which
    answers absolute-form requests too."""
    for var in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY", "http_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTP_PROXY", url)


def test_a_forked_process_opens_its_own_sockets(server):
    """A process forked from one whose client holds pooled sockets never writes to them: both
    would read answers off one connection and could take each other's (an audit: 54 of 300
    answers swapped, no error). The child's copies are closed, the parent's sockets stay."""
    url, _ = server
    with Client(url, timeout=5) as c:
        parent = c.info()["peer"]
        # Another thread holds the pool's lock across the fork: the child's copy of it
        # would stay locked forever.
        held, release = threading.Event(), threading.Event()

        def hold():
            with c._lane._lock:
                held.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(10)

        def let_go():
            release.set()
            holder.join()

        child = _child_answer(lambda: [c.info()["peer"] for _ in range(3)], after_fork=let_go)
        again = c.info()["peer"]
    assert child is not None, "the child hung on the pool's lock"
    assert parent not in child and len(set(child)) == 1
    assert again == parent


def test_a_forked_child_of_a_client_on_httpx_opens_its_own_sockets(server, monkeypatch):
    """Calls that stay on httpx (here through a proxy: the test server answers absolute-form
    requests too) get the lanes' rule: a forked child's copy of the client starts a fresh
    httpx pool instead of reusing the parent's pooled connection (both reading answers off
    one socket could take each other's), and the parent's connection keeps working."""
    url, _ = server
    _through_proxy(monkeypatch, url)
    with Client(url, timeout=5) as c:
        assert c._lane is None  # on httpx
        parent = c.info()["peer"]
        child = _child_answer(lambda: [c.info()["peer"] for _ in range(3)])
        again = c.info()["peer"]
    assert child is not None and parent not in child and len(set(child)) == 1
    assert again == parent


def test_a_forked_child_of_an_async_client_on_httpx_opens_its_own_sockets(server, monkeypatch):
    """As the blocking client's test above, for an AsyncClient on httpx forked while the
    parent's loop runs: the child, under its own loop, calls on a fresh pool."""
    import asyncio

    from moegemm.client import AsyncClient

    url, _ = server
    _through_proxy(monkeypatch, url)
    c = AsyncClient(url, timeout=5)
    assert c._lane is None  # on httpx

    async def child_calls():
        return [(await c.info())["peer"] for _ in range(3)]

    async def scenario():
        first = (await c.info())["peer"]
        child = _child_answer(lambda: asyncio.run(child_calls()))
        second = (await c.info())["peer"]
        await c.close()
        return first, child, second

    first, child, second = asyncio.run(scenario())
    assert child is not None and first not in child and len(set(child)) == 1
    assert second == first


def test_an_async_client_forked_keeps_the_parents_sockets_working(server):
    """A child forked while the parent's loop runs, calling under its own loop: the parent's
    pooled stream is disowned in the child, not closed through the loop the two share a
    copy of (that removed the parent's socket from their common epoll: the parent's next
    call hung until its read timeout)."""
    import asyncio

    from moegemm.client import AsyncClient

    url, _ = server
    c = AsyncClient(url, timeout=3)

    async def scenario():
        first = (await c.info())["peer"]
        pid = os.fork()
        if pid == 0:
            try:
                asyncio.run(c.info())
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        second = (await c.info())["peer"]
        await c.close()
        return first, second

    first, second = asyncio.run(scenario())
    assert first == second  # the same pooled socket, answering


def test_a_forked_child_lets_go_of_sockets_in_use_by_other_threads():
    """A call in flight on another thread at the fork: the child closes its copy of that
    socket too, so the connection ends when the parent closes it, not when the child exits."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    ended = threading.Event()

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            time.sleep(0.5)  # the fork happens while the call waits for this answer
            body = b'{"ok": true}'
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % len(body) + body)
            if conn.recv(65536) == b"":
                ended.set()

    threading.Thread(target=serve, daemon=True).start()
    c = Client(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=10)
    call = threading.Thread(target=c.info)
    call.start()
    time.sleep(0.2)
    pid = os.fork()
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    try:
        call.join(10)
        c.close()
        assert ended.wait(3), "the child's copy kept the connection open"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        listener.close()


def _keep_alive_server(after_first) -> tuple[str, list]:
    """Answers every request; on the first connection, ``after_first(conn)`` runs
    after its first answer (False: close the connection). Returns the URL and the
    client ports of the connections made."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    peers = []
    body = b'{"ok": true}'
    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n" % len(body) + body)

    def serve_one(conn, peer):
        with conn, contextlib.suppress(ConnectionError):  # a client drops a junked socket
            peers.append(peer[1])
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(65536)
            conn.sendall(answer)
            if len(peers) == 1 and not after_first(conn):
                return
            while True:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    head += chunk
                conn.sendall(answer)

    def serve():
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve_one, args=(conn, peer), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", peers


@pytest.mark.parametrize("trouble", ["junk", "reset"])
def test_a_pooled_socket_with_junk_or_a_reset_is_replaced(trouble):
    """Stray bytes after an answer, or a reset, mark an idle socket unusable:
    the next call goes out once, on a new connection."""

    def after_first(conn):
        time.sleep(0.05)  # after the client has read the answer: its own segment
        if trouble == "junk":
            conn.sendall(b"HTTP/1.1 200 OK\r\n")  # nobody asked: the socket is out of step
            return True
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return False  # closed with an RST

    url, peers = _keep_alive_server(after_first)
    with Client(url, timeout=5) as c:
        assert c.info() == {"ok": True}
        time.sleep(0.3)
        assert c.info() == {"ok": True}
        assert c.info() == {"ok": True}
    assert len(peers) == 2  # one replacement; the second socket stays in use


def test_a_deadline_bounds_a_reused_socket():
    """A socket pooled after a call without a deadline keeps no stale timeout:
    a later call with a short deadline on it still gives up in time."""
    gate = threading.Event()

    def after_first(conn):
        gate.wait(5)  # read nothing more until the test is done
        return False

    url, peers = _keep_alive_server(after_first)
    try:
        with Client(url, timeout=30) as c:
            assert c.info() == {"ok": True}
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                c.grouped_gemm("demo", np.zeros((1, 128), np.float32), [1], deadline=0.3)
            assert time.monotonic() - started < 2
    finally:
        gate.set()
    assert len(peers) == 1  # the call went out on the pooled socket


def _one_shot(answer: bytes) -> str:
    """A one-connection server that sends ``answer`` to the first request."""

    def respond(conn):
        conn.sendall(answer)
        time.sleep(0.2)

    return _raw_server(respond)


def test_malformed_answer_is_a_transport_error():
    with Client(_one_shot(b"HTTP/1.1 2OO OK\r\n\r\n"), timeout=5) as c, \
            pytest.raises(TransportError):
        c.live()


def test_answer_cut_short_is_a_transport_error():
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"status\""
    with Client(_one_shot(answer), timeout=5) as c, pytest.raises(TransportError):
        c.live()


def test_error_answer_maps_to_the_error_tree():
    body = b'{"error": {"code": "internal", "message": "boom"}}'
    answer = (b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
              b"x-request-id: rid-9\r\ncontent-length: %d\r\n\r\n" % len(body)) + body
    with Client(_one_shot(answer), timeout=5) as c, pytest.raises(InternalError) as info:
        c.live()
    assert info.value.request_id == "rid-9" and "boom" in str(info.value)


def test_silent_server_hits_the_deadline():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with Client(url, timeout=30) as c:
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                c.grouped_gemm("demo", np.zeros((1, 128), np.float32), [1], deadline=0.3)
            assert time.monotonic() - started < 2
    finally:
        listener.close()


def _raw_server(respond) -> str:
    """A one-connection server: ``respond(conn)`` after reading the request head."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve():
        conn, _ = listener.accept()
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(65536)
            respond(conn)
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_upload_that_timed_out_is_not_sent_on_afterwards(kind):
    """A load whose write timed out (a server that stopped reading: a GC pause, SIGSTOP)
    raises, and the rest of its body is not sent on once the server reads again: the
    server sees the body end early, so a load the caller was told failed never lands
    (the async lane's close() sent what its transport still buffered)."""
    from moegemm.client import AsyncClient

    w = np.ones((4, 1024, 4096), np.float32)  # 64 MiB, far past the socket buffers
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    failed = threading.Event()  # the server reads again once the client gave up
    received: list[int] = []

    def serve():
        conn, _ = listener.accept()
        failed.wait(30)
        conn.settimeout(2)  # no byte for 2 s: nothing more comes
        got = 0
        with conn, contextlib.suppress(ConnectionResetError, TimeoutError):
            while chunk := conn.recv(1 << 20):
                got += len(chunk)
        received.append(got)

    reader = threading.Thread(target=serve, daemon=True)
    reader.start()
    try:
        if kind == "sync":
            with Client(url, load_timeout=0.5) as c, pytest.raises(TransportError):
                c.load_weights("w", w)
            failed.set()
        else:
            async def load():
                async with AsyncClient(url, load_timeout=0.5) as c:
                    with pytest.raises(TransportError):
                        await c.load_weights("w", w)
                    failed.set()
                    # The loop runs on while the server reads: nothing more must go out.
                    await asyncio.to_thread(reader.join, 30)

            asyncio.run(load())
        reader.join(30)
        assert received and 0 < received[0] < w.nbytes // 2, received
    finally:
        listener.close()


def test_an_early_answer_to_a_large_upload_is_read():
    """A server that answers 413 before reading the body, then closes: the caller
    sees TooLarge (as with httpx), not a write error."""
    from moegemm.client import TooLarge

    body = b'{"error": {"code": "too_large", "message": "over 1 MiB"}}'

    def respond(conn):
        conn.sendall(b"HTTP/1.1 413 Content Too Large\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)

    url = _raw_server(respond)
    with Client(url, timeout=10) as c, pytest.raises(TooLarge):
        c.load_weights("w", np.zeros((2, 1024, 4096), np.float32))  # 32 MB


def test_body_until_close_interim_answers_and_reason():
    def until_close(conn):
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n"
                     b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"status\": ")
        time.sleep(0.05)
        conn.sendall(b"\"live\"}")
        conn.shutdown(socket.SHUT_WR)
        time.sleep(0.1)

    with Client(_raw_server(until_close), timeout=10) as c:
        assert c.live() == {"status": "live"}
        assert not c._lane._idle  # a body ended by the close is never pooled

    def bare_502(conn):
        conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
        time.sleep(0.1)

    with Client(_raw_server(bare_502), timeout=10) as c, pytest.raises(APIError) as info:
        c.live()
    assert "Bad Gateway" in str(info.value)


def test_headers_are_checked_and_per_call_ones_win(server):
    url, _ = server
    # A header or token that HTTP cannot carry as given is refused when the client is made.
    for bad in ({"token": "abc\r\nX-Injected: 1"}, {"token": "abc "}, {"token": ""},
                {"headers": {"X-Extra": "caf\u00e9"}}, {"headers": {"X Extra": "1"}},
                {"headers": {"X-Extra": "1\r\nX-Injected: 1"}}):
        with pytest.raises(ValueError):
            Client(url, **bad)
    with Client(url, headers={"x-request-id": "fixed"}) as c:
        c.info()
        c.info()  # a second call: the same id, sent once
    (_, _, headers) = _Handler.seen[-1]
    # The client's own X-Request-Id is every call's, sent once (never beside a generated one).
    assert _Handler.ids[-2:] == [["fixed"], ["fixed"]]
    with Client(url) as c:
        c.info()
    (generated,) = _Handler.ids[-1]
    assert generated != "fixed" and len(generated) == 32
    assert "X-Injected" not in headers


def test_pooled_sockets_are_reused_past_1024_descriptors(server):
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"needs 1200 file descriptors, the limit is {soft}")
    url, _ = server
    held = [socket.socket() for _ in range(1100)]
    try:
        with Client(url) as c:
            peers = {c.info()["peer"] for _ in range(3)}
            assert c._lane._idle[0].fileno() >= 1024
        assert len(peers) == 1
    finally:
        for s in held:
            s.close()


# -- the asyncio lane (AsyncClient) -----------------------------------------------------


def _run(coro):
    import asyncio

    return asyncio.run(coro)


def test_async_lane_keep_alive_and_close_answers(server):
    from moegemm.client import AsyncClient

    url, _ = server

    async def scenario():
        async with AsyncClient(url, token="t0k") as c:
            assert c._lane is not None
            a, b = await c.info(), await c.info()
            return a, b, len(c._lane._idle)

    a, b, idle = _run(scenario())
    assert a["peer"] == b["peer"] and idle == 1
    assert _Handler.seen[0][2]["Authorization"] == "Bearer t0k"


def test_async_lane_replaces_a_socket_the_server_closed():
    from moegemm.client import AsyncClient

    url, requests = _closing_server()

    async def scenario():
        import asyncio

        async with AsyncClient(url, timeout=5) as c:
            first = await c.info()
            await asyncio.sleep(0.3)
            return first, await c.info()

    first, second = _run(scenario())
    assert first["peer"] != second["peer"] and len(requests) == 2


def test_async_lane_replaces_a_socket_closed_while_the_loop_was_blocked():
    """The server closes the idle socket while the event loop runs no callbacks (blocking
    work, or a loop run once per call): the stream has not seen the EOF yet, the socket
    has, and the call goes out on a new connection instead of failing."""
    import asyncio

    from moegemm.client import AsyncClient

    url, requests = _closing_server()
    loop = asyncio.new_event_loop()
    try:
        c = AsyncClient(url, timeout=5)
        first = loop.run_until_complete(c.info())
        time.sleep(0.3)  # the server closes the connection; this loop is not running
        second = loop.run_until_complete(c.info())
        loop.run_until_complete(c.close())
    finally:
        loop.close()
    assert first["peer"] != second["peer"] and len(requests) == 2


def test_async_client_serves_one_event_loop_after_another(server):
    """Sockets pooled under one ``asyncio.run`` belong to its loop, closed after it: the
    next loop opens its own instead of failing with 'Event loop is closed'."""
    from moegemm.client import AsyncClient

    url, _ = server
    c = AsyncClient(url, timeout=5)
    peers = [_run(c.info())["peer"] for _ in range(3)]
    _run(c.close())
    assert len(set(peers)) == 3


def test_async_lane_early_answer_interim_and_until_close():
    from moegemm.client import AsyncClient, TooLarge

    body = b'{"error": {"code": "too_large", "message": "over 1 MiB"}}'

    def early(conn):
        conn.sendall(b"HTTP/1.1 413 Content Too Large\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)

    def until_close(conn):
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"
                     b"content-type: application/json\r\n\r\n{\"status\": \"live\"}")
        conn.shutdown(socket.SHUT_WR)
        time.sleep(0.1)

    async def scenario():
        async with AsyncClient(_raw_server(early), timeout=10) as c:
            with pytest.raises(TooLarge):
                await c.load_weights("w", np.zeros((2, 1024, 4096), np.float32))
        async with AsyncClient(_raw_server(until_close), timeout=10) as c:
            return await c.live()

    assert _run(scenario()) == {"status": "live"}


def test_async_lane_failures_map_to_the_error_tree():
    from moegemm.client import AsyncClient

    async def scenario():
        async with AsyncClient(_one_shot(b"HTTP/1.1 2OO OK\r\n\r\n"), timeout=5) as c:
            with pytest.raises(TransportError):
                await c.live()
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        try:
            url = f"http://127.0.0.1:{listener.getsockname()[1]}"
            async with AsyncClient(url, timeout=30) as c:
                started = time.monotonic()
                with pytest.raises(DeadlineExceeded):
                    await c.grouped_gemm("demo", np.zeros((1, 128), np.float32), [1],
                                         deadline=0.3)
                assert time.monotonic() - started < 2
        finally:
            listener.close()

    _run(scenario())


def _trailing_server(body: bytes, trailing: bytes) -> tuple[str, list]:
    """Answers every request with ``body``; each connection's first answer is
    followed, in the same write, by ``trailing`` bytes nobody asked for. Returns the
    URL and the client ports of the connections made."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    peers = []
    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
              b"content-length: %d\r\n\r\n" % len(body) + body)

    def serve_one(conn, peer):
        with conn, contextlib.suppress(ConnectionError):
            peers.append(peer[1])
            first = True
            while True:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    head += chunk
                conn.sendall(answer + trailing if first else answer)
                first = False

    def serve():
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve_one, args=(conn, peer), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", peers


_TRAILING = {
    "junk": b"xyz",
    "a second answer": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
}
_BODIES = {"empty": b"", "small": b"0123456789", "large": bytes(range(256)) * 1024}


@pytest.mark.parametrize("trailing", list(_TRAILING))
@pytest.mark.parametrize("size", list(_BODIES))
def test_bytes_after_a_whole_answer_close_the_socket(size, trailing):
    """Bytes that arrive with a complete answer put the socket out of step with its
    requests: the answer is returned, the socket is closed, never pooled, and the
    next call goes out on a new connection."""
    body = _BODIES[size]
    url, peers = _trailing_server(body, _TRAILING[trailing])
    with Client(url, timeout=5) as c:
        for call in range(3):
            got = c._lane.request("GET", "/x", {}, None, httpx.Timeout(5))
            assert got.status_code == 200 and bytes(got.content) == body
            assert not c._lane._idle, call  # closed, not pooled
    assert len(peers) == 3


@pytest.mark.parametrize("trailing", list(_TRAILING))
@pytest.mark.parametrize("size", list(_BODIES))
def test_async_bytes_after_a_whole_answer_close_the_socket(size, trailing):
    from moegemm.client import AsyncClient

    body = _BODIES[size]
    url, peers = _trailing_server(body, _TRAILING[trailing])

    async def scenario():
        async with AsyncClient(url, timeout=5) as c:
            for call in range(3):
                got = await c._lane.request("GET", "/x", {}, None, httpx.Timeout(5))
                assert got.status_code == 200 and bytes(got.content) == body
                assert not c._lane._idle, call

    _run(scenario())
    assert len(peers) == 3


def test_async_lane_past_its_deadline_begins_nothing():
    """A deadline that passes between the client's check and a step of the lane
    (a busy loop, many calls) raises at that step before the step's coroutine is
    made: no connection begun, no write or read left never awaited (the soak run's
    "coroutine 'open_connection' was never awaited")."""
    import gc
    import warnings

    from moegemm.client._lane import AsyncLane

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    async def scenario():
        lane = AsyncLane(url, {})
        timeout = httpx.Timeout(5)
        with pytest.raises(httpx.TimeoutException):
            await lane._connect(timeout, time.monotonic() - 1)
        reader, writer = await lane._connect(timeout, None)
        try:
            with pytest.raises(httpx.TimeoutException):
                await lane._send(writer, b"GET / HTTP/1.1\r\n\r\n", [], timeout,
                                 time.monotonic() - 1)
            with pytest.raises(httpx.TimeoutException):
                await lane._receive(reader, timeout, time.monotonic() - 1, None)
        finally:
            writer.close()

    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _run(scenario())
            gc.collect()
    finally:
        listener.close()
    assert [str(w.message) for w in seen if "never awaited" in str(w.message)] == []
