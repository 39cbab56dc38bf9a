"""Client and AsyncClient against a fake server (httpx.MockTransport) and a tiny real one."""

import asyncio
import http.server
import json
import pathlib
import socket
import threading
import uuid

import httpx
import ml_dtypes
import moegemm.client as mc
import msgspec
import numpy as np
import pytest
from moegemm.client import APIError, AsyncClient, BadDtype, Client, TransportError
from moegemm.client._wire import decode_tensors, encode_tensor, packb


def decode_tensor(obj):
    """A tensor map of a request body (``unpackb``'s bins as bytes), checked as the wire
    decoder checks one."""
    return decode_tensors(packb({"t": obj}))["t"]


def unpackb(content: bytes) -> dict:
    """A request body as the fake server reads it: one msgpack map, bins as bytes."""
    return msgspec.msgpack.decode(content)


try:
    import torch
except ImportError:  # the client installs without torch; so do these tests
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

URL = "http://moegemm.test:8000"
TOKEN = "s3cret-" + uuid.uuid4().hex


class FakeServer:
    """Records each request and answers like SPEC 2.1 would; `reply` overrides."""

    def __init__(self, n=256):
        self.n = n
        self.requests: list[httpx.Request] = []
        self.bodies: list[dict] = []
        self.outputs: list[np.ndarray] = []
        self.reply = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        rid = request.headers.get("x-request-id", "generated")
        if self.reply is not None:
            return self.reply(request)
        body = unpackb(request.content) if request.content else None
        self.bodies.append(body)
        path, method = request.url.path, request.method
        if method == "POST" and path.endswith("/gemm"):
            m = decode_tensor(body["x"]).shape[0]
            out = np.random.randn(m, self.n).astype(ml_dtypes.bfloat16)
            self.outputs.append(out)
            return httpx.Response(
                200,
                content=packb({"out": encode_tensor(out)}),
                headers={"content-type": "application/vnd.msgpack", "x-request-id": rid},
            )
        if method == "PUT":
            return httpx.Response(201, json={"name": path.rsplit("/", 1)[1], "G": 4})
        if method == "DELETE":
            return httpx.Response(204, headers={"x-request-id": rid})
        if path == "/v1/weights":
            return httpx.Response(200, json=[{"name": "w0", "G": 4, "N": 256, "K": 512}])
        return httpx.Response(200, json={"path": path})


def _error_reply(status, code, message, headers=None):
    def reply(request):
        rid = request.headers["x-request-id"]
        return httpx.Response(
            status,
            json={"error": {"code": code, "message": message}},
            headers={"x-request-id": rid, **(headers or {})},
        )

    return reply


@pytest.fixture
def fake():
    return FakeServer()


@pytest.fixture
def client(fake):
    with Client(URL, token=TOKEN, transport=httpx.MockTransport(fake)) as c:
        yield c


