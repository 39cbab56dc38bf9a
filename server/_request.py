"""The request bodies: one msgspec schema per kind, and one validator per call kind.

Every body the server reads is decoded once, by msgspec, straight into its
schema, each tensor a :class:`WireTensor` (a map of exactly ``dtype``,
``shape`` and ``data``) whose ``data`` bin is a memoryview into the body
(pinned memory on a GPU: the rows reach the device with no host copy).

- Calls: ``gemm`` (SPEC 1) and an expert set's ``ffn`` (SPEC 5.1) share
  :class:`GemmBody` (``x``, ``m_sizes``, ``x_scale``?); ``moe`` (SPEC 5.2)
  has :class:`MoeBody` (``x``, ``topk_ids``, ``topk_weights``, ``x_scale``?).
  :func:`gemm_call`, :func:`ffn_call` (the gemm rules against the set's
  ``w13``: K = H, G groups) and :func:`moe_call` then check the tensors
  against each other and the set (SPEC 2.2) and return the call the engine
  runs: raw views and exact sizes, nothing torch. What tensors hold (NaN,
  scales, routing ids) is checked on the device with the launch, never here.
- Uploads, each in two forms told apart by one key: a weight set's
  :class:`WeightsBody` (``w``, ``w_scale``?) or :class:`WeightsFileBody`
  (``file``, ``w``, ``w_scale``? as names), an expert set's
  :class:`ExpertsBody` (``w13``, ``w2``, their scales?) or
  :class:`CheckpointBody` (``checkpoint``, ``layer``). The store checks the
  tensors against each other.

Every lane of the server -- the fast transport's direct route, the ASGI
route, merged or alone, on the event loop or the worker -- takes its body
from here; no other code decodes one. A refused body raises the contract's
error (:func:`_diagnose`). msgspec reports the first thing wrong; SPEC 2.2
fixes no order among a body's faults, only the code each fault gets.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np
from moegemm.client._errors import (
    BadDtype,
    BadField,
    BadMsgpack,
    BadMSizes,
    BadRouting,
    BadShape,
    TooLarge,
)
from moegemm.client._wire import WireTensor, check_tensor, error_path, refusal
from moegemm.kernels import BLOCK

from ._unpack import unpackb
from .config import shown

FP8_NAMES = ("float8_e4m3fn", "float8_e4m3fnuz")
FLOAT_NAMES = ("bfloat16", "float16", "float32")
SIZE_DTYPES = {"int64": np.dtype("<i8"), "int32": np.dtype("<i4")}
ID_DTYPES = ("int32", "int64")

_MAX, _ADD = np.maximum, np.add  # their reduce, without ndarray.max's Python wrapper

# Up to this many groups, m_sizes are judged as Python ints (struct-unpacked): numpy's
# fixed cost per call dominates small arrays (8 groups: ~0.7 us instead of ~4 us on the
# CPU box); the reductions win beyond ~100.
_PY_SIZES_MAX_G = 96
_SIZE_FORMATS = {"int64": "q", "int32": "i"}
_SIZE_STRUCTS: dict[tuple[str, int], struct.Struct] = {}


class GemmBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/weights/{name}/gemm``: ``{"x", "x_scale"?, "m_sizes"}``."""

    x: WireTensor
    m_sizes: WireTensor
    x_scale: WireTensor | None = None  # nil or absent: none


class MoeBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/experts/{name}/moe``: ``{"x", "x_scale"?, "topk_ids", "topk_weights"}``."""

    x: WireTensor
    topk_ids: WireTensor
    topk_weights: WireTensor
    x_scale: WireTensor | None = None


class WeightsBody(msgspec.Struct, forbid_unknown_fields=True):
    """``PUT /v1/weights/{name}`` with tensors: ``{"w", "w_scale"?}``."""

    w: WireTensor
    w_scale: WireTensor | None = None


class WeightsFileBody(msgspec.Struct, forbid_unknown_fields=True):
    """``PUT /v1/weights/{name}`` from a file under the weights directory: ``{"file", "w",
    "w_scale"?}``, the tensors' names in it."""

    file: str
    w: str
    w_scale: str | None = None


class ExpertsBody(msgspec.Struct, forbid_unknown_fields=True):
    """``PUT /v1/experts/{name}`` with tensors: ``{"w13", "w13_scale"?, "w2", "w2_scale"?}``."""

    w13: WireTensor
    w2: WireTensor
    w13_scale: WireTensor | None = None
    w2_scale: WireTensor | None = None


