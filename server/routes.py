"""The endpoints of SPEC 2.1: decode -> validate -> engine -> encode.

Each handler reads a straight line: check the name and the media type, read the
body within its limit, decode it into its schema (``_request.py``: every body,
calls and uploads), hand it to the store or the engine, encode the answer. A
gemm call takes one path whatever its transport (:func:`run_gemm`:
``_request.py``'s schema and validator, then ``Engine.submit``). Errors are
raised as the domain errors of ``moegemm.client._errors``; ``app.py`` turns
them into JSON.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import torch
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from moegemm.client._errors import (
    BadField,
    BadName,
    NotReady,
    OutOfMemory,
    TooLarge,
    UnsupportedMediaType,
)
from starlette.convertors import Convertor, register_url_convertor

import moegemm

from ._body import PartsResponse, array_body_parts
from ._graphs import buckets_up_to
from ._http_gate import media_problem, secrets_of, token_refusal
from ._request import WeightsFileBody, WireTensor, decode_gemm, decode_weights, gemm_call
from ._tensors import WIRE_NAMES, to_torch
from .config import Settings
from .engine import Engine
from .experts import check_gemm_name
from .metrics import Metrics
from .store import WeightSet, WeightStore, check_name

# A relative deadline in milliseconds: a call still queued when it passes answers 504
# timeout then, instead of running (and its place in the queue is free again).
DEADLINE_HEADER = "x-deadline-ms"

# Every GET endpoint answers HEAD too (RFC 9110 9.3.2: the same head, no body).
READ = ["GET", "HEAD"]


@dataclass
class Services:
    """What the handlers use; built in the app's lifespan, kept on ``app.state``."""

    settings: Settings
    engine: Engine
    store: WeightStore
    metrics: Metrics
    ready: bool = False
    # Why start-up loading failed (then the server never becomes ready), else None.
    startup_error: str | None = None


def services(request: Request) -> Services:
    """The app's services (a FastAPI dependency)."""
    return request.app.state.services


async def _services_dep(request: Request) -> Services:
    # async: FastAPI runs a plain-def dependency on a worker thread, a thread
    # hop per request on the hot path for an attribute lookup.
    return services(request)


ServicesDep = Annotated[Services, Depends(_services_dep)]


def check_token(settings: Settings, authorization: str | None, changes: bool = False) -> None:
    """With a token configured, ``authorization`` carries it (or the admin token); a change
    (``changes``) carries the admin token when one is configured (``_http_gate``'s rule)."""
    if settings.token is None and settings.admin_token is None:
        return
    refusal = token_refusal(*secrets_of(settings), changes,
                            None if authorization is None else authorization.encode("latin-1"))
    if refusal is not None:
        raise refusal


async def require_token(request: Request) -> None:
    """With a token configured, the request carries it (or the admin token)."""
    check_token(services(request).settings, request.headers.get("authorization"))


async def require_admin(request: Request) -> None:
    """Weight changes need the admin token when one is configured, else the token."""
    check_token(services(request).settings, request.headers.get("authorization"), changes=True)


def not_ready(svc: Services) -> NotReady:
    """503 not_ready: still loading (retry soon), or loading failed (no retry will help)."""
    if svc.startup_error is not None:
        return NotReady(f"start-up loading failed, so this server will not become ready: "
                        f"{svc.startup_error} (fix the configuration and restart it)")
    return NotReady("the server is still loading its weights", retry_after=1)


def check_ready(svc: Services) -> None:
    """The weight and gemm endpoints answer 503 until start-up loading is done."""
    if not svc.ready:
        raise not_ready(svc)


async def require_ready(request: Request) -> None:
    """The weight and gemm endpoints answer 503 until start-up loading is done."""
    check_ready(services(request))


def check_body_head(content_type: str | None, content_length: str | None, limit: int) -> None:
    """A msgpack media type, and a declared length within ``limit``."""
    problem = media_problem((content_type or "").partition(";")[0].strip().lower())
    if problem:
        raise UnsupportedMediaType(problem)
    if content_length is not None and content_length.isdigit() and int(content_length) > limit:
        raise TooLarge(f"the body is {content_length} bytes; this server takes at most {limit}")


