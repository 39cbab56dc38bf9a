"""The request schemas and the gemm validator (server/_request.py).

Valid bodies decode to views into the body (no copy of the rows) with exactly
the tensors sent; anything else raises the contract's error, with the codes of
SPEC 2.2 and the order bad_msgpack, bad_field, bad_tensor/bad_dtype. Uploads
(weights, expert sets) go through the same decoder in their two forms each.
"""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moegemm.client._errors import (
    APIError,
    BadDtype,
    BadField,
    BadMsgpack,
    BadMSizes,
    BadShape,
    BadTensor,
    TooLarge,
)
from moegemm.client._wire import encode_tensor, packb
from moegemm.server._request import (
    CheckpointBody,
    ExpertsBody,
    WeightsBody,
    WeightsFileBody,
    decode_experts,
    decode_gemm,
    decode_weights,
    gemm_call,
)

G, K, N = 4, 256, 128
WS = SimpleNamespace(name="w", G=G, K=K, N=N)


def _body(rows=5, kind="fp8", sizes=None) -> dict:
    rng = np.random.default_rng(rows)
    if sizes is None:
        sizes = rng.multinomial(rows, np.full(G, 1.0 / G))
    sizes = encode_tensor(np.asarray(sizes, dtype=np.int64))
    if kind == "bf16":
        return {"x": encode_tensor(rng.standard_normal((rows, K)).astype(ml_dtypes.bfloat16)),
                "m_sizes": sizes}
    x = rng.uniform(-4, 4, (rows, K)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.1, 1, (rows, K // 128)).astype(np.float32)
    return {"x": encode_tensor(x), "x_scale": encode_tensor(scale), "m_sizes": sizes}


def _call(raw, max_m=1024):
    return gemm_call(decode_gemm(raw), lambda: WS, max_m=max_m)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_a_valid_body_is_views_into_the_body(kind):
    body = _body(9, kind)
    raw = bytearray(packb(body))
    buf = np.frombuffer(raw, dtype=np.uint8)
    call = _call(memoryview(raw))
    assert call.rows == 9 and call.dtype == body["x"]["dtype"]
    for got, sent in ((call.x, body["x"]), (call.x_scale, body.get("x_scale"))):
        if sent is None:
            assert got is None
            continue
        assert bytes(got) == bytes(sent["data"])
        start = np.frombuffer(got, dtype=np.uint8).ctypes.data - buf.ctypes.data
        assert 0 < start < len(raw)  # inside the body: not a copy
    assert call.m_sizes.tolist() == list(np.frombuffer(body["m_sizes"]["data"], np.int64))


def test_a_nil_scale_is_no_scale():
    """An optional field sent as nil is absent (a router's Option<T> serialised as nil), on
    calls as on loads; a nil where a tensor is required is still no tensor."""
    body = _body(7, "bf16")
    call = _call(packb({**body, "x_scale": None}))
    assert call.x_scale is None and bytes(call.x) == bytes(_call(packb(body)).x)
    with pytest.raises(BadTensor):
        _call(packb({**body, "x": None}))


def test_int32_sizes_and_an_empty_call():
    body = _body(6)
    body["m_sizes"] = encode_tensor(np.array([1, 2, 3, 0], dtype=np.int32))
    assert _call(packb(body)).m_sizes.tolist() == [1, 2, 3, 0]
    assert _call(packb(_body(0, sizes=[0] * G))).rows == 0


def _repeated_in_a_tensor(key: str) -> bytes:
    """A valid body whose ``x`` map holds ``key`` twice, a bad value first."""
    body = _body()
    x = body.pop("x")
    bad = {"dtype": "float64", "data": b"junk"}[key]
    entries = [(key, bad), *x.items()]
    raw = b"\x84" + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in entries)
    rest = packb(body)  # a 2-entry map (x_scale, m_sizes): take its entries
    return b"\x83" + msgpack.packb("x") + raw + rest[1:]


@pytest.mark.parametrize(("raw", "error"), [
    (b"\x82\xa1x\x01\xa1x\x02", BadMsgpack),  # a repeated key
    (_repeated_in_a_tensor("dtype"), BadMsgpack),  # a tensor map repeating a key (the last
    (_repeated_in_a_tensor("data"), BadMsgpack),   # of them would be taken)
    (packb(_body()) + b"\x00", BadMsgpack),  # trailing bytes
    (packb(_body())[:-3], BadMsgpack),  # truncated
    (msgpack.packb({"x": msgpack.ExtType(1, b"a"), "m_sizes": 1}), BadMsgpack),
    (b"\x81\x01\x02", BadField),  # a key that is not a string: a field nobody knows
    (packb([1, 2]), BadMsgpack),
    (packb({"x": 1}), BadField),  # m_sizes missing (before the bad tensor)
    (packb({**_body(), "extra": 1}), BadField),
    (packb({**_body(), "x_scale": None}), BadField),  # fp8 with a nil scale: no scales
    (packb({**_body(), "x": {**_body()["x"], "shape": [5, -256]}}), BadTensor),
    (packb({**_body(), "x": {**_body()["x"], "shape": [5, 256.0]}}), BadTensor),
    (packb({**_body(), "x": {**_body()["x"], "data": b"short"}}), BadTensor),
    (packb({**_body(), "x": {**_body()["x"], "extra": 1}}), BadTensor),
    (packb({**_body(), "x": {**_body()["x"], "dtype": 7}}), BadDtype),
    (packb({**_body(), "x": {**_body()["x"], "dtype": "float64"}}), BadDtype),
    (packb({**_body(), "m_sizes": encode_tensor(np.ones(G, np.float32))}), BadDtype),
    (packb({**_body(), "x": {**_body()["x"], "shape": [5 * K]}}), BadShape),
    (packb({**_body(), "m_sizes": encode_tensor(np.array([5], np.int64))}), BadShape),
    (packb(_body(2000)), TooLarge),
    (packb(_body(5, sizes=[6, -1, 0, 0])), BadMSizes),
    (packb(_body(16, sizes=[2**63 - 1, 2**63 - 1, 18, 0])), BadMSizes),  # wraps to 16 in int64
    (packb({k: v for k, v in _body().items() if k != "x_scale"}), BadField),  # fp8, no scales
    (packb({**_body(kind="bf16"), "x_scale": _body()["x_scale"]}), BadField),
])
def test_refusals_get_their_code(raw, error):
    with pytest.raises(error):
        _call(raw)


values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
              st.text(max_size=8), st.binary(max_size=64)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(["x", "x_scale", "m_sizes", "dtype",
                                                             "shape", "data", "y"]),
                                            inner, max_size=4)),
    max_leaves=10,
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(values.map(lambda v: msgpack.packb(v)), st.binary(max_size=200)))
def test_any_body_is_a_call_or_a_contract_error(raw):
    try:
        call = _call(raw)
    except APIError as exc:
        assert exc.status in (400, 413) and exc.code
        return
    width = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1}
    assert call.x.nbytes == call.rows * K * width[call.dtype]
    assert (call.x_scale is not None) == call.dtype.startswith("float8")