class CheckpointBody(msgspec.Struct, forbid_unknown_fields=True):
    """``PUT /v1/experts/{name}`` from a checkpoint: ``{"checkpoint", "layer"}``."""

    checkpoint: str
    layer: Annotated[int, msgspec.Meta(ge=0)]


@dataclass(frozen=True)
class _Schema:
    decoder: msgspec.msgpack.Decoder
    required: tuple[str, ...]
    optional: tuple[str, ...]
    # The tensor fields, in the order their own checks run (check_tensor).
    tensors: tuple[str, ...] = ()
    # Fields that are not tensors (names, a layer): a wrong value there is bad_field.
    plain: tuple[str, ...] = ()
    # For a tensor form, what to send to name tensors instead (a string given for a tensor).
    by_name: str = ""


_GEMM = _Schema(msgspec.msgpack.Decoder(GemmBody), ("m_sizes", "x"), ("x_scale",),
                tensors=("x", "x_scale", "m_sizes"))
_MOE = _Schema(msgspec.msgpack.Decoder(MoeBody), ("topk_ids", "topk_weights", "x"), ("x_scale",),
               tensors=("x", "x_scale", "topk_ids", "topk_weights"))
_WEIGHTS = _Schema(msgspec.msgpack.Decoder(WeightsBody), ("w",), ("w_scale",),
                   tensors=("w", "w_scale"),
                   by_name="to name a tensor in a file, send 'file' too")
_WEIGHTS_FILE = _Schema(msgspec.msgpack.Decoder(WeightsFileBody), ("file", "w"), ("w_scale",),
                        plain=("file", "w", "w_scale"))
_EXPERTS = _Schema(msgspec.msgpack.Decoder(ExpertsBody), ("w13", "w2"),
                   ("w13_scale", "w2_scale"), tensors=("w13", "w13_scale", "w2", "w2_scale"),
                   by_name="to load from a checkpoint, send {'checkpoint', 'layer'}")
_CHECKPOINT = _Schema(msgspec.msgpack.Decoder(CheckpointBody), ("checkpoint", "layer"), (),
                      plain=("checkpoint", "layer"))


def decode_gemm(body: bytes | bytearray | memoryview) -> GemmBody:
    """A gemm or ffn body as a :class:`GemmBody` (bins as views into ``body``, each tensor
    checked: :func:`check_tensor`), or the contract's error: bad_msgpack for bytes that are
    not one msgpack map, bad_field for a missing or unknown field, bad_tensor / bad_dtype
    for a malformed tensor map. An optional field sent as nil is absent (None)."""
    return _decode(body, _GEMM)


def decode_moe(body: bytes | bytearray | memoryview) -> MoeBody:
    """A moe body as a :class:`MoeBody`, with the errors of :func:`decode_gemm`."""
    return _decode(body, _MOE)


def decode_weights(body: bytes | bytearray | memoryview) -> WeightsBody | WeightsFileBody:
    """A weight-set upload: :class:`WeightsFileBody` when it has ``file``, else
    :class:`WeightsBody`; the errors of :func:`decode_gemm`, and bad_field for a name
    that is not a string."""
    return _decode(body, _WEIGHTS_FILE if "file" in _keys(body) else _WEIGHTS)


def decode_experts(body: bytes | bytearray | memoryview) -> ExpertsBody | CheckpointBody:
    """An expert-set upload: :class:`CheckpointBody` when it has ``checkpoint``, else
    :class:`ExpertsBody`; the errors of :func:`decode_weights`, and bad_field for a
    layer that is not a non-negative integer."""
    return _decode(body, _CHECKPOINT if "checkpoint" in _keys(body) else _EXPERTS)


def _keys(body) -> dict:
    """The top-level fields of a body that is one map of string keys, else none (the
    tensor form's decoder then refuses it with the contract's error). Raw spans are
    walked to their end, so a value nested past the interpreter's recursion limit
    raises RecursionError here (a typed schema stops at its first wrong type)."""
    try:
        return _SPANS.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return {}


