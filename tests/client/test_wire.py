"""The wire format (SPEC 2): round trips of every dtype and refusal of malformed input."""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moegemm.client import BadDtype, BadMsgpack, BadTensor
from moegemm.client._wire import (
    DTYPES,
    WireTensor,
    decode_tensors,
    encode_tensor,
    pack_tensors,
    packb,
)

try:
    import torch
except ImportError:  # the client installs without torch; so do these tests
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

SPEC_NAMES = [
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "bfloat16",
    "float16",
    "float32",
    "int32",
    "int64",
]

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)


def _random_array(data, name, shape):
    """An array of ``name`` whose bytes are arbitrary (NaN patterns included)."""
    dtype = DTYPES[name]
    raw = data.draw(
        st.binary(
            min_size=math.prod(shape) * dtype.itemsize, max_size=math.prod(shape) * dtype.itemsize
        )
    )
    return np.frombuffer(raw, dtype=dtype).reshape(shape), raw


def _wire_round_trip(t):
    return decode_tensors(packb({"t": encode_tensor(t)}))["t"]


def test_dtypes_are_the_spec_names():
    assert sorted(DTYPES) == sorted(SPEC_NAMES)
    assert DTYPES["float8_e4m3fn"] == np.dtype(ml_dtypes.float8_e4m3fn)
    assert DTYPES["float8_e4m3fnuz"] == np.dtype(ml_dtypes.float8_e4m3fnuz)
    assert DTYPES["bfloat16"] == np.dtype(ml_dtypes.bfloat16)
    assert [DTYPES[n].itemsize for n in SPEC_NAMES] == [1, 1, 2, 2, 4, 4, 8]


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), name=st.sampled_from(SPEC_NAMES), shape=shapes)
def test_numpy_round_trip_is_bit_exact(data, name, shape):
    arr, raw = _random_array(data, name, shape)
    enc = encode_tensor(arr)
    assert enc["dtype"] == name and enc["shape"] == shape
    assert bytes(enc["data"]) == raw
    wire = _wire_round_trip(arr)
    assert isinstance(wire, WireTensor)
    assert (wire.dtype, wire.shape, bytes(wire.data)) == (name, shape, raw)
    back = wire.numpy()
    assert back.dtype == DTYPES[name] and back.shape == tuple(shape)
    assert back.tobytes() == raw


@settings(deadline=None, max_examples=60)
@given(
    data=st.data(),
    name=st.sampled_from(["float16", "float32", "int32", "int64"]),
    shape=st.lists(st.integers(1, 4), min_size=2, max_size=3),
)
def test_big_endian_and_strided_numpy_go_out_little_endian_row_major(data, name, shape):
    arr, _ = _random_array(data, name, shape)
    expected = np.ascontiguousarray(arr.T).tobytes()
    swapped = arr.T.astype(arr.dtype.newbyteorder(">"))  # strided and big-endian
    enc = encode_tensor(swapped)
    assert enc["shape"] == list(arr.T.shape)
    assert bytes(enc["data"]) == expected


def test_numpy_scalar_keeps_shape_empty():
    enc = encode_tensor(np.float32(np.random.rand()))
    assert enc["shape"] == [] and len(enc["data"]) == 4


def test_encode_refuses_dtypes_outside_the_wire():
    """The server's code for such an array (SPEC 2.2 bad_dtype), raised before sending: one
    exception tree (SPEC 4), and a TypeError as any wrong argument."""
    for bad in (np.random.rand(2, 2), np.array([True, False]), [[0.5, 1.5]]):
        with pytest.raises(BadDtype, match="cannot go on the wire") as info:
            encode_tensor(bad)
        assert isinstance(info.value, TypeError) and info.value.code == "bad_dtype"
        assert info.value.status == 400
    with pytest.raises(BadDtype, match="list of Python floats"):  # says what the caller passed
        encode_tensor([[0.5, 1.5]])
    assert encode_tensor([3, 0, 5])["dtype"] == "int64"  # m_sizes as a list


def test_decode_is_zero_copy():
    body = packb({"t": encode_tensor(np.random.rand(8, 4).astype(np.float32))})
    arr = decode_tensors(body)["t"].numpy()
    # The array is a view on the body, not a fresh copy.
    assert np.shares_memory(arr, np.frombuffer(body, np.uint8))
    assert not arr.flags.writeable


# --- torch -----------------------------------------------------------------


@needs_torch
@settings(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), name=st.sampled_from(SPEC_NAMES), shape=shapes)
def test_torch_round_trip_is_bit_exact(data, name, shape):
    arr, raw = _random_array(data, name, shape)
    # Build the torch tensor from raw bytes, never through a float conversion.
    t = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )
    t = t.view(getattr(torch, name)).reshape(shape)
    enc = encode_tensor(t)
    assert enc["dtype"] == name and enc["shape"] == shape
    assert bytes(enc["data"]) == raw
    wire = _wire_round_trip(t)
    assert wire.numpy().tobytes() == arr.tobytes()


@needs_torch
def test_torch_non_contiguous_and_requires_grad():
    t = torch.randn(5, 3, requires_grad=True)
    enc = encode_tensor(t.T)
    assert enc["shape"] == [3, 5]
    np.testing.assert_array_equal(
        np.frombuffer(enc["data"], np.float32).reshape(3, 5), t.detach().T.numpy()
    )
    with pytest.raises(TypeError):
        encode_tensor(torch.randn(2, dtype=torch.float64))


