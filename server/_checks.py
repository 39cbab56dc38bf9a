"""Checks of request tensors' contents (SPEC 2.2 ``not_finite``), per row.

``bad_rows`` is what the engine uses: torch ops on a GPU (inside the graph),
numpy on the CPU, with the same answer.
"""

from __future__ import annotations

import numpy as np
import torch

# Exponent masks: all ones means Inf or NaN.
_EXPONENT = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


# -- on the device, per row -------------------------------------------------------------
#
# The engine checks what a call's tensors hold on the device, inside the graph
# that computes it: the bytes are there anyway, a scan of a [128, 7168] call
# costs the GPU microseconds, and the event loop -- the service's bottleneck at
# many clients -- no longer spends ~150 us per call scanning on the host (py-spy
# on the H200: 12 % of its time). Rows are independent in a grouped GEMM, so a
# bad row never touches another caller's rows in a merged launch; the engine
# answers the call that sent it ``not_finite`` and nothing else changes.

BAD_X = 1  # bf16/fp16/fp32 x holds NaN or Inf
# fp8 x is not scanned: SPEC 2.2's not_finite names its scales, not its codes (an fp8 NaN code
# gives NaN in that row's answer, as in the float64 reference). Scanning every code cost a
# lone prefill call a full extra read of x before its GEMM (v14: seed m16384 n2048 k7168,
# 464 us served against 404 us for the kernel alone).
BAD_SCALE = 2  # x_scale holds NaN, Inf or a value <= 0


def bad_rows(x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor:
    """Per row of ``x`` ``[rows, K]``: ``BAD_X | BAD_SCALE`` flags as int8 ``[rows]``.

    Works on any device and inside a CUDA graph capture (no host reads); on
    the CPU it runs in numpy (torch's uint8 comparisons there are ~30x slower).
    """
    if x.device.type == "cpu":
        return torch.from_numpy(_bad_rows_numpy(x, x_scale))
    return _bad_rows_torch(x, x_scale)


def _bad_rows_torch(x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor:
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        flags = torch.zeros(x.shape[0], dtype=torch.int8, device=x.device)
    else:
        flags = (~torch.isfinite(x).all(dim=1)).to(torch.int8)
    if x_scale is not None:
        scale_bad = ~((x_scale > 0) & torch.isfinite(x_scale)).all(dim=1)
        flags = flags | (scale_bad.to(torch.int8) << 1)
    return flags


def _bad_rows_numpy(x: torch.Tensor, x_scale: torch.Tensor | None) -> np.ndarray:
    rows = x.shape[0]
    flags = np.zeros(rows, dtype=np.int8)
    if rows == 0 or x.numel() == 0:
        return flags
    if x.dtype == torch.float32:
        flags |= (~np.isfinite(x.reshape(rows, -1).numpy())).any(axis=1).astype(np.int8)
    elif x.dtype in _EXPONENT:
        mask = _EXPONENT[x.dtype]
        bits = x.reshape(rows, -1).view(torch.int16).numpy().view(np.uint16)
        flags |= ((bits & mask) == mask).any(axis=1).astype(np.int8)
    if x_scale is not None and x_scale.numel():
        s = x_scale.reshape(rows, -1).numpy()
        flags |= (~((s > 0) & np.isfinite(s)).all(axis=1)).astype(np.int8) << 1
    return flags


def not_finite_error(flags: np.ndarray):
    """The SPEC 2.2 ``not_finite`` error for a call whose rows carry ``flags``, or None."""
    raw = flags.tobytes()
    if raw.count(0) == len(raw):  # the usual answer, without numpy's per-call cost
        return None
    from moegemm.client._errors import NotFinite

    seen = int(np.bitwise_or.reduce(flags))
    # x first: a float x the server quantized also gets a bad scale from its NaN or Inf, and the
    # caller sent no x_scale to blame.
    if seen & BAD_X:
        return NotFinite("x holds NaN or Inf; bf16/fp16/fp32 inputs are finite")
    if seen & BAD_SCALE:
        return NotFinite("x_scale holds a NaN, Inf or a value <= 0; scales are finite and > 0")
    return None
