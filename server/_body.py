"""Msgpack answers without copying the output's bytes.

``PartsResponse`` answers ``{key: tensor}`` as msgpack from a small header
and the tensor's own memory (for example a pinned output buffer): the
transport writes both parts as they are. Request bodies are decoded by
``_request.py``'s schemas.
"""

from __future__ import annotations

import numpy as np
from moegemm.client._media import MSGPACK
from moegemm.client._wire import tensor_head
from starlette.responses import Response


def array_body_parts(key: str, raw, dtype: str, shape: tuple[int, ...]) -> list:
    """``{key: {"dtype", "shape", "data"}}`` as msgpack: a header, then the tensor's bytes
    (``raw``: a contiguous numpy array of any shape whose memory is the data; the second
    part, not copied), with its wire dtype name and shape."""
    data = memoryview(raw.reshape(-1).view(np.uint8))  # contiguous: a view, never a copy
    return [b"\x81" + tensor_head(key, dtype, shape, data.nbytes), data]



class PartsResponse(Response):
    """A msgpack response sent as its parts (e.g. :func:`array_body_parts`: a header and
    the output's own memory), never joined."""

    media_type = MSGPACK

    def __init__(self, parts: list, status_code: int = 200) -> None:
        self.parts = parts  # keeps the memory alive until sent
        size = sum(len(p) for p in parts)
        super().__init__(content=None, status_code=status_code, media_type=MSGPACK)
        self.headers["content-length"] = str(size)

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part,
                        "more_body": i + 1 < len(self.parts)})
