"""One call as the client makes it: the request of each endpoint (SPEC 2.1), built and
checked before anything is sent, and its answer read back in the caller's kind (numpy,
bf16 and fp8 through ml_dtypes, or torch), or raised as the error tree (SPEC 2.2).
``Client`` and ``AsyncClient`` (``_client.py``) send them.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from ._errors import APIError, ArgumentDtype, BadMSizes, BadName, InternalError, error_for
from ._media import MSGPACK_TYPES
from ._names import gemm_name_problem, name_problem
from ._wire import (
    _PART_FROM,
    WireTensor,
    decode_tensors,
    encode_tensor,
    pack_tensors,
    packb,
    torch_of,
)


@dataclass
class Call:
    """One HTTP request to make and how to read its answer."""

    method: str
    path: str
    # The body: bytes, or parts to send back to back (``_wire.pack_tensors``: large
    # tensors as views on the caller's memory, never copied into one buffer).
    body: bytes | list | None = None
    expect: str = "json"  # "json" | "gemm" | "none"
    like_torch: Any = None  # the torch tensor whose kind (and device) the output takes
    retry: bool = True  # health probes report 503 instead of waiting it out
    deadline: float | None = None  # time.monotonic() instant by which to give up
    load: bool = False  # a weight or expert-set load: bounded by the client's load_timeout
    rows: int | None = None  # the rows a gemm, ffn or moe answer must have
    request_id: str | None = None  # the caller's X-Request-Id (else the client's, or random)

def budget(deadline: float | None) -> float | None:
    """A relative deadline in seconds as a ``time.monotonic()`` instant."""
    if deadline is None:
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        raise TypeError(f"deadline is a number of seconds, got {type(deadline).__name__}")
    if not deadline > 0 or math.isinf(deadline):
        raise ValueError(f"deadline is a positive, finite number of seconds, got {deadline!r}")
    return time.monotonic() + deadline

def weights_path(name: str) -> str:
    # Refused here because no server can answer it well: ASGI servers decode
    # %2F before routing, so "a/b" would reach a route-level 404, not bad_name.
    problem = gemm_name_problem(name)
    if problem is not None:
        raise BadName(problem)
    return "/v1/weights/" + name


def _m_sizes_int64(m_sizes: Any) -> Any:
    torch = torch_of(m_sizes)
    if torch is not None:
        if m_sizes.dtype.is_floating_point or m_sizes.dtype.is_complex or \
                m_sizes.dtype == torch.bool:
            raise ArgumentDtype(f"m_sizes must hold integers, got {m_sizes.dtype}")
        if m_sizes.dtype == getattr(torch, "uint64", None) and m_sizes.numel() and \
                int(m_sizes.max()) > np.iinfo(np.int64).max:
            raise BadMSizes(f"m_sizes holds {int(m_sizes.max())}, past int64")
        return m_sizes.to(torch.int64)
    arr = np.asarray(m_sizes)
    if arr.size and arr.dtype.kind not in "iu":
        raise ArgumentDtype(f"m_sizes must hold integers, got {arr.dtype}")
    if arr.size and arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:
        raise BadMSizes(f"m_sizes holds {int(arr.max())}, past int64")  # (never wrapped)
    return arr.astype(np.int64)


def _rows(tensor: dict) -> int | None:
    """The rows an answer to ``x`` must have; none for an ``x`` without dimensions (0-d), which
    the server refuses (400 ``bad_shape``, raised as :class:`BadShape` like any other)."""
    return tensor["shape"][0] if tensor["shape"] else None


def gemm_call(name: str, x: Any, m_sizes: Any, x_scale: Any, deadline: float | None,
              request_id: str | None = None) -> Call:
    body: dict[str, Any] = {
        "x": encode_tensor(x),
        "m_sizes": encode_tensor(_m_sizes_int64(m_sizes)),
    }
    if x_scale is not None:
        body["x_scale"] = encode_tensor(x_scale)
    return Call("POST", weights_path(name) + "/gemm", _packed(body), expect="gemm",
                like_torch=_like(x), deadline=budget(deadline), rows=_rows(body["x"]),
                request_id=request_id_of(request_id))


def load_call(name: str, w: Any, w_scale: Any) -> Call:
    body: dict[str, Any] = {"w": encode_tensor(w)}
    if w_scale is not None:
        body["w_scale"] = encode_tensor(w_scale)
    return Call("PUT", weights_path(name), _packed(body), load=True)


def load_file_call(
    name: str, file: str | os.PathLike, w_key: str, w_scale_key: str | None
) -> Call:
    keys = {"w_key": w_key} if w_scale_key is None else {"w_key": w_key, "w_scale_key": w_scale_key}
    for what, key in keys.items():
        if not isinstance(key, str):
            raise TypeError(f"{what} names a tensor in the file (a str), got {type(key).__name__}")
    body: dict[str, Any] = {"file": os.fspath(file), "w": w_key}
    if w_scale_key is not None:
        body["w_scale"] = w_scale_key
    return Call("PUT", weights_path(name), packb(body), load=True)


def experts_path(name: str) -> str:
    # As weights_path, with expert-set names (up to 128 characters).
    problem = name_problem(name, "expert-set")
    if problem is not None:
        raise BadName(problem)
    return "/v1/experts/" + name


def _like(x: Any) -> Any:
    return x if torch_of(x) is not None else None


def _packed(body: dict[str, Any]) -> bytes | list:
    # Large tensors go out as views (``pack_tensors``); a small body is packed at once
    # (one packb call costs less than assembling it from cached heads).
    big = any(t["data"].nbytes >= _PART_FROM for t in body.values())
    return pack_tensors(body) if big else packb(body)


def load_experts_call(name: str, w13: Any, w2: Any, w13_scale: Any, w2_scale: Any) -> Call:
    body: dict[str, Any] = {"w13": encode_tensor(w13), "w2": encode_tensor(w2)}
    if w13_scale is not None:
        body["w13_scale"] = encode_tensor(w13_scale)
    if w2_scale is not None:
        body["w2_scale"] = encode_tensor(w2_scale)
    return Call("PUT", experts_path(name), _packed(body), load=True)


def load_checkpoint_call(name: str, checkpoint: str | os.PathLike, layer: int) -> Call:
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
        raise TypeError(f"layer is an int, got {type(layer).__name__}")
    layer = int(layer)  # numpy integers too
    return Call("PUT", experts_path(name),
                 packb({"checkpoint": os.fspath(checkpoint), "layer": layer}), load=True)


def ffn_call(name: str, x: Any, m_sizes: Any, x_scale: Any, deadline: float | None,
             request_id: str | None = None) -> Call:
    body: dict[str, Any] = {"x": encode_tensor(x),
                            "m_sizes": encode_tensor(_m_sizes_int64(m_sizes))}
    if x_scale is not None:
        body["x_scale"] = encode_tensor(x_scale)
    return Call("POST", experts_path(name) + "/ffn", _packed(body), expect="gemm",
                like_torch=_like(x), deadline=budget(deadline), rows=_rows(body["x"]),
                request_id=request_id_of(request_id))


def _routing(topk_ids: Any, topk_weights: Any) -> tuple[Any, Any]:
    """``topk_ids`` as int32/int64 (other integers as int64), ``topk_weights`` as float32."""
    torch = torch_of(topk_ids)
    if torch is not None:
        if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or \
                topk_ids.dtype == torch.bool:
            raise ArgumentDtype(f"topk_ids must hold integers, got {topk_ids.dtype}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            topk_ids = topk_ids.to(torch.int64)
    else:
        topk_ids = np.asarray(topk_ids)
        if topk_ids.size and topk_ids.dtype.kind not in "iu":
            raise ArgumentDtype(f"topk_ids must hold integers, got {topk_ids.dtype}")
        if topk_ids.dtype not in (np.int32, np.int64):
            topk_ids = topk_ids.astype(np.int64)
    torch = torch_of(topk_weights)
    if torch is not None:
        if not topk_weights.dtype.is_floating_point:
            raise ArgumentDtype(f"topk_weights must be floats, got {topk_weights.dtype}")
        topk_weights = topk_weights.to(torch.float32)
    else:
        topk_weights = np.asarray(topk_weights)
        if topk_weights.size and topk_weights.dtype.kind != "f" and \
                topk_weights.dtype.name != "bfloat16":
            raise ArgumentDtype(f"topk_weights must be floats, got {topk_weights.dtype}")
        topk_weights = topk_weights.astype(np.float32)
    return topk_ids, topk_weights


def moe_call(name: str, x: Any, topk_ids: Any, topk_weights: Any, x_scale: Any,
             deadline: float | None, request_id: str | None = None) -> Call:
    ids, weights = _routing(topk_ids, topk_weights)
    body: dict[str, Any] = {"x": encode_tensor(x), "topk_ids": encode_tensor(ids),
                            "topk_weights": encode_tensor(weights)}
    if x_scale is not None:
        body["x_scale"] = encode_tensor(x_scale)
    return Call("POST", experts_path(name) + "/moe", _packed(body), expect="gemm",
                like_torch=_like(x), deadline=budget(deadline), rows=_rows(body["x"]),
                request_id=request_id_of(request_id))


def visible(value: str) -> bool:
    """Whether ``value`` can travel as a header value as given: printable, and no whitespace
    at its ends (HTTP strips it)."""
    return value.isprintable() and value == value.strip()


def request_id_of(value: str | None) -> str | None:
    """A caller's request id, checked: it travels as an HTTP header value."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= 200 or not value.isascii() or \
            not visible(value):
        raise ValueError(f"request_id is 1-200 printable ASCII characters, no space at its ends, "
                         f"got {value!r:.80}")
    return value


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:  # an HTTP-date: rare enough not to parse
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _raise_for_error(response: httpx.Response, request_id: str) -> None:
    if response.status_code < 300:
        return
    if response.status_code < 400:  # neither way follows a redirect: nothing was done
        where = response.headers.get("location")
        raise error_for(response.status_code, None,
                        f"redirected{f' to {where}' if where else ''}; give the client the "
                        "server's own URL", request_id=request_id)
    request_id = response.headers.get("x-request-id", request_id)
    code, message = None, response.text[:1000] or response.reason_phrase
    try:
        payload = response.json()
        error = payload["error"]
        code, message = error.get("code"), str(error.get("message", message))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        pass  # not the JSON error body: the class comes from the status alone
    raise error_for(
        response.status_code,
        code if isinstance(code, str) else None,
        message,
        request_id=request_id,
        retry_after=_retry_after(response),
    )


