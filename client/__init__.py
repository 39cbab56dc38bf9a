"""moegemm.client: the thin SDK for a moegemm server (SPEC 4); installs without torch.

    from moegemm.client import Client
    with Client("http://127.0.0.1:8000") as c:
        c.load_weights("layer0", w, w_scale)
        out = c.grouped_gemm("layer0", xq, m_sizes, x_scale)

Arrays are numpy (bf16 and fp8 via ml_dtypes) or torch tensors and come back in
the same kind. Failures raise one tree rooted at `MoegemmError`. The wire format
lives in the private `_wire` module, which the server shares.
"""

from ._client import AsyncClient, Client
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
from ._multi import AsyncMultiClient, MultiClient

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
