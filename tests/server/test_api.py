"""The happy paths of SPEC 2.1 through a real server: load, list, gemm, replace, delete."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from moegemm.client import Client
from moegemm.kernels import quantize_activations, quantize_weights
from moegemm.kernels.testing import random_m_sizes
from server_support import close_to, fp8_problem, metric_sum, out_of, reference, wire


def test_health_and_info(server):
    assert server.http.get("/v1/health/live").json() == {"status": "live"}
    assert server.http.get("/v1/health/ready").status_code == 200
    info = server.http.get("/v1/info").json()
    assert info["backend"] == "reference"
    assert info["device"] == "cpu"
    assert info["fp8_format"] == "float8_e4m3fn"
    assert info["graphs"] is False  # no CUDA graphs on the CPU
    assert info["buckets"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert info["limits"]["max_m"] == 4096
    http = info["limits"]["http"]  # the transport's limits: what a client is closed or refused by
    assert set(http) == {"max_connections", "head_timeout_s", "keep_alive_s", "min_body_rate"}
    assert http["max_connections"] >= 1 and http["head_timeout_s"] > 0
    assert info["version"]


def test_fp8_weights_and_fp8_activations(server):
    p = fp8_problem(83, 256, 384, 5)
    r = server.put("fp8set", {"w": wire(p.wq), "w_scale": wire(p.w_scale)})
    assert r.status_code in (200, 201), r.text
    assert r.json() | {"created": None, "bytes": None} == {
        "name": "fp8set", "G": 5, "N": 256, "K": 384, "layout": "plain",
        "created": None, "bytes": None,
    }
    assert r.json()["bytes"] >= 5 * 256 * 384
    out = out_of(server.gemm("fp8set", {"x": wire(p.xq), "x_scale": wire(p.x_scale),
                                        "m_sizes": wire(p.m_sizes)}))
    assert out.shape == (83, 256)
    assert close_to(out, reference(p.xq, p.x_scale, p.wq, p.w_scale, p.m_sizes))


def test_bf16_weights_and_float_activations(server):
    w = torch.randn(3, 128, 256) * torch.rand(3, 1, 1)
    assert server.put("bf16set", {"w": wire(w.bfloat16())}).status_code in (200, 201)
    wq, w_scale = quantize_weights(w.bfloat16())
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(41, 256).to(dtype)
        m_sizes = random_m_sizes(3, 41).to(torch.int32)  # int32 is accepted on the wire
        out = out_of(server.gemm("bf16set", {"x": wire(x), "m_sizes": wire(m_sizes)}))
        xq, x_scale = quantize_activations(x)
        assert close_to(out, reference(xq, x_scale, wq, w_scale, m_sizes.long()))


def test_fnuz_inputs_are_converted(server):
    from moegemm.kernels import fn_to_fnuz

    p = fp8_problem(64, 128, 256, 2)
    wq, w_scale = fn_to_fnuz(p.wq, p.w_scale)
    assert server.put("fnuz", {"w": wire(wq), "w_scale": wire(w_scale)}).status_code in (200, 201)
    xq, x_scale = fn_to_fnuz(p.xq, p.x_scale)
    out = out_of(server.gemm("fnuz", {"x": wire(xq), "x_scale": wire(x_scale),
                                      "m_sizes": wire(p.m_sizes)}))
    assert close_to(out, reference(p.xq, p.x_scale, p.wq, p.w_scale, p.m_sizes))


def test_empty_and_chunked_calls(server):
    p = fp8_problem(8, 128, 128, 4)
    server.put("small", {"w": wire(p.wq), "w_scale": wire(p.w_scale)})
    empty = out_of(server.gemm("small", {
        "x": wire(p.xq[:0]), "x_scale": wire(p.x_scale[:0]),
        "m_sizes": wire(torch.zeros(4, dtype=torch.int64))}))
    assert empty.shape == (0, 128)
    # max_bucket_m is 256: 1335 rows run as 6 chunks whose groups straddle chunk edges.
    big = fp8_problem(1335, 128, 128, 4, m_sizes=torch.tensor([300, 0, 700, 335]))
    big_out = out_of(server.gemm("small", {
        "x": wire(big.xq), "x_scale": wire(big.x_scale), "m_sizes": wire(big.m_sizes)}))
    assert close_to(big_out, reference(big.xq, big.x_scale, p.wq, p.w_scale, big.m_sizes))


def test_list_replace_delete(server):
    first = fp8_problem(16, 128, 128, 2)
    r1 = server.put("cycle", {"w": wire(first.wq), "w_scale": wire(first.w_scale)})
    assert r1.status_code == 201
    names = [ws["name"] for ws in server.http.get("/v1/weights").json()["weights"]]
    assert "cycle" in names and "demo" in names
    second = fp8_problem(16, 256, 128, 3)
    r2 = server.put("cycle", {"w": wire(second.wq), "w_scale": wire(second.w_scale)})
    assert r2.status_code == 200
    listed = {ws["name"]: ws for ws in server.http.get("/v1/weights").json()["weights"]}
    assert (listed["cycle"]["G"], listed["cycle"]["N"]) == (3, 256)
    out = out_of(server.gemm("cycle", {"x": wire(second.xq), "x_scale": wire(second.x_scale),
                                       "m_sizes": wire(second.m_sizes)}))
    assert close_to(out, reference(second.xq, second.x_scale, second.wq, second.w_scale,
                                   second.m_sizes))
    assert server.http.delete("/v1/weights/cycle").status_code == 204
    names = [ws["name"] for ws in server.http.get("/v1/weights").json()["weights"]]
    assert "cycle" not in names


def test_demo_set_answers(server):
    demo = next(ws for ws in server.http.get("/v1/weights").json()["weights"]
                if ws["name"] == "demo")
    x = torch.randn(37, demo["K"], dtype=torch.bfloat16)
    m_sizes = random_m_sizes(demo["G"], 37)
    out = out_of(server.gemm("demo", {"x": wire(x), "m_sizes": wire(m_sizes)}))
    ws = server.services.store.get("demo")
    xq, x_scale = quantize_activations(x)
    assert close_to(out, reference(xq, x_scale, ws.wq, ws.w_scale, m_sizes))


def test_request_id_is_echoed_or_generated(server):
    r = server.http.get("/v1/info", headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    a = server.http.get("/v1/info").headers["x-request-id"]
    b = server.http.get("/v1/info").headers["x-request-id"]
    assert a and b and a != b
    # Errors carry it too.
    r = server.http.get("/v1/nowhere", headers={"X-Request-Id": "trace-43"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "trace-43"


def test_a_trailing_slash_is_no_path_of_the_api(server):
    """404 with SPEC 2's JSON error, not a redirect (whose absolute Location would name the
    host as this hop saw it)."""
    for path in ("/v1/info/", "/v1/health/live/", "/metrics/"):
        r = server.http.get(path, follow_redirects=False)
        assert r.status_code == 404, (path, r.status_code, r.headers)
        assert r.headers["content-type"] == "application/json"
        assert r.json()["error"]["code"] == "not_found"


def test_metrics(server):
    x = torch.randn(5, 512)
    out_of(server.gemm("demo", {"x": wire(x), "m_sizes": wire(random_m_sizes(8, 5))}))
    text = server.http.get("/metrics").text
    assert 'moegemm_requests_total{endpoint="/v1/weights/{name}/gemm",status="200"}' in text
    for name in ("moegemm_request_seconds_bucket", "moegemm_queue_seconds_bucket",
                 "moegemm_kernel_seconds_bucket", "moegemm_batch_calls_bucket",
                 "moegemm_bytes_in_total", "moegemm_bytes_out_total",
                 "moegemm_weight_bytes", "moegemm_device_memory_bytes", "moegemm_queue_depth",
                 'moegemm_launches_total{mode="eager"}', 'moegemm_launches_total{mode="graph"}'):
        assert name in text, name
    assert metric_sum(text, "moegemm_weight_bytes") == server.services.store.total_bytes() > 0


def _bytes_out(server) -> tuple[float, int]:
    """``moegemm_bytes_out_total`` and the size of the /metrics body that told it."""
    r = server.http.get("/metrics")
    return metric_sum(r.text, "moegemm_bytes_out_total"), len(r.content)


def test_bytes_out_counts_the_bodies_sent_and_only_those(server):
    """A HEAD answer sends no body; an error the transport answers from the request's head
    (415 here, on the fast transport) sends one: both as the bytes on the wire."""
    before, told = _bytes_out(server)
    for path in ("/v1/info", "/v1/weights", "/v1/health/ready"):
        r = server.http.head(path)
        assert r.status_code == 200 and r.content == b""
    refused = server.http.post("/v1/weights/demo/gemm", content=b"\x80",
                               headers={"content-type": "text/plain"})
    assert refused.status_code == 415
    after, _ = _bytes_out(server)
    assert after - before == told + len(refused.content)


def test_client_round_trip(server):
    p = fp8_problem(50, 128, 256, 3)
    with Client(server.url) as client:
        desc = client.load_weights("via-client", p.wq, p.w_scale)
        assert desc["name"] == "via-client"
        out = client.grouped_gemm("via-client", p.xq, p.m_sizes, x_scale=p.x_scale)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
        assert close_to(out, reference(p.xq, p.x_scale, p.wq, p.w_scale, p.m_sizes))
        assert "via-client" in [ws["name"] for ws in client.weights()]
        client.delete_weights("via-client")
        assert "via-client" not in [ws["name"] for ws in client.weights()]


def test_client_answers_are_the_callers_to_write(server):
    """Answers under and over the lane's 64 KiB (read as bytes, or into a buffer of their
    own) come back writable, numpy and torch alike, each in memory of its own."""
    with Client(server.url) as client:
        # 1.5 KiB, then 100 and 150 KiB, their data at an odd and an even offset in the body
        for m in (3, 200, 300):
            p = fp8_problem(m, 256, 256, 2)
            client.load_weights("writable", p.wq, p.w_scale)
            x = p.xq.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
            args = (p.m_sizes.numpy(), p.x_scale.numpy())
            first = client.grouped_gemm("writable", x, args[0], x_scale=args[1])
            second = client.grouped_gemm("writable", x, args[0], x_scale=args[1])
            as_torch = client.grouped_gemm("writable", p.xq, p.m_sizes, x_scale=p.x_scale)
            t = as_torch.view(torch.int16).numpy()
            assert first.flags.writeable and second.flags.writeable and first.flags.aligned
            assert not np.shares_memory(first, second) and not np.shares_memory(first, t)
            kept = first.view(np.int16).copy()
            assert np.array_equal(kept, second.view(np.int16)) and np.array_equal(kept, t)
            first += first  # in place, as a caller adding a residual would
            as_torch.add_(1)
            assert np.array_equal(second.view(np.int16), kept)  # written through no other answer
            again = client.grouped_gemm("writable", p.xq, p.m_sizes, x_scale=p.x_scale)
            assert np.array_equal(again.view(torch.int16).numpy(), kept)
            assert not np.shares_memory(again.view(torch.int16).numpy(), t)
        client.delete_weights("writable")


def test_a_set_whose_name_was_taken_while_it_loaded_is_forgotten(server, monkeypatch):
    """The swap-in refuses a name an expert set took meanwhile (``{set}.w13``, a race with
    its load): 400 ``bad_name``, and what the load prepared for the set (its graphs) is
    dropped, as for a set refused for the room."""
    from moegemm.client._errors import BadName

    svc = server.services
    forgotten = []
    real_forget = svc.engine.forget
    monkeypatch.setattr(svc.engine, "forget", lambda ws: forgotten.append(ws.name) or
                        real_forget(ws))

    def taken(ws):
        raise BadName(f"{ws.name!r} is an expert set's matrix")

    monkeypatch.setattr(svc.store, "put", taken)
    p = fp8_problem(4, 128, 128, 2)
    r = server.put("raced", {"w": wire(p.wq), "w_scale": wire(p.w_scale)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_name"
    assert forgotten == ["raced"]
