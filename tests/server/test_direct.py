"""The gemm route served without the ASGI stack answers exactly what the app answers.

Two fast-transport servers on the same settings and the same (seeded) demo
weights: one hands gemm calls to ``DirectCalls``, the other to the FastAPI
route. Every request below -- good calls, each error of SPEC 2.2 the route can
give, auth, deadlines, odd framing -- goes to both with the same request id;
status, headers and body bytes must be equal, and so must the request metrics.
"""

from __future__ import annotations

import socket
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from moegemm.client._wire import encode_tensor, packb
from moegemm.kernels import quantize_activations
from moegemm.server import Settings, create_app
from moegemm.server._direct import DirectCalls
from moegemm.server._http import FastHttpServer
from server_support import _free_port, fast_server_thread

TOKEN = "tok-Qm3x"
K, G = 512, 8  # the demo set's shape


@contextmanager
def _fast(direct: bool, **overrides):
    settings = Settings(device="cpu", demo=True, token=TOKEN, max_body_bytes=1 << 20,
                        max_m=64, **overrides)
    app = create_app(settings)
    spy = _Spy(DirectCalls(app)) if direct else None
    port = _free_port()
    server = FastHttpServer(app, "127.0.0.1", port, max_body_bytes=settings.max_body_bytes,
                            direct=spy)
    with fast_server_thread(server):
        deadline = time.monotonic() + 60
        while True:
            try:
                status, _, _ = _exchange(port, _request("GET", "/v1/health/ready", b""))
                if status.startswith(b"HTTP/1.1 200"):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready")
            time.sleep(0.05)
        yield port, app, spy


class _Spy:
    """DirectCalls, counting the calls it answered."""

    def __init__(self, inner: DirectCalls) -> None:
        self.inner = inner
        self.calls = 0

    def match(self, method, path):
        return self.inner.match(method, path)

    async def __call__(self, name, headers, body, arrived):
        self.calls += 1
        return await self.inner(name, headers, body, arrived)