@needs_torch
@pytest.mark.parametrize("make", [
    lambda: torch.empty(4, 128, dtype=torch.bfloat16, device="meta"),
    lambda: torch.eye(4, dtype=torch.bfloat16).to_sparse(),
], ids=["meta", "sparse"])
def test_torch_tensor_without_dense_data_is_bad_tensor(make):
    # A meta tensor holds no bytes and a sparse one is not row-major: the client's own error,
    # not torch's NotImplementedError, and nothing is sent.
    with pytest.raises(BadTensor, match="cannot go on the wire"):
        encode_tensor(make())


# --- decode_tensors refusals -----------------------------------------------


def _good():
    return encode_tensor(np.random.rand(2, 3).astype(np.float32)) | {}


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda t: [t], BadTensor),  # not a map
        (lambda t: b"raw", BadTensor),
        (lambda t: {k: v for k, v in t.items() if k != "data"}, BadTensor),
        (lambda t: {k: v for k, v in t.items() if k != "shape"}, BadTensor),
        (lambda t: {k: v for k, v in t.items() if k != "dtype"}, BadTensor),
        (lambda t: t | {"extra": 1}, BadTensor),
        (lambda t: t | {"shape": "2,3"}, BadTensor),
        (lambda t: t | {"shape": [2, -3]}, BadTensor),
        (lambda t: t | {"shape": [2, 3.0]}, BadTensor),
        (lambda t: t | {"shape": [True, 3]}, BadTensor),
        (lambda t: t | {"shape": [2, None]}, BadTensor),
        (lambda t: t | {"shape": 6}, BadTensor),
        (lambda t: t | {"shape": [3, 3]}, BadTensor),  # bytes != shape x itemsize
        (lambda t: t | {"data": bytes(t["data"])[:-1]}, BadTensor),
        (lambda t: t | {"data": bytes(t["data"]) + b"\0"}, BadTensor),
        (lambda t: t | {"data": list(bytes(t["data"]))}, BadTensor),
        (lambda t: t | {"data": "not bin"}, BadTensor),
        (lambda t: t | {"dtype": "float64"}, BadDtype),
        (lambda t: t | {"dtype": "Float32"}, BadDtype),
        (lambda t: t | {"dtype": 5}, BadDtype),
        (lambda t: t | {"dtype": None}, BadDtype),
    ],
)
def test_decode_refuses_malformed_maps(mutate, error):
    with pytest.raises(error) as info:
        decode_tensors(packb({"t": mutate(_good())}))
    assert type(info.value) is error


@pytest.mark.parametrize("body", [b"\xc1", packb({"t": _good()})[:-1], packb([1]),
                                  packb({"t": _good()}) + b"\x00"],
                         ids=["not msgpack", "cut short", "an array", "a byte after the map"])
def test_decode_refuses_what_is_not_one_map(body):
    with pytest.raises(BadMsgpack):
        decode_tensors(body)


def test_decode_accepts_zero_size_and_refuses_what_no_layout_holds():
    wire = decode_tensors(packb({"t": {"dtype": "bfloat16", "shape": [0, 7168], "data": b""}}))
    assert wire["t"].numpy().shape == (0, 7168)
    for shape in ([0, 2**62, 4], [2**63, 0], [0, 2**64 - 1]):
        with pytest.raises(BadTensor):
            decode_tensors(packb({"t": {"dtype": "float32", "shape": shape, "data": b""}}))


_SHAPES = st.lists(st.sampled_from([0, 1, 2, 3, 127, 128, 129, 255, 256, 300, 65536, 70000]),
                   max_size=3).filter(lambda s: math.prod(s) <= 1 << 18)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["x", "x_scale", "m_sizes", "w", "k" * 40]),
                       st.tuples(st.sampled_from(SPEC_NAMES), _SHAPES), max_size=4))
def test_pack_tensors_writes_the_bytes_of_packb(body):
    """The cached-head packer is packb, byte for byte, twice (cold and cached);
    tensors of 64 KiB or more are views on the caller's memory."""
    arrays = {k: np.zeros(shape, DTYPES[name]) + 1 for k, (name, shape) in body.items()}
    encoded = {k: encode_tensor(a) for k, a in arrays.items()}
    for _ in range(2):
        parts = pack_tensors(encoded)
        assert b"".join(parts) == packb(encoded)
        views = [p for p in parts if isinstance(p, memoryview)]
        assert len(views) == sum(a.nbytes >= 64 << 10 for a in arrays.values())


def test_pack_tensors_packs_other_maps_whole():
    big = encode_tensor(np.zeros(70000, np.uint8).view(ml_dtypes.float8_e4m3fn))
    for body in ({"a": 1, "x": big}, {"x": {**big, "extra": 1}},
                 {"x": {"shape": big["shape"], "dtype": big["dtype"], "data": big["data"]}},
                 {"x": {**big, "data": bytes(big["data"])}}, {str(i): i for i in range(20)}):
        assert pack_tensors(body) == [packb(body)]


@pytest.mark.parametrize("kind", ["weights", "experts"])
def test_uploads_send_their_tensors_as_views(kind):
    """A weight or expert upload's body is packb's bytes, each tensor of 64 KiB or more a view
    on the caller's array (a 7 GB set takes no second 7 GB in the client)."""
    from moegemm.client._calls import load_call, load_experts_call

    w = np.ones((2, 256, 256), ml_dtypes.float8_e4m3fn)
    scale = np.ones((2, 2, 2), np.float32)
    if kind == "weights":
        call, body = load_call("w", w, scale), {"w": w, "w_scale": scale}
    else:
        call = load_experts_call("e", w, w, scale, scale)
        body = {"w13": w, "w2": w, "w13_scale": scale, "w2_scale": scale}
    assert b"".join(call.body) == packb({k: encode_tensor(a) for k, a in body.items()})
    views = [p for p in call.body if isinstance(p, memoryview)]
    assert len(views) == (1 if kind == "weights" else 2)
    assert all(np.shares_memory(np.asarray(v), w) for v in views)