# -- uploads ----------------------------------------------------------------------------------

_W = encode_tensor(np.ones((2, 128, 128), np.float32))
_S = encode_tensor(np.ones((2, 1, 1), np.float32))


@pytest.mark.parametrize(("body", "form"), [
    ({"w": _W}, WeightsBody),
    ({"w": _W, "w_scale": _S}, WeightsBody),
    ({"w": _W, "w_scale": None}, WeightsBody),
    ({"file": "a.safetensors", "w": "w"}, WeightsFileBody),
    ({"file": "a.safetensors", "w": "w", "w_scale": None}, WeightsFileBody),
    ({"file": "a.safetensors", "w": "w", "w_scale": "s"}, WeightsFileBody),
])
def test_weight_uploads_decode_to_their_form(body, form):
    decoded = decode_weights(packb(body))
    assert type(decoded) is form
    if form is WeightsBody:
        assert bytes(decoded.w.data) == bytes(_W["data"]) and decoded.w.shape == [2, 128, 128]
    else:
        assert (decoded.file, decoded.w) == ("a.safetensors", "w")


@pytest.mark.parametrize(("body", "error"), [
    ({"w": "w"}, BadField),  # a name without a file
    ({"w": _W, "w_scale": "s"}, BadField),
    ({"file": "a.safetensors", "w": _W}, BadField),  # a tensor where the file form names one
    ({"file": 3, "w": "w"}, BadField),
    ({"file": None, "w": "w"}, BadField),
    ({"file": "a.safetensors", "w": "w", "w_scale": 1}, BadField),
    ({"file": "a.safetensors"}, BadField),
    ({"w": _W, "bias": _W}, BadField),
    ({"w": 7}, BadTensor),
    ({"w": None}, BadTensor),
    ({"w": {**_W, "shape": [2, -1, 128]}}, BadTensor),
    ({"w": {**_W, "dtype": "float64"}}, BadDtype),
    ({"w": {**_W, "data": b"short"}}, BadTensor),  # the byte count: checked after decoding
])
def test_weight_upload_refusals_get_their_code(body, error):
    with pytest.raises(error):
        decode_weights(packb(body))


