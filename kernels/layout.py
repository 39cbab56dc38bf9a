"""Weight layouts on the device: the MFMA B preshuffle of SPEC 1.3 and its inverse.

The trailing ``[N, K]`` of a weight tensor is viewed as
``(N0, NLane, K0, KLane, KPack) = (N/16, 16, K/64, 4, 16)`` and permuted to
``(N0, K0, KLane, NLane, KPack)``, so that one 16x64 tile of B is contiguous in
the order the MFMA lanes read it. Leading (group) dimensions are kept.
"""

from __future__ import annotations

import torch

_N_LANE = 16
_K_LANE = 4
_K_PACK = 16
_K_TILE = _K_LANE * _K_PACK  # 64


def _split(w: torch.Tensor, what: str) -> tuple[list[int], int, int]:
    if w.dim() < 2:
        raise ValueError(f"{what} needs a trailing [N, K], got shape {tuple(w.shape)}")
    *lead, n, k = w.shape
    if n % _N_LANE or k % _K_TILE:
        raise ValueError(
            f"{what} requires N % {_N_LANE} == 0 and K % {_K_TILE} == 0, got N={n}, K={k}"
        )
    return lead, n, k


def preshuffle(w: torch.Tensor) -> torch.Tensor:
    """Return a contiguous copy of ``w`` ``[..., N, K]`` in the MFMA B layout (SPEC 1.3)."""
    lead, n, k = _split(w, "preshuffle")
    d = len(lead)
    tiles = w.reshape(*lead, n // _N_LANE, _N_LANE, k // _K_TILE, _K_LANE, _K_PACK)
    order = [*range(d), d + 0, d + 2, d + 3, d + 1, d + 4]
    return tiles.permute(order).contiguous().reshape(w.shape)


def unshuffle(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`preshuffle`: a contiguous plain row-major ``[..., N, K]`` copy."""
    lead, n, k = _split(w, "unshuffle")
    d = len(lead)
    tiles = w.reshape(*lead, n // _N_LANE, k // _K_TILE, _K_LANE, _N_LANE, _K_PACK)
    # (N0, K0, KLane, NLane, KPack) -> (N0, NLane, K0, KLane, KPack)
    order = [*range(d), d + 0, d + 3, d + 1, d + 2, d + 4]
    return tiles.permute(order).contiguous().reshape(w.shape)