def _decode(body, schema: _Schema):
    try:
        decoded = schema.decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _diagnose(body, exc, schema) from None
    # msgspec keeps the last of repeated keys; the contract's maps have unique ones: the body
    # has as many entries as distinct fields, each tensor map three (dtype, shape, data).
    spans = _SPANS.decode(body)
    if _map_len(body) != len(spans):
        raise BadMsgpack("the body's map repeats a key")
    for name, span in spans.items():
        entries = _map_len(memoryview(span))  # None: a string, a number or nil
        if entries is not None and entries != 3:
            raise BadMsgpack(f"the tensor map {name!r} repeats a key")
    for name in schema.tensors:
        tensor = getattr(decoded, name)
        if tensor is not None:
            check_tensor(tensor, name)
    return decoded


# Each top-level value of a body as its raw bytes (no copy): where its map header is.
_SPANS = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])


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


def field_problem(keys, required, optional) -> BadField | None:
    """BadField naming what is missing and unknown among a body's ``keys``, or None when
    it has every ``required`` field and no other than ``optional`` ones (every endpoint's
    one rule and message; client-given names quoted cut)."""
    missing = sorted(set(required) - keys)
    unknown = sorted(keys - set(required) - set(optional), key=repr)  # (an OtherKey among them)
    if not missing and not unknown:
        return None
    return BadField(f"fields: missing {missing}, unknown {shown(unknown)}; this endpoint takes "
                    f"{list(required)} and optionally {list(optional)}")


def _diagnose(body, exc: Exception, schema: _Schema) -> Exception:
    """The SPEC 2.2 error for a body the schema refused, in the contract's order: bytes
    that are not one msgpack map (bad_msgpack) before a missing or unknown field
    (bad_field) before a malformed field: a name or layer of the wrong kind (bad_field),
    a string where a tensor goes (bad_field, saying how to name tensors), a malformed
    tensor map (bad_tensor, bad_dtype). Only refused bodies come here, so decoding one
    again costs a valid body nothing."""
    obj = unpackb(body)  # raises BadMsgpack
    problem = field_problem(obj.keys(), schema.required, schema.optional)
    if problem is not None:
        return problem
    name = error_path(exc).removeprefix("$.").partition(".")[0].partition("[")[0]
    if name in schema.plain:
        return BadField(f"{name}: {exc}")
    if schema.by_name and isinstance(obj.get(name), str):
        return BadField(f"{name} is a tensor; {schema.by_name}")
    return refusal(exc)


@dataclass(eq=False)  # identity, not field-wise comparison, in queues and batches
class GemmCall:
    """One validated gemm call: its weight set, rows as wire bytes, exact group sizes.

    ``dtype`` is the wire name of ``x``; ``x``/``x_scale`` are byte views of exactly
    ``rows * K`` elements (``x_scale``: ``rows * K/128`` float32, or None).
    ``outcome`` is set once it ran: the output's bf16 bytes ``[rows, 2N]`` (uint8)
    or the error it gets. ``kind`` names the executor that runs it (the engine's
    batches hold calls of one kind).
    """

    kind: ClassVar[str] = "gemm"

    ws: Any
    rows: int
    dtype: str
    x: memoryview
    x_scale: memoryview | None
    m_sizes: np.ndarray
    deadline: float | None = None
    enqueued: float = field(default_factory=time.monotonic)
    taken: float | None = None  # when a batch took it from the queue (``time.monotonic()``)
    outcome: Any = None
    waiter: Any = None  # the engine's asyncio future for it, while it waits

    @property
    def out_shape(self) -> tuple[int, int]:
        """The answer's shape (bf16): ``[M, N]``."""
        return self.rows, self.ws.N


@dataclass(eq=False)
class FfnCall(GemmCall):
    """One validated ``ffn`` call (SPEC 5.1): a gemm call whose ``ws`` is the expert set
    (``x`` ``[M, H]``, ``m_sizes`` ``[G]``); its answer is bf16 ``[M, H]``."""

    kind: ClassVar[str] = "ffn"

    @property
    def out_shape(self) -> tuple[int, int]:
        return self.rows, self.ws.H


