"""Client and AsyncClient: the thin SDK over SPEC 2.1, on one pooled httpx client each.

Both classes send the calls ``_calls.py`` builds and read their answers there; they
share the sending policy below (headers, deadlines, retries) and differ only in
whether they await the transport.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from ._calls import (
    Call,
    budget,
    expert_list,
    experts_path,
    ffn_call,
    gemm_call,
    load_call,
    load_checkpoint_call,
    load_experts_call,
    load_file_call,
    moe_call,
    read_answer,
    request_id_of,
    visible,
    weight_list,
    weights_path,
)
from ._errors import DeadlineExceeded, MoegemmError, TransportError, Unavailable
from ._lane import AsyncLane, Lane, reset_at_fork, usable
from ._media import MSGPACK

if TYPE_CHECKING:  # annotations only: typing_extensions is not a runtime dependency
    from typing_extensions import Self

__all__ = ["AsyncClient", "Client"]

DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
# A load answers once the server has the set ready to serve: quantized, placed, its kernels
# compiled and its graphs captured. On a fresh GPU shared with other work an expert set took
# over a minute (bench/NOTES.md, session 16), so loads wait longer than calls by default.
DEFAULT_LOAD_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
# httpcore already sets TCP_NODELAY on sync sockets and asyncio does on async
# ones; asking explicitly keeps small requests from waiting on Nagle whatever
# the backend does.
_SOCKET_OPTIONS = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
# The server's relative deadline header (milliseconds): a call still queued when
# it passes is answered 504 instead of running.
DEADLINE_HEADER = "X-Deadline-Ms"


@dataclass(frozen=True)
class _Retry:
    """When to send a call again: after a 503 (the server did nothing with it) or
    a refused connection (nothing was sent), never after anything else."""

    retries: int
    backoff: float
    max_backoff: float

    def wait(self, attempt: int, error: MoegemmError, deadline: float | None) -> float | None:
        """Seconds to sleep before attempt ``attempt + 1``, or None to give up."""
        if attempt >= self.retries:
            return None
        if isinstance(error, Unavailable):
            hint = error.retry_after
        elif isinstance(error, TransportError) and isinstance(error.__cause__, httpx.ConnectError):
            hint = None
        else:
            return None
        # Exponential backoff with jitter, so a fleet of routers turned away
        # together does not come back together; the server's Retry-After is a floor,
        # and one past max_backoff (a proxy's hours) ends the retries: the 503 is raised
        # with its retry_after.
        wait = min(self.max_backoff, self.backoff * 2**attempt) * random.uniform(0.5, 1.0)
        if hint is not None:
            if hint > self.max_backoff:
                return None
            wait = max(wait, hint)
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None  # the retry could not be answered in time: report the 503 now
        return wait


def _capped(timeout: httpx.Timeout, left: float) -> httpx.Timeout:
    """``timeout`` with no phase longer than ``left`` seconds."""

    def cap(value: float | None) -> float:
        return left if value is None else min(value, left)

    return httpx.Timeout(
        connect=cap(timeout.connect), read=cap(timeout.read),
        write=cap(timeout.write), pool=cap(timeout.pool),
    )


def _header_value(key: str, value: str) -> str:
    """A header given to a client, checked now rather than at its first call: a name of RFC
    9110's token characters and a value of printable ASCII with no whitespace at its ends (no
    CR, LF or NUL, so no header can be injected through it)."""
    if not isinstance(key, str) or not _FIELD_NAME.fullmatch(key):
        raise ValueError(f"a header name is letters, digits and !#$%&'*+-.^_`|~, got {key!r:.80}")
    if not isinstance(value, str) or not value.isascii() or not visible(value):
        raise ValueError(f"header {key} must be printable ASCII with no whitespace at its ends, "
                         f"got {value!r:.80}")
    return value


def _bearer(token: str) -> str:
    """The ``Authorization`` value of ``token``: its UTF-8 bytes (as the server compares a
    token outside ASCII), held as the latin-1 text the request heads are encoded from."""
    if not isinstance(token, str) or not token or not visible(token):
        raise ValueError(f"token must be non-empty and printable with no whitespace at its ends, "
                         f"got {token!r:.80}")
    return "Bearer " + token.encode().decode("latin-1")


def _as_bytes(headers: dict[str, str]) -> dict[str, bytes]:
    """``headers`` as the bytes the lane sends (httpx would encode a str value as ASCII)."""
    return {key: value.encode("latin-1") for key, value in headers.items()}


_FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


class _Base:
    def __init__(
        self,
        url: str,
        token: str | None,
        headers: dict[str, str] | None,
        timeout: float | httpx.Timeout | None,
        retries: int,
        backoff: float,
        max_backoff: float,
        deadline: float | None,
        load_timeout: float | httpx.Timeout | None,
    ) -> None:
        if retries < 0 or not backoff >= 0 or not max_backoff >= 0:
            raise ValueError("retries, backoff and max_backoff are >= 0")
        budget(deadline)  # refuse a bad default now, not at the first call
        self.url = url.rstrip("/")
        self._headers = {"Accept": f"{MSGPACK}, application/json"}
        if token is not None:
            self._headers["Authorization"] = _bearer(token)
        given = {key: _header_value(key, value) for key, value in dict(headers or {}).items()}
        # An X-Request-Id among the client's headers is the id of every call it makes (a
        # call's request_id= wins); it is sent once, never beside a generated one.
        self._request_id = request_id_of(next(
            (given.pop(k) for k in list(given) if k.lower() == "x-request-id"), None))
        # A given header replaces the client's own of any spelling (httpx would send both).
        named = {key.lower() for key in given}
        self._headers = {k: v for k, v in self._headers.items() if k.lower() not in named}
        self._headers.update(given)
        self._timeout = httpx.Timeout(timeout)
        self._load_timeout = httpx.Timeout(load_timeout)
        self._retry = _Retry(retries, backoff, max_backoff)
        self._deadline = deadline
        self._closed = False
        self._pool_lock = threading.Lock()

    def _forked(self) -> None:
        """In a child forked from this client's process (a client whose calls go through an
        httpx pool of its own: https or a proxy, no transport given; ``_lane.reset_at_fork``):
        the pool's connections are the parent's. They are let go of, never closed through
        (the parent is still using them), and the child makes its own pool on its first call
        (``_pool``), not at the fork (an httpx client costs a TLS context: 25 ms). A
        transport the caller gave is theirs, and stays; clients on the lane are not
        registered (their httpx client carries no call)."""
        self._http = None
        self._pool_lock = threading.Lock()  # a parent thread may have held it at the fork

    def _connect(self, transport) -> None:
        """This client's httpx client and, for plain http:// calls, its lean lane (``_LANE``:
        ``_lane.py``); https, proxies and custom transports stay on httpx, whose pool a fork
        resets (:meth:`_forked`) unless the transport is the caller's."""
        self._http = self._new_http(transport)
        self._lane = self._LANE(self.url, self._headers) if usable(self.url, transport) else None
        if transport is None and self._lane is None:
            reset_at_fork(self)

    def _new_http(self, transport=None):
        """An httpx client (``_HTTPX``: blocking or async) for this client's calls, on
        ``transport`` or a fresh one of ``_TRANSPORT``."""
        return self._HTTPX(base_url=self.url, headers=_as_bytes(self._headers), timeout=self._timeout,
                           transport=transport or self._TRANSPORT(socket_options=_SOCKET_OPTIONS))

    def _pool(self):
        """The httpx client calls go through (made anew on a forked child's first call)."""
        if self._http is None:
            with self._pool_lock:
                if self._http is None:
                    self._http = self._new_http()
        return self._http

    def _request_args(self, call: Call) -> tuple[str, dict[str, Any]]:
        if self._closed:  # on every transport alike (httpx raises this; the lane would not)
            raise RuntimeError(f"this client of {self.url} is closed")
        # The caller's id, else 128 random bits (as uuid4's hex).
        request_id = call.request_id or self._request_id or os.urandom(16).hex()
        headers = {"X-Request-Id": request_id}
        if call.body is not None:
            headers["Content-Type"] = MSGPACK
        args = {
            "method": call.method,
            "url": call.path,
            "content": call.body,
            "headers": headers,
        }
        timeout = self._load_timeout if call.load else self._timeout
        if call.deadline is not None:
            left = call.deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(
                    f"the deadline of {call.method} {call.path} passed before it was sent",
                    request_id=request_id,
                )
            # The server refuses to start the call after this; the client never
            # waits past it either.
            headers[DEADLINE_HEADER] = str(max(1, math.floor(left * 1000)))
            timeout = _capped(timeout, left)
        args["timeout"] = timeout
        return request_id, args

    def _failed(self, call: Call, exc: httpx.TransportError, request_id: str) -> MoegemmError:
        """The error for a request that got no answer."""
        if isinstance(exc, httpx.TimeoutException) and call.deadline is not None \
                and time.monotonic() >= call.deadline:
            return DeadlineExceeded(
                f"no answer to {call.method} {call.path} within its deadline",
                request_id=request_id,
            )
        return TransportError(
            f"{call.method} {self.url}{call.path} failed: {exc!r} (request {request_id})",
            request_id=request_id,
        )

    def _wait(self, call: Call, attempt: int, error: MoegemmError) -> float | None:
        if not call.retry:
            return None
        return self._retry.wait(attempt, error, call.deadline)

    def _bounded(self, call: Call) -> Call:
        """``call`` (built for this one send) given the client's default deadline when it
        has none of its own: every call but loads, which ``load_timeout`` bounds."""
        if call.deadline is None and not call.load and self._deadline is not None:
            call.deadline = budget(self._deadline)
        return call


