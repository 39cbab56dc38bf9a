"""The wire format of SPEC 2: tensors as msgpack maps, bodies as one msgpack map.

A tensor on the wire is ``{"dtype": name, "shape": [d0, ...], "data": bin}``,
little-endian, row-major, no padding. The server imports this module too, so
both sides refuse exactly the same malformed input with the same error.

Nothing here imports torch: a torch tensor is recognised only when torch is
already imported by the caller (``sys.modules``), and crosses as raw bytes.
"""

from __future__ import annotations

import math
import struct
import sys
from typing import Annotated, Any

import ml_dtypes
import msgspec
import numpy as np

from ._errors import ArgumentDtype, BadDtype, BadMsgpack, BadTensor, TooLarge

__all__ = [
    "DTYPES", "WireTensor", "check_tensor", "decode_tensors", "encode_tensor", "error_path",
    "pack_tensors", "packb", "refusal", "tensor_head",
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


class WireTensor(msgspec.Struct, forbid_unknown_fields=True):
    """A tensor map of SPEC 2 as decoded: its dtype name, shape and raw little-endian bytes.

    ``data`` is a byte-format memoryview on the decoded body, not a copy. A schema
    takes only the map's form (exactly these three keys, shape a list of at most 64
    non-negative ints, data bin); :func:`check_tensor` checks the rest.
    """

    dtype: str
    # At most 64 dims (numpy's and torch's limit): a longer list is refused at its header,
    # not read into a Python int per entry.
    shape: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=64)]
    data: memoryview

    @property
    def nbytes(self) -> int:
        """The size of ``data`` in bytes."""
        return self.data.nbytes

    def numpy(self) -> np.ndarray:
        """A numpy view on ``data`` (zero-copy; read-only when the body is bytes)."""
        return np.frombuffer(self.data, dtype=DTYPES[self.dtype]).reshape(self.shape)


_MAX_DIM = 1 << 63  # torch and numpy sizes are int64


def check_tensor(t: WireTensor, name: str) -> int:
    """Check what a schema cannot: a known dtype (BadDtype), data of exactly the shape's
    bytes and dims an int64 layout can hold (BadTensor); return the element count."""
    dtype = DTYPES.get(t.dtype)
    if dtype is None:
        raise BadDtype(f"{name}: dtype {t.dtype!r:.100} is not one of {sorted(DTYPES)}")
    count = math.prod(t.shape)
    want = count * dtype.itemsize
    if t.data.nbytes != want:
        raise BadTensor(f"{name}: data holds {t.data.nbytes} bytes; {t.dtype} "
                        f"{t.shape!r:.200} needs {want}")
    # Data that holds count > 0 elements bounds every dim by count; only an empty
    # tensor can name huge dims, and torch lays out even that one: its dims and
    # strides must fit int64 (the product of its non-zero dims bounds them all).
    if count == 0 and math.prod(max(d, 1) for d in t.shape) >= _MAX_DIM:
        raise BadTensor(f"{name}: shape {t.shape!r:.200} is too large to lay out")
    return count


def error_path(exc: msgspec.MsgspecError) -> str:
    """Where in a body msgspec found ``exc`` (``$.x.dtype``); ``$`` for the body itself."""
    message = str(exc)
    return message.rpartition(" - at `")[2].rstrip("`") if " - at `" in message else "$"


def refusal(exc: msgspec.MsgspecError) -> BadMsgpack | BadDtype | BadTensor:
    """SPEC 2.2's error for a body a tensor schema refused: bytes that are not one msgpack
    map (bad_msgpack), a tensor's dtype not a string (bad_dtype), any other malformed
    tensor map (bad_tensor)."""
    path = error_path(exc)
    if not isinstance(exc, msgspec.ValidationError) or path == "$":
        return BadMsgpack(f"the body is not one msgpack map: {exc}")
    if path.endswith(".dtype"):
        return BadDtype(f"dtype is one of {sorted(DTYPES)}: {exc}")
    return BadTensor(f"a tensor is a map {{dtype, shape, data}} with shape a list of "
                     f"non-negative ints (at most 64) and data bin: {exc}")


_TENSORS = msgspec.msgpack.Decoder(dict[str, WireTensor])


def decode_tensors(body: bytes | bytearray | memoryview) -> dict[str, WireTensor]:
    """A body that is one map of tensors (a gemm answer: ``{"out": T}``), each checked, every
    ``data`` a view on ``body``; :func:`refusal`'s errors and :func:`check_tensor`'s. A
    repeated key is not refused here: the last is kept (the server's schemas refuse it)."""
    try:
        tensors = _TENSORS.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise refusal(exc) from None
    for name, t in tensors.items():
        check_tensor(t, name)
    return tensors


