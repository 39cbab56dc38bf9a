"""The strict whole-body msgpack decoder, for the diagnosis of a refused body (``_request``).

A body the schemas refused is decoded once more, whole, to name its fault with SPEC 2.2's
code: bytes that are not exactly one msgpack map (ext types, the timestamp included; invalid
UTF-8; truncation; trailing bytes; a repeated key; containers past sane sizes) are
``bad_msgpack``, while a non-string key is still one map (an :class:`OtherKey`: a field no
endpoint knows, ``bad_field``). msgpack-python's hooks do this; msgspec, which decodes every
accepted body, turns timestamps into datetimes and fails on unhashable keys.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

import msgpack
from moegemm.client._errors import BadMsgpack

# Our bodies are a few small maps around big bins: these bounds refuse
# pathological nesting and huge containers before they cost memory. Bins are
# bounded by the body itself (and by the server's body limit).
_MAX_STR_LEN = 1 << 20
_MAX_ARRAY_LEN = 1 << 16
_MAX_MAP_LEN = 1 << 12


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


# At most this many values in a body decoded here (a contract body holds a few dozen, a
# tensor's shape at most 64 dims): each becomes a Python object, so a 16 MiB body of empty
# maps took 1 GB and 2.5 s of the loop (session 54's probe), and one at the body limit would
# have taken ~18 GB. Counting them costs ~0.4 us a value, so the bound is kept low.
_MAX_VALUES = 4096

# The bytes after a msgpack type byte in 0xC0-0xDF: (length field's size, fixed payload size,
# what the length counts: 0 payload bytes, 1 values (an array), 2 pairs (a map)).
_C0_DF = {
    0xC0: (0, 0, 0), 0xC2: (0, 0, 0), 0xC3: (0, 0, 0),                  # nil, false, true
    0xC4: (1, 0, 0), 0xC5: (2, 0, 0), 0xC6: (4, 0, 0),                  # bin 8/16/32
    0xC7: (1, 1, 0), 0xC8: (2, 1, 0), 0xC9: (4, 1, 0),                  # ext 8/16/32
    0xCA: (0, 4, 0), 0xCB: (0, 8, 0),                                   # float 32/64
    0xCC: (0, 1, 0), 0xCD: (0, 2, 0), 0xCE: (0, 4, 0), 0xCF: (0, 8, 0),  # uint 8-64
    0xD0: (0, 1, 0), 0xD1: (0, 2, 0), 0xD2: (0, 4, 0), 0xD3: (0, 8, 0),  # int 8-64
    0xD4: (0, 2, 0), 0xD5: (0, 3, 0), 0xD6: (0, 5, 0), 0xD7: (0, 9, 0),  # fixext 1-8
    0xD8: (0, 17, 0),                                                   # fixext 16
    0xD9: (1, 0, 0), 0xDA: (2, 0, 0), 0xDB: (4, 0, 0),                  # str 8/16/32
    0xDC: (2, 0, 1), 0xDD: (4, 0, 1), 0xDE: (2, 0, 2), 0xDF: (4, 0, 2),  # array, map 16/32
}


def _few_values(body: bytes | bytearray | memoryview, limit: int) -> bool:
    """Whether the first msgpack value in ``body`` holds at most ``limit`` values (itself,
    and every key and element inside it), found without decoding any: bins and strings are
    stepped over by their lengths. A byte that starts no value, or the body's end, stops the
    count (the decoder then says what is wrong)."""
    view = memoryview(body).cast("B")
    size, at, pending, count = len(view), 0, 1, 0
    while pending and at < size:
        pending -= 1
        count += 1
        if count > limit:
            return False
        first = view[at]
        at += 1
        if first <= 0x7F or first >= 0xE0:  # fixint
            continue
        if first <= 0x8F:  # fixmap
            pending += 2 * (first & 0x0F)
        elif first <= 0x9F:  # fixarray
            pending += first & 0x0F
        elif first <= 0xBF:  # fixstr
            at += first & 0x1F
        else:
            step = _C0_DF.get(first)
            if step is None:  # 0xC1
                return True
            width, fixed, counts = step
            length = int.from_bytes(view[at:at + width], "big")
            at += width + fixed
            if counts:
                pending += counts * length
            else:
                at += length
    return True


def unpackb(body: bytes | bytearray | memoryview) -> dict:
    """Decode a body that must be exactly one msgpack map, else raise BadMsgpack.

    Bins become bytes; keys must be unique (a non-string one becomes an
    :class:`OtherKey`); ext types, invalid UTF-8, truncation and trailing bytes are
    refused, and so is a body of more than ``_MAX_VALUES`` values (before any is decoded).
    """
    if len(body) > _MAX_VALUES and not _few_values(body, _MAX_VALUES):  # (a value: a byte or more)
        raise BadMsgpack(f"the body holds over {_MAX_VALUES} msgpack values; the endpoints "
                         f"take a map of a few fields, each tensor a map of three")
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
