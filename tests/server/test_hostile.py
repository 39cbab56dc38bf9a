"""Hostile clients against every transport: the fast one, the acceptors, uvicorn.

One fixture, ``target``, runs each test on the three (as uvicorn's own tests run
every protocol case on each implementation): ``fast`` (``moegemm serve
--acceptors 0``, its own process), ``acceptors`` (``moegemm serve --acceptors 1``,
connections taken on the acceptor where a test needs one) and ``uvicorn``
(httptools in a thread here, as the benchmarks' peer runs it). The
catalogue: request smuggling and framing shapes, slowloris heads and bodies,
1000 idle keep-alive connections, clients that pipeline and never read, huge
declared bodies without a token, 1-byte chunks. Ours must be at least as strict as uvicorn (every framing case is
refused by each), keep memory bounded, keep health probes under 50 ms p99
while the attacks run, and log no traceback for any of it.

Short timeouts keep the module cheap (MOEGEMM_HTTP_KEEP_ALIVE_S and
MOEGEMM_HTTP_HEAD_TIMEOUT_S of 1 s; uvicorn's keep-alive the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import typing
import weakref
from pathlib import Path

import pytest
import torch
import uvicorn
from moegemm.client._wire import encode_tensor, packb
from moegemm.server import Settings, create_app
from moegemm.server._direct import DirectCalls
from moegemm.server._http import FastHttpServer
from server_support import _free_port, metric_sum

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="SO_REUSEPORT and /proc: Linux only")

TOKEN, ADMIN = "hostile-token", "hostile-admin"
TIMEOUT_S = 1.0  # keep-alive and head timeouts of the servers here
MAX_CONNECTIONS = 1500
ROWS = 512  # a gemm call of the pipeline test: a 512 KiB body, a 256 KiB answer
STATUS = re.compile(rb"^HTTP/1\.[01] (\d{3}) ")
AUTH = f"authorization: Bearer {TOKEN}\r\n"
MSGPACK = "content-type: application/vnd.msgpack\r\n"


BODY_LIMIT, INFLIGHT_LIMIT = 4 << 20, 10 << 20


def _settings(**extra) -> Settings:
    return Settings(**{"device": "cpu", "demo": True, "token": TOKEN, "admin_token": ADMIN,
                       "max_m": 1024, "max_body_bytes": BODY_LIMIT,
                       "max_inflight_bytes": INFLIGHT_LIMIT, "http_keep_alive_s": TIMEOUT_S,
                       "http_head_timeout_s": TIMEOUT_S,
                       "http_max_connections": MAX_CONNECTIONS, **extra})


def _rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) << 10
    return total


class _Tracebacks(logging.Handler):
    """Records logged with a traceback, from any thread of this process."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "Traceback" in record.getMessage():
            self.seen.append(self.format(record))


class Target:
    """A running server under attack: where it listens, its processes, its log."""

    kind = ""
    port = 0

    def pids(self) -> list[int]:
        return [os.getpid()]

    def tracebacks(self) -> list[str]:
        raise NotImplementedError

    def connect(self, timeout: float = 10, on: int | None = None) -> socket.socket:
        """A connection to the server (for ``acceptors``: one an acceptor holds, the
        acceptor ``on`` when given)."""
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def holder(self, sock: socket.socket) -> int:
        return os.getpid()


class _Uvicorn(Target):
    """uvicorn with httptools (the benchmarks' peer), in a thread of this process."""

    kind = "uvicorn"

    def __init__(self) -> None:
        self.port = _free_port()
        self.app = create_app(_settings())
        self.loop = asyncio.new_event_loop()
        self.handler = _Tracebacks()
        logging.getLogger().addHandler(self.handler)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, http="httptools",
                                log_level="warning", lifespan="on",
                                timeout_keep_alive=TIMEOUT_S)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=lambda: self.loop.run_until_complete(self.server.serve()), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        logging.getLogger().removeHandler(self.handler)

    def tracebacks(self) -> list[str]:
        return list(self.handler.seen)


class _Served(Target):
    """``moegemm serve`` as shipped, its own process: ``fast`` with no acceptors (the
    server's loop takes every connection), ``acceptors`` with one. Not a thread of this
    process: the probes time the server, not this process's GIL shared with the attackers
    (in a thread, the GIL's 5 ms hand-offs between server, attacker and probe were most of
    the probe's p99 on a 2-core box)."""

    def __init__(self, kind: str, log_path: Path) -> None:
        self.kind = kind
        self.acceptors = 1 if kind == "acceptors" else 0
        self.port = _free_port()
        env = {**os.environ, "MOEGEMM_TOKEN": TOKEN, "MOEGEMM_ADMIN_TOKEN": ADMIN,
               "MOEGEMM_HTTP_KEEP_ALIVE_S": str(TIMEOUT_S),
               "MOEGEMM_HTTP_HEAD_TIMEOUT_S": str(TIMEOUT_S),
               "MOEGEMM_HTTP_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
               "MOEGEMM_OWNER_CONNECTIONS": "0", "MOEGEMM_MAX_M": "1024",
               "MOEGEMM_MAX_BODY_BYTES": str(BODY_LIMIT),
               "MOEGEMM_MAX_INFLIGHT_BYTES": str(INFLIGHT_LIMIT)}
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 -- open while the server runs
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moegemm.cli", "serve", "--device", "cpu", "--demo",
             "--acceptors", str(self.acceptors), "--port", str(self.port),
             "--log-level", "info"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def children(self) -> list[int]:
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    spawned = b"spawn_main" in f.read()
            except OSError:
                continue
            if ppid == self.process.pid and spawned:
                out.append(int(entry))
        return out

    def pids(self) -> list[int]:
        return [self.process.pid, *self.children()]

    def listening(self) -> bool:
        local = f":{self.port:04X}"
        with open("/proc/net/tcp") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        return sum(1 for r in rows if r[1].endswith(local) and r[3] == "0A") == 1 + self.acceptors

    def connect(self, timeout: float = 10, on: int | None = None) -> socket.socket:
        if not self.acceptors:
            return super().connect(timeout)
        acceptors = set(self.children()) if on is None else {on}
        for _ in range(200):
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
            if self.holder(sock) in acceptors:
                return sock
            sock.close()
        raise AssertionError("no connection reached an acceptor")

    def holder(self, sock: socket.socket) -> int | None:
        local, remote = f":{self.port:04X}", f":{sock.getsockname()[1]:04X}"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with open("/proc/net/tcp") as f:
                rows = [line.split() for line in f.readlines()[1:]]
            inodes = [r[9] for r in rows if r[1].endswith(local) and r[2].endswith(remote)
                      and r[9] != "0"]
            for pid in self.pids():
                with contextlib.suppress(OSError):
                    for fd in os.listdir(f"/proc/{pid}/fd"):
                        with contextlib.suppress(OSError):
                            if os.readlink(f"/proc/{pid}/fd/{fd}") in (
                                    f"socket:[{i}]" for i in inodes):
                                return pid
            time.sleep(0.01)
        return None

    def tracebacks(self) -> list[str]:
        self.log.flush()
        text = self.log_path.read_text(errors="replace")
        return [block for block in text.split("\n20") if "Traceback" in block]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()


