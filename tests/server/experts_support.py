"""Helpers of the expert-set tests: bodies, requests, the eager chain they must equal."""

from __future__ import annotations

import httpx
import torch
from moegemm.client._wire import packb
from moegemm.kernels import testing_ffn
from moegemm.kernels.testing import random_m_sizes, rel_error
from moegemm.kernels.testing_ffn import FFN_TOLERANCE, random_experts, random_routing
from server_support import LOAD_TIMEOUT, MSGPACK, out_of, wire


def upload_body(p, fp8: bool = True) -> dict:
    """A PUT /v1/experts body for ExpertProblem ``p``: fp8 with scales, or float32."""
    if fp8:
        return {"w13": wire(p.w13q), "w13_scale": wire(p.w13_scale), "w2": wire(p.w2q),
                "w2_scale": wire(p.w2_scale)}
    return {"w13": wire(p.w13), "w2": wire(p.w2)}


def put_experts(http: httpx.Client, name: str, body: dict, **kw) -> httpx.Response:
    headers = {**MSGPACK, **kw.pop("headers", {})}
    kw.setdefault("timeout", LOAD_TIMEOUT)
    return http.put(f"/v1/experts/{name}", content=packb(body), headers=headers, **kw)


def post(http: httpx.Client, name: str, kind: str, body: dict, **kw) -> httpx.Response:
    headers = {**MSGPACK, **kw.pop("headers", {})}
    return http.post(f"/v1/experts/{name}/{kind}", content=packb(body), headers=headers, **kw)


def ffn_body(x, m_sizes, x_scale=None) -> dict:
    body = {"x": wire(x), "m_sizes": wire(torch.as_tensor(m_sizes, dtype=torch.int64))}
    if x_scale is not None:
        body["x_scale"] = wire(x_scale)
    return body


def moe_body(x, ids, weights, x_scale=None) -> dict:
    body = {"x": wire(x), "topk_ids": wire(ids), "topk_weights": wire(weights)}
    if x_scale is not None:
        body["x_scale"] = wire(x_scale)
    return body


def eager_ffn(p, xq, x_scale, m_sizes) -> torch.Tensor:
    """SPEC 5.1 as the reference backend computes it (float32 h): the same kernels, one call."""
    return testing_ffn.eager_ffn(p, xq, x_scale, m_sizes)


def snapshot(http: httpx.Client) -> tuple[list, list]:
    """What is loaded: the expert sets and the weight sets, as listed."""
    return http.get("/v1/experts").json()["experts"], http.get("/v1/weights").json()["weights"]


def check_any_set(srv, g: int, h: int, i: int, m: int, tokens: int, k: int, hot: int,
                  seed: int) -> None:
    """Load a random fp8 expert set of G ``g``, H ``h``, I ``i`` as "any" (replacing the last)
    and check one ffn call of ``m`` ragged rows and one moe call of ``tokens`` tokens, top-``k``
    (at most G) over all experts or, with ``hot`` > 0, over only the first ``k + hot - 1``:
    each answer equals the server's eager chain bit for bit and meets SPEC 5's bound."""
    from ffn_support import FfnExecutor

    k = min(k, g)
    gen = torch.Generator().manual_seed(seed)
    p = random_experts(g, h, i, generator=gen)
    r = put_experts(srv.http, "any", upload_body(p))
    assert r.status_code in (200, 201), r.text
    es = srv.app.state.experts.store.get("any")
    eager = FfnExecutor(srv.services.engine.backend)
    sizes = random_m_sizes(g, m, generator=gen)
    x = p.tokens(m, generator=gen)
    out = out_of(post(srv.http, "any", "ffn", ffn_body(x, sizes)))
    assert torch.equal(out, eager.ffn(es, x, None, sizes.tolist()))
    if m:
        assert rel_error(out, p.ffn_reference(*p.quantized(x), sizes)) <= FFN_TOLERANCE
    experts = list(range(g))[: k + hot - 1] if hot else None
    ids, weights = random_routing(tokens, k, g, experts=experts, generator=gen)
    x = p.tokens(tokens, generator=gen)
    out = out_of(post(srv.http, "any", "moe", moe_body(x, ids, weights)))
    assert torch.equal(out, eager.moe(es, x, None, ids, weights))
    if tokens:
        assert rel_error(out, p.moe_reference(*p.quantized(x), ids, weights)) <= FFN_TOLERANCE
