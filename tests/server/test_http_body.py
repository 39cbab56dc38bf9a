"""Zero-copy msgpack bodies: the server's schemas decode upload tensors as views on the body,
and answers go out as a packed head and the output's own memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moegemm.client._wire import encode_tensor, packb
from moegemm.server._body import array_body_parts
from moegemm.server._request import decode_experts, decode_weights
from moegemm.server._unpack import unpackb


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