def _wait_ready(target: Target, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            status, _, _ = _exchange(target.port, b"GET /v1/health/ready HTTP/1.1\r\nhost: x\r\n\r\n")
            ok = status == 200 and (not isinstance(target, _Served) or target.listening())
            if ok:
                return
        time.sleep(0.05)
    raise TimeoutError(f"the {target.kind} server did not become ready")


@pytest.fixture(scope="module", params=["fast", "acceptors", "uvicorn"])
def target(request, tmp_path_factory):
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 4096:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    if request.param == "uvicorn":
        running: Target = _Uvicorn()
    else:
        running = _Served(request.param, tmp_path_factory.mktemp(request.param) / "server.log")
    try:
        _wait_ready(running)
        yield running
        assert running.tracebacks() == [], "a client error logged a traceback"
    finally:
        running.close()


# -- raw HTTP ---------------------------------------------------------------------------


def _read(sock: socket.socket, timeout: float = 5) -> bytes:
    """Everything until the server closes (or ``timeout`` passes)."""
    sock.settimeout(timeout)
    got = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := sock.recv(1 << 16):
            got += chunk
    return got


# Bytes read past an answer on a socket: the next pipelined answer's start, for the next read.
_AHEAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _answer(sock: socket.socket, timeout: float = 10) -> tuple[int, dict, bytes]:
    """One answer read off ``sock``: status, headers, body (by Content-Length). Where requests
    were pipelined, one read may take the next answer's bytes too: they must start an answer,
    and the next call on ``sock`` reads them first."""
    sock.settimeout(timeout)
    got = _AHEAD.pop(sock, b"")
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError(f"closed before an answer: {got[:200]!r}")
        got += chunk
    head, _, rest = got.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(b":")
        headers[key.strip().lower()] = value.strip()
    length = int(headers.get(b"content-length", b"0"))
    while len(rest) < length:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        rest += chunk
    assert len(rest) >= length, "the connection closed inside an answer"
    if len(rest) > length:
        assert rest[length:].startswith(b"HTTP/1.1 "), f"bytes after an answer: {rest[length:][:80]!r}"
        _AHEAD[sock] = rest[length:]
    return int(lines[0].split()[1]), headers, rest[:length]


def _exchange(port: int, data: bytes) -> tuple[int, dict, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        return _answer(sock)


def _body(rows: int, seed: int = 0) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 512, generator=gen).to(torch.bfloat16)
    m = torch.zeros(8, dtype=torch.int64)
    m[0] = rows
    return packb({"x": encode_tensor(x), "m_sizes": encode_tensor(m)})


def _gemm(body: bytes, extra: str = AUTH) -> bytes:
    return (f"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\n{MSGPACK}{extra}"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def _metric(target: Target, status: str | None, endpoint: str = "/v1/weights/{name}/gemm",
            name: str = "moegemm_requests_total") -> float:
    """``name`` (moegemm_requests_total) for ``endpoint`` (the gemm route) and ``status``
    (None: a metric without one, such as moegemm_request_seconds_count)."""
    _, _, text = _exchange(target.port, f"GET /metrics HTTP/1.1\r\nhost: x\r\n{AUTH}\r\n".encode())
    labels = {"endpoint": endpoint} if status is None else {"endpoint": endpoint, "status": status}
    return metric_sum(text.decode(), name, **labels)


def test_a_request_refused_from_its_head_is_counted_and_timed(target):
    """SPEC 2.3's request count and total-time histogram both take a request the transport
    refuses itself (here 415, the wrong media type)."""
    before = (_metric(target, "415"), _metric(target, None, name="moegemm_request_seconds_count"))
    status, _, _ = _exchange(target.port, b"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\n"
                             b"content-type: text/plain\r\n" + AUTH.encode() + b"content-length: 1\r\n\r\n" + _TINY)
    assert status == 415
    deadline = time.monotonic() + 5  # an acceptor's report reaches the owner a moment later
    while (after := (_metric(target, "415"), _metric(target, None, name="moegemm_request_seconds_count"))) \
            != (before[0] + 1, before[1] + 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after == (before[0] + 1, before[1] + 1)


class _Probe:
    """Health probes on one keep-alive connection, timed, while an attack runs."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.times: list[float] = []
        self.failures: list[str] = []
        self.done, self.warm = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        sock = None
        while not self.done.is_set():
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", self.target.port), timeout=5)
                started = time.perf_counter()
                sock.sendall(b"GET /v1/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
                status, _, _ = _answer(sock, timeout=5)
                if self.warm.is_set():
                    self.times.append(time.perf_counter() - started)
                self.warm.set()  # the first one (connecting) is not timed
                if status != 200:
                    self.failures.append(str(status))
            except OSError as exc:
                self.failures.append(repr(exc))
                sock = None
            time.sleep(0.002)
        if sock is not None:
            sock.close()

    def __enter__(self) -> typing.Self:
        # This process's heap (hypothesis, tensors of earlier modules) is not the
        # server's: frozen, its collections do not stall the probes (measured:
        # 180-230 ms pauses of the third generation after the fuzz modules).
        gc.collect()
        gc.freeze()
        self.thread.start()
        assert self.warm.wait(10), "no health probe answered"
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(10)
        gc.unfreeze()

    def p99(self) -> float:
        times = sorted(self.times)
        return times[min(len(times) - 1, int(len(times) * 0.99))]


# -- the framing catalogue ------------------------------------------------------------

_TINY = b"\x80"  # an empty msgpack map: a bad gemm body, but well framed
_BASE = f"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\n{MSGPACK}{AUTH}".encode()
_CHUNKED = _BASE + b"transfer-encoding: chunked\r\n\r\n"
# Behind each, a request a lenient parser would see as a second one (the smuggled one).
_SMUGGLED = b"GET /v1/info HTTP/1.1\r\nhost: x\r\n\r\n"

FRAMING = {
    # A bare LF keeps the Content-Length inside the previous header's value.
    "bare LF": _BASE + b"x-a: 1\ncontent-length: 1\r\n\r\n" + _TINY,
    "bare LF ending the head": _BASE + b"content-length: 1\n\n" + _TINY,
    "xchunked": _BASE + b"transfer-encoding: xchunked\r\n\r\n1\r\n\x80\r\n0\r\n\r\n",
    "gzip": _BASE + b"transfer-encoding: gzip\r\n\r\n1\r\n\x80\r\n0\r\n\r\n",
    "gzip, chunked": _BASE + b"transfer-encoding: gzip, chunked\r\n\r\n1\r\n\x80\r\n0\r\n\r\n",
    "chunked, identity": _BASE + b"transfer-encoding: chunked, identity\r\n\r\n1\r\n\x80\r\n0"
                                 b"\r\n\r\n",
    "two transfer-encodings": _BASE + b"transfer-encoding: chunked\r\ntransfer-encoding: "
                                      b"chunked\r\n\r\n1\r\n\x80\r\n0\r\n\r\n",
    "chunk size +1": _CHUNKED + b"+1\r\n\x80\r\n0\r\n\r\n",
    "chunk size 0x1": _CHUNKED + b"0x1\r\n\x80\r\n0\r\n\r\n",
    "chunk size 0_1": _CHUNKED + b"0_1\r\n\x80\r\n0\r\n\r\n",
    "chunk size -1": _CHUNKED + b"-1\r\n\x80\r\n0\r\n\r\n",
    "chunk size with space": _CHUNKED + b"1 \r\n\x80\r\n0\r\n\r\n",
    "chunk without CRLF": _CHUNKED + b"1\r\n\x80XX0\r\n\r\n",
    "CR in a value": _BASE + b"x-a: 1\r2\r\ncontent-length: 1\r\n\r\n" + _TINY,
    "NUL in a value": _BASE + b"x-a: 1\x002\r\ncontent-length: 1\r\n\r\n" + _TINY,
    "NUL in a name": _BASE + b"x\x00a: 1\r\ncontent-length: 1\r\n\r\n" + _TINY,
    "space in a name": _BASE + b"x a: 1\r\ncontent-length: 1\r\n\r\n" + _TINY,
    "space before the colon": _BASE + b"content-length : 1\r\n\r\n" + _TINY,
    "obs-fold": _BASE + b"x-a: 1\r\n 2\r\ncontent-length: 1\r\n\r\n" + _TINY,
    "two equal lengths": _BASE + b"content-length: 1\r\ncontent-length: 1\r\n\r\n" + _TINY,
    "two lengths": _BASE + b"content-length: 1\r\ncontent-length: 2\r\n\r\n" + _TINY + b"x",
    "length list": _BASE + b"content-length: 1, 1\r\n\r\n" + _TINY,
    "signed length": _BASE + b"content-length: +1\r\n\r\n" + _TINY,
    "length and chunked": _BASE + b"content-length: 6\r\ntransfer-encoding: chunked\r\n\r\n"
                                  b"1\r\n\x80\r\n0\r\n\r\n",
    "HTTP/1.0 chunked": _BASE.replace(b"HTTP/1.1", b"HTTP/1.0") + b"transfer-encoding: "
                                                                 b"chunked\r\n\r\n1\r\n\x80\r\n"
                                                                 b"0\r\n\r\n",
    "HTTP/0.9": b"GET /v1/health/live\r\n\r\n",
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "garbage": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n",
}


# What uvicorn serves where ours refuses (ours is the stricter there).
UVICORN_SERVES = {"HTTP/0.9"}
# What uvicorn reads as plain chunked where ours refuses the coding it does not decode: it
# answers the body (here a bad gemm body, 400) and the request behind it.
UVICORN_CHUNKED = {"gzip, chunked"}


@pytest.mark.parametrize("case", list(FRAMING))
def test_framing_is_refused(target, case):
    with target.connect() as sock:
        sock.sendall(FRAMING[case] + _SMUGGLED)
        got = _read(sock)
    if target.kind == "uvicorn" and case in UVICORN_SERVES:
        assert got.startswith(b"HTTP/1.1 200 ")
        return
    if target.kind == "uvicorn" and case in UVICORN_CHUNKED:
        assert got.startswith(b"HTTP/1.1 400 ") and b'"bad_field"' in got, got[:400]
        return
    # A 4xx answer (ours: 400 bad_field) and a close, or a close alone; never an
    # answer to the smuggled request.
    statuses = [int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3}) ", got)]
    assert len(statuses) <= 1, got[:400]
    if statuses:
        assert 400 <= statuses[0] < 500, got[:400]
    if target.kind != "uvicorn":
        assert statuses == [400] and b'"bad_field"' in got, got[:400]


def test_an_oversized_head_is_too_large(target):
    head = _BASE + b"x-big: " + b"a" * (80 << 10) + b"\r\ncontent-length: 1\r\n\r\n" + _TINY
    with target.connect() as sock:
        with contextlib.suppress(OSError):
            sock.sendall(head)
        got = _read(sock)
    if target.kind == "uvicorn":
        pytest.skip("uvicorn takes heads of megabytes")
    assert got.startswith(b"HTTP/1.1 413 ") and b'"too_large"' in got, got[:300]


def test_a_content_length_past_any_number_is_too_large(target):
    with target.connect() as sock:
        sock.sendall(_BASE + b"content-length: 99999999999999999999999\r\n\r\n")
        got = _read(sock)
    if target.kind == "uvicorn":
        pytest.skip("uvicorn answers its own 400")
    assert got.startswith(b"HTTP/1.1 413 ") and b'"too_large"' in got, got[:300]


def test_a_well_framed_call_still_works(target):
    body = _body(4)
    chunks = b"".join(b"%x\r\n" % len(body[i:i + 7]) + body[i:i + 7] + b"\r\n"
                      for i in range(0, len(body), 7))
    with target.connect() as sock:
        sock.sendall(_gemm(body) + _CHUNKED + chunks + b"0\r\n\r\n")
        time.sleep(0.3)  # both answers there: one read takes bytes of each (_answer keeps them)
        assert _answer(sock)[0] == 200
        assert _answer(sock)[0] == 200


# -- HEAD, absolute form, HTTP/1.0 ---------------------------------------------------------


def test_head_answers_have_no_body(target):
    with target.connect() as sock:
        sock.sendall(b"HEAD /v1/health/live HTTP/1.1\r\nhost: x\r\n\r\n"
                     b"GET /v1/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
        sock.settimeout(10)
        got = b""
        deadline = time.monotonic() + 10
        while got.count(b"HTTP/1.1 ") < 2 and time.monotonic() < deadline:
            got += sock.recv(1 << 16)
    first, _, rest = got.partition(b"\r\n\r\n")
    # HEAD is answered as GET is (RFC 9110 9.3.2), and the next bytes after its head are the
    # GET's answer: no body.
    assert first.startswith(b"HTTP/1.1 200 ") and rest.startswith(b"HTTP/1.1 200 "), got[:600]
    get_head = rest.partition(b"\r\n\r\n")[0]
    length = [line for line in get_head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    assert length and length[0] in first.lower().split(b"\r\n"), got[:600]


def test_absolute_form_targets_are_served(target):
    status, _, body = _exchange(
        target.port, b"GET http://example.test/v1/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status == 200 and b"live" in body


def test_http10_keeps_alive_only_when_asked(target):
    with target.connect() as sock:
        sock.sendall(b"GET /v1/health/live HTTP/1.0\r\n\r\n")
        got = _read(sock)
    assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"}"), got  # then closed
    if target.kind == "uvicorn":
        # uvicorn closes every HTTP/1.0 connection, asked or not (it reads llhttp's
        # keep-alive flag once the message is complete, when llhttp has cleared it).
        pytest.skip("uvicorn never keeps HTTP/1.0 alive")
    with target.connect() as sock:
        for _ in range(2):
            sock.sendall(b"GET /v1/health/live HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
            status, headers, _ = _answer(sock)
            assert status == 200
            if target.kind != "uvicorn":
                assert headers[b"connection"] == b"keep-alive"


# -- refused from the head -----------------------------------------------------------------


def test_huge_declared_bodies_without_a_token_are_refused_from_the_head(target):
    before, counted = _rss(target.pids()), _metric(target, "401")
    socks = []
    try:
        for _ in range(12):
            sock = target.connect()
            socks.append(sock)
            sock.sendall(b"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\n"
                         + MSGPACK.encode() + b"content-length: 200000000\r\n\r\n")
            with contextlib.suppress(OSError):
                sock.sendall(b"\0" * (1 << 20))  # some of it, the rest withheld
        for sock in socks:
            status, _, body = _answer(sock, timeout=10)
            assert status == 401 and b'"unauthorized"' in body
    finally:
        for sock in socks:
            sock.close()
    grown = _rss(target.pids()) - before
    assert grown < 32 << 20, f"the server grew by {grown >> 20} MiB"
    # In the request metrics, as the app counts its own 401s on this route.
    deadline = time.monotonic() + 5
    while _metric(target, "401") < counted + 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(target, "401") == counted + 12


@pytest.mark.parametrize("request_line, endpoint", [
    ("POST /v1/weights/demo/gemm", "/v1/weights/{name}/gemm"),
    ("PUT /v1/weights/demo", "/v1/weights/{name}"),
    ("POST /v1/experts/layer/ffn", "/v1/experts/{name}/ffn")])
def test_media_type_and_size_are_judged_from_the_head(target, request_line, endpoint):
    """Refused from the head, and counted in the request metrics under the route's endpoint
    (SPEC 2.3: counts by endpoint and status), as the app counts its own refusals."""
    auth = f"authorization: Bearer {ADMIN}\r\n" if request_line.startswith("PUT") else AUTH
    for extra, status in ((f"content-type: text/plain\r\n{auth}", 415),
                          (f"{MSGPACK}{auth}", 413)):
        counted = _metric(target, str(status), endpoint)
        length = 300 << 20 if status == 413 else 1000
        with target.connect() as sock:
            sock.sendall(f"{request_line} HTTP/1.1\r\nhost: x\r\n{extra}"
                         f"content-length: {length}\r\n\r\n".encode())
            assert _answer(sock)[0] == status
        deadline = time.monotonic() + 5
        while _metric(target, str(status), endpoint) < counted + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(target, str(status), endpoint) == counted + 1


def test_in_flight_bytes_are_judged_before_bodies_are_read(target):
    """Bodies count as their bytes arrive (ours: in the process reading them): the head that
    would take the bodies held past the in-flight limit gets 503 at once. Heads that declare
    bodies and send none hold nothing: they cannot lock the other callers out."""
    size = INFLIGHT_LIMIT // 4
    head = (f"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\n{MSGPACK}{AUTH}"
            f"content-length: {size}\r\n\r\n").encode()
    first = target.connect()
    socks = [first] + [target.connect(on=target.holder(first)) for _ in range(9)]
    try:
        for sock in socks[:4]:  # the whole limit declared, none of it sent
            sock.sendall(head)
        time.sleep(0.2)
        socks[4].sendall(_gemm(_body(4)))
        status, _, body = _answer(socks[4])
        assert status == 200, body[:300]
        for sock in socks[5:9]:  # the limit received, less a byte a body: held
            sock.sendall(head + b"\0" * (size - 1))
        time.sleep(0.5)
        socks[9].sendall(head)
        status, headers, body = _answer(socks[9])
        assert status == 503 and b'"overloaded"' in body and headers[b"retry-after"] == b"1"
    finally:
        for sock in socks:
            sock.close()


def test_bodies_whose_bytes_cross_the_in_flight_limit_are_refused_there(target):
    """Heads let in while nothing was held still count their bytes as they come: the body whose
    bytes take the bodies held past the in-flight limit beside the others is refused 503 there,
    the others go on."""
    size = BODY_LIMIT
    head = (f"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\n{MSGPACK}{AUTH}"
            f"content-length: {size}\r\n\r\n").encode()
    part = INFLIGHT_LIMIT * 7 // 20  # three of them pass the limit, two do not
    first = target.connect()
    socks = [first] + [target.connect(on=target.holder(first)) for _ in range(2)]
    try:
        for sock in socks:  # all let in: nothing is held yet
            sock.sendall(head)
        time.sleep(0.2)
        for sock in socks[:2]:
            sock.sendall(b"\0" * part)
        time.sleep(0.3)
        with contextlib.suppress(OSError):  # refused mid-body: the rest may not be read
            socks[2].sendall(b"\0" * part)
        status, headers, body = _answer(socks[2])
        assert status == 503 and b'"overloaded"' in body and headers[b"retry-after"] == b"1"
        for sock in socks[:2]:  # the first two were let on: their bodies complete
            sock.sendall(b"\0" * (size - part))
            assert _answer(sock)[0] == 400  # read whole; not a gemm body
    finally:
        for sock in socks:
            sock.close()


# -- timeouts ---------------------------------------------------------------------------


def test_slowloris_heads_are_closed(target):
    if target.kind == "uvicorn":
        pytest.skip("uvicorn has no head timeout: it keeps a slow head forever")
    with target.connect() as sock:
        started = time.monotonic()
        head = b"GET /v1/health/live HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 1000
        closed = False
        for byte in head:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.05)
            if time.monotonic() - started > 4 * TIMEOUT_S + 2:
                break
        closed = closed or _read(sock, timeout=2) == b""
    assert closed and time.monotonic() - started < 4 * TIMEOUT_S + 4


def test_slow_bodies_are_closed(target):
    if target.kind == "uvicorn":
        pytest.skip("uvicorn has no body timeout")
    for framing in (b"content-length: 100000\r\n\r\n",
                    b"transfer-encoding: chunked\r\n\r\nffffff\r\n"):
        with target.connect() as sock:
            started = time.monotonic()
            sock.sendall(_BASE + framing)
            got = b"-"
            while got and time.monotonic() - started < 10:
                with contextlib.suppress(OSError):
                    sock.sendall(b"x" * 10)  # 10 bytes every 0.2 s: far below the rate
                sock.settimeout(0.2)
                try:
                    got = sock.recv(100)
                except TimeoutError:
                    got = b"-"
                except OSError:
                    got = b""
            assert got == b"" and time.monotonic() - started < 3 * TIMEOUT_S + 2


def test_idle_keep_alive_connections_are_closed(target):
    socks = []
    try:
        for _ in range(1000):
            sock = socket.create_connection(("127.0.0.1", target.port), timeout=10)
            socks.append(sock)
            sock.sendall(b"GET /v1/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
        for sock in socks:
            assert _answer(sock)[0] == 200
        deadline = time.monotonic() + TIMEOUT_S + 5
        for sock in socks:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            assert sock.recv(1) == b"", "an idle connection was kept past the keep-alive"
    finally:
        for sock in socks:
            sock.close()


@contextlib.contextmanager
def _own_fast_server(**settings):
    """A fast-transport server of its own, for limits the shared ones do not set."""
    config = _settings(**settings)
    app = create_app(config)
    port = _free_port()
    server = FastHttpServer(app, "127.0.0.1", port, max_body_bytes=config.max_body_bytes,
                            direct=DirectCalls(app))
    loop, stop = asyncio.new_event_loop(), asyncio.Event()
    thread = threading.Thread(target=lambda: loop.run_until_complete(server.serve(stop)),
                              daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if _exchange(port, b"GET /v1/health/ready HTTP/1.1\r\nhost: x\r\n\r\n")[0] == 200:
                    break
            time.sleep(0.05)
        yield port
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


def test_idle_connections_make_room_and_busy_ones_hold_the_cap():
    """At the connection cap, the connection idle longest (here: never sent a byte) is closed
    to let a new one in, so idle sockets cannot lock clients out; past the cap with every
    connection at work (bodies arriving), a new one is refused 503 cleanly."""
    with _own_fast_server(http_max_connections=4) as port:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        time.sleep(0.2)
        assert _exchange(port, b"GET /v1/health/live HTTP/1.1\r\nhost: x\r\n"
                               b"x-request-id: in-1\r\n\r\n")[:2][0] == 200
        idle[0].settimeout(2)
        try:
            closed = idle[0].recv(1) == b""
        except ConnectionResetError:
            closed = True
        assert closed, "the idlest connection was not closed"  # (a timeout raises)
        for sock in idle:
            sock.close()
        time.sleep(0.2)
        busy = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        for sock in busy:
            sock.sendall(_BASE + b"content-length: 1000\r\n\r\n" + b"\0" * 10)  # a body arriving
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            got = _read(extra)
        assert got.startswith(b"HTTP/1.1 503 ") and b'"overloaded"' in got, got
        assert b"retry-after: 1" in got.lower()
        for sock in busy:
            sock.close()
        time.sleep(0.2)
        assert _exchange(port, b"GET /v1/health/live HTTP/1.1\r\nhost: x\r\n\r\n")[0] == 200


def test_slow_heads_at_the_cap_make_room_before_a_callers_keep_alive():
    """A head still arriving is no work yet: at the cap, a connection whose head has been
    arriving over a second is closed to let a new one in, before a caller's keep-alive
    connection idle between two of its calls, even one idle longer (an audit's finding:
    slowloris heads at the cap threw the caller out, and then its calls got 503)."""
    live = b"GET /v1/health/live HTTP/1.1\r\nhost: x\r\n\r\n"
    with _own_fast_server(http_max_connections=4, http_head_timeout_s=30.0,
                          http_keep_alive_s=30.0) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=5) as caller:
        caller.sendall(live)
        assert _answer(caller)[0] == 200  # the caller's connection, idle from now
        slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
        try:
            for sock in slow:
                sock.sendall(b"GET /v1/health/live HTTP/1.1\r\nhost: x\r\nx-slow: a")  # never ends
            time.sleep(1.5)  # slow now, and all of them arriving since after the caller's call
            for _ in range(3):  # new connections, each past the cap
                assert _exchange(port, live)[0] == 200
                time.sleep(0.1)
            closed = sum(_read(sock, timeout=2) == b"" for sock in slow)
            assert closed == 3, "a slow head was kept while callers came"
            caller.sendall(live)  # its keep-alive connection still serves it
            assert _answer(caller)[0] == 200
        finally:
            for sock in slow:
                sock.close()


def test_a_body_that_stops_is_closed_within_a_window():
    """Bytes sent early buy no silence later: a body sent nearly whole at once and then
    stopped is closed within a head timeout (the window of the body rate), not after the time
    its bytes would have bought at the minimum rate (here 900 KiB at 64 KiB/s: 14 s), so it
    cannot hold the in-flight limit that long (an audit's finding)."""
    with _own_fast_server(max_body_bytes=1 << 20, max_inflight_bytes=2 << 20) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(_BASE + f"content-length: {1 << 20}\r\n\r\n".encode() + b"\0" * (900 << 10))
        started = time.monotonic()
        assert _read(sock, timeout=10) == b""
        assert time.monotonic() - started < 2 * TIMEOUT_S + 1.5


_WIDE_ROWS, _WIDE_N = 1024, 8192  # a 256 KiB call, a 16 MiB answer: over a socket's buffer


def _wide_set(port: int) -> bytes:
    """Load the weight set 'wide' (G 1, N 8192, K 128) on the server at ``port``; return a gemm
    request on it whose answer is 16 MiB."""
    w = torch.randn(1, _WIDE_N, 128).to(torch.bfloat16)
    body = packb({"w": encode_tensor(w)})
    put = (f"PUT /v1/weights/wide HTTP/1.1\r\nhost: x\r\n{MSGPACK}authorization: Bearer "
           f"{ADMIN}\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    assert _exchange(port, put)[0] in (200, 201)
    x = torch.randn(_WIDE_ROWS, 128).to(torch.bfloat16)
    call = packb({"x": encode_tensor(x), "m_sizes": encode_tensor(torch.tensor([_WIDE_ROWS]))})
    return (f"POST /v1/weights/wide/gemm HTTP/1.1\r\nhost: x\r\n{MSGPACK}{AUTH}"
            f"content-length: {len(call)}\r\n\r\n").encode() + call


def test_a_keep_alive_connection_serves_again_after_a_large_answer():
    """An answer larger than the socket takes at once pauses the connection's writing; once
    the client has read it, the connection reads its next request (a review found a change
    that never resumed it: the second call waited for the keep-alive timeout). A server of its
    own with a keep-alive of 30 s, so a stall shows as one, not as the shared servers' 1 s
    keep-alive closing a connection whose client was slow to read (a loaded host)."""
    with _own_fast_server(http_keep_alive_s=30.0) as port:
        request = _wide_set(port)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for _ in range(3):
                started = time.monotonic()
                sock.sendall(request)
                status, _, out = _answer(sock, timeout=10)
                assert status == 200 and len(out) > _WIDE_ROWS * _WIDE_N * 2
                assert time.monotonic() - started < 5


def test_answers_read_together_all_arrive():
    """Answers written together pause together, whether or not their clients read: when they
    pass the in-flight limit together, clients that read get them whole (the bound drops only
    answers that have waited past its grace)."""
    with _own_fast_server(http_keep_alive_s=30.0) as port:
        request = _wide_set(port)
        results: list = []

        def client() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
                for _ in range(3):
                    sock.sendall(request)
                    status, _, out = _answer(sock, timeout=20)
                    results.append((status, len(out)))

        threads = [threading.Thread(target=client) for _ in range(4)]  # 64 MiB, over 10 MiB
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(results) == 12 and all(
            status == 200 and size > _WIDE_ROWS * _WIDE_N * 2 for status, size in results), results


def test_answers_left_unread_are_bounded_together():
    """Clients that send a call and never read its answer hold the answers here until the
    keep-alive timeout; together they are bounded by the in-flight limit: past it, the
    connection whose answer has waited longest is dropped (an audit's finding: 60 such clients
    of 16 MB answers held 1 GB, without bound). The newest answer waiting is let out whole to a
    client that reads it."""
    rows, n = _WIDE_ROWS, _WIDE_N  # 16 MiB answers: over the 10 MiB in-flight limit
    with _own_fast_server(http_keep_alive_s=30.0) as port:
        request = _wide_set(port)
        readers = []
        try:
            for _ in range(3):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
                sock.settimeout(10)
                sock.connect(("127.0.0.1", port))
                sock.sendall(request)
                readers.append(sock)
                time.sleep(1.0)  # its answer made, waiting for it to read
            first = b"-"
            with contextlib.suppress(ConnectionResetError):
                first = _read(readers[0], timeout=3)
            assert len(first) < (n * rows * 2) // 2, "the oldest unread answer was kept whole"
            status, _, out = _answer(readers[-1], timeout=20)  # the newest: let out whole
            assert status == 200 and len(out) > n * rows * 2
        finally:
            for sock in readers:
                sock.close()


def test_a_connection_that_never_sends_is_closed_after_the_head_timeout():
    """A connection with no request yet gets a head's time (MOEGEMM_HTTP_HEAD_TIMEOUT_S), not
    the keep-alive's."""
    with _own_fast_server(http_head_timeout_s=1.0, http_keep_alive_s=30.0) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            started = time.monotonic()
            assert _read(sock, timeout=8) == b""
            assert time.monotonic() - started < 4


def test_in_flight_bytes_are_judged_from_the_head():
    """A body still arriving counts by what it has sent: the next head that would pass the
    in-flight limit is answered 503 at once, before its body is read; one that only
    declared its body holds nothing; bodies whose bytes take the held bytes past the limit
    together get 503 as they cross it."""
    with _own_fast_server(max_body_bytes=1 << 20, max_inflight_bytes=1 << 20) as port:
        head = (f"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\n{MSGPACK}{AUTH}"
                f"content-length: {800 << 10}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as first:
            first.sendall(head + b"\0" * (700 << 10))  # its body arriving, slowly
            time.sleep(0.2)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as second:
                second.sendall(head)
                status, headers, body = _answer(second)
            assert status == 503 and b'"overloaded"' in body and headers[b"retry-after"] == b"1"
        time.sleep(0.2)  # the first one gone, its bytes are free again
        with socket.create_connection(("127.0.0.1", port), timeout=10) as declared, \
                socket.create_connection(("127.0.0.1", port), timeout=10) as third:
            declared.sendall(head)  # 800 KiB declared, nothing sent
            time.sleep(0.2)
            third.sendall(head + b"\0" * (800 << 10))
            assert _answer(third)[0] == 400  # read whole; not a gemm body
            declared.sendall(b"\0" * (700 << 10))  # its bytes now count, and the third's are free
            time.sleep(0.2)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as fourth:
                fourth.sendall(head + b"\0" * (400 << 10))  # crosses the limit beside it
                status, _, body = _answer(fourth)
            assert status == 503 and b'"overloaded"' in body


def test_trailers_are_bounded_and_never_read_as_headers(target):
    """A chunked body's trailers are dropped: one that names a header the call reads
    (``X-Deadline-Ms``) changes nothing; and they are bounded as a head is: past 64 KiB of
    framing with no body byte the request is 413 at once, and the process did not grow with
    them (each trailer line was kept, about 12 times its size: 300 MB of them took 3.6 GB)."""
    if target.kind == "uvicorn":
        pytest.skip("uvicorn's own trailers")
    body = _body(3)
    upload = (_CHUNKED + b"%x\r\n" % len(body) + body + b"\r\n0\r\nx-deadline-ms: soon\r\n"
              b"x-other: 1\r\n\r\n")
    status, _, answer = _exchange(target.port, upload)
    assert status == 200, answer[:300]
    before = _rss(target.pids())
    with target.connect(timeout=30) as sock:
        sock.sendall(_CHUNKED + b"0\r\n")
        line = b"x-t: " + b"a" * 1000 + b"\r\n"
        with contextlib.suppress(ConnectionError):  # refused and closed while sending
            for _ in range(32 << 10):  # up to 32 MiB of trailers
                sock.sendall(line * 32)
        status, _, answer = _answer(sock)
    assert status == 413 and b'"too_large"' in answer, answer[:300]
    assert b"framing" in answer
    assert _rss(target.pids()) - before < 64 << 20
    assert not target.tracebacks()


def test_chunks_must_not_be_tiny_past_the_first_thousands():
    """Each chunk costs a Python callback: past 4096 chunks a body must average 64 bytes a
    chunk, else 400 at once (a 100 MiB body in one-byte chunks held the loop for 14 s, every
    caller waiting ~2.5 s a call). A small body in one-byte chunks is still served."""
    small = _body(1)
    assert len(small) < 4096
    with _own_fast_server() as port:
        one_byte = b"".join(b"1\r\n" + small[i:i + 1] + b"\r\n" for i in range(len(small)))
        status, _, answer = _exchange(port, _CHUNKED + one_byte + b"0\r\n\r\n")
        assert status == 200, answer[:300]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            with contextlib.suppress(ConnectionError):
                sock.sendall(_CHUNKED + b"1\r\n\0\r\n" * (1 << 20))
            status, _, answer = _answer(sock)
        assert status == 400 and b"chunks" in answer and b'"bad_field"' in answer, answer[:300]


def test_a_chunked_body_over_the_limit_is_too_large():
    with _own_fast_server(max_body_bytes=64 << 10) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(_CHUNKED + b"10000\r\n" + b"\0" * (64 << 10) + b"\r\n1\r\n\0\r\n")
            got = _read(sock)
        assert got.startswith(b"HTTP/1.1 413 ") and b'"too_large"' in got, got[:300]


# -- attacks that must not take the loop or the memory ----------------------------------------


def test_small_chunks_neither_burn_the_loop_nor_stall_health(target):
    # 512 KiB in chunks of 96 bytes, near the smallest ours takes past 4096 chunks (64 bytes
    # a piece on average, a chunk split across reads counting as two; smaller ones are
    # refused there: test_chunks_must_not_be_tiny_past_the_first_thousands), a body the app
    # refuses once it has it all (400 bad_field for its field): what is timed is the
    # transport, not the CPU kernel.
    body = packb({"pad": bytes(512 << 10)})
    pieces = [body[i:i + 96] for i in range(0, len(body), 96)]
    chunks = b"".join(b"%x\r\n" % len(piece) + piece + b"\r\n" for piece in pieces)
    upload = _CHUNKED + chunks + b"0\r\n\r\n"
    answers: list[int] = []
    refusal: list[bytes] = [b""]
    # Two attackers where the box has the cores for them beside the server and the probe; on
    # a 2-core box a second one only times the OS scheduler (its CPU-bound acceptor process
    # and the probe's share the cores), not the loop.
    attackers = 2 if (os.cpu_count() or 1) > 2 else 1

    def attack() -> None:
        # Until the probes have enough samples for a p99 that is not their maximum.
        deadline = time.monotonic() + 8
        while len(probe.times) < 150 and time.monotonic() < deadline or len(answers) < 4:
            with target.connect(timeout=60) as sock:
                sock.sendall(upload)
                status, _, said = _answer(sock, timeout=60)
                answers.append(status)
                refusal[:] = [said]

    with _Probe(target) as probe:
        threads = [threading.Thread(target=attack) for _ in range(attackers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    if os.environ.get("HOSTILE_VERBOSE"):
        print(f"\n{target.kind}: p99 {probe.p99() * 1e3:.1f} ms over {len(probe.times)}")
    assert len(answers) >= 4 and set(answers) == {400}
    assert b"unknown ['pad']" in refusal[0], refusal  # the app's answer, not the chunk rule's
    assert not probe.failures and len(probe.times) >= 5
    if target.kind == "uvicorn":
        return  # not ours to hold: uvicorn's chunk path costs more per chunk
    assert probe.p99() < 0.050, f"health p99 {probe.p99() * 1e3:.1f} ms"


def test_a_thousand_pipelined_requests_are_answered_in_order(target):
    with target.connect(timeout=30) as sock:
        sock.sendall(b"".join(b"GET /v1/health/live HTTP/1.1\r\nhost: x\r\nx-request-id: r%d\r\n"
                              b"\r\n" % i for i in range(1000)))
        sock.settimeout(30)
        got, i = b"", 0
        while i < 1000:
            head, sep, rest = got.partition(b"\r\n\r\n")
            length = re.search(rb"content-length: (\d+)", head) if sep else None
            if length is None or len(rest) < int(length[1]):
                chunk = sock.recv(1 << 16)
                assert chunk, f"closed after {i} answers"
                got += chunk
                continue
            assert head.startswith(b"HTTP/1.1 200 ") and b"x-request-id: r%d\r\n" % i in \
                head + b"\r\n", head
            got, i = rest[int(length[1]):], i + 1


def test_a_malformed_head_still_echoes_its_request_id(target):
    """A head refused mid-parse (a line with no colon after X-Request-Id: 400) is answered with
    the id it carried, not a made one (an audit's finding)."""
    if target.kind == "uvicorn":
        pytest.skip("uvicorn answers its own 400")
    data = b"GET /v1/health/live HTTP/1.1\r\nhost: x\r\nX-Request-Id: rid-nc\r\nno colon\r\n\r\n"
    with target.connect() as sock:
        sock.sendall(data)
        got = _read(sock)
    head = got.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 400 ") and b"\r\nx-request-id: rid-nc" in head, got[:400]


def test_a_request_id_of_any_printable_bytes_comes_back_as_sent(target):
    """X-Request-Id is echoed byte for byte (UTF-8 included: header bytes are latin-1 text to
    every transport) by a call, a route's error and a refusal from the head."""
    rid = "trace-ünï".encode()
    sent = {
        "call": _gemm(_body(3)).replace(b"\r\n\r\n", b"\r\nx-request-id: " + rid + b"\r\n\r\n", 1),
        "route error": b"GET /v1/weights/nope HTTP/1.1\r\nhost: x\r\n" + AUTH.encode()
                       + b"x-request-id: " + rid + b"\r\n\r\n",
        "head refusal": b"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\ncontent-type: text/plain\r\n"
                        + AUTH.encode() + b"x-request-id: " + rid + b"\r\ncontent-length: 1\r\n\r\n"
                        + _TINY,
    }
    for what, data in sent.items():
        with target.connect() as sock:
            sock.sendall(data)
            sock.settimeout(10)
            got = b""
            while b"\r\n\r\n" not in got:
                got += sock.recv(1 << 16)
        assert b"\r\nx-request-id: " + rid + b"\r\n" in got.partition(b"\r\n\r\n")[0] + b"\r\n", \
            (what, got[:400])


def test_small_answers_to_a_client_that_never_reads_are_made_as_it_reads():
    """A client that pipelines many cheap requests with small answers and reads none makes the
    server answer only while little of its answers waits for it (an audit's finding: 300 such
    clients of 3000 GET /metrics each kept new connections waiting over 60 s); when it reads,
    the rest are answered, in order."""
    requests = 2000
    one = b"GET /metrics HTTP/1.1\r\nhost: x\r\n" + AUTH.encode() + b"\r\n"
    with _own_fast_server(http_keep_alive_s=30.0) as port:
        def made() -> float:
            _, _, text = _exchange(port, b"GET /metrics HTTP/1.1\r\nhost: x\r\n" + AUTH.encode()
                                   + b"\r\n")
            return metric_sum(text.decode(), "moegemm_requests_total", endpoint="/metrics",
                              status="200")

        before = made()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            sock.sendall(one * requests)
            time.sleep(1.5)
            answered = made() - before - 1  # (the count's own request)
            assert answered < requests / 10, f"{answered} of {requests} answers made, none read"
            got, answers = b"", 0
            while answers < requests:
                chunk = sock.recv(1 << 20)
                assert chunk, f"closed after {answers} answers"
                got += chunk
                answers = got.count(b"HTTP/1.1 200 ")
        assert answers == requests


def test_a_client_that_pipelines_and_never_reads_holds_bounded_memory(target):
    body = _gemm(_body(ROWS, seed=5))
    calls = 200  # 50 MiB of answers if all were made and held
    # Calls first, answered and read: the growth timed is the attack's, not the process's
    # first calls (the CPU kernels' buffers and thread pools).
    for _ in range(4):
        assert _exchange(target.port, body)[0] == 200
    before_calls, before_rss = _metric(target, "200"), _rss(target.pids())
    sock = target.connect()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    with _Probe(target) as probe:
        sock.settimeout(0.2)
        # Not body * calls in memory: this process's RSS is the in-thread servers' too.
        view, sent, deadline = memoryview(body), 0, time.monotonic() + 6
        while sent < len(body) * calls and time.monotonic() < deadline:
            try:
                at = sent % len(body)
                sent += sock.send(view[at:])
            except TimeoutError:
                pass  # the server stopped reading: as it should
            except OSError:
                # Ours drops a client that leaves its answers undrained for the
                # keep-alive timeout.
                assert target.kind != "uvicorn"
                break
        time.sleep(1.0)
        made = _metric(target, "200") - before_calls
        grown = _rss(target.pids()) - before_rss
    sock.close()
    if os.environ.get("HOSTILE_VERBOSE"):
        print(f"\n{target.kind}: {made} answers, {grown >> 20} MiB, p99 {probe.p99() * 1e3:.1f} ms")
    assert made < calls / 2, f"{made} answers made for a client that reads none"
    assert grown < 48 << 20, f"the server grew by {grown >> 20} MiB"
    assert not probe.failures and len(probe.times) >= 5
    assert probe.p99() < 0.050, f"health p99 {probe.p99() * 1e3:.1f} ms"
    # And the server goes on serving.
    assert _exchange(target.port, b"GET /v1/health/live HTTP/1.1\r\nhost: x\r\n\r\n")[0] == 200
