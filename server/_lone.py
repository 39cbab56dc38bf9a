"""The lone-call lane: a plain, valid gemm body run straight from its msgpack fields.

A router's typical call is one small fp8 (or bf16) batch with nothing else in
flight. For it the general path builds torch tensors from the wire maps,
validates them, wraps them in a call and a batch, stages them and unpacks a
torch result: some thirty torch and bookkeeping steps, each several
microseconds of host time on the H200's machine, which together cost a
one-row call more than its graph (``bench/SERVICE_NOTES.md``, v4).

:func:`wire_inputs` recognises the common case directly on the decoded body
(the wire maps of ``x``, ``x_scale`` and ``m_sizes``) and returns the raw
bytes and sizes the engine's graph needs (``Engine.gemm_lone``). It accepts
only what the general path accepts and would run the same way: anything else
-- another dtype, a missing or extra field, a shape or size that does not add
up, a body too large for the lane -- returns None, and the general path then
answers it, with the contract's error where there is one. So the lane never
changes an answer, only how fast a valid one comes back.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

BLOCK = 128

_SIZES = {"int64": np.dtype("<i8"), "int32": np.dtype("<i4")}


class LoneInputs:
    """A lone call's rows, their bytes (and scales'), its group sizes and kind."""

    __slots__ = ("m_sizes", "quantize", "rows", "x", "x_scale")

    def __init__(self, rows: int, x: Any, x_scale: Any, m_sizes: np.ndarray,
                 quantize: bool) -> None:
        self.rows = rows
        self.x = x
        self.x_scale = x_scale
        self.m_sizes = m_sizes
        self.quantize = quantize


def _tensor(obj: Any, dtype: str, shape: tuple[int, ...], itemsize: int) -> Any:
    """``obj``'s data when it is exactly the wire map of ``dtype`` ``shape``, else None."""
    if type(obj) is not dict or len(obj) != 3 or obj.get("dtype") != dtype:
        return None
    got, data = obj.get("shape"), obj.get("data")
    if type(got) is not list or len(got) != len(shape):
        return None
    for have, want in zip(got, shape):
        if type(have) is not int or have != want:
            return None
    if type(data) is bytes:
        pass
    elif type(data) is not memoryview or data.format != "B" or data.ndim != 1:
        return None
    n = itemsize
    for d in shape:
        n *= d
    return data if len(data) == n else None


def wire_inputs(body: Any, G: int, K: int, fp8_name: str, max_rows: int) -> LoneInputs | None:
    """The lane's inputs for a decoded gemm body on a weight set of ``G`` groups and
    depth ``K``, when it is the common valid case with at most ``max_rows`` rows,
    in the device's fp8 format (``fp8_name``) with scales, or bf16; else None."""
    if type(body) is not dict:
        return None
    x = body.get("x")
    if type(x) is not dict:
        return None
    shape = x.get("shape")
    if type(shape) is not list or len(shape) != 2 or type(shape[0]) is not int:
        return None
    rows = shape[0]
    if not 0 < rows <= max_rows:
        return None
    dtype = x.get("dtype")
    if dtype == fp8_name:
        if len(body) != 3 or "x_scale" not in body or K % BLOCK:
            return None
        x_data = _tensor(x, dtype, (rows, K), 1)
        xs_data = _tensor(body["x_scale"], "float32", (rows, K // BLOCK), 4)
        if xs_data is None:
            return None
    elif dtype == "bfloat16":
        if len(body) != 2:
            return None
        x_data, xs_data = _tensor(x, dtype, (rows, K), 2), None
    else:
        return None
    sizes = body.get("m_sizes")
    if x_data is None or type(sizes) is not dict:
        return None
    name = sizes.get("dtype")
    kind = _SIZES.get(name) if type(name) is str else None
    if kind is None:
        return None
    raw = _tensor(sizes, name, (G,), kind.itemsize)
    if raw is None:
        return None
    m_sizes = np.frombuffer(raw, dtype=kind).astype(np.int64)
    # Each size in [0, rows] first: then the int64 sum of G sizes cannot wrap (G
    # and rows are far below 2^63 / rows), so it is the exact sum. Summing first
    # let [2^63-1, 2^63-1, 18, 0...] (exact sum 2^64 + 16) pass as 16 rows.
    if (m_sizes < 0).any() or (m_sizes > rows).any() or int(m_sizes.sum()) != rows:
        return None
    return LoneInputs(rows, x_data, xs_data, m_sizes, dtype == "bfloat16")


def address(data: bytes | memoryview) -> int:
    """The host address of a bin's bytes (a bytes object or a view on a body)."""
    if type(data) is bytes:
        return _bytes_address(data)  # ~5x cheaper than through numpy
    return np.frombuffer(data, dtype=np.uint8).ctypes.data


_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.restype = ctypes.c_void_p
_bytes_address.argtypes = [ctypes.py_object]
