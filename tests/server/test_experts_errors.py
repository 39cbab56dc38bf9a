"""Bad input on the expert-set endpoints: every new field gets the contract's code
(SPEC 2.2), and no loaded set changes."""

from __future__ import annotations

import httpx
import pytest
import torch
from experts_support import ffn_body, moe_body, post, put_experts, snapshot, upload_body
from moegemm.client._wire import packb
from moegemm.kernels.testing_ffn import random_experts, random_routing
from moegemm.server import Settings
from server_support import MSGPACK, assert_error, out_of, serve, wire

G, H, I = 4, 384, 128


def limited_settings(root, **changes) -> Settings:
    """The server these tests talk to: small limits, to be passed."""
    limits = {"max_body_bytes": 8 << 20, "max_m": 256, "max_bucket_m": 256, "max_g": 16,
              "max_weight_bytes": 4 << 20}
    return Settings(device="cpu", weights_dir=root, demo=False, **{**limits, **changes})


def with_experts(running):
    """Load the expert set 'e' the tests call (its problem as ``running.p``)."""
    p = random_experts(G, H, I)
    assert put_experts(running.http, "e", upload_body(p)).status_code == 201
    running.p = p
    return running


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with serve(limited_settings(tmp_path_factory.mktemp("w"))) as running:
        yield with_experts(running)


def _upload(p, **changes):
    body = upload_body(p)
    for key, value in changes.items():
        if value is None:
            body.pop(key)
        else:
            body[key] = value
    return body


def _bad_uploads(p):
    f32 = random_experts(G, H, I)
    nan_w = f32.w13.clone()
    nan_w[1, 5, 7] = float("nan")
    zero_scale = p.w2_scale.clone()
    zero_scale[2, 0, 1] = 0.0
    nan_scale = p.w13_scale.clone()
    nan_scale[0, 1, 0] = float("nan")
    nan_fp8 = p.w2q.clone()
    nan_fp8.view(torch.uint8)[3, 2, 1] = 0x7F
    negative_nan = p.w2q.clone()
    negative_nan.view(torch.uint8)[1, 0, 3] = 0xFF  # fn's other NaN code
    # fnuz on the wire (halved codes, doubled scales: the same values), its NaN code 0x80.
    fnuz = (p.w2q.float() / 2).to(torch.float8_e4m3fnuz)
    fnuz.view(torch.uint8)[2, 7, 0] = 0x80
    return [
        ("w2 missing", _upload(p, w2=None), "bad_field"),
        ("unknown field", {**upload_body(p), "bias": wire(torch.zeros(4))}, "bad_field"),
        ("w13 is a string", _upload(p, w13="key"), "bad_field"),
        ("fp8 w13 without a scale", _upload(p, w13_scale=None), "bad_field"),
        ("float w2 with a scale", {**upload_body(f32, fp8=False), "w2_scale": wire(p.w2_scale)},
         "bad_field"),
        ("checkpoint with tensors", {**upload_body(p), "checkpoint": "c", "layer": 0},
         "bad_field"),
        ("w13 float64", _upload(p, w13={"dtype": "float64", "shape": [1],
                                         "data": b"\0" * 8}), "bad_dtype"),
        ("w2 int32", _upload(p, w2=wire(torch.zeros(G, H, I, dtype=torch.int32))), "bad_dtype"),
        ("w13_scale bf16", _upload(p, w13_scale=wire(p.w13_scale.to(torch.bfloat16))),
         "bad_dtype"),
        ("w13 truncated data", _upload(p, w13={"dtype": "float8_e4m3fn", "shape": [G, 2 * I, H],
                                               "data": b"\0" * 10}), "bad_tensor"),
        ("w13 2-D", _upload(p, w13=wire(p.w13q[0])), "bad_shape"),
        ("w2 with another H", _upload(p, w2=wire(torch.cat([p.w2q, p.w2q], dim=1)),
                                      w2_scale=wire(torch.cat([p.w2_scale] * 2, dim=2))),
         "bad_shape"),
        ("w2 with another G", _upload(p, w2=wire(p.w2q[:2]), w2_scale=wire(p.w2_scale[:2])),
         "bad_shape"),
        ("I = 64", {"w13": wire(torch.zeros(G, 128, H)), "w2": wire(torch.zeros(G, H, 64))},
         "bad_shape"),
        ("w13_scale transposed", _upload(p, w13_scale=wire(p.w13_scale.transpose(1, 2)
                                                           .contiguous())), "bad_shape"),
        ("w13 holds NaN", {**upload_body(f32, fp8=False), "w13": wire(nan_w)}, "not_finite"),
        ("w2 holds an fp8 NaN", _upload(p, w2=wire(nan_fp8)), "not_finite"),
        ("w2 holds fn's NaN 0xFF", _upload(p, w2=wire(negative_nan)), "not_finite"),
        ("fnuz w2 holds NaN 0x80", _upload(p, w2=wire(fnuz), w2_scale=wire(p.w2_scale * 2)),
         "not_finite"),
        ("a w2 scale is 0", _upload(p, w2_scale=wire(zero_scale)), "not_finite"),
        ("a w13 scale is NaN", _upload(p, w13_scale=wire(nan_scale)), "not_finite"),
        ("checkpoint not a string", {"checkpoint": 3, "layer": 0}, "bad_field"),
        ("layer missing", {"checkpoint": "c"}, "bad_field"),
        ("layer negative", {"checkpoint": "c", "layer": -1}, "bad_field"),
        ("layer a bool", {"checkpoint": "c", "layer": True}, "bad_field"),
        ("layer a string", {"checkpoint": "c", "layer": "3"}, "bad_field"),
    ]


