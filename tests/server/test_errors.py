"""Every error of SPEC 2.2, with the input that causes it; loaded weights never change."""

from __future__ import annotations

import dataclasses
import threading
import time

import msgpack
import pytest
import torch
from moegemm.client._wire import packb
from moegemm.server import Settings
from server_support import MSGPACK, assert_error, fp8_problem, out_of, serve, wire

N, K, G = 128, 256, 3


@pytest.fixture(scope="module")
def loaded(server):
    """A fp8 weight set 'base' and a matching fp8 call."""
    p = fp8_problem(20, N, K, G)
    assert server.put("base", {"w": wire(p.wq), "w_scale": wire(p.w_scale)}).status_code in (
        200, 201)
    return p


@pytest.fixture
def unchanged(server, loaded):
    """After the test: the same WeightSet objects are loaded and 'base' still answers."""
    before = {ws.name: ws for ws in server.services.store.list()}
    yield
    after = {ws.name: ws for ws in server.services.store.list()}
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    p = loaded
    out = out_of(server.gemm("base", call(p)))
    from server_support import close_to, reference

    assert close_to(out, reference(p.xq, p.x_scale, p.wq, p.w_scale, p.m_sizes))


def call(p, **override):
    body = {"x": wire(p.xq), "x_scale": wire(p.x_scale), "m_sizes": wire(p.m_sizes)}
    body.update(override)
    return {k: v for k, v in body.items() if v is not None}


def raw_post(server, path, content, content_type="application/vnd.msgpack"):
    return server.http.post(path, content=content, headers={"content-type": content_type})


@pytest.mark.parametrize("body", [
    b"\xc1",                                          # a never-used msgpack byte
    packb({"x": 1, "m_sizes": 2})[:-1],               # truncated
    packb([1, 2, 3]),                                 # not a map
    msgpack.packb(msgpack.ExtType(5, b"abc")),        # ext type
    packb({"x": 1}) + b"\x00",                        # trailing bytes
    b"",                                              # nothing
])
def test_bad_msgpack(server, unchanged, body):
    assert_error(raw_post(server, "/v1/weights/base/gemm", body), 400, "bad_msgpack")
    r = server.http.put("/v1/weights/base", content=body, headers=MSGPACK)
    assert_error(r, 400, "bad_msgpack")


@pytest.mark.parametrize("body, says", [(b"\xc1", "starts no msgpack value"),
                                        (b"\x91" * 3_000, "nested too deeply"),
                                        (b"\x91" * 100_000, "over 4096 msgpack values")])
def test_bad_msgpack_says_what_is_wrong(server, unchanged, body, says):
    r = raw_post(server, "/v1/weights/base/gemm", body)
    assert_error(r, 400, "bad_msgpack")
    assert says in r.json()["error"]["message"]


def test_messages_quoting_client_input_stay_small(server, unchanged, loaded):
    """A megabyte dtype name or field name is quoted, but cut where it is quoted: the answer
    (and the log line) stays small whatever was sent, and still says what is expected."""
    p, vast = loaded, "q" * (1 << 20)
    wrong_dtype = {**wire(p.xq), "dtype": vast}
    for r, code in ((server.gemm("base", call(p, x=wrong_dtype)), "bad_dtype"),
                    (server.gemm("base", call(p, **{vast: 1})), "bad_field"),
                    (server.put("base", {"w": wrong_dtype, "w_scale": wire(p.w_scale)}),
                     "bad_dtype"),
                    (server.put("base", {"w": wire(p.wq), "w_scale": wire(p.w_scale),
                                         vast: 1}), "bad_field")):
        assert_error(r, 400, code)
        assert len(r.content) < 1200, len(r.content)
        message = r.json()["error"]["message"]
        assert ("is not one of" if code == "bad_dtype" else "this endpoint takes") in message