def torch_of(a: Any):
    """The torch module when ``a`` is a torch tensor, else None; torch is never imported
    here. While another thread is still importing torch, the module in ``sys.modules`` has
    no ``Tensor`` yet, and ``a`` (which exists) is no tensor of it."""
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    return torch if tensor is not None and isinstance(a, tensor) else None


def encode_tensor(a: Any) -> dict:
    """The wire map of a numpy array or a torch tensor (SPEC 2).

    ``data`` is a read-only memoryview of contiguous little-endian bytes (msgpack
    packs it as bin); it is a view on ``a`` when ``a`` is already contiguous
    little-endian on the CPU, so do not write to ``a`` before packing. Torch fp8
    and bf16 cross through a uint8 view, never through a float conversion.
    """
    torch = torch_of(a)
    if torch is not None:
        name = next((n for n in _TORCH_NAMES if getattr(torch, n, None) == a.dtype), None)
        if name is None:
            raise ArgumentDtype(f"dtype {a.dtype} cannot go on the wire; it takes {sorted(DTYPES)}")
        if a.is_meta or a.layout != torch.strided:
            # No bytes to read: a meta tensor has none, a sparse or nested one is not row-major.
            raise BadTensor(f"a {'meta' if a.is_meta else a.layout} tensor cannot go on the wire; "
                            "pass a dense (strided) tensor with its data")
        _fits_a_bin(a.numel() * a.element_size())
        t = a.detach().to("cpu").contiguous()
        shape = list(t.shape)
        # Reinterpret as bytes: numpy has no fp8/bf16 dtype torch could hand over.
        # Torch's hosts are little-endian, so its memory is already wire order.
        raw = t.reshape(-1).view(torch.uint8).numpy()
        return {"dtype": name, "shape": shape, "data": _bytes_view(raw)}
    if isinstance(a, np.ndarray):
        _fits_a_bin(a.nbytes)
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


def _fits_a_bin(nbytes: int) -> None:
    """Refuse a tensor past the 4 GiB a msgpack bin holds (SPEC 2.1) before copying it."""
    if nbytes >= 1 << 32:
        raise TooLarge(f"a tensor of {nbytes} bytes is past the 4 GiB a msgpack bin holds; "
                       "load a set this large from a file (load_weights_file, "
                       "load_experts_checkpoint)")


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


def packb(obj: Any) -> bytes:
    """Serialize a body (a map) to msgpack, bytes as bin and str as str, each value in its
    shortest form (msgpack-python's ``packb(use_bin_type=True)`` bytes, in a third of the time)."""
    return _ENCODER.encode(obj)


_ENCODER = msgspec.msgpack.Encoder()


# -- zero-copy forms: large bodies as parts ----------------------------------------------

_U8, _U16, _U32 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I")


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
    header) is :func:`tensor_head`'s (built once per shape); the data goes in
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
        small.append(tensor_head(key, dtype, shape, size))
        if size >= _PART_FROM:
            parts.append(b"".join(small))
            parts.append(data)
            small = []
        else:
            small.append(data)
    if small:
        parts.append(b"".join(small))
    return parts


def tensor_head(key: Any, dtype: Any, shape, size: int) -> bytes:
    """The msgpack of ``key`` and its tensor map up to the data: the bytes ``packb``
    writes for ``{key: {"dtype", "shape", "data"}}`` inside a map, before the
    ``size`` bytes of data. Built once per key, dtype, shape and size (calls and
    answers come in few shapes; the cache never grows past 4096)."""
    at = (key, dtype, tuple(shape), size)
    head = _TENSOR_HEADS.get(at)
    if head is None:
        # Each piece packed by packb itself, so the bytes are exactly its.
        head = b"".join((packb(key), b"\x83", packb("dtype"), packb(dtype), packb("shape"),
                         packb([int(d) for d in shape]), packb("data"), bin_header(size)))
        if len(_TENSOR_HEADS) < 4096:
            _TENSOR_HEADS[at] = head
    return head


_FIXMAP = [bytes([0x80 | n]) for n in range(16)]
# encode_tensor's keys, in its order (packb writes a map in its own order).
_TENSOR_ORDER = ("dtype", "shape", "data")
_TENSOR_HEADS: dict[tuple, bytes] = {}