def _fp8_inputs(m_sizes, k=256):
    m = sum(m_sizes)
    x = np.random.randn(m, k).astype(ml_dtypes.float8_e4m3fn)
    scale = (np.random.rand(m, k // 128) + 0.5).astype(np.float32)
    return x, scale


def test_grouped_gemm_numpy_sends_the_wire_and_returns_bf16(fake, client):
    m_sizes = [3, 0, 5, 1]
    x, x_scale = _fp8_inputs(m_sizes)
    out = client.grouped_gemm("layer.0", x, m_sizes, x_scale)

    (req,) = fake.requests
    assert req.method == "POST"
    assert req.url.path == "/v1/weights/layer.0/gemm"
    assert req.headers["content-type"] == "application/vnd.msgpack"
    assert req.headers["authorization"] == f"Bearer {TOKEN}"
    assert uuid.UUID(req.headers["x-request-id"])
    body = fake.bodies[0]
    assert set(body) == {"x", "x_scale", "m_sizes"}
    assert decode_tensor(body["x"]).numpy().tobytes() == x.tobytes()
    assert decode_tensor(body["x"]).dtype == "float8_e4m3fn"
    assert decode_tensor(body["x_scale"]).numpy().tobytes() == x_scale.tobytes()
    sizes = decode_tensor(body["m_sizes"])
    assert sizes.dtype == "int64" and sizes.numpy().tolist() == m_sizes

    assert isinstance(out, np.ndarray)
    assert out.dtype == ml_dtypes.bfloat16 and out.shape == (9, 256)
    assert out.tobytes() == fake.outputs[0].tobytes()


def test_numpy_calls_work_while_another_thread_is_importing_torch(fake, client, monkeypatch):
    """Mid-import, ``sys.modules["torch"]`` is a module without ``Tensor`` yet (a library
    importing torch lazily in another thread): numpy calls neither look into it nor fail."""
    import sys
    import types

    from moegemm.client._calls import moe_call

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    m_sizes = np.array([3, 0, 5, 1])
    x, x_scale = _fp8_inputs(m_sizes.tolist())
    out = client.grouped_gemm("layer.0", x, m_sizes, x_scale)
    assert out.tobytes() == fake.outputs[0].tobytes()
    call = moe_call("e", x[:2], np.array([[0, 1], [2, 3]]), np.full((2, 2), 0.5, np.float32),
                    x_scale[:2], None)
    body = unpackb(call.body)
    assert decode_tensor(body["topk_ids"]).numpy().tolist() == [[0, 1], [2, 3]]
    assert call.like_torch is None


def test_request_ids_are_fresh_and_x_scale_is_optional(fake, client):
    x = np.random.randn(4, 128).astype(np.float32)
    client.grouped_gemm("w", x, np.array([4], dtype=np.int32))
    client.grouped_gemm("w", x, (2, 2))
    assert "x_scale" not in fake.bodies[0] and "x_scale" not in fake.bodies[1]
    assert decode_tensor(fake.bodies[0]["x"]).dtype == "float32"
    assert decode_tensor(fake.bodies[0]["m_sizes"]).dtype == "int64"
    ids = {r.headers["x-request-id"] for r in fake.requests}
    assert len(ids) == 2


def test_m_sizes_must_be_integers(client):
    x = np.random.randn(4, 128).astype(np.float32)
    with pytest.raises(BadDtype, match="m_sizes") as info:
        client.grouped_gemm("w", x, [1.5, 2.5])
    assert isinstance(info.value, TypeError)  # a wrong argument, as Python's own
    with pytest.raises(BadDtype, match="float64"):  # what the server would answer, before sending
        client.grouped_gemm("w", x.astype(np.float64), [2, 2])


@needs_torch
def test_grouped_gemm_torch_in_torch_out(fake, client):
    m_sizes = torch.tensor([2, 0, 3], dtype=torch.int32)
    x = torch.randn(5, 256).to(torch.float8_e4m3fn)
    x_scale = torch.rand(5, 2) + 0.5
    out = client.grouped_gemm("w", x, m_sizes, x_scale)
    assert isinstance(out, torch.Tensor)
    assert out.dtype == torch.bfloat16 and out.device.type == "cpu"
    assert tuple(out.shape) == (5, 256)
    assert out.view(torch.uint8).numpy().tobytes() == fake.outputs[0].tobytes()
    out.add_(1)  # writable, not a view on the response body
    body = fake.bodies[0]
    assert decode_tensor(body["x"]).numpy().tobytes() == x.view(torch.uint8).numpy().tobytes()
    assert decode_tensor(body["m_sizes"]).dtype == "int64"
    with pytest.raises(TypeError, match="m_sizes"):
        client.grouped_gemm("w", x, torch.tensor([2.0, 3.0]), x_scale)


@needs_torch
def test_torch_zero_rows(fake, client):
    out = client.grouped_gemm("w", torch.randn(0, 128), torch.tensor([0, 0]))
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (0, 256)


def test_weights_endpoints(fake, client, tmp_path):
    w = np.random.randn(2, 128, 256).astype(ml_dtypes.float8_e4m3fnuz)
    w_scale = (np.random.rand(2, 2, 1) + 0.1).astype(np.float32)
    assert client.load_weights("e0", w, w_scale) == {"name": "e0", "G": 4}
    body = fake.bodies[-1]
    assert fake.requests[-1].method == "PUT"
    assert fake.requests[-1].headers["content-type"] == "application/vnd.msgpack"
    assert decode_tensor(body["w"]).dtype == "float8_e4m3fnuz"
    assert decode_tensor(body["w"]).numpy().tobytes() == w.tobytes()
    assert decode_tensor(body["w_scale"]).shape == [2, 2, 1]

    client.load_weights("e1", np.random.randn(1, 128, 128).astype(np.float16))
    assert set(fake.bodies[-1]) == {"w"}

    client.load_weights_file("e2", pathlib.Path("layer3/experts.safetensors"), "wq", "ws")
    assert fake.bodies[-1] == {"file": "layer3/experts.safetensors", "w": "wq", "w_scale": "ws"}
    client.load_weights_file("e3", "a.safetensors", "wq")
    assert fake.bodies[-1] == {"file": "a.safetensors", "w": "wq"}

    assert client.weights() == [{"name": "w0", "G": 4, "N": 256, "K": 512}]
    assert client.delete_weights("e0") is None
    assert (fake.requests[-1].method, fake.requests[-1].url.path) == ("DELETE", "/v1/weights/e0")
    assert client.health() == {"path": "/v1/health/ready"}
    assert client.live() == {"path": "/v1/health/live"}
    assert client.info() == {"path": "/v1/info"}
    # No body, no content type on GET.
    assert "content-type" not in fake.requests[-1].headers


def test_weights_accepts_an_envelope(fake, client):
    fake.reply = lambda r: httpx.Response(200, json={"weights": [{"name": "a"}]})
    assert client.weights() == [{"name": "a"}]


def test_a_checkpoint_layer_is_any_integer_and_nothing_else(fake, client):

    client.load_experts_checkpoint("e", "model", np.int64(3))
    assert unpackb(fake.requests[-1].content) == {"checkpoint": "model", "layer": 3}
    sent = len(fake.requests)
    for bad in (True, 3.0, "3", np.float32(3)):
        with pytest.raises(TypeError):
            client.load_experts_checkpoint("e", "model", bad)
    assert len(fake.requests) == sent


def test_file_tensor_keys_are_strings_and_nothing_else(fake, client):
    sent = len(fake.requests)
    for keys in ((None,), (3,), (b"w",), ("w", 3), ("w", b"s")):
        with pytest.raises(TypeError, match="names a tensor"):
            client.load_weights_file("e", "f.safetensors", *keys)
    assert len(fake.requests) == sent


def test_names_cannot_change_the_route(fake, client):
    sent = len(fake.requests)
    for step in (".", ".."):  # they match the pattern, but are path steps (the server's rule)
        with pytest.raises(mc.BadName, match="path step"):
            client.delete_weights(step)
        with pytest.raises(mc.BadName, match="path step"):
            client.delete_experts(step)
    assert len(fake.requests) == sent
    client.delete_weights("Layer-3_e.v2")
    assert fake.requests[-1].url.path == "/v1/weights/Layer-3_e.v2"
    sent = len(fake.requests)
    x = np.random.randn(1, 128).astype(np.float32)
    for bad in ["a/b", "", "x" * 129, "x" * 129 + ".w3", "sp ace", "caf\u00e9", "a?b"]:
        with pytest.raises(mc.BadName):
            client.grouped_gemm(bad, x, [1])
        with pytest.raises(mc.BadName):
            client.load_weights_file(bad, "f.safetensors", "w")
    assert len(fake.requests) == sent  # refused before anything went out
    client.delete_weights("x" * 128)
    # A 128-character expert set's matrices (SPEC 5) go out as they are.
    client.delete_weights("x" * 128 + ".w13")
    assert fake.requests[-1].url.path == "/v1/weights/" + "x" * 128 + ".w13"


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [
        (400, "bad_shape", mc.BadShape),
        (400, "bad_m_sizes", mc.BadMSizes),
        (401, "unauthorized", mc.Unauthorized),
        (404, "no_such_weights", mc.NoSuchWeights),
        (413, "too_large", mc.TooLarge),
        (415, "unsupported_media_type", mc.UnsupportedMediaType),
        (503, "overloaded", mc.Overloaded),
        (504, "timeout", mc.DeadlineExceeded),
        (507, "out_of_memory", mc.OutOfMemory),
    ],
)
def test_error_answers_raise_the_mapped_class(fake, client, status, code, cls):
    fake.reply = _error_reply(status, code, f"detail {code}", {"retry-after": "3"})
    x, x_scale = _fp8_inputs([2])
    with pytest.raises(cls) as info:
        client.grouped_gemm("w", x, [2], x_scale)
    err = info.value
    assert (err.status, err.code, err.message) == (status, code, f"detail {code}")
    assert err.request_id == fake.requests[-1].headers["x-request-id"]
    assert err.retry_after == 3.0


def test_non_json_error_maps_by_status(fake, client):
    fake.reply = lambda r: httpx.Response(502, text="<html>bad gateway</html>")
    with pytest.raises(APIError) as info:
        client.info()
    assert info.value.status == 502 and "bad gateway" in info.value.message
    assert info.value.request_id == fake.requests[-1].headers["x-request-id"]

    fake.reply = lambda r: httpx.Response(503, text="starting")
    with pytest.raises(mc.Unavailable):
        client.health()


def test_an_answer_outside_the_contract_is_named_by_its_status(fake, client):
    """A review: a redirect (an ingress's http -> https) counted as success, so a delete
    returned as if done; a proxy's bare 502 read code "internal"; a gateway's bare 504 read as
    the server's `timeout`, though the call may have run."""
    fake.reply = lambda r: httpx.Response(301, headers={"location": "https://moegemm.test/"})
    for call in (lambda: client.delete_weights("w"), client.weights, client.info):
        with pytest.raises(APIError) as info:
            call()
        assert (type(info.value), info.value.status, info.value.code) == (APIError, 301, "http_301")
        assert "https://moegemm.test/" in info.value.message
    fake.reply = lambda r: httpx.Response(502, text="<html>bad gateway</html>")
    with pytest.raises(APIError) as info:
        client.info()
    assert (type(info.value), info.value.code) == (APIError, "http_502")
    fake.reply = lambda r: httpx.Response(504, text="gateway timeout")
    with pytest.raises(APIError) as info:
        client.info()
    assert (type(info.value), info.value.code) == (APIError, "http_504")


def test_what_the_wire_cannot_carry_is_refused_before_sending(fake, client):
    """A review: a tensor past a msgpack bin's 4 GiB raised struct.error; torch bools were
    read as sizes and ids; a request id with spaces at its ends came back as another id."""
    huge = np.broadcast_to(np.zeros(1, np.float32), (1, 32768, 32896))  # 4.02 GiB, no memory
    with pytest.raises(mc.TooLarge, match="load_weights_file"):
        client.load_weights("huge", huge)
    torch = pytest.importorskip("torch")
    x = np.random.randn(2, 128).astype(np.float32)
    with pytest.raises(mc.ArgumentDtype):
        client.grouped_gemm("w", x, torch.tensor([True, True]))
    with pytest.raises(mc.ArgumentDtype):
        client.moe("w", x, torch.ones(2, 1, dtype=torch.bool), np.ones((2, 1), np.float32))
    with pytest.raises(ValueError, match="request_id"):
        client.grouped_gemm("w", x, [2], request_id=" abc ")
    assert fake.requests == []


def test_unreadable_success_is_an_internal_error(fake, client):
    fake.reply = lambda r: httpx.Response(
        200, content=b"\x92\x01\x02", headers={"content-type": "application/vnd.msgpack"}
    )
    with pytest.raises(mc.InternalError):
        client.grouped_gemm("w", np.random.randn(1, 128).astype(np.float32), [1])
    fake.reply = lambda r: httpx.Response(200, json={"out": 1})
    with pytest.raises(mc.InternalError, match="not msgpack"):
        client.grouped_gemm("w", np.random.randn(1, 128).astype(np.float32), [1])


def test_transport_failure_raises_transport_error(fake, client):
    def reply(request):
        raise httpx.ConnectError("connection refused", request=request)

    fake.reply = reply
    with pytest.raises(TransportError) as info:
        client.info()
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert not isinstance(info.value, APIError)


def test_no_token_no_authorization_and_custom_headers(fake):
    transport = httpx.MockTransport(fake)
    with Client(URL + "/", headers={"X-Tenant": "t1"}, transport=transport) as c:
        c.info()
    req = fake.requests[-1]
    assert "authorization" not in req.headers
    assert req.headers["x-tenant"] == "t1"
    assert str(req.url) == URL + "/v1/info"


def test_a_given_header_replaces_the_clients_own_of_any_spelling(fake):
    """A review: ``headers={"authorization": ...}`` beside ``token=`` sent both headers
    through httpx (the server read the token's) and only the given one on the lane."""
    transport = httpx.MockTransport(fake)
    with Client(URL, token=TOKEN, headers=[("authorization", "Bearer given"), ("accept", "*/*")],
                transport=transport) as c:
        c.info()
    req = fake.requests[-1]
    assert req.headers.get_list("authorization") == ["Bearer given"]
    assert req.headers.get_list("accept") == ["*/*"]


def test_async_client_mirrors_the_sync_one(fake):
    async def scenario():
        transport = httpx.MockTransport(fake)
        async with AsyncClient(URL, token=TOKEN, transport=transport) as c:
            x, x_scale = _fp8_inputs([1, 2])
            out = await c.grouped_gemm("w", x, [1, 2], x_scale)
            await c.load_weights("w", np.random.randn(1, 128, 128).astype(np.float32))
            await c.load_weights_file("w", "f.safetensors", "k")
            listed = await c.weights()
            await c.delete_weights("w")
            health, info = await c.health(), await c.info()
            fake.reply = _error_reply(404, "no_such_weights", "no w")
            with pytest.raises(mc.NoSuchWeights) as err:
                await c.grouped_gemm("w", x, [1, 2], x_scale)
            return out, listed, health, info, err.value

    out, listed, health, info, err = asyncio.run(scenario())
    assert out.dtype == ml_dtypes.bfloat16 and out.tobytes() == fake.outputs[0].tobytes()
    assert listed[0]["name"] == "w0"
    assert health == {"path": "/v1/health/ready"} and info == {"path": "/v1/info"}
    assert err.request_id == fake.requests[-1].headers["x-request-id"]
    assert all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in fake.requests)
    assert [r.method for r in fake.requests] == [
        "POST",
        "PUT",
        "PUT",
        "GET",
        "DELETE",
        "GET",
        "GET",
        "POST",
    ]


