"""The lone-call lane takes only plain valid bodies, and only as the general path would.

``wire_inputs`` must return None for anything the general path refuses or runs
another way (it then answers with the contract's error); for what it does take,
the general path's own validation must agree on the rows and group sizes.
"""

from __future__ import annotations

import copy

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moegemm.client._errors import APIError
from moegemm.client._wire import encode_tensor, packb, unpackb
from moegemm.kernels.reference import create as reference_backend
from moegemm.server import routes
from moegemm.server._body import unpack_in_place
from moegemm.server._lone import wire_inputs
from moegemm.server.engine import Engine

G, K, N = 4, 256, 128
FP8 = "float8_e4m3fn"


def _body(rows: int, kind: str = "fp8", sizes=None, size_dtype=np.int64) -> dict:
    rng = np.random.default_rng(rows)
    if sizes is None:
        sizes = rng.multinomial(rows, np.full(G, 1.0 / G))
    sizes = np.asarray(sizes).astype(size_dtype)
    if kind == "bf16":
        x = rng.standard_normal((rows, K)).astype(ml_dtypes.bfloat16)
        return {"x": encode_tensor(x), "m_sizes": encode_tensor(sizes)}
    x = rng.uniform(-4, 4, (rows, K)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.1, 1, (rows, K // 128)).astype(np.float32)
    return {"x": encode_tensor(x), "x_scale": encode_tensor(scale), "m_sizes": encode_tensor(sizes)}


def _wire(body: dict, in_place: bool = False) -> dict:
    raw = packb(body)
    return unpack_in_place(raw) if in_place else unpackb(raw)


def _general(body: dict):
    """What the general path makes of a decoded body: (rows, sizes), or the APIError."""
    ws = type("WS", (), {"G": G, "K": K, "N": N, "name": "w"})()
    engine = Engine(reference_backend(torch.device("cpu")), max_m=512, max_bucket_m=64)
    try:
        x, xs, m = routes.gemm_inputs(body)
        sizes = engine.validate(ws, x, xs, m)
        return x.shape[0], sizes, x.dtype
    except APIError as exc:
        return exc


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("in_place", [False, True])
def test_valid_bodies_are_taken_as_the_general_path_reads_them(kind, rows, in_place):
    body = _wire(_body(rows, kind), in_place)
    lone = wire_inputs(body, G, K, FP8, 64)
    assert lone is not None and lone.rows == rows and lone.quantize == (kind == "bf16")
    got_rows, sizes, _ = _general(body)
    assert got_rows == rows and lone.m_sizes.tolist() == sizes
    assert bytes(lone.x) == bytes(body["x"]["data"])
    assert (lone.x_scale is None) == (kind == "bf16")


def test_int32_sizes_are_taken():
    lone = wire_inputs(_wire(_body(5, size_dtype=np.int32)), G, K, FP8, 64)
    assert lone is not None and lone.m_sizes.dtype == np.int64 and lone.m_sizes.sum() == 5


def _mutations():
    def fp8():
        return _wire(_body(6))

    def edit(fn):
        b = fp8()
        fn(b)
        return b

    yield "too many rows for the lane", _wire(_body(65))
    yield "fnuz x", edit(lambda b: b["x"].update(dtype="float8_e4m3fnuz"))
    yield "fp16 x", _wire({"x": encode_tensor(np.zeros((6, K), np.float16)),
                           "m_sizes": encode_tensor(np.array([6, 0, 0, 0]))})
    yield "fp8 without scales", edit(lambda b: b.pop("x_scale"))
    yield "bf16 with scales", _wire({**_body(6, "bf16"),
                                     "x_scale": encode_tensor(np.ones((6, 2), np.float32))})
    yield "x_scale nil", edit(lambda b: b.update(x_scale=None))
    yield "unknown field", edit(lambda b: b.update(extra=1))
    yield "m_sizes missing", edit(lambda b: b.pop("m_sizes"))
    yield "wrong K", _wire({"x": encode_tensor(np.zeros((6, 128), ml_dtypes.float8_e4m3fn)),
                            "x_scale": encode_tensor(np.ones((6, 1), np.float32)),
                            "m_sizes": encode_tensor(np.array([6, 0, 0, 0]))})
    yield "sizes do not add up", _wire(_body(6, sizes=[1, 1, 1, 1]))
    yield "negative size", _wire(_body(6, sizes=[7, -1, 0, 0]))
    yield "wrong G", _wire({**_body(6), "m_sizes": encode_tensor(np.array([6, 0, 0]))})
    yield "float sizes", _wire({**_body(6), "m_sizes": encode_tensor(np.array([6., 0, 0, 0], np.float32))})
    yield "scales of another shape", edit(lambda b: b["x_scale"].update(shape=[6, 1]))
    yield "short data", edit(lambda b: b["x"].update(data=bytes(b["x"]["data"])[:-1]))
    yield "shape as a string", edit(lambda b: b["x"].update(shape="6,256"))
    yield "bool in a shape", edit(lambda b: b["x"].update(shape=[True, K]))
    yield "extra tensor key", edit(lambda b: b["x"].update(extra=0))
    yield "3-D x", edit(lambda b: b["x"].update(shape=[6, K, 1]))
    yield "empty call", _wire(_body(0, sizes=[0, 0, 0, 0]))


@pytest.mark.parametrize("what,body", list(_mutations()), ids=[m[0] for m in _mutations()])
def test_everything_else_is_left_to_the_general_path(what, body):
    assert wire_inputs(body, G, K, FP8, 64) is None


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 80), kind=st.sampled_from(["fp8", "bf16"]),
       key=st.sampled_from(["x", "x_scale", "m_sizes"]),
       field=st.sampled_from(["dtype", "shape", "data", None]),
       value=st.one_of(st.none(), st.integers(-2, 300), st.sampled_from(
           ["int32", "int64", "float32", "bfloat16", FP8, "float8_e4m3fnuz"]),
           st.lists(st.integers(-1, 300), max_size=3), st.binary(max_size=64)))
def test_taken_bodies_are_always_valid_for_the_general_path(rows, kind, key, field, value):
    body = copy.deepcopy(_wire(_body(rows, kind)))
    if field is None:
        body[key] = value
    elif isinstance(body.get(key), dict):
        body[key][field] = value
    lone = wire_inputs(body, G, K, FP8, 64)
    if lone is None:
        return
    general = _general(body)
    assert not isinstance(general, APIError), general
    got_rows, sizes, dtype = general
    assert got_rows == lone.rows and sizes == lone.m_sizes.tolist()
    assert (dtype == torch.bfloat16) == lone.quantize
