"""moegemm.client: the thin SDK for a moegemm server (SPEC 4); installs without torch.

    from moegemm.client import Client
    with Client("http://127.0.0.1:8000") as c:
        c.load_weights("layer0", w, w_scale)
        out = c.grouped_gemm("layer0", xq, m_sizes, x_scale)

Arrays are numpy (bf16 and fp8 via ml_dtypes) or torch tensors and come back in
the same kind. Failures raise one tree rooted at `MoegemmError`. The wire format
lives in the private `_wire` module, which the server shares.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._errors import (
    APIError,
    ArgumentDtype,
    BadDtype,
    BadField,
    BadMsgpack,
    BadMSizes,
    BadName,
    BadRouting,
    BadShape,
    BadTensor,
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    MoegemmError,
    NoSuchFile,
    NoSuchWeights,
    NotFinite,
    NotFound,
    NotReady,
    OutOfMemory,
    Overloaded,
    TooLarge,
    TransportError,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
)

if TYPE_CHECKING:
    from ._client import AsyncClient, Client
    from ._multi import AsyncMultiClient, MultiClient

# The SDK's classes, imported at their first use: the server's processes import this package
# for the error tree and the media types alone (an acceptor process has no use for httpx,
# numpy's ml_dtypes or msgpack, which take it half a second to import).
_CLASSES = {"AsyncClient": "._client", "Client": "._client",
            "AsyncMultiClient": "._multi", "MultiClient": "._multi"}

__all__ = [
    "APIError",
    "ArgumentDtype",
    "AsyncClient",
    "AsyncMultiClient",
    "BadDtype",
    "BadField",
    "BadMSizes",
    "BadMsgpack",
    "BadName",
    "BadRouting",
    "BadShape",
    "BadTensor",
    "Client",
    "DeadlineExceeded",
    "InternalError",
    "InvalidRequest",
    "MoegemmError",
    "MultiClient",
    "NoSuchFile",
    "NoSuchWeights",
    "NotFinite",
    "NotFound",
    "NotReady",
    "OutOfMemory",
    "Overloaded",
    "TooLarge",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
]


def __getattr__(name: str):
    module = _CLASSES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