def test_bad_field(server, unchanged, loaded):
    p = loaded
    for body in (call(p, m_sizes=None), call(p, extra=1), {"m_sizes": wire(p.m_sizes)},
                 call(p, x_scale=None)):  # fp8 x without its scales
        assert_error(server.gemm("base", body), 400, "bad_field")
    x = torch.randn(20, K, dtype=torch.bfloat16)
    assert_error(server.gemm("base", call(p, x=wire(x))), 400, "bad_field")  # scale for bf16
    w = torch.randn(G, N, K, dtype=torch.bfloat16)
    assert_error(server.put("base", {"w": wire(w), "w_scale": wire(p.w_scale)}), 400, "bad_field")
    assert_error(server.put("base", {"w": wire(p.wq)}), 400, "bad_field")  # fp8 without scale
    assert_error(server.put("base", {"w_scale": wire(p.w_scale)}), 400, "bad_field")
    assert_error(server.put("base", {"w": "key"}), 400, "bad_field")  # a key without a file
    assert_error(server.put("base", {"file": "f.safetensors", "w": 3}), 400, "bad_field")
    for deadline in ("soon", "0", "-0", "-3", "nan", "inf", "1e400", ""):  # not a positive number
        assert_error(server.gemm("base", call(p), headers={"X-Deadline-Ms": deadline}), 400,
                     "bad_field")


def test_nil_optional_fields_are_absent(server, unchanged, loaded):
    """An optional field sent as nil is absent (a router's Option<T>): float weights and bf16
    rows with nil scales work, fp8 with a nil scale is fp8 without its scale (bad_field), and
    nil where a tensor is required is no tensor (bad_tensor)."""
    p = loaded
    w = torch.randn(G, N, K, dtype=torch.bfloat16)
    assert server.put("nil", {"w": wire(w), "w_scale": None}).status_code == 201
    x, sizes = torch.randn(5, K, dtype=torch.bfloat16), torch.tensor([2, 0, 3])
    plain = {"x": wire(x), "m_sizes": wire(sizes)}
    assert torch.equal(out_of(server.gemm("nil", {**plain, "x_scale": None})),
                       out_of(server.gemm("nil", plain)))
    assert server.http.delete("/v1/weights/nil").status_code == 204
    assert_error(server.gemm("base", {**call(p), "x_scale": None}), 400, "bad_field")
    assert_error(server.put("base", {"w": wire(p.wq), "w_scale": None}), 400, "bad_field")
    assert_error(server.gemm("base", {**call(p), "x": None}), 400, "bad_tensor")
    assert_error(server.put("base", {"w": None, "w_scale": wire(p.w_scale)}), 400, "bad_tensor")


def test_non_string_keys_are_unknown_fields(server, unchanged, loaded):
    """A map with an int or bin key is still one msgpack map (not bad_msgpack): at the top
    such a key is a field the endpoint does not know, in a tensor map a malformed tensor."""
    p = loaded
    for body in (call(p) | {1: 2}, {b"x": wire(p.xq), b"x_scale": wire(p.x_scale),
                                    b"m_sizes": wire(p.m_sizes)}):
        r = server.gemm("base", body)
        assert_error(r, 400, "bad_field")
        assert "unknown" in r.json()["error"]["message"]
    assert_error(server.put("base", {"w": wire(p.wq), "w_scale": wire(p.w_scale), 7: 0}), 400,
                 "bad_field")
    x = wire(p.xq)
    assert_error(server.gemm("base", call(p, x={**x, b"shape": x["shape"]})), 400, "bad_tensor")


def test_bad_tensor(server, unchanged, loaded):
    good = wire(loaded.xq)
    for broken in (
        {**good, "shape": "20x256"},
        {**good, "shape": [20, -256]},
        {**good, "shape": [20, 256.0]},
        {**good, "data": "not bin"},
        {**good, "data": bytes(good["data"])[:-1]},
        {**good, "extra": 1},
        {"dtype": good["dtype"], "shape": good["shape"]},
        [1, 2],
    ):
        assert_error(server.gemm("base", call(loaded, x=broken)), 400, "bad_tensor")
    w = wire(loaded.wq)
    assert_error(server.put("base", {"w": {**w, "shape": [G, N]}, "w_scale": wire(
        loaded.w_scale)}), 400, "bad_tensor")


