"""Msgpack bodies without copying tensor bytes, in and out.

``unpack_body`` decodes a request body like ``moegemm.client._wire.unpackb``
but returns every bin as a memoryview on the body instead of a bytes copy, so
a body received into pinned memory reaches the device with no host copy at
all. It walks only the plain types our bodies use (maps, arrays, str, bin,
ints, floats, nil, bools) and only fully valid input: anything else --
truncation, ext types, duplicate or non-string keys, oversize containers,
bad UTF-8 -- is handed to ``unpackb``, which raises exactly the error the
contract names. So the fast path never changes what a bad body answers.

``TensorResponse`` answers ``{key: tensor}`` as msgpack from a small header
and the tensor's own memory (for example a pinned output buffer): the
transport writes both parts as they are.
"""

from __future__ import annotations

import struct
from typing import Any

import torch
from moegemm.client._wire import unpackb
from starlette.responses import Response

from ._tensors import WIRE_NAMES

MSGPACK = "application/vnd.msgpack"

# The limits unpackb enforces; beyond them the standard path decides.
_MAX_STR_LEN = 1 << 20
_MAX_ARRAY_LEN = 1 << 16
_MAX_MAP_LEN = 1 << 12
_MAX_DEPTH = 16

_U8, _U16, _U32, _U64 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">Q")
_I8, _I16, _I32, _I64 = struct.Struct(">b"), struct.Struct(">h"), struct.Struct(">i"), struct.Struct(">q")
_F32, _F64 = struct.Struct(">f"), struct.Struct(">d")


class _Unusual(Exception):
    """Not a plain valid body: let the standard decoder decide."""


class _Reader:
    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.pos = 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.view):
            raise _Unusual
        out = self.view[self.pos:end]
        self.pos = end
        return out

    def num(self, fmt: struct.Struct):
        end = self.pos + fmt.size
        if end > len(self.view):
            raise _Unusual
        value = fmt.unpack_from(self.view, self.pos)[0]
        self.pos = end
        return value

    def value(self, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise _Unusual
        b = self.num(_U8)
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self.map(b & 0x0F, depth)
        if 0x90 <= b <= 0x9F:
            return self.array(b & 0x0F, depth)
        if 0xA0 <= b <= 0xBF:
            return self.str(b & 0x1F)
        if b == 0xC0:
            return None
        if b == 0xC2:
            return False
        if b == 0xC3:
            return True
        if b == 0xC4:
            return self.take(self.num(_U8))
        if b == 0xC5:
            return self.take(self.num(_U16))
        if b == 0xC6:
            return self.take(self.num(_U32))
        simple = _SCALARS.get(b)
        if simple is not None:
            return self.num(simple)
        if b == 0xD9:
            return self.str(self.num(_U8))
        if b == 0xDA:
            return self.str(self.num(_U16))
        if b == 0xDB:
            return self.str(self.num(_U32))
        if b == 0xDC:
            return self.array(self.num(_U16), depth)
        if b == 0xDD:
            return self.array(self.num(_U32), depth)
        if b == 0xDE:
            return self.map(self.num(_U16), depth)
        if b == 0xDF:
            return self.map(self.num(_U32), depth)
        raise _Unusual  # ext types and the unused byte 0xC1

    def str(self, n: int) -> str:
        if n > _MAX_STR_LEN:
            raise _Unusual
        try:
            return str(self.take(n), "utf-8")
        except UnicodeDecodeError:
            raise _Unusual from None

    def array(self, n: int, depth: int) -> list:
        if n > _MAX_ARRAY_LEN:
            raise _Unusual
        return [self.value(depth + 1) for _ in range(n)]

    def map(self, n: int, depth: int) -> dict:
        if n > _MAX_MAP_LEN:
            raise _Unusual
        out: dict = {}
        for _ in range(n):
            key = self.value(depth + 1)
            if not isinstance(key, str) or key in out:
                raise _Unusual
            out[key] = self.value(depth + 1)
        return out


_SCALARS = {
    0xCA: _F32, 0xCB: _F64, 0xCC: _U8, 0xCD: _U16, 0xCE: _U32, 0xCF: _U64,
    0xD0: _I8, 0xD1: _I16, 0xD2: _I32, 0xD3: _I64,
}


# Below this, msgpack's C decoder (which copies bins) is faster than walking
# the body in Python: a 7 KB call decodes in ~7 us instead of ~35 us, and its
# copies cost nothing next to that.
_COPY_BELOW = 64 << 10


def unpack_body(body: bytes | bytearray | memoryview) -> dict:
    """One msgpack map from ``body``, bins as memoryviews on it; errors as ``unpackb``.

    Bodies under 64 KiB are decoded by ``unpackb`` itself (bins then are copies).
    """
    if len(body) < _COPY_BELOW:
        return unpackb(body)
    return unpack_in_place(body)


def unpack_in_place(body: bytes | bytearray | memoryview) -> dict:
    """``unpack_body`` at any size: bins are always memoryviews on ``body``."""
    view = memoryview(body)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    reader = _Reader(view)
    try:
        obj = reader.value(0)
        if isinstance(obj, dict) and reader.pos == len(view):
            return obj
    except _Unusual:
        pass
    return unpackb(body)


def _bin_header(n: int) -> bytes:
    if n < 1 << 8:
        return b"\xc4" + _U8.pack(n)
    if n < 1 << 16:
        return b"\xc5" + _U16.pack(n)
    return b"\xc6" + _U32.pack(n)


def _str(s: str) -> bytes:
    raw = s.encode()
    return bytes([0xA0 | len(raw)]) + raw  # our keys and dtype names are < 32 bytes


def _uint(n: int) -> bytes:
    if n <= 0x7F:
        return bytes([n])
    if n < 1 << 32:
        return b"\xce" + _U32.pack(n)
    return b"\xcf" + _U64.pack(n)


def tensor_body_parts(key: str, t: torch.Tensor) -> list[bytes | memoryview]:
    """``{key: {"dtype", "shape", "data"}}`` as msgpack: a header, then the tensor's bytes.

    ``t`` is a contiguous CPU tensor; its memory is the second part, not copied.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().to("cpu").contiguous()
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    if t.dim() >= 16:
        raise ValueError("tensor has too many dimensions for a fixarray shape")
    header = b"".join((
        b"\x81", _str(key), b"\x83",
        _str("dtype"), _str(WIRE_NAMES[t.dtype]),
        _str("shape"), bytes([0x90 | t.dim()]), *(_uint(d) for d in t.shape),
        _str("data"), _bin_header(data.nbytes),
    ))
    return [header, data]


class TensorResponse(Response):
    """A msgpack ``{key: tensor}`` response sent as header + tensor memory (no copy)."""

    media_type = MSGPACK

    def __init__(self, key: str, tensor: torch.Tensor, status_code: int = 200) -> None:
        self.parts = tensor_body_parts(key, tensor)
        self.tensor = tensor  # keeps the memory alive until sent
        size = sum(len(p) for p in self.parts)
        super().__init__(content=None, status_code=status_code, media_type=MSGPACK)
        self.headers["content-length"] = str(size)

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part,
                        "more_body": i + 1 < len(self.parts)})
