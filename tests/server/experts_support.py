"""Helpers of the expert-set tests: bodies, requests, the eager chain they must equal."""

from __future__ import annotations

import httpx
import torch
from moegemm.client._wire import packb
from moegemm.kernels import testing_ffn
from server_support import LOAD_TIMEOUT, MSGPACK, wire


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