@dataclass(eq=False)
class MoeCall:
    """One validated ``moe`` call (SPEC 5.2) on expert set ``ws``.

    ``tokens`` rows of ``x`` (wire bytes, ``dtype``; ``x_scale`` for fp8), each
    routed to ``top_k`` experts: ``ids`` (``ids_dtype`` int32 or int64) and
    ``weights`` (float32) are byte views of ``tokens * top_k`` elements, never read
    on the host. ``rows`` = ``tokens * top_k``, the expert rows the device runs
    (what the engine's row bounds count). The answer is bf16 ``[tokens, H]``.
    """

    kind: ClassVar[str] = "moe"

    ws: Any
    tokens: int
    top_k: int
    dtype: str
    x: memoryview
    x_scale: memoryview | None
    ids_dtype: str
    ids: memoryview
    weights: memoryview
    deadline: float | None = None
    enqueued: float = field(default_factory=time.monotonic)
    taken: float | None = None
    outcome: Any = None
    waiter: Any = None

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def out_shape(self) -> tuple[int, int]:
        return self.tokens, self.ws.H


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
    ws, rows, dtype, x, x_scale, sizes = _rows_call(body, weights, max_m, _width_k)
    _answer_fits(rows, ws.N)
    return GemmCall(ws, rows, dtype, x, x_scale, sizes, deadline)


def ffn_call(body: GemmBody, experts: Callable[[], Any], *, max_m: int,
             deadline: float | None = None) -> FfnCall:
    """An ``ffn`` body (the gemm schema) checked as a gemm call on the expert set's
    ``w13`` (K = H, G groups) that ``experts()`` returns: the call."""
    es, rows, dtype, x, x_scale, sizes = _rows_call(body, experts, max_m, _width_h)
    _answer_fits(rows, es.H)
    return FfnCall(es, rows, dtype, x, x_scale, sizes, deadline)


def _answer_fits(rows: int, width: int) -> None:
    """413 before any work for an answer no msgpack bin can carry (``[rows, width]`` bf16
    of 4 GiB or more: SPEC 2's tensors are bins, whose length is 32 bits)."""
    size = 2 * rows * width
    if size >= 1 << 32:
        raise TooLarge(f"the answer would be {size} bytes ([{rows}, {width}] bf16); a msgpack "
                       f"bin holds less than 4 GiB: send fewer rows per call")


def _width_k(ws) -> tuple[int, str]:
    return ws.K, f"weight set {ws.name!r} has K={ws.K}"


def _width_h(es) -> tuple[int, str]:
    return es.H, f"expert set {es.name!r} has H={es.H}"


def _rows_call(body: GemmBody, target: Callable[[], Any], max_m: int, width):
    """SPEC 2.2's checks of a gemm/ffn body: ``(set, M, x dtype, x, x_scale, sizes)``."""
    x, x_scale, m_sizes = body.x, body.x_scale, body.m_sizes
    ws = target()
    _x_dtype(x)
    if m_sizes.dtype not in SIZE_DTYPES:
        raise BadDtype(f"m_sizes is {m_sizes.dtype}; expected one of: int64, int32")
    if len(x.shape) != 2:
        raise BadShape(f"x has shape {shown(x.shape)}; expected 2-D [M, K]")
    M, K = x.shape
    want, held = width(ws)
    if K != want:
        raise BadShape(f"x has K={K}; {held}")
    if m_sizes.shape != [ws.G]:
        raise BadShape(f"m_sizes has shape {shown(m_sizes.shape)}; expected [{ws.G}] "
                       f"([G], G={ws.G} groups)")
    if M > max_m:
        raise TooLarge(f"x has M={M} rows; this server takes at most {max_m} per call")
    _x_scale(x, x_scale, M, "M")
    return ws, M, x.dtype, x.data, None if x_scale is None else x_scale.data, \
        _sizes(m_sizes, M)


def _sizes(m_sizes: WireTensor, M: int) -> np.ndarray:
    """The group sizes (checked ``[G]`` of int32/int64) as int64, each in ``[0, M]`` and
    summing to ``M`` (else bad_m_sizes)."""
    G = m_sizes.shape[0]
    if G <= _PY_SIZES_MAX_G:
        layout = _SIZE_STRUCTS.get((m_sizes.dtype, G))
        if layout is None:
            layout = _SIZE_STRUCTS[m_sizes.dtype, G] = struct.Struct(
                f"<{G}{_SIZE_FORMATS[m_sizes.dtype]}")
        values = layout.unpack(m_sizes.data)  # Python ints: exact
        if G and (min(values) < 0 or max(values) > M) or sum(values) != M:
            _refuse_sizes(list(values), M)
        return np.array(values, dtype=np.int64)
    sizes = np.frombuffer(m_sizes.data, dtype=SIZE_DTYPES[m_sizes.dtype]).astype(np.int64)
    # Each size in [0, M] first (one reduction: read as unsigned, a negative size is
    # above any M): then the int64 sum of G sizes is exact. Two reductions, not
    # five array operations: ~2 us less per call on the CPU box (bench/overhead_cpu.py).
    if _MAX.reduce(sizes.view(np.uint64)) > M or int(_ADD.reduce(sizes)) != M:
        _refuse_sizes(sizes.tolist(), M)
    return sizes