def test_bad_uploads_change_nothing(srv):
    before = snapshot(srv.http)
    for what, body, code in _bad_uploads(srv.p):
        for name in ("e", "fresh"):  # replacing a loaded set and loading a new one
            r = put_experts(srv.http, name, body)
            assert r.status_code == 400, (what, r.text)
            assert r.json()["error"]["code"] == code, (what, r.text)
    assert snapshot(srv.http) == before


def test_bad_names_media_and_limits(srv):
    before = snapshot(srv.http)
    body = upload_body(srv.p)
    for name in ("a b", "x" * 129, "caf\u00e9"):
        assert_error(put_experts(srv.http, name, body), 400, "bad_name")
        assert_error(post(srv.http, name, "ffn", ffn_body(torch.zeros(1, H), [1, 0, 0, 0])),
                     400, "bad_name")
    assert_error(srv.http.put("/v1/experts/e", content=packb(body),
                              headers={"content-type": "application/json"}),
                 415, "unsupported_media_type")
    assert_error(srv.http.put("/v1/experts/e", content=b"\xc1garbage", headers=MSGPACK),
                 400, "bad_msgpack")
    big = random_experts(17, 128, 128)
    assert_error(put_experts(srv.http, "big", upload_body(big)), 413, "too_large")
    # 4 MiB of weights at most: G=16, H=512, I=256 is 6 MiB of fp8.
    fp8 = torch.float8_e4m3fn
    huge = {"w13": wire(torch.zeros(16, 512, 512, dtype=fp8)),
            "w13_scale": wire(torch.ones(16, 4, 4)),
            "w2": wire(torch.zeros(16, 512, 256, dtype=fp8)),
            "w2_scale": wire(torch.ones(16, 2, 4))}
    assert_error(put_experts(srv.http, "huge", huge), 507, "out_of_memory")
    # Each matrix fits the 4 MiB alone (3 and 1.5 MiB); the two together do not.
    pair = {"w13": wire(torch.zeros(16, 512, 384, dtype=fp8)),
            "w13_scale": wire(torch.ones(16, 3, 4)),
            "w2": wire(torch.zeros(16, 384, 256, dtype=fp8)),
            "w2_scale": wire(torch.ones(16, 2, 3))}
    assert_error(put_experts(srv.http, "pair", pair), 507, "out_of_memory")
    assert snapshot(srv.http) == before


