"""Fuzzing the fast HTTP transport (llhttp heads, our framing around it) at the socket.

Any bytes on a connection, and any request head built from plausible and
implausible parts, get an answer below 500 or a closed connection; the
server keeps serving other connections, and its loaded weights never change.
"""

from __future__ import annotations

import re
import socket

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from moegemm.server import Settings
from server_support import fp8_problem, serve, wire

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
ADMIN = "transport-admin"
STATUS = re.compile(rb"^HTTP/1\.[01] (\d{3}) ")


@pytest.fixture(scope="module")
def fast():
    """The app behind FastHttpServer (``server_support.serve``), one set loaded.

    Weight changes need the admin token, which the fuzzed requests never carry: a
    well-formed DELETE of 'base' would otherwise be a legitimate change.
    """
    config = Settings(device="cpu", demo=False, max_body_bytes=64 << 10, admin_token=ADMIN)
    with serve(config) as running:
        p = fp8_problem(8, 128, 128, 2)
        r = running.put("base", {"w": wire(p.wq), "w_scale": wire(p.w_scale)},
                        headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 201, r.text
        running.base = running.services.store.get("base")
        yield running


def _exchange(url: str, data: bytes, wait: float = 0.05) -> bytes:
    """Send ``data`` and read whatever comes back before close or ``wait`` of silence
    (a half-close would make the server drop the request unanswered)."""
    host, port = url.removeprefix("http://").split(":")
    received = b""
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        try:
            sock.sendall(data)
        except OSError:
            return received  # the server closed first: allowed
        sock.settimeout(wait)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return received


def _check(fast, answer: bytes) -> None:
    statuses = [int(m.group(1)) for m in STATUS.finditer(answer)]
    event(f"answers {sorted(set(statuses))}")
    assert all(status < 500 for status in statuses), answer[:500]
    # The server still answers a fresh connection, and nothing was changed.
    assert fast.http.get("/v1/health/live").status_code == 200
    assert fast.services.store.get("base") is fast.base


# Mostly well-formed parts, so that requests get past the parser into the app.
methods = st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE"] * 4
                          + [b"HEAD", b"", b"G ET", b"\x00"])
targets = (
    st.sampled_from([b"/v1/health/live", b"/v1/weights/base/gemm", b"/v1/weights/base",
                     b"/v1/weights/%2E%2E", b"/v1/weights/a%2Fb/gemm", b"*", b"", b"/%ZZ",
                     b"/v1/weights/base?x=1&&=", b"http://x/v1/info"])
)
versions = st.sampled_from([b"HTTP/1.1"] * 8 + [b"HTTP/1.0", b"HTTP/2", b"HTTP/1.1 extra", b""])
header_lines = st.lists(st.one_of(
    st.tuples(st.sampled_from([b"content-length", b"Content-Length", b"transfer-encoding",
                               b"expect", b"connection", b"content-type", b"authorization",
                               b"x-deadline-ms", b"host", b" host", b"", b"x:y"]),
              st.one_of(st.sampled_from([b"0", b"5", b"-1", b"99999999999999999999", b"abc",
                                         b"chunked", b"100-continue", b"close", b"keep-alive",
                                         b"application/vnd.msgpack", b"1e3", b" 7 "]),
                        st.text(max_size=30).map(lambda t: t.encode()),
                        st.binary(max_size=30)))
    .map(lambda kv: kv[0] + b": " + kv[1]),
), max_size=6)


@st.composite
def requests(draw):
    eol = draw(st.sampled_from([b"\r\n"] * 8 + [b"\n", b"\r"]))
    target = draw(targets) if draw(st.integers(0, 9)) else draw(st.binary(max_size=40))
    line = draw(methods) + b" " + target + b" " + draw(versions)
    lines = draw(header_lines)
    if not draw(st.integers(0, 9)):
        lines.append(draw(st.binary(max_size=40)))  # one line of anything
    head = eol.join([line, *lines]) + eol + eol
    body = draw(st.binary(max_size=200))
    pipelined = draw(st.booleans())
    if pipelined:  # a valid request after the fuzzed one, on the same connection
        body += b"GET /v1/health/live HTTP/1.1\r\nhost: x\r\n\r\n"
    return head + body


@FUZZ
@given(st.binary(max_size=600))
def test_any_bytes_on_a_connection(fast, data):
    _check(fast, _exchange(fast.url, data))


@FUZZ
@given(requests())
def test_any_request_head(fast, data):
    _check(fast, _exchange(fast.url, data))


def test_a_slow_client_does_not_block_others(fast):
    """A connection that sends half a head and stalls holds nothing up."""
    host, port = fast.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as stalled:
        stalled.sendall(b"POST /v1/weights/base/gemm HTTP/1.1\r\ncontent-length: 1000\r\n\r\nab")
        for _ in range(5):
            assert fast.http.get("/v1/health/live").status_code == 200
