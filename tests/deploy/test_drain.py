"""Graceful termination, as the deployments rely on it: SIGTERM lets the call
in flight finish with its full answer, then the process exits by itself.

The Kubernetes preStop pause and terminationGracePeriodSeconds, and Compose's
stop_grace_period, are sized for exactly this behaviour of `moegemm serve`.
"""

from __future__ import annotations

import re
import signal
import socket
import threading
import time

import ml_dtypes
import msgspec
import numpy as np
import pytest
from moegemm.client import Client


def test_sigterm_drains_the_call_in_flight(start_servers):
    rng = np.random.default_rng()
    (server,) = start_servers(1)
    try:
        # Big enough that the call is still running on the CPU backend when
        # the signal comes (about a second on a small machine).
        g, n, k, m = 4, 1024, 2048, 8192
        m_sizes = [m // g] * g
        x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
        with Client(server.url, token=server.token, timeout=120) as client:
            client.load_weights("drain", rng.standard_normal((g, n, k)).astype(ml_dtypes.bfloat16))
            started = time.monotonic()
            expected = client.grouped_gemm("drain", x, m_sizes)
            one_call = time.monotonic() - started
            result: dict = {}

            def call() -> None:
                try:
                    result["out"] = client.grouped_gemm("drain", x, m_sizes)
                except Exception as exc:  # noqa: BLE001 (reported by the assert below)
                    result["error"] = exc

            worker = threading.Thread(target=call)
            worker.start()
            time.sleep(min(0.3, one_call / 4))  # the request is on the server now
            assert worker.is_alive(), "the call ended before the signal: make it bigger"
            server.proc.send_signal(signal.SIGTERM)
            worker.join(timeout=60)
        assert "error" not in result, result.get("error")
        np.testing.assert_array_equal(result["out"], expected)
        # uvicorn ends by re-raising SIGTERM: exit 143 in a container, a clean stop.
        assert server.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        server.stop()


def _raw_call(token: str, name: str, x, m_sizes) -> tuple[bytes, bytes]:
    """A gemm request as bytes: (head, body)."""
    from moegemm.client._calls import gemm_call

    call = gemm_call(name, x, m_sizes, None, None)
    body = call.body if isinstance(call.body, bytes) else b"".join(call.body)
    head = (f"POST {call.path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\n"
            f"content-type: application/vnd.msgpack\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode(), body


def _answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """One whole answer read raw: (head, body); EOF first raises."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError(f"closed before an answer ({len(got)} bytes)")
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("closed inside the answer")
        body += chunk
    return head, body


@pytest.mark.parametrize("acceptors", ["0", "2"])
def test_at_sigterm_a_body_still_arriving_is_answered_and_a_new_request_is_refused(
        start_servers, acceptors):
    """The drain covers every request begun: one whose body is still arriving at the signal
    gets its answer (it was cut at once, unanswered, before), with and without acceptors;
    answers during the drain close their connection; a request begun on a kept-alive
    connection after the signal is refused 503 not_ready at once instead of being read and
    dropped at the end."""
    (server,) = start_servers(1, MOEGEMM_ACCEPTORS=acceptors, MOEGEMM_OWNER_CONNECTIONS="0")
    rng = np.random.default_rng()
    try:
        g, n, k = 4, 256, 512
        with Client(server.url, token=server.token, timeout=60) as client:
            client.load_weights("d", rng.standard_normal((g, n, k)).astype(ml_dtypes.bfloat16))
            x = rng.standard_normal((64, k)).astype(ml_dtypes.bfloat16)
            expected = client.grouped_gemm("d", x, [16] * g)
            head, body = _raw_call(server.token, "d", x, [16] * g)
        port = server.port
        with socket.create_connection(("127.0.0.1", port), timeout=30) as slow, \
                socket.create_connection(("127.0.0.1", port), timeout=30) as idle:
            idle.sendall(head + body)  # one request answered: the connection is kept alive
            first, _ = _answer(idle)
            assert first.startswith(b"HTTP/1.1 200")
            slow.sendall(head + body[: len(body) // 2])
            time.sleep(0.3)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            if acceptors == "0":
                # (An acceptor with nothing in progress ends its drain at once and closes its
                # idle connections, as servers do at a stop: which one holds ``idle`` is the
                # kernel's choice, so this part is checked on the server alone.)
                idle.sendall(head + body)
                refused, text = _answer(idle)
                assert refused.startswith(b"HTTP/1.1 503"), refused
                assert b'"not_ready"' in text and b"stopping" in text
            slow.sendall(body[len(body) // 2:])
            answered, out = _answer(slow)
            assert answered.startswith(b"HTTP/1.1 200"), answered
            assert b"connection: close" in answered.lower()
            got = msgspec.msgpack.decode(out)["out"]
            assert got["dtype"] == "bfloat16" and got["shape"] == list(expected.shape)
            np.testing.assert_array_equal(
                np.frombuffer(got["data"], ml_dtypes.bfloat16).reshape(expected.shape), expected)
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()