def test_a_wrong_method_on_an_action_is_405_not_a_bad_name(srv):
    # An audit: GET /v1/experts/e/ffn answered 400 bad_name (the name "e/ffn").
    before = snapshot(srv.http)
    for method, path in (("GET", "/v1/experts/e/ffn"), ("PUT", "/v1/experts/e/moe"),
                         ("DELETE", "/v1/experts/e/moe"), ("GET", "/v1/weights/e.w13/gemm"),
                         ("PUT", "/v1/weights/e.w2/gemm"), ("DELETE", "/v1/weights/e.w2/gemm")):
        r = srv.http.request(method, path)
        assert_error(r, 405, "method_not_allowed")
        assert r.headers["allow"] == "POST", (method, path)
    # Still names where the path is no action of that resource (a review: one convertor for
    # both made these 404).
    for method, path in (("GET", "/v1/experts/e/other"), ("PUT", "/v1/weights/x/ffn"),
                         ("DELETE", "/v1/weights/x/moe"), ("GET", "/v1/experts/x/gemm"),
                         ("PUT", "/v1/experts/x/gemm"), ("DELETE", "/v1/experts/x/gemm")):
        assert_error(srv.http.request(method, path), 400, "bad_name")
    # Allow names every method the path takes, not only its first route's (RFC 9110 15.5.6).
    for method, path, allow in (("GET", "/v1/weights/e.w13", "PUT, DELETE"),
                                ("POST", "/v1/experts/e", "GET, HEAD, PUT, DELETE"),
                                ("POST", "/v1/health/live", "GET, HEAD")):
        r = srv.http.request(method, path)
        assert_error(r, 405, "method_not_allowed")
        assert r.headers["allow"] == allow, (method, path)
    assert snapshot(srv.http) == before


def test_a_128_character_expert_set_and_its_matrices_are_served(srv):
    """SPEC 2.1's names run to 128 characters, an expert set's too; its matrices' names
    ({name}.w13, {name}.w2, SPEC 5) run to 132 and the gemm endpoint serves them. A name of
    129 characters that is no expert set's matrix is still bad_name."""
    name = "x" * 128
    assert put_experts(srv.http, name, upload_body(random_experts(1, H, I))).status_code == 201
    listed = {w["name"] for w in srv.http.get("/v1/weights").json()["weights"]}
    assert {name + ".w13", name + ".w2"} <= listed
    gemm = {"x": wire(torch.randn(2, H).to(torch.bfloat16)), "m_sizes": wire(torch.tensor([2]))}
    r = srv.http.post(f"/v1/weights/{name}.w13/gemm", content=packb(gemm), headers=MSGPACK)
    assert r.status_code == 200, r.text
    assert out_of(r).shape == (2, 2 * I)
    r = srv.http.post(f"/v1/weights/{'y' * 128}.w13/gemm", content=packb(gemm), headers=MSGPACK)
    assert_error(r, 404, "no_such_weights")
    for other in ("y" * 129, "y" * 129 + ".w3", "a b.w13"):
        r = srv.http.post(f"/v1/weights/{other}/gemm", content=packb(gemm), headers=MSGPACK)
        assert_error(r, 400, "bad_name")
    # Changed through /v1/weights, they are refused as the expert set's, not as too long.
    for r in (srv.http.put(f"/v1/weights/{name}.w13", content=packb({"w": gemm["x"]}),
                           headers=MSGPACK), srv.http.delete(f"/v1/weights/{name}.w2")):
        assert_error(r, 400, "bad_name")
        assert f"belongs to expert set {name!r}" in r.json()["error"]["message"]
    assert {name + ".w13", name + ".w2"} <= {w["name"] for w in srv.http.get("/v1/weights").json()["weights"]}
    assert srv.http.delete("/v1/experts/" + name).status_code == 204


def _bad_ffn(p):
    x = p.tokens(10)
    sizes = torch.tensor([4, 0, 6, 0])
    xq, x_scale = p.quantized(x)
    nan_x = x.clone()
    nan_x[3, 9] = float("inf")
    bad_scale = x_scale.clone()
    bad_scale[2, 1] = -1.0
    return [
        ("m_sizes missing", {"x": wire(x)}, 400, "bad_field"),
        ("unknown field", {**ffn_body(x, sizes), "topk_ids": wire(sizes)}, 400, "bad_field"),
        ("fp8 x without x_scale", ffn_body(xq, sizes), 400, "bad_field"),
        ("bf16 x with x_scale", ffn_body(x, sizes, x_scale), 400, "bad_field"),
        ("x int64", ffn_body(torch.zeros(10, H, dtype=torch.int64), sizes), 400, "bad_dtype"),
        ("m_sizes float32", {"x": wire(x), "m_sizes": wire(sizes.float())}, 400, "bad_dtype"),
        ("x_scale bf16", ffn_body(xq, sizes, x_scale.to(torch.bfloat16)), 400, "bad_dtype"),
        ("x with another H", ffn_body(torch.zeros(10, 2 * H), sizes), 400, "bad_shape"),
        ("x 1-D", ffn_body(torch.zeros(H), sizes), 400, "bad_shape"),
        ("m_sizes of another G", ffn_body(x, [4, 6]), 400, "bad_shape"),
        ("x_scale rows", ffn_body(xq, sizes, x_scale[:5]), 400, "bad_shape"),
        ("negative size", ffn_body(x, [12, -2, 0, 0]), 400, "bad_m_sizes"),
        ("sizes sum past M", ffn_body(x, [4, 1, 6, 0]), 400, "bad_m_sizes"),
        ("x holds Inf", ffn_body(nan_x, sizes), 400, "not_finite"),
        ("x_scale <= 0", ffn_body(xq, sizes, bad_scale), 400, "not_finite"),
        ("M over max_m", ffn_body(torch.zeros(257, H), [257, 0, 0, 0]), 413, "too_large"),
    ]


