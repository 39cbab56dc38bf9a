"""The one exception tree of moegemm, shared by the server and the client (SPEC 2.2).

    MoegemmError
     ├── TransportError                          (client side: connect/read failures)
     └── APIError(message, *, request_id=None)   .status .code
          ├── InvalidRequest 400
          │    ├── BadMsgpack bad_msgpack
          │    ├── BadField bad_field
          │    ├── BadTensor bad_tensor
          │    ├── BadDtype bad_dtype                (ArgumentDtype: the client's, also a TypeError)
          │    ├── BadShape bad_shape
          │    ├── BadMSizes bad_m_sizes
          │    ├── NotFinite not_finite
          │    ├── BadName bad_name
          │    └── BadRouting bad_routing
          ├── Unauthorized 401 unauthorized
          ├── NotFound 404
          │    ├── NoSuchWeights no_such_weights
          │    └── NoSuchFile no_such_file
          ├── TooLarge 413 too_large
          ├── UnsupportedMediaType 415 unsupported_media_type
          ├── Unavailable 503
          │    ├── NotReady not_ready
          │    └── Overloaded overloaded           (retry_after)
          ├── DeadlineExceeded 504 timeout
          ├── OutOfMemory 507 out_of_memory
          └── InternalError 500 internal

The server raises these as domain errors and turns any `APIError` into
`{"error": {"code", "message"}}` with its status; the client turns an error
response back into the same class with `error_for`.
"""

from __future__ import annotations

__all__ = [
    "APIError",
    "ArgumentDtype",
    "BadDtype",
    "BadField",
    "BadMSizes",
    "BadMsgpack",
    "BadName",
    "BadRouting",
    "BadShape",
    "BadTensor",
    "DeadlineExceeded",
    "InternalError",
    "InvalidRequest",
    "MoegemmError",
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
    "error_for",
]


class MoegemmError(Exception):
    """Base class of every error moegemm raises."""


class TransportError(MoegemmError):
    """The client could not reach the server or lost the connection (no HTTP answer).

    `request_id` is the `X-Request-Id` the failed request was sent with, when known.
    """

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class APIError(MoegemmError):
    """An error with an HTTP status and a machine-readable code (SPEC 2.2).

    `request_id` is the `X-Request-Id` of the request that failed, when known.
    `retry_after` is the server's `Retry-After` hint in seconds, when it sent one.
    """

    status: int = 500
    code: str = "internal"

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.retry_after = retry_after

    def to_dict(self) -> dict:
        """The JSON error body of SPEC 2: `{"error": {"code", "message"}}`."""
        return {"error": {"code": self.code, "message": self.message}}

    def __str__(self) -> str:
        text = f"{self.status} {self.code}: {self.message}"
        if self.request_id is not None:
            text += f" (request {self.request_id})"
        return text


class InvalidRequest(APIError):
    """The request is malformed (400)."""

    status = 400
    code = "invalid_request"


class BadMsgpack(InvalidRequest):
    """The body is not exactly one msgpack map."""

    code = "bad_msgpack"


class BadField(InvalidRequest):
    """A required field is missing, or an unknown field is present."""

    code = "bad_field"


class BadTensor(InvalidRequest):
    """A tensor map is malformed (keys, shape, or data length)."""

    code = "bad_tensor"


class BadDtype(InvalidRequest):
    """A dtype the endpoint does not take."""

    code = "bad_dtype"


class ArgumentDtype(BadDtype, TypeError):
    """``BadDtype`` found by the client before sending: an array whose dtype no endpoint takes
    (float64 on the wire, float ids or sizes). Also a ``TypeError``, as any wrong argument.
    A server's ``bad_dtype`` answer is a plain ``BadDtype``: catch ``BadDtype`` for both."""


class BadShape(InvalidRequest):
    """Shapes disagree with each other, with the weight set, or with N, K % 128."""

    code = "bad_shape"


class BadMSizes(InvalidRequest):
    """A group size is negative, or the sizes do not sum to M."""

    code = "bad_m_sizes"


