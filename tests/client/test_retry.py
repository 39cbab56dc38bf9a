"""Client retries (503 and refused connections, with backoff) and deadlines."""

import asyncio
import socket
import threading
import time

import httpx
import ml_dtypes
import moegemm.client as mc
import numpy as np
import pytest
from moegemm.client import AsyncClient, Client
from moegemm.client._wire import encode_tensor, packb

URL = "http://moegemm.test:8000"


def _ok_gemm(request: httpx.Request) -> httpx.Response:
    out = np.random.randn(2, 128).astype(ml_dtypes.bfloat16)
    return httpx.Response(200, content=packb({"out": encode_tensor(out)}),
                          headers={"content-type": "application/vnd.msgpack"})


def _error(status, code, retry_after=None):
    def reply(request):
        headers = {} if retry_after is None else {"retry-after": str(retry_after)}
        return httpx.Response(status, json={"error": {"code": code, "message": code}},
                              headers=headers)

    return reply


class Script:
    """Answers each request with the next reply of a list (the last one repeats)."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.requests: list[httpx.Request] = []
        self.times: list[float] = []

    def __call__(self, request):
        self.requests.append(request)
        self.times.append(time.monotonic())
        reply = self.replies[min(len(self.requests), len(self.replies)) - 1]
        return reply(request)


def _client(script, **kw) -> Client:
    return Client(URL, transport=httpx.MockTransport(script), **kw)


def _gemm(c, **kw):
    x = np.random.randn(2, 128).astype(np.float32)
    return c.grouped_gemm("w", x, [2], **kw)


def test_503_is_retried_until_it_succeeds():
    script = Script(_error(503, "overloaded", 0.01), _error(503, "not_ready"), _ok_gemm)
    with Client(URL, transport=httpx.MockTransport(script), retries=3, backoff=0.001) as c:
        out = _gemm(c)
    assert out.shape == (2, 128)
    assert len(script.requests) == 3
    ids = [r.headers["x-request-id"] for r in script.requests]
    assert len(set(ids)) == 3  # each attempt is its own request


def test_retries_run_out_and_raise_the_last_answer():
    script = Script(_error(503, "overloaded", 0.01))
    with _client(script, retries=2, backoff=0.001) as c, pytest.raises(mc.Overloaded) as info:
        _gemm(c)
    assert len(script.requests) == 3
    assert info.value.retry_after == 0.01
    assert info.value.request_id == script.requests[-1].headers["x-request-id"]


def test_no_retries_by_default():
    script = Script(_error(503, "overloaded", 0.01), _ok_gemm)
    with Client(URL, transport=httpx.MockTransport(script)) as c, pytest.raises(mc.Overloaded):
        _gemm(c)
    assert len(script.requests) == 1


@pytest.mark.parametrize(("status", "code", "cls"), [
    (400, "bad_shape", mc.BadShape),
    (404, "no_such_weights", mc.NoSuchWeights),
    (500, "internal", mc.InternalError),
    (504, "timeout", mc.DeadlineExceeded),
    (507, "out_of_memory", mc.OutOfMemory),
])
def test_other_errors_are_not_retried(status, code, cls):
    script = Script(_error(status, code), _ok_gemm)
    with _client(script, retries=3, backoff=0.001) as c, pytest.raises(cls):
        _gemm(c)
    assert len(script.requests) == 1


def test_retry_after_is_a_floor_and_backoff_grows():
    script = Script(_error(503, "overloaded", 0.15), _error(503, "overloaded", 0.15), _ok_gemm)
    with Client(URL, transport=httpx.MockTransport(script), retries=2, backoff=0.001) as c:
        _gemm(c)
    gaps = np.diff(script.times)
    assert (gaps >= 0.15).all(), gaps

    script = Script(*[_error(503, "not_ready")] * 4, _ok_gemm)
    with Client(URL, transport=httpx.MockTransport(script), retries=4, backoff=0.04,
                max_backoff=0.1) as c:
        _gemm(c)
    gaps = np.diff(script.times)
    # Jitter draws each wait from [half, all] of 0.04, 0.08, 0.1 (capped), 0.1.
    assert gaps[0] >= 0.02 and gaps[1] >= 0.04 and gaps[3] >= 0.05, gaps
    assert gaps.max() < 0.5, gaps


def test_refused_connection_is_retried_but_a_lost_answer_is_not():
    def refused(request):
        raise httpx.ConnectError("refused", request=request)

    def lost(request):
        raise httpx.ReadError("reset", request=request)

    script = Script(refused, refused, _ok_gemm)
    with Client(URL, transport=httpx.MockTransport(script), retries=2, backoff=0.001) as c:
        _gemm(c)
    assert len(script.requests) == 3

    script = Script(lost, _ok_gemm)
    with _client(script, retries=2, backoff=0.001) as c, pytest.raises(mc.TransportError) as info:
        _gemm(c)
    assert isinstance(info.value.__cause__, httpx.ReadError)
    assert len(script.requests) == 1


def test_health_reports_not_ready_at_once():
    script = Script(_error(503, "not_ready", 0.01))
    with _client(script, retries=3, backoff=0.001) as c, pytest.raises(mc.NotReady):
        c.health()
    assert len(script.requests) == 1
    # Weight endpoints do retry a server that is still starting.
    script = Script(_error(503, "not_ready", 0.01), lambda r: httpx.Response(200, json=[]))
    with Client(URL, transport=httpx.MockTransport(script), retries=3, backoff=0.001) as c:
        assert c.weights() == []
    assert len(script.requests) == 2


def test_deadline_is_sent_and_caps_the_timeout():
    script = Script(_ok_gemm)
    with Client(URL, transport=httpx.MockTransport(script), timeout=60) as c:
        _gemm(c, deadline=2.5)
        _gemm(c)
    with_deadline, without = script.requests
    ms = int(with_deadline.headers["x-deadline-ms"])
    assert 2000 < ms <= 2500
    assert all(0 < t <= 2.5 for t in with_deadline.extensions["timeout"].values())
    assert "x-deadline-ms" not in without.headers
    assert without.extensions["timeout"]["read"] == 60


def _loaded(request: httpx.Request) -> httpx.Response:
    return httpx.Response(201, json={"name": "w"})


def _load_everything(c):
    """Each load call once (weights, weights from a file, experts, experts from a checkpoint), then
    a call that is not a load."""
    w = np.ones((2, 128, 128), np.float32)
    c.load_weights("w", w)
    c.load_weights_file("w", "w.safetensors", "weight")
    c.load_experts("e", np.ones((2, 256, 128), np.float32), np.ones((2, 128, 128), np.float32))
    c.load_experts_checkpoint("e", "model", 3)
    c.weights()


def test_loads_wait_for_the_load_timeout_and_calls_for_the_timeout():
    """A load answers once the server has compiled and captured what serves the set (over a
    minute for an expert set on a busy fresh GPU): the four load calls read for ``load_timeout``
    (600 s unless set), every other call for ``timeout``; a deadline caps both."""
    script = Script(_loaded, _loaded, _loaded, _loaded, lambda r: httpx.Response(200, json=[]))
    with Client(URL, transport=httpx.MockTransport(script), timeout=60) as c:
        _load_everything(c)
    *loads, listing = script.requests
    assert [r.method for r in loads] == ["PUT"] * 4
    assert all(r.extensions["timeout"]["read"] == 600 for r in loads)
    assert all(r.extensions["timeout"]["connect"] == 5 for r in loads)
    assert listing.extensions["timeout"]["read"] == 60
    script = Script(_loaded, _loaded, _loaded, _loaded, lambda r: httpx.Response(200, json=[]))
    with Client(URL, transport=httpx.MockTransport(script), timeout=2, load_timeout=90,
                deadline=30) as c:
        _load_everything(c)
    *loads, listing = script.requests
    assert all(r.extensions["timeout"]["read"] == 90 for r in loads)
    assert 0 < listing.extensions["timeout"]["read"] <= 2

    async def main():
        script = Script(_loaded, _loaded, lambda r: httpx.Response(200, json=[]))
        async with AsyncClient(URL, transport=httpx.MockTransport(script), load_timeout=120) as c:
            w = np.ones((2, 128, 128), np.float32)
            await c.load_weights("w", w)
            await c.load_experts("e", np.ones((2, 256, 128), np.float32), w)
            await c.weights()
        load_w, load_e, listing = script.requests
        assert load_w.extensions["timeout"]["read"] == load_e.extensions["timeout"]["read"] == 120
        assert listing.extensions["timeout"]["read"] == 60

    asyncio.run(main())


def test_client_default_deadline_and_per_call_override():
    script = Script(_ok_gemm)
    with Client(URL, transport=httpx.MockTransport(script), deadline=0.8) as c:
        _gemm(c)
        _gemm(c, deadline=5)
    first, second = (int(r.headers["x-deadline-ms"]) for r in script.requests)
    assert 500 < first <= 800 and 4000 < second <= 5000


def test_a_deadline_stops_retries_that_could_not_finish_in_time():
    script = Script(_error(503, "overloaded", 5), _ok_gemm)
    started = time.monotonic()
    with _client(script, retries=3) as c, pytest.raises(mc.Overloaded):
        _gemm(c, deadline=1.0)
    assert time.monotonic() - started < 1.0
    assert len(script.requests) == 1


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan")])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        Client(URL, deadline=bad)
    with Client(URL, transport=httpx.MockTransport(_ok_gemm)) as c, pytest.raises(ValueError):
        _gemm(c, deadline=bad)
    with pytest.raises(ValueError):
        Client(URL, retries=-1)


@pytest.fixture
def silent_server():
    """A socket that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    accepted = []
    stop = threading.Event()

    def accept():
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in accepted:
        conn.close()
    sock.close()


