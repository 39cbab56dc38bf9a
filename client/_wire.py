"""The wire format of SPEC 2: tensors as msgpack maps, bodies as one msgpack map.

A tensor on the wire is ``{"dtype": name, "shape": [d0, ...], "data": bin}``,
little-endian, row-major, no padding. The server imports this module too, so
both sides refuse exactly the same malformed input with the same error.

Nothing here imports torch: a torch tensor is recognised only when torch is
already imported by the caller (``sys.modules``), and crosses as raw bytes.
"""

from __future__ import annotations

import math
import reprlib
import struct
import sys
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import msgpack
import numpy as np

from ._errors import ArgumentDtype, BadDtype, BadMsgpack, BadTensor

__all__ = [
    "DTYPES", "WireTensor", "decode_tensor", "encode_tensor", "pack_tensors",
    "packb", "tensor_head", "unpack_in_place", "unpackb",
]

DTYPES: dict[str, np.dtype] = {
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
}

# Torch dtypes by their attribute name on the torch module; the wire names are
# chosen to equal them, so the lookup needs no torch at import time.
_TORCH_NAMES = tuple(DTYPES)

_TENSOR_KEYS = frozenset(("dtype", "shape", "data"))

# Our bodies are a few small maps around big bins: these bounds refuse
# pathological nesting and huge containers before they cost memory. Bins are
# bounded by the body itself (and by the server's body limit).
_MAX_STR_LEN = 1 << 20
_MAX_ARRAY_LEN = 1 << 16
_MAX_MAP_LEN = 1 << 12


@dataclass(frozen=True)
class WireTensor:
    """A validated tensor map: its dtype name, shape and raw little-endian bytes.

    ``data`` is a byte-format memoryview on the decoded body, not a copy.
    """

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @property
    def nbytes(self) -> int:
        """The size of ``data`` in bytes."""
        return self.data.nbytes

    def numpy(self) -> np.ndarray:
        """A numpy view on ``data`` (zero-copy; read-only when the body is bytes)."""
        return np.frombuffer(self.data, dtype=DTYPES[self.dtype]).reshape(self.shape)


def _torch_tensor(a: Any):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return torch
    return None


def encode_tensor(a: Any) -> dict:
    """The wire map of a numpy array or a torch tensor (SPEC 2).

    ``data`` is a read-only memoryview of contiguous little-endian bytes (msgpack
    packs it as bin); it is a view on ``a`` when ``a`` is already contiguous
    little-endian on the CPU, so do not write to ``a`` before packing. Torch fp8
    and bf16 cross through a uint8 view, never through a float conversion.
    """
    torch = _torch_tensor(a)
    if torch is not None:
        name = next((n for n in _TORCH_NAMES if getattr(torch, n, None) == a.dtype), None)
        if name is None:
            raise ArgumentDtype(f"dtype {a.dtype} cannot go on the wire; it takes {sorted(DTYPES)}")
        t = a.detach().to("cpu").contiguous()
        shape = list(t.shape)
        # Reinterpret as bytes: numpy has no fp8/bf16 dtype torch could hand over.
        # Torch's hosts are little-endian, so its memory is already wire order.
        raw = t.reshape(-1).view(torch.uint8).numpy()
        return {"dtype": name, "shape": shape, "data": _bytes_view(raw)}
    if type(a) is np.ndarray and a.flags.c_contiguous:
        name = _NAMES.get(a.dtype)  # known little-endian (or byte) dtypes only
        if name is not None:  # the common case: the array's own memory as it is
            return {"dtype": name, "shape": list(a.shape),
                    "data": memoryview(a.reshape(-1).view(np.uint8)).toreadonly()}
    arr = np.asarray(a)
    if not isinstance(a, np.ndarray) and arr.dtype == np.float64:
        # A list of Python floats: numpy makes it float64, which no tensor field takes.
        raise ArgumentDtype(f"a {type(a).__name__} of Python floats becomes float64, which "
                            f"cannot go on the wire; pass an array of one of {sorted(DTYPES)}")
    name = _wire_name(arr.dtype)
    # astype, not ascontiguousarray: the latter turns a 0-d array into shape [1].
    arr = arr.astype(DTYPES[name], order="C", copy=False)
    return {"dtype": name, "shape": list(arr.shape), "data": _bytes_view(arr)}


