"""The strict msgpack decoder of refused bodies (server/_unpack.py), and packb's bytes."""

import struct
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moegemm.client import BadMsgpack, BadTensor
from moegemm.client._wire import decode_tensors, encode_tensor, packb
from moegemm.server._request import decode_gemm
from moegemm.server._unpack import _MAX_VALUES, OtherKey, _few_values, unpackb


def test_unpackb_gives_the_map():
    body = packb({"x": encode_tensor(np.arange(3, dtype=np.int64)), "file": "a/b.safetensors"})
    msg = unpackb(memoryview(body))
    assert msg["file"] == "a/b.safetensors"
    assert np.frombuffer(msg["x"]["data"], np.int64).tolist() == [0, 1, 2]


GOOD = msgpack.packb({"a": 1}, use_bin_type=True)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",  # never-used byte
        b"not msgpack at all",
        GOOD[:-1],  # truncated
        GOOD + b"\x00",  # trailing bytes
        GOOD + GOOD,  # two maps
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb("just a string"),
        msgpack.packb(7),
        msgpack.packb(None),
        msgpack.packb({"a": msgpack.ExtType(5, b"xyz")}),
        msgpack.packb({"a": msgpack.Timestamp(1, 2)}),  # ext -1, decoded by msgpack itself
        b"\x81\xa2\xff\xfe\x01",  # {invalid utf-8: 1}
        b"\x82\xa1a\x01\xa1a\x02",  # duplicate key "a"
        b"\x81\xa1a" + b"\x91" * 5000 + b"\x00",  # nesting deeper than the unpacker's stack
        b"\xdf\xff\xff\xff\xff",  # a map claiming 4G entries
        b"\x81\xa1a\xc6\xff\xff\xff\xff",  # a bin claiming 4 GiB
    ],
)
def test_unpackb_refuses(body):
    with pytest.raises(BadMsgpack):
        unpackb(body)


def test_unpackb_keeps_non_string_keys_as_other_keys():
    """Still one msgpack map: its non-string keys are fields nobody knows (bad_field at the
    top, bad_tensor in a tensor map), told apart from the string of the same text."""
    got = unpackb(msgpack.packb({1: "a", "1": "b", b"k": 2, "x": 3}, use_bin_type=True))
    assert got == {OtherKey(1): "a", "1": "b", OtherKey(b"k"): 2, "x": 3}
    huge = unpackb(msgpack.packb({b"k" * (1 << 20): 1}, use_bin_type=True))
    assert len(repr(list(huge))) < 100  # shown cut, whatever the key's size
    with pytest.raises(BadMsgpack, match="duplicate"):
        unpackb(b"\x82\x01\x01\x01\x02")  # {1: 1, 1: 2}
    for tensor in ({"dtype": "float32", "shape": [1], "data": b"\0" * 4, 7: 0},
                   {"dtype": "float32", "shape": [1], b"data": b"\0" * 4}):
        with pytest.raises(BadTensor):  # a tensor map's non-string key
            decode_tensors(msgpack.packb({"t": tensor}, use_bin_type=True))


@settings(deadline=None, max_examples=500)
@given(st.binary(max_size=64))
def test_unpackb_any_bytes_is_a_map_or_bad_msgpack(body):
    try:
        msg = unpackb(body)
    except BadMsgpack:
        return
    assert isinstance(msg, dict)


@settings(deadline=None, max_examples=200)
@given(st.binary(min_size=1, max_size=64), st.integers(0, 63))
def test_unpackb_corrupted_valid_body(noise, cut):
    body = packb({"x": encode_tensor(np.random.rand(2, 2).astype(np.float32)), "n": "w"})
    mutated = body[:cut] + noise + body[cut + len(noise) :]
    try:
        msg = unpackb(mutated)
    except BadMsgpack:
        return
    assert isinstance(msg, dict)


_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary()
)
_values = st.recursive(
    _leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(deadline=None, max_examples=200)
@given(st.dictionaries(st.text(), _values, max_size=5))
def test_unpackb_round_trips_any_string_keyed_map(msg):
    back = unpackb(packb(msg))
    assert packb(back) == packb(msg)  # bytes compare: NaN != NaN as floats




@settings(deadline=None, max_examples=500)
@given(st.dictionaries(st.text(), _values, max_size=5))
def test_packb_writes_msgpack_pythons_bytes(msg):
    """packb (msgspec's encoder) writes what msgpack-python writes with use_bin_type."""
    assert packb(msg) == msgpack.packb(msg, use_bin_type=True)


def _values(obj) -> int:
    """How many msgpack values ``obj`` packs to (itself and everything inside)."""
    if isinstance(obj, msgpack.ExtType):  # (a tuple, but one value)
        return 1
    if isinstance(obj, dict):
        return 1 + sum(_values(k) + _values(v) for k, v in obj.items())
    if isinstance(obj, list):
        return 1 + sum(_values(v) for v in obj)
    return 1


_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                    st.floats(allow_nan=False, width=32), st.text(max_size=70000),
                    st.binary(max_size=70000),
                    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=300)))


@settings(max_examples=300, deadline=None)
@given(st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=20)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=17), max_leaves=60),
       st.booleans())
def test_the_value_count_is_exact_without_decoding(obj, single_float):
    body = msgpack.packb({"a": obj}, use_single_float=single_float)
    n = _values({"a": obj})
    assert _few_values(body, n) and not _few_values(body, n - 1)


def test_a_body_of_many_small_values_is_refused_before_it_is_decoded():
    """A body of a few bytes a value would become millions of Python objects: a 16 MiB body
    of empty maps took 1 GB and 2.5 s of the event loop to diagnose. Past 4096 values it is
    bad_msgpack at once, with no object made; a body at the bound is still decoded."""
    inner = b"\xdc\xff\xff" + b"\x80" * 65535  # an array of 65535 empty maps
    bomb = b"\x82\xa1x\xdd" + struct.pack(">I", 256) + inner * 256 + b"\xa7m_sizes\xc0"
    tracemalloc.start()
    try:
        with pytest.raises(BadMsgpack, match="over 4096 msgpack values"):
            unpackb(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    # The map, its key and its array are 3 values: the array may hold the rest.
    at_bound = msgpack.packb({"x": [None] * (_MAX_VALUES - 3)})
    assert len(unpackb(at_bound)["x"]) == _MAX_VALUES - 3
    with pytest.raises(BadMsgpack, match="msgpack values"):
        unpackb(msgpack.packb({"x": [None] * (_MAX_VALUES - 2)}))


def test_a_tensor_shape_of_over_64_dims_is_refused_at_its_header():
    """A shape is at most 64 dims (numpy's and torch's limit): a longer one is refused before
    its entries are read (a body of 16M zero dims passed the schema and took 2 s and 110 MiB
    in the checks after it)."""
    x = {"dtype": "bfloat16", "shape": [1] * 65, "data": b"\0\0"}
    with pytest.raises(BadTensor, match="at most 64"):
        decode_gemm(packb({"x": x, "m_sizes": encode_tensor(np.array([1]))}))
    huge = {"dtype": "bfloat16", "shape": [0] * (1 << 24), "data": b""}
    body = packb({"x": huge, "m_sizes": encode_tensor(np.array([0]))})
    tracemalloc.start()
    try:
        with pytest.raises((BadTensor, BadMsgpack)):
            decode_gemm(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