def test_bad_dtype(server, unchanged, loaded):
    p = loaded
    x64 = {"dtype": "float64", "shape": [20, K], "data": bytes(20 * K * 8)}
    assert_error(server.gemm("base", call(p, x=x64)), 400, "bad_dtype")
    ints = torch.randint(-5, 5, (20, K), dtype=torch.int32)
    assert_error(server.gemm("base", call(p, x=wire(ints), x_scale=None)), 400, "bad_dtype")
    assert_error(server.gemm("base", call(p, m_sizes=wire(p.m_sizes.float()))), 400, "bad_dtype")
    assert_error(server.gemm("base", call(p, x_scale=wire(p.x_scale.half()))), 400, "bad_dtype")
    assert_error(server.put("base", {"w": wire(p.wq), "w_scale": wire(p.w_scale.bfloat16())}),
                 400, "bad_dtype")
    assert_error(server.put("base", {"w": wire(torch.randint(0, 9, (G, N, K)))}), 400,
                 "bad_dtype")


def test_bad_shape(server, unchanged, loaded):
    p = loaded
    other_k = fp8_problem(20, N, 128, G)
    assert_error(server.gemm("base", call(other_k)), 400, "bad_shape")  # K differs from the set
    assert_error(server.gemm("base", call(p, x=wire(p.xq.reshape(-1)))), 400, "bad_shape")
    assert_error(server.gemm("base", call(p, m_sizes=wire(torch.tensor([10, 10])))), 400,
                 "bad_shape")
    assert_error(server.gemm("base", call(p, x_scale=wire(p.x_scale[:, :1]))), 400, "bad_shape")
    w = torch.randn(2, 100, 256, dtype=torch.bfloat16)  # N % 128 != 0
    assert_error(server.put("base", {"w": wire(w)}), 400, "bad_shape")
    assert_error(server.put("base", {"w": wire(torch.randn(128, 256).bfloat16())}), 400,
                 "bad_shape")
    assert_error(server.put("base", {"w": wire(torch.randn(0, 128, 128).bfloat16())}), 400,
                 "bad_shape")
    assert_error(server.put("base", {"w": wire(p.wq), "w_scale": wire(p.w_scale[:, :, :0])}),
                 400, "bad_shape")


def test_bad_m_sizes(server, unchanged, loaded):
    p = loaded
    for sizes in ([25, -5, 0], [10, 5, 4], [10, 5, 6]):
        r = server.gemm("base", call(p, m_sizes=wire(torch.tensor(sizes))))
        assert_error(r, 400, "bad_m_sizes")


def test_not_finite(server, unchanged, loaded):
    p = loaded
    for poison in (float("nan"), float("inf"), 0.0, -1.0):
        scale = p.x_scale.clone()
        scale[3, 1] = poison
        assert_error(server.gemm("base", call(p, x_scale=wire(scale))), 400, "not_finite")
        w_scale = p.w_scale.clone()
        w_scale[1, 0, 0] = poison
        assert_error(server.put("base", {"w": wire(p.wq), "w_scale": wire(w_scale)}), 400,
                     "not_finite")
    for poison in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(20, K, dtype=torch.bfloat16)
        x[7, 200] = poison
        assert_error(server.gemm("base", call(p, x=wire(x), x_scale=None)), 400, "not_finite")
        w = torch.randn(G, N, K)
        w[2, 5, 9] = poison
        assert_error(server.put("base", {"w": wire(w)}), 400, "not_finite")
    # fp8 rows' codes are not checked (SPEC 2.2 names their scales): a NaN code is answered,
    # NaN in its own row only, as the float64 reference has it.
    xq = p.xq.clone()
    xq.view(torch.uint8)[0, 0] = 0x7F  # NaN in e4m3fn
    got = server.gemm("base", call(p, x=wire(xq)))
    assert got.status_code == 200, got.content[:200]


@pytest.mark.parametrize("name", ["a%20b", "a$b", "x" * 129, "%C3%A9t%C3%A9"])
def test_bad_name(server, unchanged, loaded, name):
    assert_error(server.put(name, {"w": wire(loaded.wq), "w_scale": wire(loaded.w_scale)}),
                 400, "bad_name")
    assert_error(server.gemm(name, call(loaded)), 400, "bad_name")
    assert_error(server.http.delete(f"/v1/weights/{name}"), 400, "bad_name")