def _wire_name(dtype: np.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is not None:
        return name
    little = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    for name, wire in DTYPES.items():
        if little == wire:
            if dtype.byteorder != ">":  # only dtypes whose bytes are already wire order
                _NAMES[dtype] = name
            return name
    raise ArgumentDtype(f"dtype {dtype} cannot go on the wire; it takes {sorted(DTYPES)}")


# numpy dtypes seen before -> their wire name (a dict hit instead of a scan).
_NAMES: dict[np.dtype, str] = {}


def _bytes_view(arr: np.ndarray) -> memoryview:
    # reshape(-1) of a contiguous array is a view; uint8 makes the memoryview byte-format.
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return memoryview(arr.reshape(-1).view(np.uint8)).toreadonly()


def decode_tensor(obj: Any) -> WireTensor:
    """Validate a decoded tensor map and wrap it without copying its bytes.

    Raises BadTensor for a map that is not exactly {dtype, shape, data}, a shape
    that is not a list of non-negative ints, or data that is not bin of exactly
    ``prod(shape) * itemsize`` bytes; BadDtype for a dtype name outside SPEC 2.
    """
    if not isinstance(obj, dict):
        raise BadTensor(f"a tensor is a map {{dtype, shape, data}}, got {type(obj).__name__}")
    if obj.keys() != _TENSOR_KEYS:
        keys = set(obj)
        missing = sorted(_TENSOR_KEYS - keys)
        extra = sorted(map(repr, keys - _TENSOR_KEYS))
        raise BadTensor(
            f"a tensor map has exactly the keys dtype, shape, data; missing {missing}, "
            f"unknown {extra}"
        )
    name = obj["dtype"]
    if not isinstance(name, str) or name not in DTYPES:
        raise BadDtype(f"dtype {name!r:.100} is not one of {sorted(DTYPES)}")
    shape = obj["shape"]
    if not isinstance(shape, (list, tuple)) or not all(
        type(d) is int and d >= 0
        for d in shape  # bool is an int subclass: refused
    ):
        raise BadTensor(f"shape must be a list of non-negative ints, got {shape!r:.200}")
    data = obj["data"]
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadTensor(f"data must be bin, got {type(data).__name__}")
    view = memoryview(data)
    if not view.c_contiguous:
        raise BadTensor("data must be one contiguous buffer")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    expected = math.prod(shape) * DTYPES[name].itemsize
    if view.nbytes != expected:
        raise BadTensor(f"data holds {view.nbytes} bytes; {name} {list(shape)} needs {expected}")
    return WireTensor(name, tuple(shape), view)


def packb(obj: Any) -> bytes:
    """Serialize a body (a map) to msgpack, bytes as bin and str as str."""
    return msgpack.packb(obj, use_bin_type=True)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise BadMsgpack(f"msgpack ext type {code} is not allowed")


@dataclass(frozen=True)
class OtherKey:
    """A map key that is not a string (an int, a bin, ...): still one msgpack map, so a body's
    non-string key is a field no endpoint knows (400 ``bad_field``) and a tensor map's makes it
    malformed (``bad_tensor``), never ``bad_msgpack``. Equal as the key it holds (a container
    key, unhashable, as its own object); shown cut, whatever the key's size."""

    key: Any

    def __repr__(self) -> str:
        key = self.key
        if isinstance(key, bytes):
            head = repr(key[:40])
            return head if len(key) <= 40 else f"{head}... ({len(key)} bytes)"
        return reprlib.repr(key)


def _other_key(key: Any) -> OtherKey:
    try:
        hash(key)
    except TypeError:  # a map or an array as a key: only ever equal to itself
        return OtherKey(_Opaque(key))
    return OtherKey(key)


@dataclass(frozen=True, eq=False)
class _Opaque:
    value: Any

    def __repr__(self) -> str:
        return reprlib.repr(self.value)


def _pairs_to_dict(pairs: list) -> dict:
    out: dict = {}
    for key, value in pairs:
        if not isinstance(key, str):
            key = _other_key(key)
        if key in out:
            raise BadMsgpack(f"duplicate map key {key!r:.100}")
        out[key] = value
    return out


# What msgpack's FormatError and StackError leave unsaid (their messages are empty).
_UNPACK_ERRORS = {
    msgpack.exceptions.FormatError: "a byte that starts no msgpack value (0xC1, or garbage)",
    msgpack.exceptions.StackError: "containers nested too deeply",
}


def unpackb(body: bytes | bytearray | memoryview) -> dict:
    """Decode a body that must be exactly one msgpack map, else raise BadMsgpack.

    Bins become bytes (the only copy of tensor data); keys must be unique (a non-string
    one becomes an :class:`OtherKey`); ext types, invalid UTF-8, truncation and
    trailing bytes are refused.
    """
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            use_list=True,
            strict_map_key=False,  # non-string keys: OtherKey
            object_pairs_hook=_pairs_to_dict,
            ext_hook=_refuse_ext,
            max_str_len=_MAX_STR_LEN,
            max_array_len=_MAX_ARRAY_LEN,
            max_map_len=_MAX_MAP_LEN,
            max_ext_len=0,  # every ext, the built-in timestamp (-1) included
        )
    except BadMsgpack:
        raise
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        # ValueError covers ExtraData, FormatError, StackError and UnicodeDecodeError.
        detail = _UNPACK_ERRORS.get(type(exc)) or str(exc) or type(exc).__name__
        raise BadMsgpack(f"the body is not one msgpack map: {detail}") from exc
    if not isinstance(obj, dict):
        raise BadMsgpack(f"the body must be a msgpack map, got {type(obj).__name__}")
    return obj