def test_async_transport_failure():
    def reply(request):
        raise httpx.ReadTimeout("slow", request=request)

    async def scenario():
        async with AsyncClient(URL, transport=httpx.MockTransport(reply)) as c:
            await c.info()

    with pytest.raises(TransportError):
        asyncio.run(scenario())


class _InfoHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so the client can reuse its connection

    def do_GET(self):
        body = json.dumps({"peer_port": self.client_address[1]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture
def real_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _InfoHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_real_socket_is_reused_and_no_delay(real_server):
    with Client(real_server) as c:
        first, second = c.info(), c.info()
        assert first["peer_port"] == second["peer_port"]  # one connection, reused
        (sock,) = c._lane._idle  # plain http:// goes over the lean lane (_lane.py)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_a_closed_client_refuses_calls_on_every_transport(real_server, fake):
    """Use after close() is the caller's mistake, said the same way whichever transport
    the client took: the lean lane (plain http, which could reconnect) and httpx (which
    raises RuntimeError itself)."""
    lane = Client(real_server)
    assert lane._lane is not None and lane.info()["peer_port"]
    mocked = Client(URL, transport=httpx.MockTransport(fake))
    assert mocked._lane is None and mocked.info() == {"path": "/v1/info"}
    for c in (lane, mocked):
        c.close()
        with pytest.raises(RuntimeError, match="closed"):
            c.info()

    async def scenario():
        async with AsyncClient(real_server) as a:
            assert (await a.info())["peer_port"]
        with pytest.raises(RuntimeError, match="closed"):
            await a.info()

    asyncio.run(scenario())


def test_real_connection_refused_is_transport_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connecting is refused
        with Client(f"http://127.0.0.1:{port}", timeout=5) as c, pytest.raises(TransportError):
            c.live()


@pytest.mark.parametrize("m", [1, 40, 300])  # answers under and over 64 KiB
def test_repeated_answers_decode_alike_and_lookalikes_are_decoded_in_full(fake, client, m):
    """Gemm answers are decoded in full once per length and head; later ones of the
    same length and head reuse that, and every other answer -- same length, other
    dtype or a damaged head -- is decoded (or refused) as the first was."""
    x, scale = _fp8_inputs([m])
    for _ in range(3):
        out = client.grouped_gemm("w", x, [m], x_scale=scale)
        assert out.dtype == ml_dtypes.bfloat16 and out.flags.writeable
        np.testing.assert_array_equal(out.view(np.uint16), fake.outputs[-1].view(np.uint16))
    half = np.random.randn(m, fake.n).astype(np.float16)  # same length, another head
    answers = [packb({"out": encode_tensor(half)})]
    damaged = bytearray(answers[0])
    damaged[1:4] = b"\xa3o_t"[:3]  # {"o_t": ...}: the same length, no "out"
    answers.append(bytes(damaged))
    fake.reply = lambda r: httpx.Response(
        200, content=answers.pop(0), headers={"content-type": "application/vnd.msgpack"})
    # Decoded in full (the cached bf16 head would have read it as bf16), then refused:
    # an answer is bf16.
    with pytest.raises(mc.InternalError, match=rf"out is float16 \[{m}, {fake.n}\]"):
        client.grouped_gemm("w", x, [m], x_scale=scale)
    with pytest.raises(mc.InternalError, match="'out'"):
        client.grouped_gemm("w", x, [m], x_scale=scale)


def test_answers_received_into_a_buffer_decode_as_views_on_it():
    """The lane hands large answers over as a view on its own buffer, which the caller may
    write."""
    from moegemm.client._calls import decode_out

    out = np.random.randn(300, 256).astype(ml_dtypes.bfloat16)
    raw = np.frombuffer(packb({"out": encode_tensor(out)}), np.uint8).copy()
    for _ in range(2):
        got = decode_out(memoryview(raw))
        assert got.dtype == "bfloat16" and got.shape == [300, 256]
        arr = got.numpy()
        assert arr.flags.writeable and np.shares_memory(arr, raw)
        np.testing.assert_array_equal(arr.view(np.uint16), out.view(np.uint16))


def test_request_ids_the_caller_gives_are_the_ones_sent(fake):
    """SPEC 2.1: a request may carry its own X-Request-Id. A call's request_id= wins,
    then one among the client's headers (sent once, never beside a generated one)."""
    x, scale = _fp8_inputs([2, 1])
    with Client(URL, headers={"x-request-id": "router-7"},
                transport=httpx.MockTransport(fake)) as c:
        c.grouped_gemm("w", x, [2, 1], scale)
        c.weights()
        c.grouped_gemm("w", x, [2, 1], scale, request_id="call-9")
        fake.reply = _error_reply(400, "bad_shape", "no")
        with pytest.raises(mc.BadShape) as info:
            c.grouped_gemm("w", x, [2, 1], scale, request_id="call-10")
        assert info.value.request_id == "call-10"
        with pytest.raises(ValueError, match="request_id"):
            c.grouped_gemm("w", x, [2, 1], scale, request_id="two\nlines")
    sent = [r.headers.get_list("x-request-id") for r in fake.requests]
    assert sent == [["router-7"], ["router-7"], ["call-9"], ["call-10"]]


def test_a_client_deadline_bounds_every_call_but_loads():
    """``Client(deadline=s)`` bounds weights(), info(), deletes and health as well as the
    compute calls; a load, which answers once the server compiled and captured, waits
    ``load_timeout`` instead."""
    import time

    def slow(request):
        time.sleep(0.6)
        if request.method == "PUT":
            return httpx.Response(201, json={"name": "w"})
        return httpx.Response(200, json=[])

    with Client(URL, deadline=0.3, transport=httpx.MockTransport(slow)) as c:
        for call in (c.weights, c.info, lambda: c.delete_weights("w")):
            started = time.monotonic()
            with pytest.raises(mc.DeadlineExceeded):
                call()
            assert time.monotonic() - started < 2
        assert c.load_weights("w", np.zeros((1, 128, 128), ml_dtypes.bfloat16)) == {"name": "w"}


@pytest.mark.parametrize("out", [np.zeros((2, 256), ml_dtypes.bfloat16),    # rows != M
                                 np.zeros((3, 256), np.float32),             # not bf16
                                 np.zeros((3,), ml_dtypes.bfloat16)])        # not 2-D
def test_an_answer_not_shaped_as_asked_is_an_internal_error(fake, client, out):
    fake.reply = lambda request: httpx.Response(
        200, content=packb({"out": encode_tensor(out)}),
        headers={"content-type": "application/vnd.msgpack"})
    x, scale = _fp8_inputs([2, 1])
    with pytest.raises(mc.InternalError, match="expected bfloat16"):
        client.grouped_gemm("w", x, [2, 1], scale)


def test_arguments_refused_before_anything_is_sent(fake, client):
    x, scale = _fp8_inputs([2, 1])
    with pytest.raises(mc.BadMSizes, match="past int64"):
        client.grouped_gemm("w", x, np.array([2**63 + 1, 1], np.uint64), scale)
    with pytest.raises(TypeError, match="deadline"):
        client.grouped_gemm("w", x, [2, 1], scale, deadline="1")
    assert fake.requests == []


def test_an_error_keeps_the_status_it_was_answered_with(fake, client):
    fake.reply = _error_reply(404, "bad_shape", "odd proxy")
    with pytest.raises(mc.BadShape) as info:
        client.weights()
    assert info.value.status == 404 and info.value.code == "bad_shape"


def test_a_transport_error_carries_its_request_id():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connecting is refused
        with Client(f"http://127.0.0.1:{port}", timeout=5) as c, \
                pytest.raises(TransportError) as info:
            c.grouped_gemm("w", *_fp8_inputs([1])[:1], [1], _fp8_inputs([1])[1],
                           request_id="mine-1")
    assert info.value.request_id == "mine-1"


def test_an_answer_nested_past_the_json_parser_is_an_internal_error():
    """A 200 whose JSON nests deeper than the parser's stack is the server's fault, raised
    in the tree (it was a bare RecursionError); an error answer so nested keeps its status."""
    import httpx
    from moegemm.client import InternalError, NotFound

    def handle(request):
        status = 404 if request.method == "DELETE" else 200
        return httpx.Response(status, content=b"[" * 100_000,
                              headers={"content-type": "application/json"})

    with Client("http://x", transport=httpx.MockTransport(handle)) as c:
        with pytest.raises(InternalError):
            c.weights()
        with pytest.raises(NotFound):
            c.delete_weights("w")
