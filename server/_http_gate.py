"""What a request head alone decides, before a byte of its body is read.

The fast transport (``_http.py``) and the acceptor processes (``_acceptors.py``)
judge every request that declares a body from its head: the token, the media
type, the body limit and the in-flight budget. A refused request is answered
(401, 415, 413, 503) and its connection closed without its body ever being
received, so an unauthenticated client cannot make the server hold a byte
past its head. The app repeats these checks with the same rules (the gate
only answers earlier); requests without a body are left to the app entirely.
With a token configured, any body needs it, even one sent to an endpoint that
takes none (the health probes): an unauthenticated body is never read.

The answers are the contract's errors (SPEC 2.2, ``moegemm.client._errors``): the
transport has no codes of its own. Malformed HTTP (bad framing, a head llhttp refuses) is 400
``bad_field``; a head over the head limit is 413 ``too_large``; a full server
(connections or in-flight bytes) is 503 ``overloaded`` with Retry-After.

:class:`HttpLimits` is plain data, so an acceptor process gets it as is.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import uuid
from dataclasses import dataclass, replace
from typing import NamedTuple

from moegemm.client._errors import (
    APIError,
    Overloaded,
    TooLarge,
    Unauthorized,
    UnsupportedMediaType,
)
from moegemm.client._media import MSGPACK, MSGPACK_TYPES

log = logging.getLogger("moegemm.server.http")

# Bodies sent here are msgpack maps (SPEC 2.1): the media type is judged from the head.
_MSGPACK_PREFIXES = ("/v1/weights/", "/v1/experts/")

REASONS = {
    100: "Continue", 200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request",
    401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
    413: "Content Too Large", 415: "Unsupported Media Type", 500: "Internal Server Error",
    503: "Service Unavailable", 504: "Gateway Timeout", 507: "Insufficient Storage",
}


def media_problem(media: str) -> str | None:
    """What is wrong with a body's media type (lower-cased, without parameters), if it is
    not msgpack's (SPEC 2): the 415's message."""
    if media in MSGPACK_TYPES:
        return None
    others = ", ".join(sorted(MSGPACK_TYPES - {MSGPACK}))
    return f"send the body as {MSGPACK} (or {others}), got {media[:100] or 'none'!r}"


# The calls (gemm, an expert set's ffn and moe): what DirectCalls serves without the ASGI
# stack, and what the transport cancels when its client leaves. Starlette matches
# "/v1/weights/{name:wsname}/gemm" with this (wsname takes anything, so check_name answers
# bad_name); POST is the only method there. The expert sets' two calls are served the same
# way: their bodies are as large as gemm's, and the ASGI body path costs milliseconds per MB.
_GEMM = re.compile(r"/v1/weights/([\s\S]*)/gemm")
GEMM_ENDPOINT = "/v1/weights/{name}/gemm"  # the route's path_format: the metrics label
_EXPERTS = re.compile(r"/v1/experts/([\s\S]*)/(ffn|moe)")


class Route(NamedTuple):
    """A call: its kind, the set's name, its metrics label."""

    kind: str  # "gemm", "ffn" or "moe"
    name: str
    endpoint: str


def call_route(method: str, path: str) -> Route | None:
    """The route when this request is a gemm, ffn or moe call, else None."""
    if method != "POST":
        return None
    found = _GEMM.fullmatch(path)
    if found is not None:
        return Route("gemm", found.group(1), GEMM_ENDPOINT)
    found = _EXPERTS.fullmatch(path)
    if found is not None:
        kind = found.group(2)
        return Route(kind, found.group(1), "/v1/experts/{name}/" + kind)
    return None