def _refuse_sizes(values: list[int], M: int):
    if any(v < 0 for v in values):
        raise BadMSizes(f"m_sizes {values} holds a negative size")
    raise BadMSizes(f"m_sizes sum to {sum(values)}; x has M={M} rows")


def moe_call(body: MoeBody, experts: Callable[[], Any], *, max_m: int, max_top_k: int,
             deadline: float | None = None) -> MoeCall:
    """Check a decoded moe body against SPEC 2.2 and the expert set ``experts()``
    returns: dtypes and shapes (``x`` ``[T, H]``, ``topk_ids`` and ``topk_weights``
    ``[T, k]`` with ``k >= 1``), ``T * k <= max_m`` expert rows and ``k <=
    max_top_k`` (what one launch holds for one token), 413 beyond. ``k > G`` is
    ``bad_routing`` (k distinct experts of G cannot be; ``bad_shape`` with no token);
    the ids and weights themselves are checked on the device."""
    x, x_scale, ids, weights = body.x, body.x_scale, body.topk_ids, body.topk_weights
    es = experts()
    _x_dtype(x)
    if ids.dtype not in ID_DTYPES:
        raise BadDtype(f"topk_ids is {ids.dtype}; expected one of: int32, int64")
    if weights.dtype != "float32":
        raise BadDtype(f"topk_weights is {weights.dtype}; expected one of: float32")
    if len(x.shape) != 2:
        raise BadShape(f"x has shape {shown(x.shape)}; expected 2-D [T, H]")
    T, H = x.shape
    if H != es.H:
        raise BadShape(f"x has H={H}; expert set {es.name!r} has H={es.H}")
    if len(ids.shape) != 2 or ids.shape[0] != T:
        raise BadShape(f"topk_ids has shape {shown(ids.shape)}; expected [T, k] with T={T}")
    k = ids.shape[1]
    if k < 1:
        raise BadShape(f"topk_ids has k={k} experts per token; expected 1 <= k <= G={es.G}")
    if k > es.G:
        # Some token's ids repeat or leave [0, G) (bad_routing); with no token, only the shape.
        raise (BadRouting if T else BadShape)(
            f"topk_ids has k={k} experts per token; {k} distinct experts of the set's "
            f"G={es.G} cannot be")
    if weights.shape != [T, k]:
        raise BadShape(f"topk_weights has shape {shown(weights.shape)}; expected [{T}, {k}] "
                       f"([T, k], as topk_ids)")
    if T * k > max_m:
        raise TooLarge(f"T*k = {T * k} expert rows; this server takes at most {max_m} "
                       f"per call")
    if k > max_top_k:
        raise TooLarge(f"k={k} experts per token; this server runs at most {max_top_k} "
                       f"(its largest bucket)")
    _x_scale(x, x_scale, T, "T")
    _answer_fits(T, es.H)
    return MoeCall(es, T, k, x.dtype, x.data, None if x_scale is None else x_scale.data,
                   ids.dtype, ids.data, weights.data, deadline)


def _x_dtype(x: WireTensor) -> None:
    if x.dtype not in FP8_NAMES + FLOAT_NAMES:
        raise BadDtype(f"x is {x.dtype}; expected one of: {', '.join(FP8_NAMES + FLOAT_NAMES)}")


def _x_scale(x: WireTensor, x_scale: WireTensor | None, rows: int, label: str) -> None:
    """fp8 ``x`` comes with float32 ``x_scale`` ``[rows, width/128]``; other x without."""
    if x.dtype in FP8_NAMES:
        width = x.shape[1]
        if x_scale is None:
            raise BadField(f"fp8 x needs x_scale (float32 [{label}, {width}/128])")
        if x_scale.dtype != "float32":
            raise BadDtype(f"x_scale is {x_scale.dtype}; expected one of: float32")
        if x_scale.shape != [rows, width // BLOCK]:
            raise BadShape(f"x_scale has shape {shown(x_scale.shape)}; expected "
                           f"[{rows}, {width // BLOCK}] ([{label}, {width}/128])")
    elif x_scale is not None:
        raise BadField("x_scale is only for fp8 x; bf16/fp16/fp32 x is quantized by the server")
