"""The gemm request: one schema, one validator, from body bytes to a call the engine runs.

A body is decoded once, by msgspec, straight into :class:`GemmBody`: the
schema (a map of exactly ``x``, ``m_sizes`` and optionally ``x_scale``, each
a tensor map of exactly ``dtype``, ``shape`` and ``data``) is enforced while
decoding, and every ``data`` bin is a memoryview into the body (pinned memory
on a GPU: the rows reach the device with no host copy). :func:`gemm_call`
then checks the tensors against each other and the weight set (SPEC 2.2) and
returns a :class:`GemmCall`: raw views and exact group sizes, nothing torch.

Every lane of the server -- the fast transport's direct route, the ASGI
route, merged or alone, on the event loop or the worker -- takes the call
from here; no other code checks a gemm request. A refused body raises the
contract's error. msgspec reports the first thing wrong where the old
decoder reported the first by its own order; SPEC 2.2 fixes no order among
a body's faults, only the code each fault gets.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np
from moegemm.client._errors import (
    BadDtype,
    BadField,
    BadMsgpack,
    BadMSizes,
    BadShape,
    BadTensor,
    TooLarge,
)
from moegemm.client._wire import DTYPES, unpackb

BLOCK = 128

FP8_NAMES = ("float8_e4m3fn", "float8_e4m3fnuz")
FLOAT_NAMES = ("bfloat16", "float16", "float32")
SIZE_DTYPES = {"int64": np.dtype("<i8"), "int32": np.dtype("<i4")}

_MAX_DIM = 1 << 63  # torch sizes are int64


class WireTensor(msgspec.Struct, forbid_unknown_fields=True):
    """A tensor map of SPEC 2 as decoded: ``data`` is a view into the body."""

    dtype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    data: memoryview


class GemmBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/weights/{name}/gemm``: ``{"x", "x_scale"?, "m_sizes"}``."""

    x: WireTensor
    m_sizes: WireTensor
    x_scale: WireTensor | msgspec.UnsetType = msgspec.UNSET


_DECODER = msgspec.msgpack.Decoder(GemmBody)
_FIELDS = ("x", "m_sizes", "x_scale")


def decode_gemm(body: bytes | bytearray | memoryview) -> GemmBody:
    """The body as a :class:`GemmBody` (bins as views into ``body``), or the contract's
    error: bad_msgpack for bytes that are not one msgpack map, bad_field for a
    missing or unknown field, bad_tensor / bad_dtype for a malformed tensor map."""
    try:
        decoded = _DECODER.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _diagnose(body, exc) from None
    # msgspec keeps the last of repeated keys; the contract's maps have unique ones.
    present = 2 + (decoded.x_scale is not msgspec.UNSET)
    if _map_len(body) != present:
        raise BadMsgpack("the body's map repeats a key")
    return decoded


def _map_len(body) -> int | None:
    """The entry count in the header of the map that opens ``body``."""
    first = body[0]
    if 0x80 <= first <= 0x8F:
        return first & 0x0F
    if first == 0xDE:
        return int.from_bytes(bytes(body[1:3]), "big")
    if first == 0xDF:
        return int.from_bytes(bytes(body[1:5]), "big")
    return None


def _diagnose(body, exc: Exception) -> Exception:
    """The SPEC 2.2 error for a body the schema refused, in the contract's order: bytes
    that are not one msgpack map (bad_msgpack) before a missing or unknown field
    (bad_field) before a malformed tensor map (bad_tensor, bad_dtype). Only refused
    bodies come here, so decoding one again costs a valid call nothing."""
    obj = unpackb(body)  # raises BadMsgpack
    missing = sorted({"x", "m_sizes"} - obj.keys())
    unknown = sorted(obj.keys() - set(_FIELDS))
    if missing or unknown:
        return BadField(f"fields: missing {missing}, unknown {unknown}; this endpoint takes "
                        f"['m_sizes', 'x'] and optionally ['x_scale']")
    message = str(exc)
    path = message.rpartition(" - at `")[2].rstrip("`") if " - at `" in message else "$"
    if not isinstance(exc, msgspec.ValidationError) or path == "$":  # (unpackb took it)
        return BadMsgpack(f"the body is not one msgpack map: {message}")
    if path.endswith(".dtype"):
        return BadDtype(f"dtype is one of {sorted(DTYPES)}: {message}")
    return BadTensor(f"a tensor is a map {{dtype, shape, data}} with shape a list of "
                     f"non-negative ints and data bin: {message}")