# -- zero-copy forms: large bodies as parts, large bins as views ---------------------

# Nesting deeper than this is left to unpackb (our bodies are three levels deep).
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



def unpack_in_place(body: bytes | bytearray | memoryview) -> dict:
    """``unpackb``, but every bin is a memoryview on ``body`` instead of a bytes copy.

    Walks only the plain types our bodies use (maps, arrays, str, bin, ints,
    floats, nil, bools) and only fully valid input: anything else --
    truncation, ext types, duplicate or non-string keys, oversize containers,
    bad UTF-8 -- is handed to ``unpackb``, which raises exactly the error the
    contract names (non-string keys it decodes). Used for large bodies (the
    server's requests, the client's answers): their tensor bytes are then never
    copied on the host.
    """
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


# Bins at least this large go out as their own part (a view, not a copy; _calls._packed).
_PART_FROM = 64 << 10


def bin_header(n: int) -> bytes:
    """The msgpack header of a bin of ``n`` bytes."""
    if n < 1 << 8:
        return b"\xc4" + _U8.pack(n)
    if n < 1 << 16:
        return b"\xc5" + _U16.pack(n)
    return b"\xc6" + _U32.pack(n)


def pack_tensors(body: dict[str, dict]) -> list[bytes | memoryview]:
    """``packb(body)`` for a map of ``encode_tensor`` maps, as parts whose concatenation is
    exactly those bytes.

    Each tensor's msgpack up to its data (key, map header, dtype, shape, bin
    header) is built once per key, dtype and shape and kept; the data goes in
    behind it: copied when small, its own part (a view on the caller's memory:
    do not write to it before the parts are sent) from 64 KiB. A socket sends
    the list with one scatter-gather call (``sendmsg``). Anything but plain
    tensor maps with fewer than 16 keys is packed whole (correct, only not
    zero-copy: our bodies never are).
    """
    if len(body) >= 16:
        return [packb(body)]
    parts: list[bytes | memoryview] = []
    small: list = [_FIXMAP[len(body)]]
    for key, tensor in body.items():
        if type(tensor) is not dict or tuple(tensor) != _TENSOR_ORDER:
            return [packb(body)]
        data = tensor["data"]
        if type(data) is not memoryview or data.format != "B" or data.ndim != 1:
            return [packb(body)]
        dtype, shape, size = tensor["dtype"], tensor["shape"], data.nbytes
        at = (key, dtype, tuple(shape), size)
        head = _TENSOR_HEADS.get(at)
        if head is None:
            head = tensor_head(key, dtype, shape, size)
            if len(_TENSOR_HEADS) < 4096:  # calls come in few shapes; never grow without bound
                _TENSOR_HEADS[at] = head
        small.append(head)
        if size >= _PART_FROM:
            parts.append(b"".join(small))
            parts.append(data)
            small = []
        else:
            small.append(data)
    if small:
        parts.append(b"".join(small))
    return parts


def tensor_head(key: Any, dtype: Any, shape: list, size: int) -> bytes:
    """The msgpack of ``key`` and its tensor map up to the data: the bytes ``packb``
    writes for ``{key: {"dtype", "shape", "data"}}`` inside a map, before the
    ``size`` bytes of data."""
    # Each piece packed by msgpack itself, so the bytes are exactly packb's.
    return b"".join((packb(key), b"\x83", packb("dtype"), packb(dtype), packb("shape"),
                     packb(shape), packb("data"), bin_header(size)))


_FIXMAP = [bytes([0x80 | n]) for n in range(16)]
# encode_tensor's keys, in its order (packb writes a map in its own order).
_TENSOR_ORDER = ("dtype", "shape", "data")
_TENSOR_HEADS: dict[tuple, bytes] = {}