class NotFinite(InvalidRequest):
    """A scale is NaN, Inf or <= 0, or a float input holds NaN or Inf."""

    code = "not_finite"


class BadName(InvalidRequest):
    """A weight-set name outside `[A-Za-z0-9._-]{1,128}`."""

    code = "bad_name"


class BadRouting(InvalidRequest):
    """A `topk_ids` entry outside `[0, G)` or repeated within a token, or a
    `topk_weights` entry NaN or Inf."""

    code = "bad_routing"


class Unauthorized(APIError):
    """A token is configured and the request's is missing or wrong (401)."""

    status = 401
    code = "unauthorized"


class NotFound(APIError):
    """Something named by the request does not exist (404)."""

    status = 404
    code = "not_found"


class NoSuchWeights(NotFound):
    """Unknown weight-set name."""

    code = "no_such_weights"


class NoSuchFile(NotFound):
    """A weights file or tensor key that does not exist."""

    code = "no_such_file"


class TooLarge(APIError):
    """The body is over the configured limit (413)."""

    status = 413
    code = "too_large"


class UnsupportedMediaType(APIError):
    """Not msgpack where msgpack is required (415)."""

    status = 415
    code = "unsupported_media_type"


class Unavailable(APIError):
    """The server cannot take the request now (503); see `retry_after`."""

    status = 503
    code = "unavailable"


class NotReady(Unavailable):
    """The server is still starting up."""

    code = "not_ready"


class Overloaded(Unavailable):
    """The queue is full; retry after `retry_after` seconds."""

    code = "overloaded"


class DeadlineExceeded(APIError):
    """The request's deadline passed before it ran (504)."""

    status = 504
    code = "timeout"


class OutOfMemory(APIError):
    """The device cannot hold the weight set (507)."""

    status = 507
    code = "out_of_memory"


class InternalError(APIError):
    """An unexpected failure on the server (500)."""

    status = 500
    code = "internal"


# Leaves by code; the intermediate classes are fallbacks by status only, so a
# code they carry (e.g. "not_found") is not a contract code.
_LEAVES: tuple[type[APIError], ...] = (
    BadMsgpack,
    BadField,
    BadTensor,
    BadDtype,
    BadShape,
    BadMSizes,
    NotFinite,
    BadName,
    BadRouting,
    Unauthorized,
    NoSuchWeights,
    NoSuchFile,
    TooLarge,
    UnsupportedMediaType,
    NotReady,
    Overloaded,
    DeadlineExceeded,
    OutOfMemory,
    InternalError,
)
_BY_CODE: dict[str, type[APIError]] = {cls.code: cls for cls in _LEAVES}
_BY_STATUS: dict[int, type[APIError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    404: NotFound,
    413: TooLarge,
    415: UnsupportedMediaType,
    503: Unavailable,
    504: DeadlineExceeded,
    507: OutOfMemory,
    500: InternalError,
}


def error_for(
    status: int,
    code: str | None,
    message: str,
    request_id: str | None = None,
    retry_after: float | None = None,
) -> APIError:
    """The `APIError` for an error response: by code when known, else by status.

    A known code wins (it is the contract's machine-readable part); the instance keeps
    the status the response had. Otherwise the
    class comes from the status, or is `APIError` itself for a status outside the
    contract (a proxy's 502, a redirect, a gateway's 504 without the contract's body); the
    instance then keeps the response's status and the code sent, else ``http_<status>``.
    """
    cls = _BY_CODE.get(code) if code is not None else None
    if cls is not None:
        err = cls(message, request_id=request_id, retry_after=retry_after)
        err.status = status  # as answered, should a proxy have changed it
        return err
    cls = _BY_STATUS.get(status, APIError)
    if status == 504 and code is None:
        cls = APIError  # a gateway's timeout, not the server's: the call may have run
    err = cls(message, request_id=request_id, retry_after=retry_after)
    err.status = status
    # Without a code, a status outside the contract (a proxy's 502, a redirect) is named as
    # such, never as the server's "internal".
    err.code = code if code is not None else cls.code if cls is not APIError else f"http_{status}"
    return err
