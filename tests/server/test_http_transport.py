"""The fast HTTP transport's own cases: keep-alive, pipelining, Expect: 100-continue,
oversize and chunked bodies. (Every server suite runs on this transport, the one
``moegemm serve`` runs; ``test_api_uvicorn.py`` runs the contract's suites under uvicorn
too.)"""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import torch
from moegemm.client import Client
from moegemm.client._wire import encode_tensor, packb
from moegemm.kernels import quantize_activations, reference_float64
from moegemm.kernels.testing import SPEC_TOLERANCE, random_m_sizes, rel_error
from moegemm.server._unpack import unpackb
from server_support import MSGPACK, Running, metric_sum


def _raw(server: Running, data: bytes, reads: int = 1, timeout: float = 20,
         stall: float = 0.0) -> bytes:
    """Send ``data`` (with ``stall``: its first half, a wait of that many seconds, the rest)
    and read until ``reads`` answers have begun (or the server closes, or ``timeout``)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        if stall:
            sock.sendall(data[:len(data) // 2])
            time.sleep(stall)
            data = data[len(data) // 2:]
        sock.sendall(data)
        got = b""
        deadline = time.monotonic() + timeout
        while got.count(b"HTTP/1.1 ") < reads and time.monotonic() < deadline:
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            got += chunk
        return got


def _gemm_request(body: bytes, extra: str = "") -> bytes:
    return (f"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\ncontent-type: "
            f"application/vnd.msgpack\r\ncontent-length: {len(body)}\r\n{extra}\r\n").encode() + body


def _demo_body(rows: int, gen: torch.Generator) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, 512, generator=gen).to(torch.bfloat16)
    m = random_m_sizes(8, rows, generator=gen)
    return packb({"x": encode_tensor(x), "m_sizes": encode_tensor(m)}), x, m


def test_client_round_trip_meets_the_spec(server):
    gen = torch.Generator().manual_seed(torch.seed())
    ws = server.services.store.get("demo")
    with Client(server.url) as client:
        for rows in (1, 83, 300):
            x = torch.randn(rows, ws.K, generator=gen).to(torch.bfloat16)
            m = random_m_sizes(ws.G, rows, generator=gen)
            out = client.grouped_gemm("demo", x, m)
            xq, xs = quantize_activations(x, torch.float8_e4m3fn)
            ref = reference_float64(xq, ws.wq, xs, ws.w_scale, m)
            assert rel_error(out, ref) <= SPEC_TOLERANCE


def test_keep_alive_and_pipelined_requests(server):
    gen = torch.Generator().manual_seed(torch.seed())
    bodies = [_demo_body(rows, gen)[0] for rows in (3, 17)]
    got = _raw(server, b"".join(_gemm_request(b) for b in bodies), reads=2)
    assert got.count(b"HTTP/1.1 200 OK") == 2
    assert got.count(b"content-type: application/vnd.msgpack") == 2


def test_expect_100_continue(server):
    gen = torch.Generator().manual_seed(torch.seed())
    body = _demo_body(5, gen)[0]
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        head = _gemm_request(body, "expect: 100-continue\r\n")[: -len(body)]
        sock.sendall(head)
        assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        got = b""
        while b"\r\n\r\n" not in got:
            got += sock.recv(1 << 16)
        assert got.startswith(b"HTTP/1.1 200 OK")


def test_oversize_body_is_refused_before_reading(server):
    limit = server.services.settings.max_body_bytes
    head = (f"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\ncontent-type: "
            f"application/vnd.msgpack\r\ncontent-length: {limit + 1}\r\n\r\n").encode()
    got = _raw(server, head)
    assert got.startswith(b"HTTP/1.1 413")
    assert b'"too_large"' in got and b"connection: close" in got


def test_chunked_upload_with_odd_framing(server):
    gen = torch.Generator().manual_seed(torch.seed())
    body = _demo_body(7, gen)[0]
    cut = [0, 1, 100, len(body) // 2, len(body)]
    chunks = b"".join(b"%x;ext=1\r\n" % (b - a) + body[a:b] + b"\r\n"
                      for a, b in zip(cut[:-1], cut[1:]))
    head = (b"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\ncontent-type: "
            b"application/vnd.msgpack\r\ntransfer-encoding: chunked\r\n\r\n")
    got = _raw(server, head + chunks + b"0\r\ntrailer: x\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 OK"), got[:200]
    bad = head + b"zz\r\nhello\r\n0\r\n\r\n"
    assert _raw(server, bad).startswith(b"HTTP/1.1 400")


def test_a_chunked_upload_decoded_over_several_turns(server):
    # 300 rows (~300 KiB) in 1000-byte chunks: several reads, each decoded in turns of
    # _CHUNKED_TURN bytes. The answer is the Content-Length call's, bit for bit; a request sent
    # behind the upload in the same write is not served and the connection closes after the
    # upload's answer (the module's rule).
    from moegemm.server._http_conn import _CHUNKED_TURN

    gen = torch.Generator().manual_seed(torch.seed())
    body = _demo_body(300, gen)[0]
    assert len(body) > 4 * _CHUNKED_TURN
    step = 1000
    chunks = b"".join(b"%x\r\n" % len(body[i:i + step]) + body[i:i + step] + b"\r\n"
                      for i in range(0, len(body), step))
    head = (b"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\ncontent-type: "
            b"application/vnd.msgpack\r\ntransfer-encoding: chunked\r\n\r\n")
    behind = b"GET /v1/health/live HTTP/1.1\r\nhost: x\r\n\r\n"
    got = _raw(server, head + chunks + b"0\r\n\r\n" + behind, reads=2)
    plain = server.http.post("/v1/weights/demo/gemm", content=body, headers=MSGPACK)
    assert got.startswith(b"HTTP/1.1 200 OK"), got[:200]
    assert got.count(b"HTTP/1.1 ") == 1 and b"connection: close" in got.lower()
    assert plain.status_code == 200 and got.split(b"\r\n\r\n", 1)[1] == plain.content


def test_a_body_framed_two_ways_is_refused(server):
    # Request-smuggling shapes (RFC 9112 6.3): never pick one framing silently.
    base = (b"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\ncontent-type: "
            b"application/vnd.msgpack\r\n")
    both = base + b"content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
    assert _raw(server, both).startswith(b"HTTP/1.1 400")
    two = base + b"content-length: 5\r\ncontent-length: 6\r\n\r\nhello!"
    assert _raw(server, two).startswith(b"HTTP/1.1 400")
    # The server keeps serving afterwards.
    assert server.http.get("/v1/health/live").status_code == 200


def test_malformed_request_line(server):
    assert _raw(server, b"NOT HTTP\r\n\r\n").startswith(b"HTTP/1.1 400")


def test_response_parts_decode(server):
    gen = torch.Generator().manual_seed(torch.seed())
    body = _demo_body(9, gen)[0]
    r = server.http.post("/v1/weights/demo/gemm", content=body, headers=MSGPACK)
    assert r.status_code == 200
    out = unpackb(r.content)["out"]
    assert out["dtype"] == "bfloat16" and out["shape"] == [9, 256]
    assert len(out["data"]) == 9 * 256 * 2
    assert np.isfinite(np.frombuffer(out["data"], dtype=np.uint16).astype(np.float32)).all()


def test_gemm_tensors_are_views_on_the_received_body(server, monkeypatch):
    from moegemm.server import routes

    seen = []
    real = routes.gemm_call

    def spy(request, *args, **kwargs):
        seen.extend((request.x.data, request.m_sizes.data))
        return real(request, *args, **kwargs)

    monkeypatch.setattr(routes, "gemm_call", spy)
    gen = torch.Generator().manual_seed(torch.seed())
    # 200 rows of 512 bf16: a body over 64 KiB, which is decoded in place.
    r = server.http.post("/v1/weights/demo/gemm", content=_demo_body(200, gen)[0], headers=MSGPACK)
    assert r.status_code == 200
    # Not bytes copied out by a msgpack decoder: writable views on the one body buffer.
    assert len(seen) == 2 and all(not v.readonly and not isinstance(v.obj, bytes) for v in seen)


def test_the_timeout_sweep_keeps_no_connection_alive():
    """The sweep holds no reference to a connection between its rounds: a departed client's
    connection (and the body it held) goes when the server drops it, not at the next round
    that finds another connection to check (an audit's finding: 200 MB kept on an idle
    server)."""
    import weakref

    from moegemm.server._http_conn import sweep
    from moegemm.server._http_gate import HttpLimits

    class Conn:
        def check(self, now: float) -> None:
            pass

    connections = {Conn()}
    ref = weakref.ref(next(iter(connections)))

    async def main() -> bool:
        task = asyncio.ensure_future(sweep(connections, HttpLimits(head_timeout_s=0.02,
                                                                   keep_alive_s=0.02), {}))
        await asyncio.sleep(0.05)  # rounds that checked it
        connections.clear()
        await asyncio.sleep(0.05)  # rounds with nothing to check
        alive = ref() is not None
        task.cancel()
        return alive

    assert not asyncio.run(main())


def _bytes_in(server) -> float:
    return metric_sum(server.http.get("/metrics").text, "moegemm_bytes_in_total")


def test_bytes_in_counts_bodies_refused_before_they_are_read(server):
    """The transport holds the whole body before the app runs: a request refused for its
    name, a header or its path, which never reads it, counts its bytes too."""
    before = _bytes_in(server)
    body = packb({"x": 1, "m_sizes": 2})
    sent = 0
    for method, path, headers in (("PUT", "/v1/weights/bad!name", {}),
                                  ("POST", "/v1/weights/demo/gemm", {"X-Deadline-Ms": "soon"}),
                                  ("POST", "/v1/nowhere", {})):
        r = server.http.request(method, path, content=body,
                                headers={"content-type": "application/vnd.msgpack", **headers})
        assert r.status_code in (400, 404), r.text
        sent += len(body)
    assert _bytes_in(server) - before == sent


def test_bytes_in_counts_a_body_the_call_reads_once(server):
    """A body that is read counts its bytes once, whichever way it went: gemm calls answered
    by the direct route (one answered, one refused for its fields), and bodies the ASGI app
    reads (weight uploads refused for their fields). The transport counts a body on arrival;
    the app's read must add nothing."""
    gen = torch.Generator().manual_seed(8)
    calls = [("POST", "/v1/weights/demo/gemm", _demo_body(37, gen)[0], 200),
             ("POST", "/v1/weights/demo/gemm", packb({"x": 1, "m_sizes": 2, "extra": 3}), 400),
             ("PUT", "/v1/weights/bytes-in-probe", packb({"wq": 1, "extra": 2}), 400),
             ("PUT", "/v1/experts/bytes-in-probe", packb({"w13": 1, "extra": 2}), 400)]
    before = _bytes_in(server)
    for method, path, body, status in calls:
        r = server.http.request(method, path, content=body, headers=MSGPACK)
        assert r.status_code == status, (path, r.text)
    assert _bytes_in(server) - before == sum(len(body) for _, _, body, _ in calls)