def _request(method: str, path: str, body: bytes, headers: dict | None = None,
             length: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: x", "x-request-id: same-id-1"]
    for key, value in (headers or {}).items():
        lines.append(f"{key}: {value}")
    if length:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _exchange(port: int, data: bytes) -> tuple[bytes, dict, bytes]:
    """One request on a fresh connection: status line, headers, body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
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
        return lines[0], headers, rest


def _wire(t: torch.Tensor) -> dict:
    return encode_tensor(t)


def _cases() -> list[tuple[str, bytes]]:
    gen = torch.Generator().manual_seed(7)
    auth = {"authorization": f"Bearer {TOKEN}", "content-type": "application/vnd.msgpack"}
    x = torch.randn(5, K, generator=gen).to(torch.bfloat16)
    m = torch.tensor([2, 0, 1, 0, 0, 2, 0, 0])
    xq, xs = quantize_activations(torch.randn(9, K, generator=gen), torch.float8_e4m3fn)
    m9 = torch.tensor([0, 3, 0, 0, 4, 0, 2, 0])
    good = packb({"x": _wire(x), "m_sizes": _wire(m)})
    fp8 = packb({"x": _wire(xq), "x_scale": _wire(xs), "m_sizes": _wire(m9)})
    nan = x.clone()
    nan[1, 3] = float("nan")
    gemm = "/v1/weights/demo/gemm"
    cases = [
        ("bf16 call", _request("POST", gemm, good, auth)),
        ("fp8 call", _request("POST", gemm, fp8, auth)),
        ("empty call", _request("POST", gemm, packb(
            {"x": _wire(torch.empty(0, K, dtype=torch.bfloat16)),
             "m_sizes": _wire(torch.zeros(G, dtype=torch.int64))}), auth)),
        ("no token", _request("POST", gemm, good, {"content-type": "application/vnd.msgpack"})),
        ("wrong token", _request("POST", gemm, good, {**auth, "authorization": "Bearer nope"})),
        ("bad name", _request("POST", "/v1/weights/a%20b/gemm", good, auth)),
        ("no such set", _request("POST", "/v1/weights/other/gemm", good, auth)),
        ("media type", _request("POST", gemm, good, {**auth, "content-type": "text/plain"})),
        ("declared too large", _request("POST", gemm, b"", {**auth, "content-length": "9999999"},
                                        length=False)),
        ("not msgpack", _request("POST", gemm, b"\xc1\x00", auth)),
        ("not a map", _request("POST", gemm, packb([1, 2]), auth)),
        ("missing field", _request("POST", gemm, packb({"x": _wire(x)}), auth)),
        ("unknown field", _request("POST", gemm, packb(
            {"x": _wire(x), "m_sizes": _wire(m), "y": 1}), auth)),
        ("bad dtype", _request("POST", gemm, packb(
            {"x": _wire(x.to(torch.int32)), "m_sizes": _wire(m)}), auth)),
        ("bad K", _request("POST", gemm, packb(
            {"x": _wire(x[:, :256].contiguous()), "m_sizes": _wire(m)}), auth)),
        ("bad m_sizes", _request("POST", gemm, packb(
            {"x": _wire(x), "m_sizes": _wire(m + 1)}), auth)),
        ("too many rows", _request("POST", gemm, packb(
            {"x": _wire(torch.zeros(65, K, dtype=torch.bfloat16)),
             "m_sizes": _wire(torch.tensor([65] + [0] * 7))}), auth)),
        ("nan", _request("POST", gemm, packb({"x": _wire(nan), "m_sizes": _wire(m)}), auth)),
        ("fp8 without scale", _request("POST", gemm, packb(
            {"x": _wire(xq), "m_sizes": _wire(m9)}), auth)),
        ("bad deadline", _request("POST", gemm, good, {**auth, "x-deadline-ms": "-3"})),
        ("good deadline", _request("POST", gemm, good, {**auth, "x-deadline-ms": "60000"})),
        ("junk request id", _request("POST", gemm, good, auth).replace(
            b"x-request-id: same-id-1", b"x-request-id: a\tbad")),  # llhttp refuses \x01
    ]
    chunked = _request("POST", gemm, b"", {**auth, "transfer-encoding": "chunked"}, length=False)
    cases.append(("chunked", chunked + b"%x\r\n" % len(good) + good + b"\r\n0\r\n\r\n"))
    return cases


CASES = _cases()
_FROM_THE_HEAD = {"no token", "wrong token", "media type", "declared too large"}


@pytest.fixture(scope="module")
def pair():
    with _fast(direct=True) as direct, _fast(direct=False) as asgi:
        yield direct, asgi


@pytest.mark.parametrize("name,data", CASES, ids=[c[0] for c in CASES])
def test_direct_answers_as_the_app_does(pair, name, data):
    (d_port, _, spy), (a_port, _, _) = pair
    before = spy.calls
    d_status, d_headers, d_body = _exchange(d_port, data)
    a_status, a_headers, a_body = _exchange(a_port, data)
    # The direct path served it, unless the transport refused it from its head
    # (_http_gate.py: the token, media type and declared size, before the body).
    assert spy.calls == before + (name not in _FROM_THE_HEAD)
    if name == "junk request id":  # both made a fresh id: compare its form only
        assert len(d_headers.pop(b"x-request-id")) == len(a_headers.pop(b"x-request-id")) == 32
    assert d_status == a_status
    assert d_headers == a_headers
    assert d_body == a_body
    ok = name.endswith("call") or name in ("good deadline", "junk request id", "chunked")
    if ok:
        assert d_status == b"HTTP/1.1 200 OK"
    else:
        assert d_status.split()[1] in (b"400", b"401", b"404", b"413", b"415")


def test_other_methods_and_routes_go_to_the_app(pair):
    (d_port, _, spy), (a_port, _, _) = pair
    before = spy.calls
    for data in (_request("GET", "/v1/weights/demo/gemm", b""),
                 _request("GET", "/v1/info", b"", {"authorization": f"Bearer {TOKEN}"})):
        assert _exchange(d_port, data) == _exchange(a_port, data)
    assert spy.calls == before


def test_request_metrics_match(pair):
    (d_port, d_app, _), (a_port, a_app, _) = pair
    for _, data in CASES[:6]:
        _exchange(d_port, data)
        _exchange(a_port, data)

    def counts(app):
        out = {}
        for family in app.state.metrics.requests.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and "gemm" in sample.labels["endpoint"]:
                    out[sample.labels["status"]] = sample.value
        return out

    # RequestContext counts after the answer went out: give it a moment.
    deadline = time.monotonic() + 10
    while counts(d_app) != counts(a_app) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counts(d_app) == counts(a_app)
    assert counts(d_app).get("200", 0) >= 3


def test_the_body_budget_is_shared_with_the_app(pair):
    """A gemm call on the direct path reserves its body in the app's BodyBudget."""
    (d_port, _, spy), _ = pair
    budget = spy.inner._budget()
    held = budget.held
    budget.held = budget.limit  # as if other bodies filled the budget
    try:
        status, headers, body = _exchange(d_port, CASES[0][1])
    finally:
        budget.held = held
    assert status.startswith(b"HTTP/1.1 503")
    assert headers[b"retry-after"] == b"1"
    assert b'"overloaded"' in body


def test_output_matches_between_paths_for_numpy_rows(pair):
    (d_port, _, _), (a_port, _, _) = pair
    _, _, d_body = _exchange(d_port, CASES[1][1])
    _, _, a_body = _exchange(a_port, CASES[1][1])
    assert d_body == a_body and len(d_body) > 9 * 256 * 2
    assert np.frombuffer(d_body[-16:], np.uint8).any()


def _expert_cases() -> list[tuple[str, bytes]]:
    gen = torch.Generator().manual_seed(11)
    auth = {"authorization": f"Bearer {TOKEN}", "content-type": "application/vnd.msgpack"}
    x = torch.randn(6, 256, generator=gen).to(torch.bfloat16)
    m = torch.tensor([3, 0, 2, 1])
    ids = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]], dtype=torch.int32)
    w = torch.rand(4, 2, generator=gen)
    ffn, moe = "/v1/experts/ex/ffn", "/v1/experts/ex/moe"
    x4 = x[:4].contiguous()
    return [
        ("ffn call", _request("POST", ffn, packb({"x": _wire(x), "m_sizes": _wire(m)}), auth)),
        ("moe call", _request("POST", moe, packb(
            {"x": _wire(x4), "topk_ids": _wire(ids), "topk_weights": _wire(w)}), auth)),
        ("moe bad routing", _request("POST", moe, packb(
            {"x": _wire(x4), "topk_ids": _wire(ids.clamp(max=0)), "topk_weights": _wire(w)}),
            auth)),
        ("ffn bad m_sizes", _request("POST", ffn, packb({"x": _wire(x), "m_sizes": _wire(m + 1)}),
                                     auth)),
        ("ffn missing field", _request("POST", ffn, packb({"x": _wire(x)}), auth)),
        ("no such expert set", _request("POST", "/v1/experts/nope/moe", packb(
            {"x": _wire(x4), "topk_ids": _wire(ids), "topk_weights": _wire(w)}), auth)),
        ("bad expert name", _request("POST", "/v1/experts/a%20b/ffn", packb(
            {"x": _wire(x), "m_sizes": _wire(m)}), auth)),
        ("not msgpack", _request("POST", ffn, b"\xc1\x00", auth)),
        ("bad deadline", _request("POST", moe, b"", {**auth, "x-deadline-ms": "-3"})),
    ]