@dataclass(frozen=True)
class HttpLimits:
    """The transport's limits and secrets (``Settings``' ``http_*`` fields and tokens)."""

    max_body_bytes: int = 256 << 20
    max_inflight_bytes: int = 2048 << 20
    # Any of these authorizes a call; empty: no token is configured.
    tokens: tuple[bytes, ...] = ()
    # Weight and expert changes (PUT) need this one when set.
    admin_token: bytes | None = None
    head_timeout_s: float = 10.0
    min_body_rate: int = 64 << 10
    keep_alive_s: float = 30.0
    max_connections: int = 2048

    @classmethod
    def from_settings(cls, settings) -> HttpLimits:
        tokens, admin = secrets_of(settings)
        return cls(
            max_body_bytes=settings.max_body_bytes,
            max_inflight_bytes=settings.max_inflight_bytes,
            tokens=tokens,
            admin_token=admin,
            head_timeout_s=settings.http_head_timeout_s,
            min_body_rate=settings.http_min_body_rate,
            keep_alive_s=settings.http_keep_alive_s,
            max_connections=settings.http_max_connections,
        )


# Descriptors kept for the process's own files (weights, logs, the GPU driver's) beside its
# connections, or half the open-file limit where that is small.
_FD_RESERVE = 256


def fit_to_descriptors(limits: HttpLimits) -> HttpLimits:
    """``limits`` with a connection cap this process's open-file limit can hold: the soft limit
    raised towards the hard one to hold the cap and a reserve, and the cap lowered (with a
    warning) where even that does not fit. Without this a soft limit under the cap (1024 under
    systemd) made new clients meet a closed socket instead of the cap's rules (an idle
    connection closed to make room, or 503 overloaded): an audit's finding."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to fit
        return limits
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    want = limits.max_connections + _FD_RESERVE
    if soft != infinite and soft < want:
        raised = want if hard == infinite else min(want, hard)
        if raised > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
                soft = raised
            except (ValueError, OSError):  # the cap is lowered to the soft limit below
                pass
    if soft == infinite:
        return limits
    room = soft - min(_FD_RESERVE, soft // 2)
    if room >= limits.max_connections:
        return limits
    log.warning("the open-file limit (%d, hard %s) holds %d connections, not "
                "MOEGEMM_HTTP_MAX_CONNECTIONS=%d: serving at most %d", soft,
                "unlimited" if hard == infinite else hard, room, limits.max_connections, room)
    return replace(limits, max_connections=room)


def secrets_of(settings) -> tuple[tuple[bytes, ...], bytes | None]:
    """``Settings``' tokens as (any that authorizes a call, the one a change needs): with a
    token configured the admin token also authorizes every call; none: no token needed."""
    token = settings.token.get_secret_value().encode() if settings.token else None
    admin = settings.admin_token.get_secret_value().encode() if settings.admin_token else None
    return (tuple(t for t in (token, admin) if t is not None) if token else ()), admin


def token_refusal(tokens: tuple[bytes, ...], admin_token: bytes | None, changes: bool,
                  authorization: bytes | None) -> Unauthorized | None:
    """The 401 of a request whose ``Authorization`` header value is ``authorization``, or
    None: a change of weights or experts (``changes``) needs the admin token when one is
    set; every request needs one of ``tokens`` when there are any. Every transport's and
    the app's one rule."""
    given = _bearer(authorization)
    if changes and admin_token is not None:
        if not _matches(given, (admin_token,)):
            return Unauthorized("changing weights needs 'Authorization: Bearer <admin token>'")
    elif tokens and not _matches(given, tokens):
        return Unauthorized("send 'Authorization: Bearer <token>' with this server's token")
    return None


