"""The expert-set endpoints of SPEC 2.1 and 5: load, list, unload, ffn, moe.

Each handler reads as the gemm route does: check the name, read the msgpack
body within its limit, validate it (one function per request kind below),
hand host tensors to the engine's thread, encode the answer. Nothing changes
until a request is valid: a set is built aside and swapped in atomically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from moegemm.client._errors import (
    BadField,
    BadMSizes,
    BadName,
    BadShape,
    OutOfMemory,
    TooLarge,
)

from ._body import PartsResponse, tensor_body_parts
from ._tensors import BLOCK, FLOATS, FP8, require_dtype, require_shape
from .engine import Engine
from .experts import ExpertSet, ExpertStore, check_expert_name
from .routes import (
    DEADLINE_HEADER,
    ServicesDep,
    _string,
    _tensor,
    check_fields,
    parse_deadline,
    read_msgpack,
    require_admin,
    require_ready,
    require_token,
)


@dataclass
class Experts:
    """The expert store and the FFN runner; built in the app's lifespan, on ``app.state``."""

    store: ExpertStore
    runner: Any  # FfnExecutor or FfnGraphs (server/_ffn.py)

    def info(self) -> dict:
        """What ``GET /v1/info`` says about expert sets."""
        return {
            "runner": type(self.runner).__name__,
            "endpoints": ["ffn", "moe"],
            "loaded": [es.name for es in self.store.list()],
        }


def _experts(request: Request) -> Experts:
    return request.app.state.experts


# -- validation: one function per request kind --------------------------------------------


@dataclass(frozen=True)
class TensorUpload:
    w13: torch.Tensor
    w13_scale: torch.Tensor | None
    w2: torch.Tensor
    w2_scale: torch.Tensor | None


@dataclass(frozen=True)
class CheckpointUpload:
    checkpoint: str
    layer: int


def expert_upload(body: dict) -> TensorUpload | CheckpointUpload:
    """A ``PUT /v1/experts/{name}`` body: tensors (checked further by the builder,
    against each other) or a checkpoint directory and layer."""
    if "checkpoint" in body:
        check_fields(body, {"checkpoint", "layer"})
        checkpoint = _string(body, "checkpoint")
        layer = body["layer"]
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise BadField(f"layer is a non-negative integer, got {layer!r:.100}")
        return CheckpointUpload(checkpoint, layer)
    check_fields(body, {"w13", "w2"}, {"w13_scale", "w2_scale"})
    for key in ("w13", "w2"):
        if isinstance(body[key], str):
            raise BadField(f"{key} is a tensor; to load from a checkpoint send "
                           f"{{'checkpoint', 'layer'}}")
    return TensorUpload(*(_tensor(body, k) for k in ("w13", "w13_scale", "w2", "w2_scale")))


