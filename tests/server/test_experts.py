"""Expert sets on a real CPU server (reference backend): load, list, replace, delete,
the gemm endpoint on their matrices, and ffn/moe answers against the float64 chain."""

from __future__ import annotations

import pytest
import torch
from experts_support import (
    check_any_set,
    eager_ffn,
    ffn_body,
    moe_body,
    post,
    put_experts,
    snapshot,
    upload_body,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moegemm.kernels import fn_to_fnuz, reference_float64
from moegemm.kernels.testing import SPEC_TOLERANCE, random_m_sizes, rel_error
from moegemm.kernels.testing_ffn import (
    FFN_TOLERANCE,
    random_experts,
    random_routing,
)
from moegemm.server import Settings
from server_support import assert_error, out_of, serve, wire


def expert_settings(root) -> Settings:
    """The expert suite's CPU server: no demo set, bodies up to 32 MiB."""
    return Settings(device="cpu", weights_dir=root, demo=False, max_body_bytes=32 << 20,
                    max_m=4096, max_bucket_m=256)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with serve(expert_settings(tmp_path_factory.mktemp("w"))) as running:
        yield running


@pytest.fixture
def experts(srv):
    """A fresh fp8 expert set 'e' (G=6, H=256, I=256), deleted afterwards."""
    p = random_experts(6, 256, 256)
    r = put_experts(srv.http, "e", upload_body(p))
    assert r.status_code == 201, r.text
    yield p
    srv.http.delete("/v1/experts/e")


def test_load_list_replace_delete(srv):
    p = random_experts(3, 256, 128)
    r = put_experts(srv.http, "layer0", upload_body(p, fp8=False))
    assert r.status_code == 201, r.text
    desc = r.json()
    assert {k: desc[k] for k in ("name", "G", "H", "I", "layout", "source")} == {
        "name": "layer0", "G": 3, "H": 256, "I": 128, "layout": "plain", "source": "upload"}
    assert desc["bytes"] == 3 * (256 * 256 + 256 * 128) + 3 * 4 * (2 * 2 + 1 * 2)
    experts, weights = snapshot(srv.http)
    assert [e["name"] for e in experts] == ["layer0"]
    assert srv.http.get("/v1/experts/layer0").json() == experts[0]
    by_name = {w["name"]: w for w in weights}
    assert (by_name["layer0.w13"]["G"], by_name["layer0.w13"]["N"], by_name["layer0.w13"]["K"]) \
        == (3, 256, 256)
    assert (by_name["layer0.w2"]["N"], by_name["layer0.w2"]["K"]) == (256, 128)
    assert by_name["layer0.w13"]["bytes"] + by_name["layer0.w2"]["bytes"] == desc["bytes"]

    # Atomic replace, with other shapes: the weight sets follow.
    q = random_experts(2, 384, 256)
    r = put_experts(srv.http, "layer0", upload_body(q))
    assert r.status_code == 200, r.text
    experts, weights = snapshot(srv.http)
    assert [(e["G"], e["H"], e["I"]) for e in experts] == [(2, 384, 256)]
    by_name = {w["name"]: w for w in weights}
    assert (by_name["layer0.w13"]["G"], by_name["layer0.w13"]["N"], by_name["layer0.w13"]["K"]) \
        == (2, 512, 384)

    info = srv.http.get("/v1/info").json()["experts"]
    assert info["loaded"] == ["layer0"] and info["moe_top_k_graphs"] == []  # CPU: no graphs

    assert srv.http.delete("/v1/experts/layer0").status_code == 204
    assert snapshot(srv.http) == ([], [])
    assert_error(srv.http.delete("/v1/experts/layer0"), 404, "no_such_weights")
    assert_error(srv.http.get("/v1/experts/layer0"), 404, "no_such_weights")
    assert_error(post(srv.http, "layer0", "ffn", ffn_body(torch.zeros(0, 384), [0, 0])),
                 404, "no_such_weights")


def test_matrices_answer_gemm(srv, experts):
    p = experts
    x = p.tokens(37)
    sizes = random_m_sizes(p.G, 37)
    xq, x_scale = p.quantized(x)
    for matrix, wq, ws, xin, xs in (("e.w13", p.w13q, p.w13_scale, xq, x_scale),):
        r = srv.gemm(matrix, {"x": wire(xin), "x_scale": wire(xs), "m_sizes": wire(sizes)})
        ref = reference_float64(xin, wq, xs, ws, sizes)
        assert rel_error(out_of(r), ref) <= SPEC_TOLERANCE
    a = torch.randn(37, p.I).to(torch.bfloat16)
    r = srv.gemm("e.w2", {"x": wire(a), "m_sizes": wire(sizes)})
    aq, a_scale = p.quantized(a)
    ref = reference_float64(aq, p.w2q, a_scale, p.w2_scale, sizes)
    assert rel_error(out_of(r), ref) <= SPEC_TOLERANCE


@pytest.mark.parametrize("m", [0, 1, 7, 83, 301])
def test_ffn(srv, experts, m):
    """Ragged groups with empty ones; bit for bit the eager chain, and within the bound."""
    p = experts
    sizes = random_m_sizes(p.G, m)
    x = p.tokens(m)
    out = out_of(post(srv.http, "e", "ffn", ffn_body(x, sizes)))
    assert out.shape == (m, p.H)
    xq, x_scale = p.quantized(x)
    assert torch.equal(out, eager_ffn(p, xq, x_scale, sizes))
    if m:
        assert rel_error(out, p.ffn_reference(xq, x_scale, sizes)) <= FFN_TOLERANCE


def test_ffn_small_calls_each_meet_the_bound(srv, experts):
    """h and a in float32: every call is held to the bound, single rows included."""
    p = experts
    for m in [1] * 40 + [3] * 10:
        sizes = random_m_sizes(p.G, m)
        xq, x_scale = p.quantized(p.tokens(m))
        out = out_of(post(srv.http, "e", "ffn", ffn_body(xq, sizes, x_scale)))
        assert rel_error(out, p.ffn_reference(xq, x_scale, sizes)) <= FFN_TOLERANCE


def test_ffn_fp8_inputs_in_either_format(srv, experts):
    p = experts
    sizes = torch.tensor([20, 0, 0, 50, 0, 30])
    xq, x_scale = p.quantized(p.tokens(100))
    want = eager_ffn(p, xq, x_scale, sizes)
    fn = out_of(post(srv.http, "e", "ffn", ffn_body(xq, sizes, x_scale)))
    assert torch.equal(fn, want)
    # fn -> fnuz keeps the bits and doubles the scales; the server converts back
    # (fnuz -> fn at the same scale): the values, hence the answer, are close.
    q_nuz, s_nuz = fn_to_fnuz(xq, x_scale)
    nuz = out_of(post(srv.http, "e", "ffn", ffn_body(q_nuz, sizes, s_nuz)))
    assert rel_error(nuz, p.ffn_reference(xq, x_scale, sizes)) <= FFN_TOLERANCE
    # fp16 and fp32 activations are quantized as bf16 ones are.
    x = p.tokens(100)
    ref = p.ffn_reference(*p.quantized(x), sizes)
    for dtype in (torch.float16, torch.float32):
        out = out_of(post(srv.http, "e", "ffn", ffn_body(x.to(dtype), sizes)))
        assert rel_error(out, ref) <= FFN_TOLERANCE


@pytest.mark.parametrize("k", [1, 2, 8])
def test_moe(srv, k):
    """Top-k over a few live experts (all others empty), and over all of them."""
    g = 12
    p = random_experts(g, 256, 256)
    assert put_experts(srv.http, "m", upload_body(p)).status_code in (200, 201)
    live = [3] if k == 1 else list(range(2, 2 + k))  # exactly k experts: all tokens share them
    for tokens, experts in ((1, live), (5, live), (40, live), (96, None), (3, None)):
        ids, weights = random_routing(tokens, k, g, experts=experts)
        ids = ids.to(torch.int32) if tokens == 5 else ids  # int32 ids are taken too
        x = p.tokens(tokens)
        out = out_of(post(srv.http, "m", "moe", moe_body(x, ids, weights)))
        assert out.shape == (tokens, p.H)
        ref = p.moe_reference(*p.quantized(x), ids, weights)
        assert rel_error(out, ref) <= FFN_TOLERANCE
    for _ in range(30):  # every small call on its own
        ids, weights = random_routing(2, k, g)
        x = p.tokens(2)
        out = out_of(post(srv.http, "m", "moe", moe_body(x, ids, weights)))
        assert rel_error(out, p.moe_reference(*p.quantized(x), ids, weights)) <= FFN_TOLERANCE
    empty = out_of(post(srv.http, "m", "moe", moe_body(
        p.tokens(0), torch.zeros((0, k), dtype=torch.int64), torch.zeros((0, k)))))
    assert empty.shape == (0, p.H)
    assert srv.http.delete("/v1/experts/m").status_code == 204


def test_moe_is_the_weighted_sum_of_ffn_answers(srv, experts):
    """moe == sum_j w_j * ffn_{id_j}(x) in float32 over the bf16 ffn answers (SPEC 5.2),
    computed here from the server's own ffn answers, token by token."""
    p = experts
    ids, weights = random_routing(9, 3, p.G)
    x = p.tokens(9)
    out = out_of(post(srv.http, "e", "moe", moe_body(x, ids, weights)))
    for t in range(9):
        acc = torch.zeros(p.H)
        for j in range(3):
            sizes = torch.zeros(p.G, dtype=torch.int64)
            sizes[ids[t, j]] = 1
            y = out_of(post(srv.http, "e", "ffn", ffn_body(x[t:t + 1], sizes)))
            acc += weights[t, j] * y[0].float()
        assert torch.equal(out[t], acc.to(torch.bfloat16))


def test_nil_scales_are_no_scales(srv):
    """Optional fields sent as nil (a router's Option<T>) are absent: float weights with nil
    scales load, and ffn/moe calls of bf16 rows with a nil x_scale answer as without it;
    nil where a tensor is required is bad_tensor, and fp8 weights with nil scales bad_field
    (fp8 without its scale), each leaving what was loaded as it was."""
    p = random_experts(3, 256, 128)
    r = put_experts(srv.http, "nil", {**upload_body(p, fp8=False), "w13_scale": None,
                                       "w2_scale": None})
    assert r.status_code == 201, r.text
    x = p.tokens(4)
    ids, weights = random_routing(4, 2, p.G)
    for kind, body in (("moe", moe_body(x, ids, weights)), ("ffn", ffn_body(x, [1, 0, 3]))):
        out = out_of(post(srv.http, "nil", kind, {**body, "x_scale": None}))
        assert torch.equal(out, out_of(post(srv.http, "nil", kind, body)))
    before = snapshot(srv.http)
    assert_error(put_experts(srv.http, "nil", {**upload_body(p), "w2": None}), 400, "bad_tensor")
    assert_error(put_experts(srv.http, "nil", {**upload_body(p), "w2_scale": None}), 400,
                 "bad_field")
    assert snapshot(srv.http) == before
    assert srv.http.delete("/v1/experts/nil").status_code == 204


def test_moe_with_wrong_scales_fails_the_bound(srv):
    """A control through the server: gate and up swapped in the upload."""
    g, i = 4, 256
    p = random_experts(g, 256, i)
    body = upload_body(p)
    body["w13"] = wire(torch.cat([p.w13q[:, i:], p.w13q[:, :i]], dim=1))
    body["w13_scale"] = wire(torch.cat([p.w13_scale[:, :, i // 128:],
                                        p.w13_scale[:, :, :i // 128]], dim=2).contiguous())
    assert put_experts(srv.http, "swapped", body).status_code == 201
    ids, weights = random_routing(64, 2, g)
    x = p.tokens(64)
    out = out_of(post(srv.http, "swapped", "moe", moe_body(x, ids, weights)))
    assert rel_error(out, p.moe_reference(*p.quantized(x), ids, weights)) > 3 * FFN_TOLERANCE
    assert srv.http.delete("/v1/experts/swapped").status_code == 204


def test_names_are_never_clobbered(srv):
    """A plain set named like an expert set's matrix, and the other way round."""
    p = random_experts(2, 256, 128)
    w = torch.randn(2, 256, 256).to(torch.bfloat16)
    assert srv.put("plain.w13", {"w": wire(w)}).status_code == 201
    before = snapshot(srv.http)
    assert_error(put_experts(srv.http, "plain", upload_body(p)), 400, "bad_name")
    assert snapshot(srv.http) == before

    assert put_experts(srv.http, "owned", upload_body(p)).status_code == 201
    before = snapshot(srv.http)
    assert_error(srv.put("owned.w13", {"w": wire(w)}), 400, "bad_name")
    assert_error(srv.http.delete("/v1/weights/owned.w2"), 400, "bad_name")
    assert snapshot(srv.http) == before
    # The expert set still answers with its own weights.
    sizes = torch.tensor([0, 64])
    x = p.tokens(64)
    out = out_of(post(srv.http, "owned", "ffn", ffn_body(x, sizes)))
    assert torch.equal(out, eager_ffn(p, *p.quantized(x), sizes))
    assert srv.http.delete("/v1/experts/owned").status_code == 204
    assert srv.http.delete("/v1/weights/plain.w13").status_code == 204
    assert snapshot(srv.http) == ([], [])


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    g=st.integers(1, 12),
    h_blocks=st.integers(1, 4),
    i_blocks=st.integers(1, 3),
    m=st.integers(0, 300),
    tokens=st.integers(0, 120),
    k=st.sampled_from([1, 2, 3, 8]),
    hot=st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
def test_any_expert_set_shape_and_routing(srv, g, h_blocks, i_blocks, m, tokens, k, hot, seed):
    """Any G, H, I and routing on the CPU server (the GPU's twin: test_experts_gpu.py):
    ragged ffn rows, top-k 1, 2, 3 or 8 (at most G), all experts or a few hot ones."""
    check_any_set(srv, g, 128 * h_blocks, 128 * i_blocks, m, tokens, k, hot, seed)
