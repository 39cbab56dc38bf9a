"""The backend selector: one backend per device, chosen once, lazily.

``MOEGEMM_BACKEND`` (or an explicit ``name``) is one of ``auto``, ``reference``,
``triton``, ``flydsl``. ``auto`` picks the reference on CPU; on ROCm it tries
FlyDSL, on NVIDIA CUDA Triton (our Triton kernels are Hopper's: ``triton_kernel``
refuses ROCm, so trying it there would only load Triton's LLVM into the process);
the reference is the last resort, with a warning. An explicitly named GPU backend
that cannot load raises :class:`BackendUnavailable` instead of falling back.

GPU backend modules are imported only when tried, and never both: FlyDSL and
Triton each bring their own LLVM, and MSLK reported one process holding both
crashing (not reproduced in compile-only runs here; kept apart as a precaution).
Once either library is imported, or either backend created, the other is not tried.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading

import torch

from . import reference
from ._backend import Backend, BackendUnavailable

log = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "reference", "triton", "flydsl")

# backend name -> (module that defines create(), the third-party library it pulls in)
_GPU_BACKENDS = {
    "triton": ("moegemm.kernels.triton_kernel", "triton"),
    "flydsl": ("moegemm.kernels.flydsl_kernel", "flydsl"),
}
_RIVAL = {"triton": "flydsl", "flydsl": "triton"}

_lock = threading.Lock()
_cache: dict[tuple[torch.device, str], Backend] = {}
# The GPU backend created in this process, if any: a backend may import its
# library late (FlyDSL on the first compile), so sys.modules alone is not enough.
_created_gpu: set[str] = set()


def _normalize(device: torch.device | str | int) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # "cuda" and "cuda:0" must share one cache entry.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _requested(name: str | None) -> str:
    name = (name or os.environ.get("MOEGEMM_BACKEND") or "auto").strip().lower()
    if name not in BACKEND_NAMES:
        raise ValueError(f"MOEGEMM_BACKEND must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    return name


def _load_gpu(name: str, device: torch.device) -> Backend:
    """Import one GPU backend module and create its Backend, or raise BackendUnavailable."""
    module_name, _ = _GPU_BACKENDS[name]
    rival = _RIVAL[name]
    rival_library = _GPU_BACKENDS[rival][1]
    if rival_library in sys.modules and name not in _created_gpu:
        # (Once this backend runs here, a caller's later import of the rival changes nothing.)
        raise BackendUnavailable(
            f"{name} cannot load: {rival_library} is already imported in this process"
        )
    if rival in _created_gpu:
        raise BackendUnavailable(f"{name} cannot load: this process already runs {rival}")
    problem = _device_problem(name, device)
    if problem is not None:
        raise BackendUnavailable(problem)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(f"{name} cannot load: {exc}") from exc
    backend = module.create(device)
    _created_gpu.add(name)
    return backend


def _choose(device: torch.device, requested: str) -> Backend:
    if requested == "reference":
        return reference.create(device)
    if requested in _GPU_BACKENDS:
        return _load_gpu(requested, device)
    if device.type != "cuda":
        return reference.create(device)
    name = "flydsl" if torch.version.hip else "triton"
    try:
        return _load_gpu(name, device)
    except BackendUnavailable as exc:
        log.warning("backend %s unavailable on %s: %s", name, device, exc)
    log.warning("no GPU backend loads on %s: using the slow reference backend", device)
    return reference.create(device)


def get_backend(device: torch.device | str | int, name: str | None = None) -> Backend:
    """The backend that computes the grouped GEMM on ``device``.

    Chosen on the first call for the device (``name``, else ``MOEGEMM_BACKEND``,
    else ``auto``) and cached for the life of the process. Raises
    :class:`BackendUnavailable` when an explicitly requested backend cannot run,
    and ``ValueError`` for an unknown name.
    """
    device = _normalize(device)
    requested = _requested(name)
    key = (device, requested)
    with _lock:
        backend = _cache.get(key)
        if backend is None:
            backend = _choose(device, requested)
            log.info("grouped GEMM backend on %s: %s", device, backend.name)
            _cache[key] = backend
        return backend


def backend_refusal(device: torch.device | str | int, name: str | None = None) -> str | None:
    """Why :func:`get_backend` must refuse ``device`` with this name (else ``MOEGEMM_BACKEND``),
    found without importing a GPU library: an unknown name, or a GPU backend named for the
    CPU. None when it may succeed (a GPU backend can still fail to import)."""
    try:
        requested = _requested(name)
    except ValueError as exc:
        return str(exc)
    problem = _device_problem(requested, torch.device(device)) if requested in _GPU_BACKENDS else None
    return None if problem is None else f"MOEGEMM_BACKEND={problem}"


def _device_problem(name: str, device: torch.device) -> str | None:
    """Why GPU backend ``name`` cannot run on ``device``, or None."""
    return None if device.type == "cuda" else f"{name} needs a CUDA or ROCm device, got {device}"


def _clear_cache() -> None:
    """Forget every choice (for tests that change MOEGEMM_BACKEND)."""
    with _lock:
        _cache.clear()
        _created_gpu.clear()
