"""The FP8 grouped GEMM with block-wise scales (SPEC 1), on whichever backend the device has.

    out = grouped_gemm(xq, wq, x_scale, w_scale, m_sizes)

``grouped_gemm`` takes plain ``[G, N, K]`` weights, ``grouped_gemm_preshuffled``
weights in the MFMA B layout of SPEC 1.3. Both check the contract, allocate the
output when none is given, and hand the call to ``get_backend(xq.device).run``.
A server that keeps weights resident should prepare them once with
``backend.prepare_weights`` and call ``backend.run`` itself.
"""

from __future__ import annotations

import contextlib

import torch

from ._backend import BLOCK, Backend, BackendUnavailable, check_operands
from ._select import backend_refusal, get_backend
from .activation import silu_mul_quant
from .layout import preshuffle, unshuffle
from .quant import fn_to_fnuz, fnuz_to_fn, fp8_max, quantize_activations, quantize_weights
from .reference import ffn_reference_float64, moe_reference_float64, reference_float64

__all__ = [
    "BLOCK",
    "Backend",
    "BackendUnavailable",
    "backend_refusal",
    "ffn_reference_float64",
    "fn_to_fnuz",
    "fnuz_to_fn",
    "fp8_max",
    "get_backend",
    "grouped_gemm",
    "grouped_gemm_preshuffled",
    "moe_reference_float64",
    "preshuffle",
    "quantize_activations",
    "quantize_weights",
    "reference_float64",
    "silu_mul_quant",
    "unshuffle",
]

_ALIGN = 16  # bytes
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _check_contract(xq, wq, x_scale, w_scale, m_sizes, out) -> None:
    """Raise TypeError/ValueError unless the arguments meet SPEC 1 (no host reads)."""
    tensors = {"xq": xq, "wq": wq, "x_scale": x_scale, "w_scale": w_scale, "m_sizes": m_sizes}
    if out is not None:
        tensors["out"] = out
    for what, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != xq.device:
            raise ValueError(
                f"{what} is on {t.device}, xq on {xq.device}: all must share one device"
            )
    if xq.dtype not in _FP8_DTYPES:
        raise TypeError(f"xq must be float8_e4m3fn or float8_e4m3fnuz, got {xq.dtype}")
    if wq.dtype != xq.dtype:
        raise TypeError(f"wq must have xq's dtype {xq.dtype}, got {wq.dtype}")
    check_operands(xq, wq, x_scale, w_scale, m_sizes, out)
    if not wq.is_contiguous():
        raise ValueError("wq must be contiguous (row-major [G, N, K])")
    if out is not None:
        if out.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"out must be bfloat16 or float32, got {out.dtype}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")


def _dispatch(backend: Backend, run, xq, wq_prepared, x_scale, w_scale, m_sizes, out):
    if backend.name != "reference" and xq.dtype != backend.fp8_dtype:
        # The reference decodes either format; a GPU kernel computes in one.
        raise TypeError(
            f"the {backend.name} backend computes in {backend.fp8_dtype}, got {xq.dtype}: "
            "convert with fn_to_fnuz / fnuz_to_fn"
        )
    shape = (xq.shape[0], wq_prepared.shape[1])
    into = out if out is not None and _is_aligned(out) else None
    if into is None:
        dtype = torch.bfloat16 if out is None else out.dtype
        into = torch.empty(shape, dtype=dtype, device=xq.device)
    # The kernels launch on the current device and its stream: the operands' device, whatever
    # device the calling thread has current (one without peer access would fault).
    with torch.cuda.device(xq.device) if xq.device.type == "cuda" else contextlib.nullcontext():
        run(
            _aligned(xq),
            _aligned(wq_prepared),
            _aligned(x_scale),
            _aligned(w_scale),
            _aligned(m_sizes),
            into,
        )
    if out is None or out is into:
        return into
    return out.copy_(into)


def _is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % _ALIGN == 0


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous from a 16-byte boundary: the GPU kernels' vector and TMA accesses need
    both. A view that starts elsewhere (an offset into a flat buffer) is copied, and a torch
    allocation always starts aligned."""
    t = t.contiguous()
    return t if _is_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def grouped_gemm(
    xq: torch.Tensor,
    wq: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """SPEC 1: ``out[r, n] = bf16(sum_k xq[r,k] x_scale[r,k//128] wq[g(r),n,k] w_scale[g(r),k//128,n//128])``.

    ``xq`` ``[M, K]`` fp8 e4m3, ``wq`` ``[G, N, K]`` plain row-major in the same
    dtype, ``x_scale`` ``[M, K/128]`` and ``w_scale`` ``[G, K/128, N/128]``
    float32, ``m_sizes`` ``[G]`` int64/int32 (rows per group, summing to M; the GPU
    backends do not check it, because that would read the device: there, rows past the
    sum are not written and the sizes are taken clamped to ``[0, M]``; the CPU reference
    raises ValueError). Returns bf16 ``[M, N]``,
    written into ``out`` when given; a float32 ``out`` receives the same sum
    unrounded (what the expert FFN keeps as ``h``). ``xq`` and the scales may have any
    strides (copied contiguous), and an operand or ``out`` that does not start on a 16-byte
    boundary is copied too. The GPU kernels scale each K block by the float32 product
    ``x_scale * w_scale``, so a pair of scales whose product leaves float32's normal range
    (hand-made, e.g. 1e20 and 1e20) can give Inf where the answer is finite (README, "Scale
    range"). Raises TypeError/ValueError on a contract violation.
    """
    _check_contract(xq, wq, x_scale, w_scale, m_sizes, out)
    backend = get_backend(xq.device)
    # A backend that loads its weights preshuffled (flydsl) runs its kernel's plain layout here.
    run = backend.run if backend.weight_layout == "plain" else backend.run_plain
    return _dispatch(backend, run, xq, wq, x_scale, w_scale, m_sizes, out)


def grouped_gemm_preshuffled(
    xq: torch.Tensor,
    wq_shuffled: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`grouped_gemm` with weights in the MFMA B layout of SPEC 1.3 (see :func:`preshuffle`)."""
    _check_contract(xq, wq_shuffled, x_scale, w_scale, m_sizes, out)
    backend = get_backend(xq.device)
    if backend.weight_layout == "plain":
        # Correct but slow: the weights are unshuffled on every call.
        wq_shuffled = unshuffle(wq_shuffled)
    return _dispatch(backend, backend.run, xq, wq_shuffled, x_scale, w_scale, m_sizes, out)
