"""Zero-copy msgpack bodies: the client's in-place decoder gives the same result and errors as
the wire decoder; the server's schemas decode upload tensors as views on the body."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moegemm.client._errors import BadMsgpack
from moegemm.client._wire import encode_tensor, packb, unpack_in_place, unpackb
from moegemm.server._body import array_body_parts
from moegemm.server._request import decode_experts, decode_weights

scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, width=32) | st.text(max_size=40) | st.binary(max_size=300)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=5),
    max_leaves=20,
)
bodies = st.dictionaries(st.text(max_size=10), values, max_size=6)


def _plain(obj):
    """Bins as bytes, so results of both decoders compare equal."""
    if isinstance(obj, memoryview):
        return obj.tobytes()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


@settings(max_examples=300, deadline=None)
@given(body=bodies, single_floats=st.booleans())
def test_same_result_as_unpackb(body, single_floats):
    data = msgpack.packb(body, use_bin_type=True, use_single_float=single_floats)
    assert _plain(unpack_in_place(data)) == _plain(unpackb(data))


@settings(max_examples=300, deadline=None)
@given(body=bodies, cut=st.integers(0, 10_000), junk=st.binary(min_size=1, max_size=4))
def test_same_error_as_unpackb_on_damaged_bodies(body, cut, junk):
    data = msgpack.packb(body, use_bin_type=True)
    for damaged in (data[: cut % max(1, len(data))], data + junk, junk + data):
        try:
            expected = unpackb(damaged)
        except BadMsgpack as exc:
            with pytest.raises(BadMsgpack) as got:
                unpack_in_place(damaged)
            assert str(got.value) == str(exc)
        else:
            assert _plain(unpack_in_place(damaged)) == _plain(expected)


def test_refusals_match():
    cases = [
        b"\xc1",  # never used
        msgpack.packb({"a": msgpack.ExtType(3, b"x")}),
        b"\x82\xa1a\x01\xa1a\x02",  # duplicate key
        b"\x81\xa1a\xa2\xff\xfe",  # bad utf-8
        msgpack.packb([1, 2]),  # not a map
    ]
    for data in cases:
        with pytest.raises(BadMsgpack) as expected:
            unpackb(data)
        with pytest.raises(BadMsgpack) as got:
            unpack_in_place(data)
        assert str(got.value) == str(expected.value)


def test_non_string_keys_decode_the_same():
    """A non-string key leaves the fast walk to ``unpackb``: both give the same map."""
    for data in (b"\x81\x01\x02", msgpack.packb({b"k": 1, "a": 2}, use_bin_type=True)):
        assert unpack_in_place(data) == unpackb(data)


def test_upload_tensors_are_views_on_the_body():
    w = torch.randn(3, 64, 256).to(torch.bfloat16)
    body = bytearray(packb({"w": encode_tensor(w)}))
    decoded = decode_weights(memoryview(body))
    assert decoded.w.data.obj is body
    assert decoded.w.shape == [3, 64, 256]
    assert decoded.w.data.tobytes() == w.view(torch.uint8).numpy().tobytes()
    w13, w2 = torch.randn(2, 512, 128), torch.randn(2, 128, 256)
    body = bytearray(packb({"w13": encode_tensor(w13), "w2": encode_tensor(w2)}))
    decoded = decode_experts(memoryview(body))
    assert decoded.w13.data.obj is body and decoded.w2.data.obj is body


@pytest.mark.parametrize("shape", [(0, 128), (1, 7), (129, 300), (3, 70000)])
def test_tensor_response_parts_are_the_packed_map(shape):
    t = torch.randn(shape).to(torch.bfloat16)
    header, data = array_body_parts("out", t.view(torch.uint8).numpy(), "bfloat16", shape)
    assert isinstance(data, memoryview)
    decoded = unpackb(header + data.tobytes())
    assert decoded["out"]["dtype"] == "bfloat16" and decoded["out"]["shape"] == list(shape)
    raw = bytes(decoded["out"]["data"])
    assert raw == t.view(torch.uint8).numpy().tobytes() and len(raw) == t.numel() * 2


def test_small_bodies_are_not_pinned():
    """Bodies under 64 KiB skip the pinned allocator."""
    from moegemm.server._staging import _PIN_BODIES_FROM, pinned_body_allocator

    view = pinned_body_allocator()(_PIN_BODIES_FROM - 1)
    assert len(view) == _PIN_BODIES_FROM - 1 and not view.readonly
    assert not torch.from_numpy(np.asarray(view)).is_pinned()
    if torch.cuda.is_available():
        big = pinned_body_allocator()(_PIN_BODIES_FROM)
        assert torch.from_numpy(np.asarray(big)).is_pinned()