def _request_seconds(server, endpoint: str) -> tuple[float, float]:
    """``moegemm_request_seconds``' count and sum under ``endpoint``."""
    text = server.http.get("/metrics").text
    return tuple(metric_sum(text, f"moegemm_request_seconds_{part}", endpoint=endpoint)
                 for part in ("count", "sum"))


def test_the_total_time_counts_from_the_head_so_a_slow_upload_shows(server):
    """``moegemm_request_seconds`` starts where the deadline does, at the head's first bytes:
    a body that took 0.5 s to arrive shows as at least 0.5 s, on the direct route (a gemm
    call) and on the app's (a weight upload). It started once the body was in, so slow
    uploads (and the 504s they end in) showed as fast answers."""
    gen = torch.Generator().manual_seed(9)
    body = _demo_body(64, gen)[0]
    upload = packb({"w": encode_tensor(torch.randn(1, 128, 128).to(torch.bfloat16))})
    cases = [("/v1/weights/{name}/gemm", _gemm_request(body)[:-len(body)], body, b"200"),
             ("/v1/weights/{name}", (
                 "PUT /v1/weights/slow-upload HTTP/1.1\r\nhost: x\r\ncontent-type: "
                 f"application/vnd.msgpack\r\ncontent-length: {len(upload)}\r\n\r\n").encode(),
              upload, b"201")]
    try:
        for endpoint, head, data, status in cases:
            count, total = _request_seconds(server, endpoint)
            answer = _raw(server, head + data, stall=0.5)
            assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
            after = _request_seconds(server, endpoint)
            # (0.4: the server may read the head a little after it was sent)
            assert after[0] == count + 1 and after[1] - total >= 0.4, (endpoint, after, total)
    finally:
        server.http.delete("/v1/weights/slow-upload")
