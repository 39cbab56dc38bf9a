"""Property-based fuzzing of the wire decoder and of every endpoint's body and name.

Any byte string, any msgpack value and any mutation of a valid body gets a
2xx or a 4xx from SPEC 2.2's table with its matching code: never a 500, never a
dropped connection, never a change to a loaded weight set.
"""

from __future__ import annotations

import hashlib
import re

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from moegemm.client._errors import BadDtype, BadField, BadMsgpack, BadTensor, InvalidRequest
from moegemm.client._wire import DTYPES, packb
from moegemm.server import Settings
from moegemm.server._request import decode_weights
from moegemm.server._unpack import OtherKey, unpackb
from moegemm.server.routes import upload_tensor
from server_support import MSGPACK, close_to, fp8_problem, out_of, reference, serve, wire

N, K, G = 128, 256, 3
TOKEN, ADMIN = "fuzz-reader", "fuzz-admin"
NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")

# SPEC 2.2: every status a bad request may get, and the codes that go with it.
CODES = {
    400: {"bad_msgpack", "bad_field", "bad_tensor", "bad_dtype", "bad_shape", "bad_m_sizes",
          "not_finite", "bad_name"},
    401: {"unauthorized"},
    404: {"no_such_weights", "no_such_file"},
    413: {"too_large"},
    415: {"unsupported_media_type"},
    503: {"not_ready", "overloaded"},
    504: {"timeout"},
    507: {"out_of_memory"},
}

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """A CPU server with tokens, small limits, a weights directory and one fp8 set."""
    root = tmp_path_factory.mktemp("weights")
    (root / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    settings_ = Settings(device="cpu", demo=False, token=TOKEN, admin_token=ADMIN,
                         weights_dir=root, max_body_bytes=1 << 20, max_m=512,
                         max_bucket_m=64)
    with serve(settings_) as running:
        running.http.headers["authorization"] = f"Bearer {ADMIN}"
        p = fp8_problem(24, N, K, G)
        r = running.put("base", {"w": wire(p.wq), "w_scale": wire(p.w_scale)})
        assert r.status_code == 201, r.text
        running.problem = p
        running.base = running.services.store.get("base")
        running.base_digest = _digest(running.base)
        yield running


def _digest(ws) -> str:
    h = hashlib.sha256(ws.wq.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(ws.w_scale.contiguous().numpy().tobytes())
    return h.hexdigest()


def check_answer(r, ok=(200, 201)) -> None:
    """A success, or an error status with its SPEC code and a message; never a 500."""
    if r.status_code in ok:
        return
    assert r.status_code in CODES, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert error["code"] in CODES[r.status_code], (r.status_code, error)
    assert isinstance(error["message"], str) and error["message"]


def check_base_untouched(srv) -> None:
    assert srv.services.store.get("base") is srv.base
    assert _digest(srv.base) == srv.base_digest


@pytest.fixture(scope="module", autouse=True)
def base_still_answers(srv):
    """After all the fuzzing: 'base' is the same set and answers correctly."""
    yield
    check_base_untouched(srv)
    p = srv.problem
    body = {"x": wire(p.xq), "x_scale": wire(p.x_scale), "m_sizes": wire(p.m_sizes)}
    out = out_of(srv.gemm("base", body))
    assert close_to(out, reference(p.xq, p.x_scale, p.wq, p.w_scale, p.m_sizes))


# -- strategies -----------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
    st.text(max_size=20), st.binary(max_size=64),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
dims = st.one_of(st.integers(0, 300), st.sampled_from([128, 256, 2**31, 2**63 - 1, 2**63,
                                                       2**64 - 1]), st.integers(-3, -1))
dtype_names = st.one_of(st.sampled_from(sorted(DTYPES)),
                        st.sampled_from(["float64", "uint8", "", "bool"]))


@st.composite
def tensors(draw):
    """Tensor-like maps: sometimes exactly consistent, often slightly wrong."""
    dtype = draw(dtype_names)
    shape = draw(st.lists(dims, max_size=4))
    itemsize = DTYPES[dtype].itemsize if dtype in DTYPES else 4
    size = 1
    for d in shape:
        size *= max(d, 0)
    if size * itemsize <= 4096 and draw(st.booleans()):
        data = draw(st.binary(min_size=size * itemsize, max_size=size * itemsize))
    else:
        data = draw(st.binary(max_size=256))
    tensor = {"dtype": dtype, "shape": shape, "data": data}
    if draw(st.integers(0, 9)) == 0:  # damage the map itself
        key = draw(st.sampled_from(["dtype", "shape", "data"]))
        tensor[key] = draw(values)
    return tensor


def bodies(keys):
    """Maps over an endpoint's keys (and strangers) with tensors or any values."""
    return st.dictionaries(st.sampled_from(keys + ["extra", ""]),
                           st.one_of(tensors(), values), max_size=4)


@st.composite
def mutated(draw, valid: bytes):
    """A valid body with bytes flipped, cut, inserted or deleted."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            del data[i:i + draw(st.integers(1, 16))]
    return bytes(data)


# -- the decoder, in process ----------------------------------------------------------------


@settings(max_examples=600, deadline=None)
@given(st.one_of(st.binary(max_size=300), values.map(lambda v: msgpack.packb(v))))
def test_unpackb_returns_a_map_or_raises_bad_msgpack(body):
    try:
        obj = unpackb(body)
    except BadMsgpack:
        return
    assert isinstance(obj, dict) and all(isinstance(k, (str, OtherKey)) for k in obj)


def _uploaded(obj):
    """``obj`` as an upload's tensor ``w``, through the server's schema: a torch view."""
    return upload_tensor(decode_weights(packb({"w": obj})).w)


@settings(max_examples=600, deadline=None)
@given(st.one_of(tensors(), values))
def test_tensor_maps_decode_or_raise_their_code(obj):
    try:
        t = _uploaded(obj)
    except (BadTensor, BadDtype):
        assert not isinstance(obj, str)
        return
    except BadField:  # a string for a tensor: the name form takes 'file' too
        assert isinstance(obj, str)
        return
    assert list(t.shape) == obj["shape"]
    assert t.numel() * t.element_size() == len(obj["data"])
    if t.numel():
        assert t.view(-1).view(torch.uint8).numpy().tobytes() == obj["data"]


def test_routes_refuse_dims_torch_cannot_hold():
    for shape in ([2**63, 0], [0, 2**64 - 1], [0, 2**62, 4]):
        with pytest.raises(InvalidRequest):
            _uploaded({"dtype": "float32", "shape": shape, "data": b""})
    assert _uploaded({"dtype": "float32", "shape": [0, 5, 4], "data": b""}).shape == (0, 5, 4)


# -- the endpoints, over HTTP -------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=400))
def test_any_bytes_to_every_endpoint(srv, body):
    check_answer(srv.http.post("/v1/weights/base/gemm", content=body, headers=MSGPACK))
    check_answer(srv.http.put("/v1/weights/fuzz", content=body, headers=MSGPACK))
    check_base_untouched(srv)


@pytest.mark.parametrize("key", ["w", "file", "w13", "checkpoint", "x"])
def test_values_nested_deeper_than_the_recursion_limit(srv, key):
    """The session 47 probe's 500: an upload whose value nests 967 arrays deep (the form's key
    lookup hit Python's recursion limit). Every endpoint answers 400, and nothing changes."""
    for depth in (967, 5000):
        body = b"\x81" + packb(key) + b"\x91" * depth + b"\xc0"
        for r in (srv.http.put("/v1/weights/deep", content=body, headers=MSGPACK),
                  srv.http.put("/v1/experts/deep", content=body, headers=MSGPACK),
                  srv.http.post("/v1/weights/base/gemm", content=body, headers=MSGPACK)):
            assert r.status_code == 400, (key, depth, r.status_code, r.text)
            check_answer(r)
    check_base_untouched(srv)


@FUZZ
@given(bodies(["x", "x_scale", "m_sizes"]))
def test_msgpack_maps_to_gemm(srv, body):
    r = srv.http.post("/v1/weights/base/gemm", content=packb(body), headers=MSGPACK)
    check_answer(r, ok=(200,))
    check_base_untouched(srv)


@FUZZ
@given(bodies(["w", "w_scale", "file"]))
def test_msgpack_maps_to_put(srv, body):
    before = _scratch(srv)
    r = srv.http.put("/v1/weights/fuzz", content=packb(body), headers=MSGPACK)
    check_answer(r)
    if r.status_code >= 400:
        assert _scratch(srv) is before  # a refused load changes nothing
    check_base_untouched(srv)


@FUZZ
@given(st.data())
def test_mutated_valid_gemm_bodies(srv, data):
    p = srv.problem
    valid = packb({"x": wire(p.xq), "x_scale": wire(p.x_scale), "m_sizes": wire(p.m_sizes)})
    body = data.draw(mutated(valid))
    r = srv.http.post("/v1/weights/base/gemm", content=body, headers=MSGPACK)
    check_answer(r, ok=(200,))
    check_base_untouched(srv)


@FUZZ
@given(st.data())
def test_mutated_valid_put_bodies(srv, data):
    p = srv.problem
    valid = packb({"w": wire(p.wq), "w_scale": wire(p.w_scale)})
    before = _scratch(srv)
    r = srv.http.put("/v1/weights/fuzz", content=data.draw(mutated(valid)), headers=MSGPACK)
    check_answer(r)
    if r.status_code >= 400:
        assert _scratch(srv) is before
    check_base_untouched(srv)


def _scratch(srv):
    sets = {ws.name: ws for ws in srv.services.store.list()}
    return sets.get("fuzz")


def _spelled(name: str) -> str:
    # Every byte percent-encoded: the name reaches the server whole, whatever it holds.
    return "".join(f"%{b:02X}" for b in name.encode())


@FUZZ
@given(st.one_of(st.text(max_size=140), st.from_regex(NAME_RE, fullmatch=True),
                 st.sampled_from(["a/b", "../etc", "..", ".", "a\x00b", "a\nb", "x" * 129])))
def test_any_name(srv, name):
    assume(name != "base")
    path = f"/v1/weights/{_spelled(name)}"
    p = srv.problem
    call = packb({"x": wire(p.xq), "x_scale": wire(p.x_scale), "m_sizes": wire(p.m_sizes)})
    valid = NAME_RE.fullmatch(name) is not None and name not in (".", "..")
    for r, if_valid in (
        (srv.http.post(path + "/gemm", content=call, headers=MSGPACK), (404, "no_such_weights")),
        (srv.http.delete(path), (404, "no_such_weights")),
        (srv.http.put(path, content=b"\xc1", headers=MSGPACK), (400, "bad_msgpack")),
    ):
        status, code = if_valid if valid else (400, "bad_name")
        assert r.status_code == status, (name, r.status_code, r.text)
        assert r.json()["error"]["code"] == code, (name, r.text)
    check_base_untouched(srv)


@FUZZ
@given(st.dictionaries(
    st.sampled_from(["authorization", "content-type", "x-deadline-ms", "x-request-id"]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(str.strip),
    max_size=4,
))
def test_any_headers(srv, headers):
    p = srv.problem
    body = packb({"x": wire(p.xq), "x_scale": wire(p.x_scale), "m_sizes": wire(p.m_sizes)})
    headers = {"content-type": MSGPACK["content-type"], **headers}
    r = srv.http.post("/v1/weights/base/gemm", content=body, headers=headers)
    check_answer(r, ok=(200,))
    check_base_untouched(srv)
