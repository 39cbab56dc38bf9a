"""The expert-set endpoints of SPEC 2.1 and 5: load, list, unload, ffn, moe.

Each handler reads as the gemm route does: check the name, read the msgpack
body within its limit, validate it, hand the call to the engine, encode the
answer. ``ffn`` and ``moe`` calls are validated by ``_request.py``'s schemas
(``ffn`` with the gemm schema and rules, against the set's ``w13``) and run
as calls of the engine's one entry (``Engine.submit``): merged with other
callers', on the event loop when small, bound by the same queue and
deadlines. Nothing changes until a request is valid: a set is built aside
and swapped in atomically.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from moegemm.client._errors import BadName, OutOfMemory

from ._body import PartsResponse, array_body_parts
from ._request import CheckpointBody, decode_experts, decode_gemm, decode_moe, ffn_call, moe_call
from .engine import Engine
from .experts import ExpertSet, ExpertStore, check_expert_name
from .routes import (
    READ,
    ServicesDep,
    call_deadline,
    read_body,
    require_admin,
    require_ready,
    require_token,
    upload_tensor,
)


@dataclass
class Experts:
    """The expert store; built in the app's lifespan, on ``app.state``."""

    store: ExpertStore

    def info(self, engine: Engine) -> dict:
        """What ``GET /v1/info`` says about expert sets."""
        return {
            "endpoints": ["ffn", "moe"],
            "moe_top_k_graphs": list(engine.moe_top_k) if engine.graphs else [],
            "loaded": [es.name for es in self.store.list()],
        }


def _experts(request: Request) -> Experts:
    return request.app.state.experts


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
        await engine.forget_experts(es)
        raise
    if old is not None:
        await engine.forget_experts(old)
    return es, old is not None


# -- the routes ------------------------------------------------------------------------------

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token), Depends(require_ready)])
admin = APIRouter(prefix="/v1", dependencies=[Depends(require_admin), Depends(require_ready)])


@router.api_route("/experts", methods=READ)
async def list_experts(request: Request) -> dict:
    """Every loaded expert set."""
    return {"experts": [es.describe() for es in _experts(request).store.list()]}


@router.api_route("/experts/{name:expertset}", methods=READ)
async def get_experts(name: str, request: Request) -> dict:
    """One expert set's description."""
    return _experts(request).store.get(check_expert_name(name)).describe()


@admin.put("/experts/{name:expertset}")
async def put_experts(name: str, request: Request, svc: ServicesDep):
    """Load or replace an expert set from tensors or a checkpoint layer (201/200)."""
    check_expert_name(name)
    experts = _experts(request)
    body = decode_experts(await read_body(request, svc.settings.max_body_bytes))
    if isinstance(body, CheckpointBody):
        def build():
            return experts.store.build_from_checkpoint(name, body.checkpoint, body.layer)
    else:
        w13, w13_scale, w2, w2_scale = (upload_tensor(t) for t in
                                        (body.w13, body.w13_scale, body.w2, body.w2_scale))

        def build():
            return experts.store.build(name, w13, w13_scale, w2, w2_scale)
    es, replaced = await install_experts(svc.engine, experts, build)
    return JSONResponse(es.describe(), status_code=200 if replaced else 201)


@admin.delete("/experts/{name:expertset}", status_code=204)
async def delete_experts(name: str, request: Request, svc: ServicesDep) -> Response:
    """Unload an expert set and its two weight sets."""
    experts = _experts(request)
    old = experts.store.delete(check_expert_name(name))
    await svc.engine.forget_experts(old)
    return Response(status_code=204)


async def run_expert_call(svc, experts: Experts, kind: str, name: str, body,
                          deadline: float | None, alone: bool = False) -> list:
    """An ``ffn`` or ``moe`` call from its body bytes to its answer's msgpack parts (header
    and the output's memory): the one path of the ASGI routes below and the fast
    transport's direct path (``_direct.py``). ``alone``: the transport knows of no
    other request in progress (``Engine.submit``)."""
    def expert_set() -> ExpertSet:
        return experts.store.get(name)

    limit = svc.settings.max_m
    if kind == "ffn":
        call = ffn_call(decode_gemm(body), expert_set, max_m=limit, deadline=deadline)
    else:
        call = moe_call(decode_moe(body), expert_set, max_m=limit,
                        max_top_k=svc.engine.max_bucket_m, deadline=deadline)
    out = await svc.engine.submit(call, alone=alone)
    return array_body_parts("out", out, "bfloat16", call.out_shape)


async def _answer(kind: str, name: str, request: Request, svc) -> Response:
    """An ffn or moe route: the name, the deadline, the body, then run_expert_call."""
    check_expert_name(name)
    deadline = call_deadline(request)
    body = await read_body(request, svc.settings.max_body_bytes)
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