def _bad_moe(p):
    t, k = 6, 2
    ids, weights = random_routing(t, k, G)
    x = p.tokens(t)
    xq, x_scale = p.quantized(x)
    out_of_range, negative, repeated = ids.clone(), ids.clone(), ids.clone()
    out_of_range[2, 1] = G
    negative[0, 0] = -1
    repeated[4, 1] = repeated[4, 0]
    nan_w, inf_w = weights.clone(), weights.clone()
    nan_w[1, 0] = float("nan")
    inf_w[5, 1] = float("-inf")
    nan_x = x.clone()
    nan_x[0, 0] = float("nan")
    return [
        ("topk_weights missing", {"x": wire(x), "topk_ids": wire(ids)}, 400, "bad_field"),
        ("m_sizes given", {**moe_body(x, ids, weights), "m_sizes": wire(ids[0])}, 400,
         "bad_field"),
        ("fp8 x without x_scale", moe_body(xq, ids, weights), 400, "bad_field"),
        ("bf16 x with x_scale", moe_body(x, ids, weights, x_scale), 400, "bad_field"),
        ("topk_ids float32", moe_body(x, ids.float(), weights), 400, "bad_dtype"),
        ("topk_ids int16-ish bf16", moe_body(x, ids.to(torch.bfloat16), weights), 400,
         "bad_dtype"),
        ("topk_weights bf16", moe_body(x, ids, weights.to(torch.bfloat16)), 400, "bad_dtype"),
        ("topk_weights int64", moe_body(x, ids, ids), 400, "bad_dtype"),
        ("x int32", moe_body(ids.to(torch.int32), ids, weights), 400, "bad_dtype"),
        ("topk_ids 1-D", moe_body(x, ids[:, 0].contiguous(), weights), 400, "bad_shape"),
        ("topk_ids for other tokens", moe_body(x, ids[:4], weights[:4]), 400, "bad_shape"),
        ("k = 0", moe_body(x, ids[:, :0].contiguous(), weights[:, :0].contiguous()), 400,
         "bad_shape"),
        ("k > G", moe_body(x, torch.arange(5).repeat(t, 1), torch.ones(t, 5)), 400,
         "bad_routing"),  # SPEC 2.2: with k > G some id repeats or is outside [0, G)
        ("k > G, no token", moe_body(x[:0], torch.zeros((0, 5), dtype=torch.int64),
                                     torch.zeros((0, 5))), 400, "bad_shape"),
        ("topk_weights of another k", moe_body(x, ids, weights[:, :1].contiguous()), 400,
         "bad_shape"),
        ("x with another H", moe_body(torch.zeros(t, 2 * H), ids, weights), 400, "bad_shape"),
        ("x_scale rows", moe_body(xq, ids, weights, x_scale[:1]), 400, "bad_shape"),
        ("an id = G", moe_body(x, out_of_range, weights), 400, "bad_routing"),
        ("an id < 0", moe_body(x, negative, weights), 400, "bad_routing"),
        ("an id repeated", moe_body(x, repeated, weights), 400, "bad_routing"),
        ("an int32 id = G", moe_body(x, out_of_range.to(torch.int32), weights), 400,
         "bad_routing"),
        ("a weight NaN", moe_body(x, ids, nan_w), 400, "bad_routing"),
        ("a weight -Inf", moe_body(x, ids, inf_w), 400, "bad_routing"),
        ("x holds NaN", moe_body(nan_x, ids, weights), 400, "not_finite"),
        ("T*k over max_m", moe_body(p.tokens(129), *random_routing(129, 2, G)), 413,
         "too_large"),
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_float_x_holding_nan_is_named_as_x(srv, dtype):
    """SPEC 2: the message says what was wrong. A float x the server quantizes for the caller
    (fp16/fp32: before the graphs) also makes a NaN scale; the caller sent none, so the message
    names x, on both endpoints."""
    x = srv.p.tokens(6).to(dtype)
    x[2, 5] = float("nan")
    for kind, body in (("ffn", ffn_body(x, [2, 0, 4, 0])), ("moe", moe_body(x, *random_routing(6, 2, G)))):
        r = post(srv.http, "e", kind, body)
        assert_error(r, 400, "not_finite")
        assert r.json()["error"]["message"].startswith("x holds NaN or Inf"), (kind, dtype, r.text)


def test_bad_calls_get_their_codes_and_change_nothing(srv):
    p = srv.p
    before = snapshot(srv.http)
    x = p.tokens(8)
    sizes = torch.tensor([2, 2, 0, 4])
    good = out_of(post(srv.http, "e", "ffn", ffn_body(x, sizes)))
    for kind, cases in (("ffn", _bad_ffn(p)), ("moe", _bad_moe(p))):
        for what, body, status, code in cases:
            r = post(srv.http, "e", kind, body)
            assert r.status_code == status, (kind, what, r.text)
            assert r.json()["error"]["code"] == code, (kind, what, r.text)
    assert_error(post(srv.http, "nope", "moe", moe_body(x, *random_routing(8, 1, G))), 404,
                 "no_such_weights")
    assert snapshot(srv.http) == before
    assert torch.equal(out_of(post(srv.http, "e", "ffn", ffn_body(x, sizes))), good)


def test_more_experts_per_token_than_the_largest_bucket_is_too_large(tmp_path):
    """k past ``max_bucket_m`` (one token's k rows are one launch) with T*k within ``max_m``:
    413 too_large naming the bucket, nothing changed, and k at the bucket still answers."""
    p = random_experts(16, H, I)
    with serve(limited_settings(tmp_path, max_bucket_m=8)) as s:
        assert put_experts(s.http, "e16", upload_body(p)).status_code == 201
        before = snapshot(s.http)
        x = p.tokens(1)
        r = post(s.http, "e16", "moe", moe_body(x, *random_routing(1, 12, 16)))
        assert_error(r, 413, "too_large")
        assert "k=12" in r.json()["error"]["message"], r.text
        assert snapshot(s.http) == before
        assert post(s.http, "e16", "moe", moe_body(x, *random_routing(1, 8, 16))).status_code == 200


def test_auth_and_readiness(tmp_path):
    settings = Settings(device="cpu", weights_dir=tmp_path, demo=False, token="calls-token",
                        admin_token="admin-token")
    p = random_experts(2, H, I)
    with serve(settings) as s:
        user = {"authorization": "Bearer calls-token"}
        admin = {"authorization": "Bearer admin-token"}
        assert_error(put_experts(s.http, "a", upload_body(p)), 401, "unauthorized")
        assert_error(put_experts(s.http, "a", upload_body(p), headers=user), 401,
                     "unauthorized")
        assert put_experts(s.http, "a", upload_body(p), headers=admin).status_code == 201
        assert_error(httpx.get(s.url + "/v1/experts"), 401, "unauthorized")
        assert s.http.get("/v1/experts", headers=user).json()["experts"][0]["name"] == "a"
        body = ffn_body(p.tokens(3), [1, 2])
        assert_error(post(s.http, "a", "ffn", body), 401, "unauthorized")
        assert out_of(post(s.http, "a", "ffn", body, headers=user)).shape == (3, H)
        ids, w = random_routing(3, 2, 2)
        assert_error(post(s.http, "a", "moe", moe_body(p.tokens(3), ids, w)), 401,
                     "unauthorized")
        assert_error(s.http.delete("/v1/experts/a", headers=user), 401, "unauthorized")
        assert s.http.delete("/v1/experts/a", headers=admin).status_code == 204


CONTRACT_400 = {"bad_msgpack", "bad_field", "bad_tensor", "bad_dtype", "bad_shape",
                "bad_m_sizes", "not_finite", "bad_name", "bad_routing"}


def _mutations(rng: torch.Generator, body: dict) -> dict:
    """``body`` with one to three random fields broken in random ways."""
    body = dict(body)
    keys = list(body) + ["x_scale", "m_sizes", "extra"]
    for _ in range(int(torch.randint(1, 4, (), generator=rng))):
        key = keys[int(torch.randint(len(keys), (), generator=rng))]
        choice = int(torch.randint(8, (), generator=rng))
        tensor = body.get(key) if isinstance(body.get(key), dict) else None
        if choice == 0:
            body.pop(key, None)
        elif choice == 1:
            body[key] = 7
        elif choice == 2 and tensor is not None:
            body[key] = {**tensor, "dtype": ["int32", "int64", "float16", "float8_e4m3fnuz",
                                             "float64", "bogus"][int(torch.randint(6, ()))]}
        elif choice == 3 and tensor is not None:
            body[key] = {**tensor, "shape": list(reversed(tensor["shape"]))}
        elif choice == 4 and tensor is not None:
            body[key] = {**tensor, "data": bytes(tensor["data"])[:-1]}
        elif choice == 5 and tensor is not None:
            raw = bytearray(bytes(tensor["data"]))
            if raw:
                raw[int(torch.randint(len(raw), ()))] = int(torch.randint(256, ()))
            body[key] = {**tensor, "data": bytes(raw)}
        elif choice == 6:
            body[key] = wire(torch.randint(-3, 9, (6, 2), dtype=torch.int64))
        else:
            body[key] = {"dtype": "float32", "shape": [0], "data": b""}
    return body


def test_random_bad_bodies_never_crash(srv):
    """Randomly broken ffn/moe bodies get a contract code (or an answer), never a 500."""
    p = srv.p
    rng = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    before = snapshot(srv.http)
    x = p.tokens(6)
    good = {"ffn": ffn_body(x, [1, 2, 0, 3]), "moe": moe_body(x, *random_routing(6, 2, G))}
    for _ in range(150):
        kind = "ffn" if torch.rand((), generator=rng) < 0.5 else "moe"
        r = post(srv.http, "e", kind, _mutations(rng, good[kind]))
        if r.status_code == 200:
            assert out_of(r).shape[1] == H
            continue
        assert r.status_code in (400, 413), r.text
        assert r.json()["error"]["code"] in CONTRACT_400 | {"too_large"}, r.text
    assert snapshot(srv.http) == before


def test_an_expert_sets_scales_are_checked_once_before_either_matrix_is_read(monkeypatch):
    """One check per matrix (``store.check_matrix``, with the expert set's names): each scale
    tensor is scanned once, not again by the weight store's assembly, and a bad ``w2_scale``
    is refused before any of w13 is read."""
    from moegemm.client import BadField, BadShape, NotFinite
    from moegemm.kernels import get_backend
    from moegemm.server import store as store_module
    from moegemm.server.experts import ExpertStore
    from moegemm.server.store import WeightStore

    experts = ExpertStore(WeightStore(get_backend(torch.device("cpu"))))
    p = random_experts(G, H, I)
    scanned, assembled = [], []
    scan = store_module.require_positive_finite_scales
    monkeypatch.setattr(store_module, "require_positive_finite_scales",
                        lambda scale, what: (scanned.append(what), scan(scale, what))[1])
    assemble = WeightStore._assemble
    monkeypatch.setattr(WeightStore, "_assemble",
                        lambda self, name, *rest: (assembled.append(name),
                                                   assemble(self, name, *rest))[1])
    es = experts.build("e", p.w13q, p.w13_scale, p.w2q, p.w2_scale)
    assert (es.G, es.H, es.I) == (G, H, I)
    assert scanned == ["w13_scale", "w2_scale"] and assembled == ["e.w13", "e.w2"]

    scanned.clear(), assembled.clear()
    bad = p.w2_scale.clone()
    bad[1, 0, 2] = float("inf")
    with pytest.raises(NotFinite, match="w2_scale"):
        experts.build("e", p.w13q, p.w13_scale, p.w2q, bad)
    assert scanned == ["w13_scale", "w2_scale"] and assembled == []
    with pytest.raises(BadField, match=r"fp8 w13 needs w13_scale \(float32 \[G, H/128, 2I/128\]\)"):
        experts.build("e", p.w13q, None, p.w2q, p.w2_scale)
    with pytest.raises(BadShape, match=r"w2_scale .*\[G, I/128, H/128\]"):
        experts.build("e", p.w13q, p.w13_scale, p.w2q, p.w2_scale.transpose(1, 2).contiguous())