def test_the_client_never_waits_past_its_deadline(silent_server):
    started = time.monotonic()
    with Client(silent_server, timeout=30) as c, pytest.raises(mc.DeadlineExceeded) as info:
        _gemm(c, deadline=0.3)
    assert 0.25 < time.monotonic() - started < 3
    assert info.value.status == 504 and info.value.code == "timeout"
    # Without a deadline the same silence is a transport timeout.
    with Client(silent_server, timeout=0.2) as c, pytest.raises(mc.TransportError):
        _gemm(c)


def test_async_client_retries_and_honours_deadlines(silent_server):
    script = Script(_error(503, "overloaded", 0.01), _ok_gemm)

    async def main():
        async with AsyncClient(URL, transport=httpx.MockTransport(script), retries=1,
                               backoff=0.001) as c:
            out = await c.grouped_gemm("w", np.ones((2, 128), np.float32), [2], deadline=3)
            assert out.shape == (2, 128)
        async with AsyncClient(silent_server, timeout=30) as c:
            started = time.monotonic()
            with pytest.raises(mc.DeadlineExceeded):
                await c.grouped_gemm("w", np.ones((2, 128), np.float32), [2], deadline=0.3)
            assert time.monotonic() - started < 3

    asyncio.run(main())
    assert len(script.requests) == 2
    assert 0 < int(script.requests[-1].headers["x-deadline-ms"]) <= 3000