@dataclass(eq=False)  # identity, not field-wise comparison, in queues and batches
class GemmCall:
    """One validated gemm call: its weight set, rows as wire bytes, exact group sizes.

    ``dtype`` is the wire name of ``x``; ``x``/``x_scale`` are byte views of exactly
    ``rows * K`` elements (``x_scale``: ``rows * K/128`` float32, or None).
    ``outcome`` is set once it ran: the output's bf16 bytes ``[rows, 2N]`` (uint8)
    or the error it gets.
    """

    ws: Any
    rows: int
    dtype: str
    x: memoryview
    x_scale: memoryview | None
    m_sizes: np.ndarray
    deadline: float | None = None
    enqueued: float = field(default_factory=time.monotonic)
    outcome: Any = None
    waiter: Any = None  # the engine's asyncio future for it, while it waits


def _tensor(t: WireTensor, name: str) -> int:
    """Check what msgspec cannot: a known dtype, byte count and torch-sized dims;
    return the element count."""
    dtype = DTYPES.get(t.dtype)
    if dtype is None:
        raise BadDtype(f"{name}: dtype {t.dtype!r} is not one of {sorted(DTYPES)}")
    count = math.prod(t.shape)
    want = count * dtype.itemsize
    if t.data.nbytes != want:
        raise BadTensor(f"{name}: data holds {t.data.nbytes} bytes; {t.dtype} {t.shape} "
                        f"needs {want}")
    if any(d >= _MAX_DIM for d in t.shape) or (
            count == 0 and math.prod(max(d, 1) for d in t.shape) >= _MAX_DIM):
        # torch lays out even an empty tensor: its dims and strides must fit int64.
        raise BadTensor(f"{name}: shape {t.shape} is too large to lay out")
    return count


def _bytes(view: memoryview) -> memoryview:
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def gemm_call(body: GemmBody, weights: Callable[[], Any], *, max_m: int,
              deadline: float | None = None) -> GemmCall:
    """Check a decoded gemm body against SPEC 2.2 and the weight set ``weights()``
    returns (after the tensors' own checks: a malformed tensor answers before an
    unknown set): the call.

    Group sizes are judged exactly: each in ``[0, M]`` before they are summed, so
    no int64 wrap-around (``[2^63-1, 2^63-1, 18, 0...]``) can pass as a small M.
    What the rows hold (NaN, Inf, scales <= 0: ``not_finite``) is checked on the
    device with the launch (``_checks.bad_rows``), not here.
    """
    x, m_sizes = body.x, body.m_sizes
    x_scale = None if body.x_scale is msgspec.UNSET else body.x_scale
    _tensor(x, "x")
    if x_scale is not None:
        _tensor(x_scale, "x_scale")
    _tensor(m_sizes, "m_sizes")
    ws = weights()
    if x.dtype not in FP8_NAMES + FLOAT_NAMES:
        raise BadDtype(f"x is {x.dtype}; expected one of: {', '.join(FP8_NAMES + FLOAT_NAMES)}")
    kind = SIZE_DTYPES.get(m_sizes.dtype)
    if kind is None:
        raise BadDtype(f"m_sizes is {m_sizes.dtype}; expected one of: int64, int32")
    if len(x.shape) != 2:
        raise BadShape(f"x has shape {x.shape}; expected 2-D [M, K]")
    M, K = x.shape
    if K != ws.K:
        raise BadShape(f"x has K={K}; weight set {ws.name!r} has K={ws.K}")
    if m_sizes.shape != [ws.G]:
        raise BadShape(f"m_sizes has shape {m_sizes.shape}; expected [{ws.G}] "
                       f"([G], G={ws.G} groups)")
    if M > max_m:
        raise TooLarge(f"x has M={M} rows; this server takes at most {max_m} per call")
    if x.dtype in FP8_NAMES:
        if x_scale is None:
            raise BadField("fp8 x needs x_scale (float32 [M, K/128])")
        if x_scale.dtype != "float32":
            raise BadDtype(f"x_scale is {x_scale.dtype}; expected one of: float32")
        if x_scale.shape != [M, K // BLOCK]:
            raise BadShape(f"x_scale has shape {x_scale.shape}; expected [{M}, {K // BLOCK}] "
                           f"([M, K/128])")
    elif x_scale is not None:
        raise BadField("x_scale is only for fp8 x; bf16/fp16/fp32 x is quantized by the server")
    sizes = np.frombuffer(m_sizes.data, dtype=kind).astype(np.int64)
    if (sizes < 0).any():
        raise BadMSizes(f"m_sizes {sizes.tolist()} holds a negative size")
    # Each size in [0, M] first: then the int64 sum of G sizes is exact.
    if (sizes > M).any() or int(sizes.sum()) != M:
        total = sum(int(s) for s in sizes.tolist())  # Python ints: exact
        raise BadMSizes(f"m_sizes sum to {total}; x has M={M} rows")
    return GemmCall(ws, M, x.dtype, _bytes(x.data),
                    None if x_scale is None else _bytes(x_scale.data), sizes, deadline)