def test_no_such_weights(server, unchanged, loaded):
    assert_error(server.gemm("missing", call(loaded)), 404, "no_such_weights")
    assert_error(server.http.delete("/v1/weights/missing"), 404, "no_such_weights")


def test_too_large(server, unchanged, loaded):
    limit = server.services.settings.max_body_bytes
    x = torch.randn(limit // (2 * K) + 8, K, dtype=torch.bfloat16)
    body = {"x": wire(x), "m_sizes": wire(torch.tensor([x.shape[0], 0, 0]))}
    assert_error(server.gemm("base", body), 413, "too_large")

    # Without Content-Length (a chunked upload) the body limit holds too: a body over it whose
    # rows are within max_m, padded by a field the decoder would refuse (400). That it holds
    # while streaming, before the body's end: test_hostile.py.
    small = fp8_problem(64, N, K, G)
    padded = {**call(small), "padding": b"\0" * (limit + (1 << 20))}

    def chunks():
        data = packb(padded)
        step = 1 << 20
        for i in range(0, len(data), step):
            yield data[i:i + step]

    r = server.http.post("/v1/weights/base/gemm", content=chunks(), headers=MSGPACK)
    assert_error(r, 413, "too_large")
    assert f"over {limit} bytes" in r.json()["error"]["message"], r.text
    # More rows than max_m in a body under the limit.
    rows = server.services.settings.max_m + 1
    p = fp8_problem(rows, N, K, G)
    assert_error(server.gemm("base", call(p)), 413, "too_large")


@pytest.mark.parametrize("content_type", ["application/json", "text/plain", None])
def test_unsupported_media_type(server, unchanged, loaded, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    r = server.http.post("/v1/weights/base/gemm", content=packb(call(loaded)), headers=headers)
    assert_error(r, 415, "unsupported_media_type")
    r = server.http.put("/v1/weights/base", content=packb({"w": wire(loaded.wq)}), headers=headers)
    assert_error(r, 415, "unsupported_media_type")


def test_other_msgpack_media_types_are_accepted(server, unchanged, loaded):
    for media in ("application/msgpack", "application/x-msgpack; charset=binary"):
        r = server.http.post("/v1/weights/base/gemm", content=packb(call(loaded)),
                             headers={"content-type": media})
        assert r.status_code == 200, r.text


def test_out_of_memory_leaves_other_sets(server, unchanged, loaded):
    store = server.services.store
    real = store.backend

    def no_memory(wq, w_scale):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    store.backend = dataclasses.replace(real, prepare_weights=no_memory)
    try:
        r = server.put("base", {"w": wire(torch.randn(G, N, K).bfloat16())})
        assert_error(r, 507, "out_of_memory")
        r = server.put("newset", {"w": wire(torch.randn(G, N, K).bfloat16())})
        assert_error(r, 507, "out_of_memory")
    finally:
        store.backend = real
    # Capturing the graphs of a new set runs out of memory.
    executor = server.services.engine._executor
    executor.prepare = lambda *args: no_memory(None, None)
    try:
        r = server.put("newset", {"w": wire(torch.randn(G, N, K).bfloat16())})
        assert_error(r, 507, "out_of_memory")
    finally:
        del executor.prepare
    assert "newset" not in [ws.name for ws in store.list()]


def test_internal_errors_answer_500(server, unchanged, loaded):
    executor = server.services.engine._executor
    executor.run = _raise  # the kernel blows up
    try:
        assert_error(server.gemm("base", call(loaded)), 500, "internal")
    finally:
        del executor.run
    store = server.services.store
    store.list = _raise  # a bug outside the engine
    try:
        assert_error(server.http.get("/v1/weights"), 500, "internal")
    finally:
        del store.list


def _raise(*args, **kwargs):
    raise RuntimeError("boom")


def _blocking_engine(engine):
    """Make the engine's next batch wait for the returned event."""
    release, entered = threading.Event(), threading.Event()
    executor = engine._executor
    real = executor.run

    def run(*args):
        entered.set()
        release.wait(30)
        return real(*args)

    executor.run = run
    return release, entered


def test_overloaded_and_timeout():
    p = fp8_problem(9, N, K, G)
    settings = Settings(device="cpu", demo=False, queue_size=1)
    with serve(settings) as srv:
        assert srv.put("base", {"w": wire(p.wq), "w_scale": wire(p.w_scale)}).status_code == 201
        engine = srv.services.engine
        release, entered = _blocking_engine(engine)
        results = {}

        def send(key, **kw):
            results[key] = srv.gemm("base", call(p), **kw)

        first = threading.Thread(target=send, args=("running",))
        first.start()
        assert entered.wait(30)
        queued = threading.Thread(target=send, args=("queued",),
                                  kwargs={"headers": {"X-Deadline-Ms": "50"}})
        queued.start()
        while engine.queued() < 1:
            time.sleep(0.005)
        r = srv.gemm("base", call(p))
        assert_error(r, 503, "overloaded")
        assert int(r.headers["retry-after"]) >= 1
        time.sleep(0.1)  # the queued call's 50 ms pass while the worker is busy
        del engine._executor.run
        release.set()
        first.join(30)
        queued.join(30)
        assert results["running"].status_code == 200
        assert_error(results["queued"], 504, "timeout")
        # The queue drained: calls run again.
        assert srv.gemm("base", call(p)).status_code == 200


def test_not_ready_until_startup_loading_is_done(monkeypatch):
    from moegemm.server.store import WeightStore

    release = threading.Event()
    real = WeightStore.build_demo

    def slow_demo(self, *args, **kwargs):
        release.wait(30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(WeightStore, "build_demo", slow_demo)
    with serve(Settings(device="cpu"), wait=False) as srv:
        assert_error(srv.http.get("/v1/health/ready"), 503, "not_ready")
        assert srv.http.get("/v1/health/ready").headers["retry-after"] == "1"
        assert srv.http.get("/v1/health/live").status_code == 200
        assert_error(srv.http.get("/v1/weights"), 503, "not_ready")
        x = torch.randn(4, 512)
        r = srv.gemm("demo", {"x": wire(x), "m_sizes": wire(torch.tensor([4] + [0] * 7))})
        assert_error(r, 503, "not_ready")
        release.set()
        srv.wait_ready()
        assert out_of(srv.gemm("demo", {"x": wire(x), "m_sizes": wire(
            torch.tensor([4] + [0] * 7))})).shape == (4, 256)


def test_unauthorized():
    p = fp8_problem(8, N, K, G)
    settings = Settings(device="cpu", demo=False, token="reader-secret",
                        admin_token="admin-secret")
    with serve(settings) as srv:
        reader = {"authorization": "Bearer reader-secret"}
        admin = {"authorization": "Bearer admin-secret"}
        body = {"w": wire(p.wq), "w_scale": wire(p.w_scale)}
        for headers in ({}, {"authorization": "Bearer wrong"}, reader,
                        {"authorization": "Basic admin-secret"}):
            r = srv.put("base", body, headers=headers)
            assert_error(r, 401, "unauthorized")
            assert r.headers["www-authenticate"] == "Bearer"
        assert srv.put("base", body, headers=admin).status_code == 201
        for headers in ({}, {"authorization": "Bearer wrong"}):
            assert_error(srv.gemm("base", call(p), headers=headers), 401, "unauthorized")
            assert_error(srv.http.get("/v1/weights", headers=headers), 401, "unauthorized")
            assert_error(srv.http.get("/metrics", headers=headers), 401, "unauthorized")
            assert_error(srv.http.delete("/v1/weights/base", headers=headers), 401,
                         "unauthorized")
        assert srv.gemm("base", call(p), headers=reader).status_code == 200
        assert srv.gemm("base", call(p), headers=admin).status_code == 200
        assert_error(srv.http.delete("/v1/weights/base", headers=reader), 401, "unauthorized")
        # Health stays open for probes.
        assert srv.http.get("/v1/health/live").status_code == 200
        assert srv.http.get("/v1/health/ready").status_code == 200
        assert srv.http.delete("/v1/weights/base", headers=admin).status_code == 204
