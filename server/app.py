"""create_app(settings): the wiring, and nothing else.

The lifespan picks the device and backend, creates the engine (the device's only
owner) and the weight store, and loads the start-up weight sets on the engine's
thread while the server already answers (``/v1/health/ready`` says when it is
done). Routers come from ``routes.py``; domain errors become SPEC 2 JSON here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
import warnings
from typing import Any

import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from moegemm.client._errors import APIError, BadField, InternalError, OutOfMemory, TooLarge
from moegemm.kernels import get_backend
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from . import routes, routes_experts
from ._asgi import leaf_routes
from ._http_gate import error_parts, over_budget
from ._http_gate import request_id as request_id_of
from .config import Settings, get_settings
from .engine import EXIT_DEVICE_LOST, Engine
from .experts import ExpertStore
from .metrics import Metrics
from .store import WeightLimits, WeightStore

log = logging.getLogger("moegemm.server")

# How long a stop waits for a batch or load that outlived the requests' grace period.
CLOSE_WAIT_S = 5.0

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


class NoSuchDevice(ValueError):
    """The configured device is not one this process can use (no GPU visible, or fewer)."""


def resolve_device(name: str) -> torch.device:
    """``auto`` is the first CUDA/ROCm device when there is one, else the CPU; a GPU named
    (``cuda``, ``cuda:N``) must exist: a GPU image whose container was not given its GPU
    fails at start with :class:`NoSuchDevice` instead of serving from the CPU."""
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    # FlyDSL's compile-only mode (COMPILE_ONLY=1) runs with no device by design: it goes
    # as far as the first device call (tests/deploy/test_rocm_image.py).
    if device.type == "cuda" and os.environ.get("COMPILE_ONLY") != "1":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index >= count:
            seen = f"{count} GPU{'s' if count != 1 else ''}" if count else "no GPU"
            raise NoSuchDevice(
                f"device {device} was asked for and this process sees {seen} (torch "
                f"{torch.__version__}): give the container its GPU (--device /dev/kfd "
                f"--device /dev/dri on ROCm, --gpus on NVIDIA), or set MOEGEMM_DEVICE=cpu")
    return device


def error_response(exc: APIError) -> Response:
    """The SPEC 2 JSON answer for a domain error (``_http_gate.error_parts``)."""
    headers, body = error_parts(exc)
    return Response(body, status_code=exc.status, headers=dict(headers),
                    media_type="application/json")


def _device_memory(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.cuda.memory_allocated(device)
    return lambda: 0


async def _load_startup_sets(svc: routes.Services, experts: routes_experts.Experts) -> None:
    """Preload files, checkpoint layers (or the demo set), then mark the server ready."""
    settings, store, engine = svc.settings, svc.store, svc.engine
    started = time.monotonic()
    layers = settings.checkpoint_layers()
    if layers:  # every layer there before loading one
        from ._checkpoint import check_layers

        await asyncio.to_thread(check_layers, store, settings.checkpoint, layers)
    for layer in layers:
        log.info("loading layer %d of checkpoint %s as expert set 'layer%d'", layer,
                 settings.checkpoint, layer)
        await routes_experts.install_experts(
            engine, experts,
            lambda n=layer: experts.store.build_from_checkpoint(f"layer{n}", settings.checkpoint, n),
        )
    for entry in settings.preload_entries():
        log.info("preloading %r from %s", entry.name, entry.file)
        await routes.install(
            svc, lambda e=entry: store.build_from_file(e.name, e.file, e.w_key, e.w_scale_key)
        )
    if settings.wants_demo():
        try:
            await routes.install(svc, store.build_demo)
        except (TooLarge, OutOfMemory) as exc:
            if settings.demo:  # asked for by name: refused as any preload is
                raise
            # Loaded by default, so a first run answers calls; a server whose limits leave
            # no room for it still becomes ready, for the sets it does take.
            log.warning("the random demo weight set is not loaded: %s", exc)
        else:
            log.info("loaded the random demo weight set 'demo'")
    svc.ready = True
    log.info("ready in %.2f s: %d weight sets on %s", time.monotonic() - started,
             len(store.list()), engine.device)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    settings: Settings = app.state.settings
    device = resolve_device(settings.device)
    backend = get_backend(device)
    log.info("device %s, backend %s (%s, %s weights)", device, backend.name,
             backend.fp8_dtype, backend.weight_layout)
    metrics: Metrics = app.state.metrics
    engine = Engine(
        backend,
        queue_size=settings.queue_size,
        max_m=settings.max_m,
        max_bucket_m=settings.max_bucket_m,
        merge_window_us=settings.merge_window_us,
        metrics=metrics,
        switch_interval_us=settings.gil_switch_us,
        moe_top_k=settings.moe_top_k,
    )
    limits = WeightLimits(
        max_g=settings.max_g, max_n=settings.max_n, max_k=settings.max_k,
        max_total_bytes=settings.max_weight_bytes,
        headroom_bytes=settings.memory_headroom_bytes,
    )
    store = WeightStore(backend, settings.weights_dir, limits, engine.weight_graph_bytes)
    metrics.watch(store.total_bytes, _device_memory(device), engine.queued)
    engine.on_lost = lambda reason: exit_for_restart(settings.shutdown_grace_s)
    svc = routes.Services(settings=settings, engine=engine, store=store, metrics=metrics)
    app.state.services = svc
    app.state.experts = routes_experts.Experts(ExpertStore(store, engine.expert_graph_bytes))
    engine.start()
    loading = asyncio.create_task(_load_startup_sets(svc, app.state.experts))
    # A failed start-up load is final: the server stays live but never ready, and every call
    # answers 503 not_ready naming the error (routes.not_ready), rather than no_such_weights
    # while claiming to be ready. Probes of readiness (Kubernetes, compose.yaml) see it.
    loading.add_done_callback(lambda task: _fail_loudly(task, svc))
    try:
        yield
    finally:
        loading.cancel()
        # The transport gave the requests in flight the grace already: a batch or load still
        # running now (a cut-off call, a start-up load) has no one to answer, so the stop
        # waits for it a few seconds at most, and the process then exits without it
        # (cli._serve_fast).
        if not await asyncio.to_thread(engine.close, min(settings.shutdown_grace_s, CLOSE_WAIT_S)):
            log.warning("stopping: a batch or load still runs at the stop; the process exits "
                        "without waiting for it")
            app.state.cut_off = True


def exit_for_restart(grace_s: float) -> None:
    """Stop this process because its device is lost: SIGTERM for an orderly stop
    (acceptors drained, answers in flight sent), then exit with EXIT_DEVICE_LOST
    whatever state the transport is in."""
    def stop() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s + 5.0)
        os._exit(EXIT_DEVICE_LOST)

    threading.Thread(target=stop, name="moegemm-device-lost", daemon=True).start()


def _fail_loudly(task: asyncio.Task, svc: routes.Services) -> None:
    if task.cancelled() or task.exception() is None:
        return
    error = task.exception()
    svc.startup_error = str(error) or type(error).__name__
    # A contract error (a missing file or tensor, a bad shape) names itself: no traceback.
    log.error("start-up loading failed; the server stays live and never ready (every call "
              "answers 503 not_ready naming this): %s", svc.startup_error,
              exc_info=None if isinstance(error, APIError) else error)


class BodyBudget:
    """Pure ASGI middleware: a bound on the request bodies held at once.

    A request that declares a body (Content-Length; chunked: the body limit) is
    judged before the app reads a byte of it: one that would take the bodies
    held over ``limit`` is answered 503 overloaded with Retry-After at once;
    when no other body is held a request is always let in. Its bytes count as
    the app receives them, so a head that declares a body and sends none holds
    nothing (a client cannot lock the others out with heads alone); one whose
    bytes take the bodies held past ``limit`` beside others is refused 503
    there. What it received counts until the request ends (the app holds its
    body until then). The fast transport judges heads and counts bytes the same
    way before the app runs (``_http.py``), and hands the app whole bodies.
    """

    def __init__(self, app: Any, limit: int, body_limit: int) -> None:
        self.app = app
        self.limit = limit
        self.body_limit = body_limit
        self.held = 0  # one event loop: no lock needed

    def _size(self, scope) -> int:
        for key, value in scope["headers"]:
            if key == b"content-length":
                size = int(value) if value.isdigit() else 0
                # Over the body limit: answered 413 from the head, never read.
                return size if size <= self.body_limit else 0
            if key == b"transfer-encoding" and value.lower() != b"identity":
                return self.body_limit
        return 0

    async def __call__(self, scope, receive, send) -> None:
        size = self._size(scope) if scope["type"] == "http" else 0
        if size == 0:
            await self.app(scope, receive, send)
            return
        refusal = over_budget(self.held, size, self.limit)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        got = 0

        async def counted():
            nonlocal got
            message = await receive()
            if message["type"] == "http.request":
                n = len(message.get("body", b""))
                got += n
                self.held += n
                refusal = over_budget(self.held - got, got, self.limit)
                if refusal is not None:
                    raise refusal
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            self.held -= got



class RequestContext:
    """Pure ASGI middleware: X-Request-Id, request metrics, and a last-resort 500.

    Pure ASGI (not BaseHTTPMiddleware) so a request costs one extra function
    call, and the body streams through untouched.
    """

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope["headers"])
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        # Uvicorn runs the app once the head is in: the arrival (our transports stamp their own).
        arrived = state.setdefault("arrived", time.monotonic())
        status = 500
        response_started = False
        metrics = self.metrics
        head_only = scope["method"] == "HEAD"  # the transport sends no body

        whole = getattr(receive, "whole_body", None)
        if whole is not None:
            # Our transports received the body before the app runs: it is in, read or not
            # (a request refused for its name or a header never reads it).
            metrics.bytes_in.inc(len(whole))
            counting_receive = receive
        else:  # uvicorn: the bytes read, as they are read

            async def counting_receive():
                message = await receive()
                if message["type"] == "http.request":
                    metrics.bytes_in.inc(len(message.get("body", b"")))
                return message

        async def tagging_send(message):
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and not head_only:
                metrics.bytes_out.inc(len(message.get("body", b"")))
            await send(message)

        try:
            await self.app(scope, counting_receive, tagging_send)
        except ClientDisconnect:
            # The client left mid-body (e.g. its deadline passed): nobody to answer.
            status = 499
            log.info("request %s %r: the client disconnected (request id %s)",
                     scope.get("method"), scope.get("path"), request_id)
        except Exception as exc:
            # Never a crash: log the traceback, answer 500 if nothing went out yet.
            # %r: a decoded path may hold control characters; they stay escaped.
            log.exception("request %s %r failed (request id %s)", scope.get("method"),
                          scope.get("path"), request_id)
            if not response_started:
                response = error_response(
                    InternalError(f"unexpected {type(exc).__name__}; see the server log")
                )
                await response(scope, counting_receive, tagging_send)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path_format", "unmatched")
            metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
            metrics.request_seconds.labels(endpoint=endpoint).observe(time.monotonic() - arrived)


async def _api_error(request, exc: APIError) -> Response:
    return error_response(exc)


async def _validation_error(request, exc: RequestValidationError) -> Response:
    return error_response(BadField(f"invalid request: {exc.errors()!s:.500}"))


async def _http_error(request, exc: StarletteHTTPException) -> JSONResponse:
    body = {"error": {"code": _HTTP_CODES.get(exc.status_code, "http_error"),
                      "message": str(exc.detail)}}
    headers = exc.headers
    if exc.status_code == 405:  # every method the path takes, not only its first route's
        headers = {**(headers or {}), "Allow": _allowed(request)}
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def _allowed(request) -> str:
    """The methods of every route at the request's path."""
    methods = set()
    for route in leaf_routes(request.app.router.routes):
        if route.matches(request.scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(m for m in ("GET", "HEAD", "PUT", "POST", "DELETE") if m in methods)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The moegemm FastAPI app for ``settings`` (default: the environment's)."""
    settings = settings if settings is not None else get_settings()
    # Uploaded tensors are read where they arrived, never written (``_tensors.to_torch``);
    # torch warns once about any read-only buffer, a line in every server's log that
    # reads as a fault. Only that message, only from there.
    warnings.filterwarnings("ignore", message="The given buffer is not writable",
                            category=UserWarning, module=r"moegemm\.server\._tensors")
    metrics = Metrics()
    app = FastAPI(
        title="moegemm",
        summary="FP8 grouped GEMM with block-wise scales for MoE routers",
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # /v1/info/ is no path of the API: 404 and a JSON error (SPEC 2), not a redirect whose
        # absolute Location names this host as it was reached (wrong behind a proxy).
        redirect_slashes=False,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.include_router(routes.health)
    app.include_router(routes.api)
    app.include_router(routes.weights_admin)
    app.include_router(routes_experts.router)
    app.include_router(routes_experts.admin)
    app.include_router(routes.metrics_router)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    # The last added is the outermost: request ids and metrics see every answer.
    app.add_middleware(BodyBudget, limit=settings.max_inflight_bytes,
                       body_limit=settings.max_body_bytes)
    app.add_middleware(RequestContext, metrics=metrics)
    return app
