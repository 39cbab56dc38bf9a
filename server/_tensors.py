"""Wire tensors to torch and back, and the checks every tensor input shares.

The wire format itself (msgpack maps, SPEC 2) lives in ``moegemm.client._wire``;
this module only bridges a checked ``WireTensor`` to torch without copying (weight
uploads), and holds the dtype tables and the checks the store uses. Gemm calls
are checked by ``_request.py`` alone.
"""

from __future__ import annotations

import torch
from moegemm.client._errors import BadDtype, BadShape, NotFinite
from moegemm.client._wire import DTYPES

# SPEC 2's dtype names are torch's attribute names (``client/_wire.DTYPES``).
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
WIRE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def to_torch(wire) -> torch.Tensor:
    """A CPU torch view of a checked wire tensor (``_wire.check_tensor``: a known dtype,
    its bytes exactly the shape's, dims torch can lay out), no copy; do not write to it.

    The body's bytes are immutable, so torch warns once per process that the
    tensor is not writable; nothing in the server writes to its inputs.
    """
    dtype, shape = TORCH_DTYPES[wire.dtype], tuple(wire.shape)
    if len(wire.data) == 0:
        return torch.empty(shape, dtype=dtype)
    # Read the bytes as the dtype at once (one torch call instead of three).
    return torch.frombuffer(wire.data, dtype=dtype).view(shape)


def require_dtype(t: torch.Tensor, allowed: tuple[torch.dtype, ...], what: str) -> None:
    """Raise BadDtype unless ``t.dtype`` is one of ``allowed``."""
    if t.dtype not in allowed:
        names = ", ".join(WIRE_NAMES[d] for d in allowed)
        raise BadDtype(f"{what} is {str(t.dtype).removeprefix('torch.')}; expected one of: {names}")


def require_shape(t: torch.Tensor, shape: tuple[int, ...], what: str, meaning: str) -> None:
    """Raise BadShape unless ``t`` has exactly ``shape`` (``meaning`` names the axes)."""
    if tuple(t.shape) != tuple(shape):
        raise BadShape(f"{what} has shape {list(t.shape)}; expected {list(shape)} ({meaning})")


def require_positive_finite_scales(scale: torch.Tensor, what: str) -> None:
    """Raise NotFinite unless every scale is finite and > 0 (NaN fails both tests)."""
    if scale.numel() and not bool(((scale > 0) & torch.isfinite(scale)).all()):
        raise NotFinite(f"{what} holds a NaN, Inf or a value <= 0; scales are finite and > 0")


def to_backend_fp8(
    q: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert fp8 data and its scales to the format the device computes in (SPEC 1.2)."""
    from moegemm.kernels import fn_to_fnuz, fnuz_to_fn

    if q.dtype == fp8_dtype:
        return q, scale
    if fp8_dtype == torch.float8_e4m3fnuz:
        return fn_to_fnuz(q, scale)
    return fnuz_to_fn(q, scale)