async def read_body(request: Request, limit: int) -> bytes | memoryview:
    """The body of a msgpack request: media type checked, size bounded while reading."""
    check_body_head(request.headers.get("content-type"), request.headers.get("content-length"),
                    limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the body is over {limit} bytes, the limit of this server")
        if chunk:  # Starlette ends every stream with an empty chunk
            chunks.append(chunk)
    # One chunk (the fast transport's whole body) is used in place: tensor bins
    # stay views on the body, which is pinned memory on a GPU.
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def upload_tensor(t: WireTensor | None) -> torch.Tensor | None:
    """An upload's tensor field (checked by its schema) as a CPU torch view of the body; None
    for an optional field sent as nil or not at all."""
    return None if t is None else to_torch(t)


def parse_deadline(raw: str | None, arrived: float) -> float | None:
    """The ``X-Deadline-Ms`` header value as a ``time.monotonic()`` instant (None: none),
    counted from ``arrived``, when the request's head arrived: a slow upload spends the
    call's time too."""
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not ms > 0 or ms == float("inf"):
        raise BadField(f"{DEADLINE_HEADER} is a positive number of milliseconds, got {raw!r}")
    return arrived + ms / 1000


def call_deadline(request: Request) -> float | None:
    """An app route's call deadline: ``X-Deadline-Ms`` from when the request's head arrived,
    as the transport or the app's outer middleware stamped it in the scope's state."""
    return parse_deadline(request.headers.get(DEADLINE_HEADER), request.scope["state"]["arrived"])


async def run_gemm(svc: Services, name: str, body, deadline: float | None,
                   alone: bool = False) -> list:
    """A gemm call from its body to its answer's parts (header, output bytes): the one
    path of every transport. ``alone``: the transport knows of no other request in
    progress (``Engine.submit``)."""
    request = decode_gemm(body)
    call = gemm_call(request, lambda: svc.store.get(name), max_m=svc.settings.max_m,
                     deadline=deadline)
    out = await svc.engine.submit(call, alone=alone)
    return array_body_parts("out", out, "bfloat16", (call.rows, call.ws.N))


async def install(svc: Services, build: Callable[[], WeightSet]) -> tuple[WeightSet, bool]:
    """Build a set and capture its graphs off the calls' path (``Engine.load``), then
    swap it in.

    Returns the set and whether it replaced one; the replaced set's graphs are
    dropped (calls still holding it finish on it, eagerly if need be).
    """
    ws = await svc.engine.load(build)
    try:
        old = svc.store.put(ws)
    except (OutOfMemory, BadName):
        # The room or the name (an expert set's matrix) was taken meanwhile: this set
        # never goes live.
        svc.engine.forget(ws)
        raise
    if old is not None:
        svc.engine.forget(old)
    return ws, old is not None


class _AnyName(Convertor):
    """Matches any name, even empty or holding '/' or a newline, so that check_name
    answers 400 bad_name for it instead of the router's 404."""

    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


class _NameBefore(_AnyName):
    """``wsname`` for a path that ends with the name, but not where the name ends in one
    of its resource's actions (``x/gemm`` under /weights; ``x/ffn``, ``x/moe`` under
    /experts): there a wrong method is 405, not bad_name for the name ``x/gemm``."""

    def __init__(self, *actions: str) -> None:
        self.regex = rf"(?![\s\S]*/(?:{'|'.join(actions)})$)[\s\S]*"


# Route paths are compiled when the decorators below run, so the convertors are
# registered first (entries in Starlette's convertor table).
register_url_convertor("wsname", _AnyName())
register_url_convertor("weightset", _NameBefore("gemm"))
register_url_convertor("expertset", _NameBefore("ffn", "moe"))

health = APIRouter(prefix="/v1/health")
api = APIRouter(prefix="/v1", dependencies=[Depends(require_token)])
weights_admin = APIRouter(
    prefix="/v1", dependencies=[Depends(require_admin), Depends(require_ready)]
)
metrics_router = APIRouter(dependencies=[Depends(require_token)])


@health.api_route("/live", methods=READ)
async def live(svc: ServicesDep) -> dict:
    """The process answers (503 once its device is lost: it is exiting)."""
    _require_device(svc)
    return {"status": "live"}


@health.api_route("/ready", methods=READ)
async def ready(svc: ServicesDep) -> dict:
    """200 once start-up loading is done, 503 not_ready before (and once the device
    is lost)."""
    _require_device(svc)
    if not svc.ready:
        raise not_ready(svc)
    return {"status": "ready"}


def _require_device(svc: Services) -> None:
    if svc.engine.lost is not None:
        raise NotReady(f"the device is lost ({svc.engine.lost}); the server is exiting")


@api.api_route("/info", methods=READ)
async def info(svc: ServicesDep, request: Request) -> dict:
    """Version, backend, device, fp8 format, buckets, limits and the expert sets."""
    s, backend = svc.settings, svc.engine.backend
    return {
        "version": moegemm.__version__,
        "backend": backend.name,
        "device": str(backend.device),
        "fp8_format": WIRE_NAMES[backend.fp8_dtype],
        "weight_layout": backend.weight_layout,
        "graphs": svc.engine.graphs,
        "buckets": buckets_up_to(s.max_bucket_m),
        "limits": {
            "max_body_bytes": s.max_body_bytes,
            "max_inflight_bytes": s.max_inflight_bytes,
            "max_m": s.max_m,
            "max_g": s.max_g,
            "max_n": s.max_n,
            "max_k": s.max_k,
            "max_weight_bytes": s.max_weight_bytes,
            "max_bucket_m": s.max_bucket_m,
            "queue_size": s.queue_size,
            "merge_window_us": s.merge_window_us,
            # The HTTP transport's (server/_http.py), per process: the server's and each
            # acceptor's (max_inflight_bytes too).
            "http": {
                "max_connections": s.http_max_connections,
                "head_timeout_s": s.http_head_timeout_s,
                "keep_alive_s": s.http_keep_alive_s,
                "min_body_rate": s.http_min_body_rate,
            },
        },
        "experts": request.app.state.experts.info(svc.engine),
    }


@api.api_route("/weights", methods=READ, dependencies=[Depends(require_ready)])
async def list_weights(svc: ServicesDep) -> dict:
    """Every loaded weight set."""
    return {"weights": [ws.describe() for ws in svc.store.list()]}


def _plain_name(svc: Services, name: str) -> None:
    """A name PUT or DELETE may change: an expert set's matrix is refused as such first (its
    name may run past 128 characters, SPEC 5), then anything outside SPEC 2.1's names."""
    svc.store.refuse_owned(name)
    check_name(name)


@weights_admin.put("/weights/{name:weightset}")
async def put_weights(name: str, request: Request, svc: ServicesDep):
    """Load or replace a weight set, from tensors in the body or from a file (201/200)."""
    _plain_name(svc, name)
    body = decode_weights(await read_body(request, svc.settings.max_body_bytes))
    if isinstance(body, WeightsFileBody):
        # Opened here, off the engine's thread: a slow path (800 KB, a slow disk)
        # never holds up the calls the engine runs.
        opened = await asyncio.to_thread(svc.store.resolve, body.file)
        ws, replaced = await install(
            svc, lambda: svc.store.build_from_file(name, opened, body.w, body.w_scale))
    else:
        w, w_scale = upload_tensor(body.w), upload_tensor(body.w_scale)
        ws, replaced = await install(svc, lambda: svc.store.build(name, w, w_scale))
    return JSONResponse(ws.describe(), status_code=200 if replaced else 201)


@weights_admin.delete("/weights/{name:weightset}", status_code=204)
async def delete_weights(name: str, svc: ServicesDep) -> Response:
    """Unload a weight set."""
    _plain_name(svc, name)
    old = svc.store.delete(name)
    svc.engine.forget(old)  # its graphs' table entries only: never the calls' path
    return Response(status_code=204)


@api.post("/weights/{name:wsname}/gemm", dependencies=[Depends(require_ready)])
async def gemm(name: str, request: Request, svc: ServicesDep) -> Response:
    """SPEC 1 on a loaded weight set: msgpack {x, x_scale?, m_sizes} -> {out}."""
    check_gemm_name(name)
    deadline = call_deadline(request)
    body = await read_body(request, svc.settings.max_body_bytes)
    # The header, then the output rows as they are: no msgpack copy.
    return PartsResponse(await run_gemm(svc, name, body, deadline))


@metrics_router.api_route("/metrics", methods=READ)
async def metrics(svc: ServicesDep) -> Response:
    """Prometheus text exposition."""
    return Response(svc.metrics.render(), media_type=svc.metrics.content_type)