def ffn_request(engine: Engine, es: ExpertSet, body: dict):
    """A ``POST .../ffn`` body as ``(x, x_scale, m_sizes as a list)``: the gemm rules
    against the set's w13 (K = H, G groups)."""
    check_fields(body, {"x", "m_sizes"}, {"x_scale"})
    x, x_scale, m_sizes = (_tensor(body, k) for k in ("x", "x_scale", "m_sizes"))
    require_dtype(x, FP8 + FLOATS, "x")
    require_dtype(m_sizes, (torch.int64, torch.int32), "m_sizes")
    if x.dim() != 2:
        raise BadShape(f"x has shape {list(x.shape)}; expected 2-D [M, H]")
    M, H = x.shape
    if H != es.H:
        raise BadShape(f"x has H={H}; expert set {es.name!r} has H={es.H}")
    require_shape(m_sizes, (es.G,), "m_sizes", f"[G], G={es.G} experts")
    if M > engine.max_m:
        raise TooLarge(f"x has M={M} rows; this server takes at most {engine.max_m} per call")
    if x.dtype in FP8:
        if x_scale is None:
            raise BadField("fp8 x needs x_scale (float32 [M, H/128])")
        require_dtype(x_scale, (torch.float32,), "x_scale")
        require_shape(x_scale, (M, H // BLOCK), "x_scale", "[M, H/128]")
    elif x_scale is not None:
        raise BadField("x_scale is only for fp8 x; bf16/fp16/fp32 x is quantized by the server")
    sizes = [int(m) for m in m_sizes.tolist()]  # Python ints: the sum is exact
    if any(m < 0 for m in sizes):
        raise BadMSizes(f"m_sizes {sizes} holds a negative size")
    if sum(sizes) != M:
        raise BadMSizes(f"m_sizes sum to {sum(sizes)}; x has M={M} rows")
    return x, x_scale, sizes


def moe_request(engine: Engine, es: ExpertSet, body: dict):
    """A ``POST .../moe`` body as ``(x, x_scale, topk_ids, topk_weights)``, their dtypes
    and shapes checked (what they hold is checked where they are used: bad_routing,
    not_finite)."""
    check_fields(body, {"x", "topk_ids", "topk_weights"}, {"x_scale"})
    x, x_scale, ids, weights = (_tensor(body, k)
                                for k in ("x", "x_scale", "topk_ids", "topk_weights"))
    require_dtype(x, FP8 + FLOATS, "x")
    require_dtype(ids, (torch.int64, torch.int32), "topk_ids")
    require_dtype(weights, (torch.float32,), "topk_weights")
    if x.dim() != 2:
        raise BadShape(f"x has shape {list(x.shape)}; expected 2-D [T, H]")
    T, H = x.shape
    if H != es.H:
        raise BadShape(f"x has H={H}; expert set {es.name!r} has H={es.H}")
    if ids.dim() != 2 or ids.shape[0] != T:
        raise BadShape(f"topk_ids has shape {list(ids.shape)}; expected [T, k] with T={T}")
    k = ids.shape[1]
    if not 1 <= k <= es.G:
        raise BadShape(f"topk_ids has k={k} experts per token; expected 1 <= k <= G={es.G}")
    require_shape(weights, (T, k), "topk_weights", "[T, k], as topk_ids")
    if T * k > engine.max_m:
        raise TooLarge(f"T*k = {T * k} expert rows; this server takes at most "
                       f"{engine.max_m} per call")
    if x.dtype in FP8:
        if x_scale is None:
            raise BadField("fp8 x needs x_scale (float32 [T, H/128])")
        require_dtype(x_scale, (torch.float32,), "x_scale")
        require_shape(x_scale, (T, H // BLOCK), "x_scale", "[T, H/128]")
    elif x_scale is not None:
        raise BadField("x_scale is only for fp8 x; bf16/fp16/fp32 x is quantized by the server")
    return x, x_scale, ids, weights


# -- installing ----------------------------------------------------------------------------


async def install_experts(engine: Engine, experts: Experts, build) -> tuple[ExpertSet, bool]:
    """Build an expert set and capture its matrices' gemm graphs off the calls' path
    (``Engine.load``: the loader thread and stream), then swap it in; returns the set
    and whether it replaced one."""
    es = await engine.load(build)
    try:
        old = experts.store.put(es)
    except (OutOfMemory, BadName):
        # The name was taken or the room used meanwhile: this set never goes live.
        _forget(engine, es)
        raise
    if old is not None:
        _forget(engine, old)
    return es, old is not None


def _forget(engine: Engine, es: ExpertSet) -> None:
    engine.forget(es.w13)
    engine.forget(es.w2)


def _name(name: str) -> str:
    return check_expert_name(name)


# -- the routes ------------------------------------------------------------------------------

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token), Depends(require_ready)])
admin = APIRouter(prefix="/v1", dependencies=[Depends(require_admin), Depends(require_ready)])


@router.get("/experts")
async def list_experts(request: Request) -> dict:
    """Every loaded expert set."""
    return {"experts": [es.describe() for es in _experts(request).store.list()]}


@router.get("/experts/{name:wsname}")
async def get_experts(name: str, request: Request) -> dict:
    """One expert set's description."""
    return _experts(request).store.get(_name(name)).describe()


@admin.put("/experts/{name:wsname}")
async def put_experts(name: str, request: Request, svc: ServicesDep):
    """Load or replace an expert set from tensors or a checkpoint layer (201/200)."""
    _name(name)
    experts = _experts(request)
    body = await read_msgpack(request, svc.settings.max_body_bytes)
    upload = expert_upload(body)
    if isinstance(upload, CheckpointUpload):
        def build():
            return experts.store.build_from_checkpoint(name, upload.checkpoint, upload.layer)
    else:
        def build():
            return experts.store.build(name, upload.w13, upload.w13_scale, upload.w2,
                                       upload.w2_scale)
    es, replaced = await install_experts(svc.engine, experts, build)
    return JSONResponse(es.describe(), status_code=200 if replaced else 201)


@admin.delete("/experts/{name:wsname}", status_code=204)
async def delete_experts(name: str, request: Request, svc: ServicesDep) -> Response:
    """Unload an expert set and its two weight sets."""
    old = _experts(request).store.delete(_name(name))
    _forget(svc.engine, old)
    return Response(status_code=204)


async def run_expert_call(svc, experts: Experts, kind: str, name: str, body: dict,
                          deadline: float | None) -> list:
    """An ``ffn`` or ``moe`` call on a decoded body: the answer's msgpack parts (header and
    the output's memory). The ASGI routes below and the fast transport's direct path
    (``_direct.py``) both answer through it."""
    es = experts.store.get(name)
    if kind == "ffn":
        x, x_scale, sizes = ffn_request(svc.engine, es, body)
        out = await svc.engine.run_call(lambda: experts.runner.ffn(es, x, x_scale, sizes),
                                        deadline)
    else:
        x, x_scale, ids, weights = moe_request(svc.engine, es, body)
        out = await svc.engine.run_call(
            lambda: experts.runner.moe(es, x, x_scale, ids, weights), deadline)
    return tensor_body_parts("out", out)


async def _answer(kind: str, name: str, request: Request, svc) -> Response:
    """An ffn or moe route: the name, the deadline, the body, then run_expert_call."""
    _name(name)
    deadline = parse_deadline(request.headers.get(DEADLINE_HEADER))
    body = await read_msgpack(request, svc.settings.max_body_bytes)
    return PartsResponse(await run_expert_call(svc, _experts(request), kind, name, body,
                                               deadline))


@router.post("/experts/{name:wsname}/ffn")
async def ffn(name: str, request: Request, svc: ServicesDep) -> Response:
    """SPEC 5.1: msgpack {x, x_scale?, m_sizes} -> {out} bf16 [M, H]."""
    return await _answer("ffn", name, request, svc)


@router.post("/experts/{name:wsname}/moe")
async def moe(name: str, request: Request, svc: ServicesDep) -> Response:
    """SPEC 5.2: msgpack {x, x_scale?, topk_ids, topk_weights} -> {out} bf16 [T, H]."""
    return await _answer("moe", name, request, svc)
