"""Fast host checks of request tensors (SPEC 2.2 ``not_finite``), in numpy.

The engine validates every call on the event loop before queueing it, so these
scans sit on the request path. On a [128, 7168] fp8 call, torch's elementwise
ops on a busy host cost milliseconds (thread-pool dispatch per op); one numpy
pass over the same bytes costs tens of microseconds. The checks read the
tensors' own memory (no copies of the data) and answer exactly what the torch
versions in ``_tensors.py`` answer.
"""

from __future__ import annotations

import numpy as np
import torch

# Exponent masks: all ones means Inf or NaN.
_EXPONENT = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def fp8_has_nan(t: torch.Tensor) -> bool:
    """Whether fp8 data holds a NaN encoding (e4m3fn: 0x7F/0xFF; e4m3fnuz: 0x80)."""
    if t.numel() == 0:
        return False
    raw = _bytes(t)
    if t.dtype == torch.float8_e4m3fn:
        return bool(np.any((raw & 0x7F) == 0x7F))
    if t.dtype == torch.float8_e4m3fnuz:
        return bool(np.any(raw == 0x80))
    raise TypeError(f"not an fp8 e4m3 dtype: {t.dtype}")


def scales_ok(t: torch.Tensor) -> bool:
    """Whether every float32 scale is finite and > 0 (NaN fails ``> 0``)."""
    if t.numel() == 0:
        return True
    a = t.detach().reshape(-1).numpy()
    return bool(np.all(a > 0) and np.all(np.isfinite(a)))


def floats_finite(t: torch.Tensor) -> bool:
    """Whether a bf16/fp16/fp32 tensor holds no NaN or Inf."""
    if t.numel() == 0:
        return True
    if t.dtype == torch.float32:
        return bool(np.all(np.isfinite(t.detach().reshape(-1).numpy())))
    mask = _EXPONENT.get(t.dtype)
    if mask is None:
        raise TypeError(f"not a bf16/fp16/fp32 tensor: {t.dtype}")
    bits = t.detach().reshape(-1).view(torch.int16).numpy().view(np.uint16)
    return not bool(np.any((bits & mask) == mask))