class Client(_Base):
    """A blocking moegemm client; one pooled connection set, reuse it.

    ``Client(url, token=..., timeout=..., headers=...)``; use it as a context
    manager or call ``close()``. ``timeout`` bounds each call's connect, reads and writes
    (60 s by default); a weight or expert-set load, which answers once the server has
    compiled and captured what serves the set, waits ``load_timeout`` instead (600 s).
    Errors raise the `moegemm.client` tree:
    `APIError` subclasses for error answers, `TransportError` for no answer;
    a weight-set name outside ``[A-Za-z0-9._-]{1,128}`` raises `BadName` before
    anything is sent.
    ``transport`` replaces the network (tests pass an ``httpx.MockTransport``).

    Retries: a call answered 503 (`NotReady`, `Overloaded`: the server did
    nothing with it) or refused at connect (nothing was sent) is sent again up to
    ``retries`` times, after an exponential backoff from ``backoff`` seconds up
    to ``max_backoff``, with jitter, and never sooner than the server's
    ``Retry-After`` (a ``Retry-After`` past ``max_backoff`` ends the retries: the
    503 is raised with its ``retry_after``). The default is 0: a `MultiClient` fails over to another
    replica instead, which is faster than waiting.

    Deadlines: ``grouped_gemm(..., deadline=s)`` (or ``deadline=`` here, the
    default of every call but the loads, which ``load_timeout`` bounds) is a
    budget in seconds for the whole call, retries included. The server is told
    the time left (``X-Deadline-Ms``) and answers 504 rather than start the call
    late; the client never waits past the budget either, and raises
    `DeadlineExceeded` when it passes.

    Request ids: every request carries an ``X-Request-Id``, which the server
    echoes and logs, and errors carry as ``request_id``: a call's
    ``request_id=``, else one given in ``headers``, else a random one.
    """

    _HTTPX, _TRANSPORT, _LANE = httpx.Client, httpx.HTTPTransport, Lane

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        headers: dict[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
        retries: int = 0,
        backoff: float = 0.05,
        max_backoff: float = 2.0,
        deadline: float | None = None,
        load_timeout: float | httpx.Timeout | None = DEFAULT_LOAD_TIMEOUT,
    ) -> None:
        super().__init__(url, token, headers, timeout, retries, backoff, max_backoff, deadline,
                         load_timeout)
        self._connect(transport)

    def _send(self, call: Call) -> Any:
        call = self._bounded(call)
        attempt = 0
        while True:
            request_id, args = self._request_args(call)
            try:
                if self._lane is not None:
                    response = self._lane.request(
                        call.method, call.path, args["headers"], call.body,
                        args["timeout"], call.deadline)
                elif call.deadline is None:
                    response = self._pool().request(**_joined(args))
                else:
                    response = self._request_by(call, args, request_id)
                return read_answer(call, response, request_id)
            except httpx.TransportError as exc:
                error, cause = self._failed(call, exc, request_id), exc
                error.__cause__ = exc
            except Unavailable as exc:
                error, cause = exc, exc.__cause__
            wait = self._wait(call, attempt, error)
            if wait is None:
                raise error from cause
            time.sleep(wait)
            attempt += 1

    def _request_by(self, call: Call, args: dict[str, Any], request_id: str) -> httpx.Response:
        """The request, its answer read in pieces so that the deadline bounds the whole wait.

        httpx's timeouts bound each read, not their sum: an answer trickling in
        could otherwise outlast the deadline many times over.
        """
        with self._pool().stream(**_joined(args)) as response:
            chunks = []
            for chunk in response.iter_bytes():
                chunks.append(chunk)
                if time.monotonic() >= call.deadline:
                    raise DeadlineExceeded(
                        f"the answer to {call.method} {call.path} was still arriving "
                        "at its deadline", request_id=request_id)
            if time.monotonic() >= call.deadline:
                raise DeadlineExceeded(
                    f"no full answer to {call.method} {call.path} within its deadline",
                    request_id=request_id)
        headers = [(k, v) for k, v in response.headers.multi_items()
                   if k.lower() not in ("content-encoding", "transfer-encoding")]
        return httpx.Response(response.status_code, headers=headers, content=b"".join(chunks),
                              request=response.request)

    def grouped_gemm(
        self, name: str, x: Any, m_sizes: Any, x_scale: Any = None, *,
        deadline: float | None = None, request_id: str | None = None,
    ) -> Any:
        """Run the grouped GEMM of SPEC 1 on weight set ``name``; returns bf16 ``[M, N]``.

        ``x`` is fp8 ``[M, K]`` with ``x_scale`` float32 ``[M, K/128]``, or
        bf16/fp16/fp32 ``[M, K]`` that the server quantizes. ``m_sizes`` (list,
        numpy or torch ints) are the rows of each group, sent as int64. The
        result is numpy (``ml_dtypes.bfloat16``, writable) for numpy input, or
        a torch bfloat16 tensor on ``x``'s device for torch input. ``deadline``
        is this call's budget in seconds (see the class); ``request_id`` its
        ``X-Request-Id`` (the server's logs and answer carry it; default: the
        client's, else a random one).
        """
        return self._send(gemm_call(name, x, m_sizes, x_scale, deadline, request_id))

    def load_weights(self, name: str, w: Any, w_scale: Any = None) -> dict:
        """Load or replace weight set ``name`` from ``w`` ``[G, N, K]`` (fp8 with
        ``w_scale`` ``[G, K/128, N/128]``, or bf16/fp16/fp32 to be quantized)."""
        return self._send(load_call(name, w, w_scale))

    def load_weights_file(
        self,
        name: str,
        file: str | os.PathLike,
        w_key: str,
        w_scale_key: str | None = None,
    ) -> dict:
        """Load weight set ``name`` from a safetensors file under the server's
        weights directory (``file`` is relative to it), tensors ``w_key`` and
        ``w_scale_key``."""
        return self._send(load_file_call(name, file, w_key, w_scale_key))

    def weights(self) -> list[dict]:
        """The loaded weight sets: name, G, N, K, layout, bytes, created."""
        return weight_list(self._send(Call("GET", "/v1/weights")))

    def delete_weights(self, name: str) -> None:
        """Unload weight set ``name``."""
        self._send(Call("DELETE", weights_path(name), expect="none"))

    def load_experts(self, name: str, w13: Any, w2: Any, w13_scale: Any = None,
                     w2_scale: Any = None) -> dict:
        """Load or replace expert set ``name`` (SPEC 5): ``w13`` ``[G, 2I, H]`` (gate rows,
        then up rows) and ``w2`` ``[G, H, I]``, fp8 with ``w13_scale`` ``[G, H/128,
        2I/128]`` and ``w2_scale`` ``[G, I/128, H/128]``, or bf16/fp16/fp32 to be
        quantized. Its matrices also become weight sets ``{name}.w13``, ``{name}.w2``."""
        return self._send(load_experts_call(name, w13, w2, w13_scale, w2_scale))

    def load_experts_checkpoint(self, name: str, checkpoint: str | os.PathLike,
                                layer: int) -> dict:
        """Load expert set ``name`` from layer ``layer`` of a Hugging Face checkpoint
        directory under the server's weights directory (SPEC 5.3)."""
        return self._send(load_checkpoint_call(name, checkpoint, layer))

    def experts(self) -> list[dict]:
        """The loaded expert sets: name, G, H, I, layout, bytes, created, source."""
        return expert_list(self._send(Call("GET", "/v1/experts")))

    def delete_experts(self, name: str) -> None:
        """Unload expert set ``name`` (and its two weight sets)."""
        self._send(Call("DELETE", experts_path(name), expect="none"))

    def expert_ffn(self, name: str, x: Any, m_sizes: Any, x_scale: Any = None, *,
                   deadline: float | None = None, request_id: str | None = None) -> Any:
        """SPEC 5.1 on expert set ``name``: rows of ``x`` ``[M, H]`` grouped per expert
        (``m_sizes``, as for `grouped_gemm`); returns bf16 ``[M, H]`` in ``x``'s kind."""
        return self._send(ffn_call(name, x, m_sizes, x_scale, deadline, request_id))

    def moe(self, name: str, x: Any, topk_ids: Any, topk_weights: Any, x_scale: Any = None,
            *, deadline: float | None = None, request_id: str | None = None) -> Any:
        """SPEC 5.2 on expert set ``name``: tokens ``x`` ``[T, H]`` in their own order,
        ``topk_ids`` ``[T, k]`` (distinct experts per token) and ``topk_weights``
        ``[T, k]`` (sent as float32); returns bf16 ``[T, H]`` in ``x``'s kind. Bad
        routing raises `BadRouting`."""
        return self._send(moe_call(name, x, topk_ids, topk_weights, x_scale, deadline,
                                   request_id))

    def health(self) -> dict:
        """The readiness answer; raises `NotReady` while the server starts."""
        return self._send(Call("GET", "/v1/health/ready", retry=False))

    def live(self) -> dict:
        """The liveness answer: the process responds."""
        return self._send(Call("GET", "/v1/health/live", retry=False))

    def info(self) -> dict:
        """Version, backend, device, ``fp8_format``, buckets and limits."""
        return self._send(Call("GET", "/v1/info"))

    def close(self) -> None:
        """Close the pooled connections; calls made after it raise RuntimeError."""
        self._closed = True
        if self._lane is not None:
            self._lane.close()
        if self._http is not None:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient(_Base):
    """The asyncio twin of `Client`: the same methods, awaited.

    Encoding and decoding run on the event loop; they are memory copies, not
    compute, but very large uploads may want ``asyncio.to_thread``.
    """

    _HTTPX, _TRANSPORT, _LANE = httpx.AsyncClient, httpx.AsyncHTTPTransport, AsyncLane

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        headers: dict[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        retries: int = 0,
        backoff: float = 0.05,
        max_backoff: float = 2.0,
        deadline: float | None = None,
        load_timeout: float | httpx.Timeout | None = DEFAULT_LOAD_TIMEOUT,
    ) -> None:
        super().__init__(url, token, headers, timeout, retries, backoff, max_backoff, deadline,
                         load_timeout)
        self._connect(transport)

    def _exchange(self, call: Call, args: dict[str, Any]):
        if self._lane is None:
            return self._pool().request(**_joined(args))
        return self._lane.request(call.method, call.path, args["headers"], call.body,
                                  args["timeout"], call.deadline)

    async def _send(self, call: Call) -> Any:
        call = self._bounded(call)
        attempt = 0
        while True:
            request_id, args = self._request_args(call)
            try:
                if call.deadline is None:
                    response = await self._exchange(call, args)
                else:
                    # httpx's timeouts bound each read, not their sum.
                    left = max(0.0, call.deadline - time.monotonic())
                    try:
                        response = await asyncio.wait_for(self._exchange(call, args), left)
                    except asyncio.TimeoutError:
                        raise DeadlineExceeded(
                            f"no full answer to {call.method} {call.path} within its deadline",
                            request_id=request_id) from None
                return read_answer(call, response, request_id)
            except httpx.TransportError as exc:
                error, cause = self._failed(call, exc, request_id), exc
                error.__cause__ = exc
            except Unavailable as exc:
                error, cause = exc, exc.__cause__
            wait = self._wait(call, attempt, error)
            if wait is None:
                raise error from cause
            await asyncio.sleep(wait)
            attempt += 1

    async def grouped_gemm(
        self, name: str, x: Any, m_sizes: Any, x_scale: Any = None, *,
        deadline: float | None = None, request_id: str | None = None,
    ) -> Any:
        """See `Client.grouped_gemm`."""
        return await self._send(gemm_call(name, x, m_sizes, x_scale, deadline, request_id))

    async def load_weights(self, name: str, w: Any, w_scale: Any = None) -> dict:
        """See `Client.load_weights`."""
        return await self._send(load_call(name, w, w_scale))

    async def load_weights_file(
        self,
        name: str,
        file: str | os.PathLike,
        w_key: str,
        w_scale_key: str | None = None,
    ) -> dict:
        """See `Client.load_weights_file`."""
        return await self._send(load_file_call(name, file, w_key, w_scale_key))

    async def weights(self) -> list[dict]:
        """See `Client.weights`."""
        return weight_list(await self._send(Call("GET", "/v1/weights")))

    async def delete_weights(self, name: str) -> None:
        """See `Client.delete_weights`."""
        await self._send(Call("DELETE", weights_path(name), expect="none"))

    async def load_experts(self, name: str, w13: Any, w2: Any, w13_scale: Any = None,
                           w2_scale: Any = None) -> dict:
        """See `Client.load_experts`."""
        return await self._send(load_experts_call(name, w13, w2, w13_scale, w2_scale))

    async def load_experts_checkpoint(self, name: str, checkpoint: str | os.PathLike,
                                      layer: int) -> dict:
        """See `Client.load_experts_checkpoint`."""
        return await self._send(load_checkpoint_call(name, checkpoint, layer))

    async def experts(self) -> list[dict]:
        """See `Client.experts`."""
        return expert_list(await self._send(Call("GET", "/v1/experts")))

    async def delete_experts(self, name: str) -> None:
        """See `Client.delete_experts`."""
        await self._send(Call("DELETE", experts_path(name), expect="none"))

    async def expert_ffn(self, name: str, x: Any, m_sizes: Any, x_scale: Any = None, *,
                         deadline: float | None = None, request_id: str | None = None) -> Any:
        """See `Client.expert_ffn`."""
        return await self._send(ffn_call(name, x, m_sizes, x_scale, deadline, request_id))

    async def moe(self, name: str, x: Any, topk_ids: Any, topk_weights: Any,
                  x_scale: Any = None, *, deadline: float | None = None,
                  request_id: str | None = None) -> Any:
        """See `Client.moe`."""
        return await self._send(moe_call(name, x, topk_ids, topk_weights, x_scale, deadline,
                                            request_id))

    async def health(self) -> dict:
        """See `Client.health`."""
        return await self._send(Call("GET", "/v1/health/ready", retry=False))

    async def live(self) -> dict:
        """See `Client.live`."""
        return await self._send(Call("GET", "/v1/health/live", retry=False))

    async def info(self) -> dict:
        """See `Client.info`."""
        return await self._send(Call("GET", "/v1/info"))

    async def close(self) -> None:
        """Close the pooled connections (awaited); calls made after it raise RuntimeError."""
        self._closed = True
        if self._lane is not None:
            await self._lane.aclose()
        if self._http is not None:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _joined(args: dict[str, Any]) -> dict[str, Any]:
    """httpx's arguments with a body of parts joined into bytes (the lane sends parts as
    they are; httpx would stream a list chunked)."""
    if isinstance(args["content"], list):
        return {**args, "content": b"".join(args["content"])}
    return args
