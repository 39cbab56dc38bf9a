"""The call endpoints (gemm, and an expert set's ffn and moe) served by the fast
transport without the ASGI stack.

``POST /v1/weights/{name}/gemm`` and ``POST /v1/experts/{name}/{ffn,moe}`` are the
service's hot paths, and on the request path Starlette and FastAPI cost more than
everything else on the host: measured on this repo's CPU box with the kernel
replaced by a no-op, the middleware, routing and dependency machinery took ~40 % of
the server's time
per call (py-spy, ``bench/SERVICE_NOTES.md``, v2). The fast transport
(``_http.py``) therefore hands these routes to :class:`DirectCalls`, which
does, in the same order and with the same helpers, what the ASGI path does:

1. the request context: ``X-Request-Id`` (echoed or made), the request and
   byte metrics under the route's own label;
2. the in-flight body budget (``BodyBudget`` in ``app.py``): 503 with
   Retry-After when the bodies held would pass it;
3. the router's and the route's dependencies: the token, then readiness;
4. the route: the name, ``X-Deadline-Ms``, the media type and size, the
   msgpack fields, the engine call, the answer as header + output memory.

Errors become the same SPEC 2.2 JSON as ``app.error_response`` makes (it is
used for the bytes); anything unexpected is logged and answered 500. The
contract does not change with the transport: every server suite runs on this
one, and the contract's suites also under uvicorn (``tests/server/*_uvicorn.py``),
which serves these routes through FastAPI (the benchmarks' peer, ``bench/uvicorn_peer.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from moegemm.client._errors import APIError, InternalError, TooLarge

from . import routes
from ._body import MSGPACK
from ._http_gate import GEMM_ENDPOINT, Route, call_route, echoed_id, error_head, over_budget
from .metrics import Metrics

log = logging.getLogger("moegemm.server")

_MSGPACK = MSGPACK.encode()

Headers = list[tuple[bytes, bytes]]


class DirectCalls:
    """Serves gemm, ffn and moe calls for the app's services straight from the transport."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.metrics: Metrics = app.state.metrics
        self.settings = app.state.settings
        # Metric children by (endpoint, status) and by endpoint (few of each); the gemm
        # route's latency is in the exposition from the start.
        self._requests: dict[tuple[str, int], Any] = {}
        self._request_seconds: dict[str, Any] = {
            GEMM_ENDPOINT: self.metrics.request_seconds.labels(endpoint=GEMM_ENDPOINT)}
        # The transport sets this: how many requests it has begun and not yet
        # answered (``FastHttpServer.active``). A call that is the only one may
        # run on the loop's thread when the engine allows it (``Engine.submit``).
        self.in_progress: Callable[[], int] = lambda: 2  # unknown: not alone

    match = staticmethod(call_route)  # the route when this request is a call, else None

    async def __call__(
        self, route: Route, headers: Headers, body: memoryview, arrived: float
    ) -> tuple[int, bytes, list]:
        """Answer one call: the status, the header lines (each ending in CRLF, without
        the status line and the blank line) and the body parts. ``arrived``: when its head
        arrived (``time.monotonic()``), where its deadline and its total time count from."""
        fields = _fields(headers)
        request_id = echoed_id(fields.get("x-request-id"))
        try:
            status, head, parts, endpoint = await self._budgeted(route, fields, body, request_id,
                                                                 arrived)
        except asyncio.CancelledError:
            # The client went away (the transport cancels the call): nobody to answer. Counted
            # as a body the client left is (499).
            log.info("request POST %r: the client disconnected (request id %s)",
                     route.name[:200], request_id)
            self._count(route.endpoint, 499, arrived)
            raise
        except Exception as exc:  # never a crash: the same last resort as RequestContext
            log.exception("request POST %r failed (request id %s)", route.name[:200],
                          request_id)
            status, head, parts = _error(InternalError(
                f"unexpected {type(exc).__name__}; see the server log"), request_id)
            endpoint = route.endpoint
        self.metrics.bytes_out.inc(sum(len(p) for p in parts))
        self._count(endpoint, status, arrived)
        return status, head, parts

    def _count(self, endpoint: str, status: int, arrived: float) -> None:
        """The request's count and total time (from its head's arrival) under its endpoint's
        label."""
        # The labelled children, looked up once each: prometheus-client's labels()
        # costs more than the update itself.
        counter = self._requests.get((endpoint, status))
        if counter is None:
            counter = self.metrics.requests.labels(endpoint=endpoint, status=str(status))
            self._requests[endpoint, status] = counter
        counter.inc()
        seconds = self._request_seconds.get(endpoint)
        if seconds is None:
            seconds = self._request_seconds[endpoint] = \
                self.metrics.request_seconds.labels(endpoint=endpoint)
        seconds.observe(time.monotonic() - arrived)

    async def _budgeted(self, route: Route, fields, body, request_id,
                        arrived: float) -> tuple[int, bytes, list, str]:
        """The answer, and the endpoint label its metrics go under."""
        # BodyBudget's rule over the body it now holds whole (the transport counted its bytes as
        # they arrived and judged its head): a body over the body limit was never read
        # (answered 413 below).
        size = len(body) if len(body) <= self.settings.max_body_bytes else 0
        self.metrics.bytes_in.inc(size)  # received, whether or not the call gets to read it
        budget = self._budget()
        refusal = over_budget(budget.held, size, budget.limit) if size else None
        if refusal is not None:
            # The ASGI path refuses before routing: its metrics say "unmatched".
            return (*_error(refusal, request_id), "unmatched")
        budget.held += size
        try:
            if route.kind == "gemm":
                parts = await self._gemm(route.name, fields, body, arrived)
            else:
                parts = await self._expert(route, fields, body, arrived)
        except APIError as exc:
            return (*_error(exc, request_id), route.endpoint)
        finally:
            budget.held -= size
        size_out = sum(len(p) for p in parts)
        head = b"content-type: %s\r\ncontent-length: %d\r\nx-request-id: %s\r\n" % (
            _MSGPACK, size_out, request_id.encode("latin-1"))
        return 200, head, parts, route.endpoint

    def _budget(self):
        """The app's BodyBudget middleware: direct and ASGI calls share one budget."""
        budget = getattr(self, "_budget_mw", None)
        if budget is None:
            budget = _find_budget(self.app)
            self._budget_mw = budget
        return budget

    def _admit(self, fields: dict[str, str], body: memoryview, check_name: Callable[[str], Any],
               name: str, arrived: float):
        """What every route does before its body, in the app's order: the router's
        dependencies (token, readiness), the name, the deadline, the media type and
        size. Returns the services and the deadline."""
        svc: routes.Services = self.app.state.services
        routes.check_token(svc.settings, fields.get("authorization"))
        routes.check_ready(svc)
        check_name(name)
        deadline = routes.parse_deadline(fields.get(routes.DEADLINE_HEADER), arrived)
        limit = svc.settings.max_body_bytes
        routes.check_body_head(fields.get("content-type"), fields.get("content-length"), limit)
        if len(body) > limit:
            raise TooLarge(f"the body is over {limit} bytes, the limit of this server")
        return svc, deadline

    async def _gemm(self, name: str, fields: dict[str, str], body: memoryview,
                    arrived: float):
        svc, deadline = self._admit(fields, body, routes.check_gemm_name, name, arrived)
        return await routes.run_gemm(svc, name, body, deadline, alone=self.in_progress() <= 1)

    async def _expert(self, route: Route, fields: dict[str, str], body: memoryview,
                      arrived: float):
        """``routes_experts.ffn`` / ``moe``: the same steps, the same one path."""
        from . import routes_experts

        svc, deadline = self._admit(fields, body, routes_experts.check_expert_name, route.name,
                                    arrived)
        return await routes_experts.run_expert_call(
            svc, self.app.state.experts, route.kind, route.name, body, deadline,
            alone=self.in_progress() <= 1)


def _fields(headers: Headers) -> dict[str, str]:
    """Header names (lower case, as the transport gives them) to values; the first wins."""
    out: dict[str, str] = {}
    for key, value in headers:
        name = key.decode("latin-1")
        if name not in out:
            out[name] = value.decode("latin-1")
    return out


def _error(exc: APIError, request_id: str) -> tuple[int, bytes, list]:
    """The SPEC 2 JSON answer for ``exc`` (``_http_gate.error_head``) as (status, header
    lines, body parts)."""
    lines, body = error_head(exc)
    return exc.status, lines + f"x-request-id: {request_id}\r\n".encode("latin-1"), [body]


def _find_budget(app: Any):
    """The BodyBudget instance in the app's middleware stack (built on first use)."""
    from .app import BodyBudget

    layer = app.middleware_stack
    if layer is None:
        app.middleware_stack = layer = app.build_middleware_stack()
    while layer is not None:
        if isinstance(layer, BodyBudget):
            return layer
        layer = getattr(layer, "app", None)
    raise RuntimeError("the app has no BodyBudget middleware")
