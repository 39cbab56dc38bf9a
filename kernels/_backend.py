"""What every kernel backend provides (the seam between kernels and server)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

WeightLayout = Literal["plain", "preshuffled"]


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this device or in this process."""


@dataclass(frozen=True)
class Backend:
    """One way of computing the grouped GEMM on one device.

    ``prepare_weights`` runs once when a weight set is loaded and returns the
    weights in ``weight_layout``. ``run`` computes SPEC 1 into ``out`` and
    returns it; on a GPU it reads no tensor contents on the host, launches no
    helper kernels, and may be captured into a CUDA/HIP graph.
    """

    name: str
    device: torch.device
    fp8_dtype: torch.dtype
    weight_layout: WeightLayout
    prepare_weights: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    run: Callable[..., torch.Tensor]
    # run(xq, wq_prepared, x_scale, w_scale, m_sizes, out) -> out
    capture_safe: bool = False