def test_upload_bodies_repeating_a_key_are_bad_msgpack():
    w = packb({"w": _W})
    with pytest.raises(BadMsgpack):  # {"w": .., "w": ..}
        decode_weights(b"\x82" + w[1:] + w[1:])
    tensor = packb(_W)
    with pytest.raises(BadMsgpack):  # {"w": {"dtype": "float64", "dtype": .., "shape", "data"}}
        decode_weights(b"\x81" + packb("w") + b"\x84" + packb("dtype") + packb("float64")
                       + tensor[1:])


@pytest.mark.parametrize(("body", "error"), [
    ({"w13": _W, "w2": _W}, None),
    ({"w13": _W, "w2": _W, "w13_scale": _S, "w2_scale": None}, None),
    ({"checkpoint": "c", "layer": 0}, None),
    ({"checkpoint": "c", "layer": 2**40}, None),
    ({"w13": "k", "w2": _W}, BadField),  # a name: checkpoints are loaded by directory
    ({"w13": _W}, BadField),
    ({"checkpoint": "c", "layer": 0, "w13": _W}, BadField),
    ({"checkpoint": "c", "layer": -1}, BadField),
    ({"checkpoint": "c", "layer": True}, BadField),
    ({"checkpoint": "c", "layer": 1.0}, BadField),
    ({"checkpoint": "c", "layer": None}, BadField),
    ({"checkpoint": ["c"], "layer": 0}, BadField),
    ({"w13": _W, "w2": {**_W, "extra": 1}}, BadTensor),
    ({"w13": _W, "w2": {**_W, "dtype": 3}}, BadDtype),
])
def test_expert_uploads_decode_or_get_their_code(body, error):
    if error is None:
        decoded = decode_experts(packb(body))
        assert type(decoded) is (CheckpointBody if "checkpoint" in body else ExpertsBody)
        return
    with pytest.raises(error):
        decode_experts(packb(body))


@pytest.mark.parametrize("decode", [decode_weights, decode_experts, decode_gemm])
@pytest.mark.parametrize("key", ["w", "file", "checkpoint", "x"])
@pytest.mark.parametrize("depth", [900, 5000, 100_000])
def test_values_nested_past_the_recursion_limit_are_refused(decode, key, depth):
    """Found by the session 47 probe: an upload of {"w": [[[...nil]]]} 967 deep answered 500
    (the form's key lookup walked it to Python's recursion limit); every body is a 400."""
    body = b"\x81" + packb(key) + b"\x91" * depth + b"\xc0"
    with pytest.raises(APIError) as info:
        decode(body)
    assert info.value.status == 400