def read_answer(call: Call, response: httpx.Response, request_id: str) -> Any:
    _raise_for_error(response, request_id)
    request_id = response.headers.get("x-request-id", request_id)
    if call.expect == "none":
        return None
    try:
        if call.expect == "json":
            return response.json()
        media = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if media not in MSGPACK_TYPES:
            raise ValueError(f"content type {media!r} is not msgpack")
        out = decode_out(response.content)
        if out.dtype != "bfloat16" or len(out.shape) != 2 or (
                call.rows is not None and out.shape[0] != call.rows):
            raise ValueError(f"out is {out.dtype} {list(out.shape)}; expected bfloat16 "
                             f"[{call.rows}, N]")
    except (ValueError, KeyError, APIError, RecursionError) as exc:
        # A 2xx answer we cannot read is the server's fault, not the request's.
        raise InternalError(
            f"malformed {response.status_code} response to {call.method} {call.path}: {exc}",
            request_id=request_id,
        ) from exc
    arr = out.numpy()  # a view on the answer's buffer, writable when the lane read it into one
    if not (arr.flags.writeable and arr.flags.aligned):  # read as bytes, or at an odd offset
        arr = arr.copy()
    return arr if call.like_torch is None else _to_torch(arr, call.like_torch)


def decode_out(content: bytes | memoryview) -> WireTensor:
    """The ``out`` tensor of a gemm answer, checked, as a view on ``content`` (no copy)."""
    tensors = decode_tensors(content)
    if tensors.keys() != {"out"}:
        raise ValueError(f"the answer holds {sorted(tensors)!r:.200}; expected ['out']")
    return tensors["out"]


def _to_torch(arr: np.ndarray, like: Any) -> Any:
    """The bf16 answer ``arr`` (writable, aligned) as a torch tensor on ``like``'s device,
    sharing ``arr``'s memory on the CPU."""
    import torch  # already imported by the caller: `like` is a torch tensor

    result = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return result if like.device.type == "cpu" else result.to(like.device)

def expert_list(payload: Any) -> list[dict]:
    if isinstance(payload, dict) and isinstance(payload.get("experts"), list):
        return payload["experts"]
    raise InternalError(f"GET /v1/experts answered {type(payload).__name__}, expected "
                        "{'experts': [...]}")


def weight_list(payload: Any) -> list[dict]:
    # SPEC 2.1 names the fields, not the envelope: accept a bare list or {"weights": [...]}.
    if isinstance(payload, dict) and isinstance(payload.get("weights"), list):
        return payload["weights"]
    if isinstance(payload, list):
        return payload
    raise InternalError(f"GET /v1/weights answered {type(payload).__name__}, expected a list")