EXPERT_CASES = _expert_cases()


@pytest.fixture(scope="module")
def expert_pair(pair):
    gen = torch.Generator().manual_seed(3)
    w13 = (torch.randn(4, 2 * 128, 256, generator=gen) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(4, 256, 128, generator=gen) * 0.05).to(torch.bfloat16)
    body = packb({"w13": _wire(w13), "w2": _wire(w2)})
    auth = {"authorization": f"Bearer {TOKEN}", "content-type": "application/vnd.msgpack"}
    for port in (pair[0][0], pair[1][0]):
        status, _, text = _exchange(port, _request("PUT", "/v1/experts/ex", body, auth))
        assert status.split()[1] in (b"200", b"201"), text
    return pair


@pytest.mark.parametrize("name,data", EXPERT_CASES, ids=[c[0] for c in EXPERT_CASES])
def test_expert_calls_are_direct_and_answer_as_the_app_does(expert_pair, name, data):
    (d_port, _, spy), (a_port, _, _) = expert_pair
    before = spy.calls
    d_status, d_headers, d_body = _exchange(d_port, data)
    a_status, a_headers, a_body = _exchange(a_port, data)
    assert spy.calls == before + 1
    assert (d_status, d_body) == (a_status, a_body), name
    assert d_headers == a_headers
    if name.endswith("call"):
        assert d_status.startswith(b"HTTP/1.1 200") and len(d_body) > 4 * 256 * 2


@pytest.mark.parametrize("shape", [(1, 2048), (128, 256), (0, 7168), (70000, 4)])
def test_answer_heads_are_what_packb_writes(shape):
    """An answer's head (``array_body_parts``, cached per shape) is what ``packb`` writes for
    it, and the client reads the answer as a view on the body."""
    from moegemm.client._calls import decode_out
    from moegemm.client._wire import tensor_head
    from moegemm.server._body import array_body_parts

    out = np.arange(int(np.prod(shape)), dtype=np.uint16).reshape(shape).view(np.uint8)
    for _ in range(2):  # built, then from the cache
        head, data = array_body_parts("out", out, "bfloat16", shape)
        assert head == b"\x81" + tensor_head("out", "bfloat16", list(shape), out.nbytes)
        body = bytearray(head + bytes(data))
        got = decode_out(body)
        assert (got.dtype, got.shape) == ("bfloat16", list(shape))
        assert bytes(got.data) == bytes(data) and got.data.obj is body