def _bearer(value: bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header value, else None."""
    if value is None:
        return None
    scheme, _, token = value.partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


def _matches(given: bytes | None, secrets: tuple[bytes, ...]) -> bool:
    ok = False
    for secret in secrets:  # every one, constant-time each
        if given is not None and hmac.compare_digest(given, secret):
            ok = True
    return ok


def judge(limits: HttpLimits, method: str, path: str, headers: list[tuple[bytes, bytes]],
          size: int | None, held: int) -> APIError | None:
    """The refusal of a request that declares a body (``size`` bytes; None: chunked,
    judged as the body limit), or None to read it. ``held``: the request bodies this
    process holds now (received, being received, or running)."""
    authorization = content_type = None
    for name, value in headers:
        if name == b"authorization" and authorization is None:
            authorization = value
        elif name == b"content-type" and content_type is None:
            content_type = value
    changes = method == "PUT" and path.startswith(_MSGPACK_PREFIXES)
    refusal = token_refusal(limits.tokens, limits.admin_token, changes, authorization)
    if refusal is not None:
        return refusal
    if method in ("POST", "PUT") and path.startswith(_MSGPACK_PREFIXES):
        media = (content_type or b"").partition(b";")[0].strip().lower().decode("latin-1")
        problem = media_problem(media)
        if problem:
            return UnsupportedMediaType(problem)
    limit = limits.max_body_bytes
    if size is not None and size > limit:
        return TooLarge(f"the body is {size} bytes; this server takes at most {limit}")
    return over_budget(held, limit if size is None else size, limits.max_inflight_bytes)


def over_budget(others: int, size: int, limit: int) -> Overloaded | None:
    """The 503 when a body of ``size`` bytes (received or declared) and the ``others`` held
    beside it would pass ``limit`` (``MOEGEMM_MAX_INFLIGHT_BYTES``), else None: a lone body
    is always let in. Every transport's and the app's one rule."""
    if others and others + size > limit:
        return Overloaded(
            f"{others} bytes of request bodies are held; {size} more would pass the limit "
            f"of {limit} (MOEGEMM_MAX_INFLIGHT_BYTES); retry later", retry_after=1)
    return None


def echoed_id(given: str | None) -> str:
    """The X-Request-Id to answer with (SPEC 2.1), from the client's (its bytes as latin-1
    text, written back as latin-1: the same bytes): the client's when safe in a header and a
    log line, else a fresh one. Every transport's one rule."""
    if given is not None and 0 < len(given) <= 200 and given.isprintable():
        return given
    return uuid.uuid4().hex


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """:func:`echoed_id` of a raw head's X-Request-Id."""
    for name, value in headers:
        if name == b"x-request-id":
            return echoed_id(value.decode("latin-1"))
    return echoed_id(None)


def error_parts(exc: APIError) -> tuple[list[tuple[str, str]], bytes]:
    """SPEC 2's answer for ``exc`` but its status and framing: the headers it carries
    (Retry-After, WWW-Authenticate; content type and length are the framer's) and the JSON
    body, in the bytes Starlette's JSONResponse writes. Every transport renders errors from
    here (``app.error_response``, :func:`error_bytes`, the direct and acceptor lanes)."""
    body = json.dumps(exc.to_dict(), ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode()
    headers = []
    if exc.retry_after is not None:
        headers.append(("retry-after", str(max(1, round(exc.retry_after)))))
    if exc.status == 401:
        headers.append(("www-authenticate", "Bearer"))
    return headers, body


def error_head(exc: APIError) -> tuple[bytes, bytes]:
    """:func:`error_parts` framed for HTTP/1.1: the header lines (content type, length and
    the error's own, each ending CRLF) and the body; the status line, the request id and
    the connection's lines are the caller's."""
    headers, body = error_parts(exc)
    lines = [("content-type", "application/json"), ("content-length", str(len(body))), *headers]
    return "".join(f"{name}: {value}\r\n" for name, value in lines).encode("latin-1"), body


def error_bytes(exc: APIError, *, head_only: bool = False, close: bool = True,
                request_id: str | None = None) -> bytes:
    """A whole HTTP/1.1 answer for ``exc`` (:func:`error_head`); ``head_only`` for a HEAD
    request."""
    lines, body = error_head(exc)
    head = [f"HTTP/1.1 {exc.status} {REASONS.get(exc.status, '')}\r\n".encode("latin-1"), lines]
    if request_id is not None:
        head.append(f"x-request-id: {request_id}\r\n".encode("latin-1"))  # the id's bytes
    if close:
        head.append(b"connection: close\r\n")
    head = b"".join(head) + b"\r\n"
    return head if head_only else head + body
