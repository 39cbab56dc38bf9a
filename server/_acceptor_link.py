"""The owner <-> acceptor link: frames on a Unix socket (``_acceptors.py``).

A frame is ``<meta length u32><inline length u32>``, a msgpack map, then the
inline bytes; ``fds.sock`` beside the main socket carries handed-over
connections (SCM_RIGHTS).
"""

from __future__ import annotations

import asyncio
import os
import struct
from typing import Any

import msgspec

_FRAME = struct.Struct("<II")


def _frame(meta: dict, size: int) -> bytes:
    packed = msgspec.msgpack.encode(meta)
    return _FRAME.pack(len(packed), size) + packed


async def _read_frame(reader: asyncio.StreamReader) -> tuple[dict, bytes]:
    meta_size, size = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    meta = msgspec.msgpack.decode(await reader.readexactly(meta_size))
    return meta, (await reader.readexactly(size) if size else b"")


def _fd_path(socket_path: str) -> str:
    """The owner's socket for handed-over connections, beside its main socket."""
    return os.path.join(os.path.dirname(socket_path), "fds.sock")


def _byte_view(part: Any) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