def _trickling_server() -> tuple[socket.socket, threading.Event]:
    """Answers one call with headers at once, then one body byte every 0.1 s."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    done = threading.Event()

    def serve():
        conn, _ = listener.accept()
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.msgpack\r\n"
                         b"content-length: 100\r\n\r\n")
            for _ in range(100):
                if done.wait(0.1):
                    return
                try:
                    conn.sendall(b"\x00")
                except OSError:
                    return

    threading.Thread(target=serve, daemon=True).start()
    return listener, done


def test_a_trickling_answer_cannot_outlast_the_deadline():
    listener, done = _trickling_server()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    start = time.monotonic()
    try:
        with mc.Client(url, timeout=30) as c, pytest.raises(mc.DeadlineExceeded):
            c.grouped_gemm("w", np.ones((2, 128), np.float32), [2], deadline=0.3)
    finally:
        done.set()
        listener.close()
    assert time.monotonic() - start < 2


def test_a_trickling_answer_cannot_outlast_the_deadline_async():
    listener, done = _trickling_server()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    async def call():
        async with mc.AsyncClient(url, timeout=30) as c:
            with pytest.raises(mc.DeadlineExceeded):
                await c.grouped_gemm("w", np.ones((2, 128), np.float32), [2], deadline=0.3)

    start = time.monotonic()
    try:
        asyncio.run(call())
    finally:
        done.set()
        listener.close()
    assert time.monotonic() - start < 2


@pytest.mark.timeout(30)  # the code before slept the day
@pytest.mark.parametrize("hint", ["86400", "inf", "nan", "-5"])
def test_a_retry_after_past_max_backoff_or_not_a_time_never_sleeps_on_it(hint):
    """A review: a proxy's `Retry-After: 86400` made a retrying call sleep a day, and `inf`
    raised OverflowError from time.sleep, outside the client's errors. A hint past
    max_backoff ends the retries with the 503 and its hint; one that is no time is ignored."""
    script = Script(_error(503, "overloaded", hint))
    started = time.monotonic()
    with _client(script, retries=2, backoff=0.001, max_backoff=0.01) as c, \
            pytest.raises(mc.Overloaded) as info:
        _gemm(c)
    assert time.monotonic() - started < 5
    if hint == "86400":
        assert len(script.requests) == 1 and info.value.retry_after == 86400
    else:
        assert len(script.requests) == 3 and info.value.retry_after is None
