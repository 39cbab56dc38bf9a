"""The FlyDSL backend: the grouped FP8 GEMM on AMD MI300 (gfx942) and MI350 (gfx950).

| tensor    | shape               | dtype                                 |
|-----------|---------------------|---------------------------------------|
| `xq`      | `[M, K]`            | e4m3fnuz (gfx942) / e4m3fn (gfx950)   |
| `wq`      | `[G, N, K]`         | same; plain or preshuffled (SPEC 1.3) |
| `x_scale` | `[M, K/128]`        | float32                               |
| `w_scale` | `[G, K/128, N/128]` | float32                               |
| `m_sizes` | `[G]`               | int64 or int32                        |
| `out`     | `[M, N]`            | bfloat16 or float32                   |

Two launchers, named for the weight layout they read: :func:`run_preshuffled`
(the MFMA B layout the server keeps resident, shuffled once at load) and
:func:`run_plain` (row-major ``[G, N, K]``). Both check the call, then launch
one kernel whose grid depends only on M, N and G; the group of each tile is
found inside the kernel, so a launch reads nothing on the host and can be
captured into a HIP graph. The kernel itself is in ``_flydsl_gemm.py``.

FlyDSL is imported lazily, on the first compile, and never into a process
that already imported Triton (each brings its own LLVM; MSLK reported one process
holding both crashing, which compile-only runs here with flydsl 0.5.0 and triton 3.6.0 do
not reproduce: they are kept apart as a precaution). :func:`create` is what the backend
selector calls. The backend's weights are preshuffled at load (the faster layout); the
public ``grouped_gemm`` runs the same kernel on plain weights (``Backend.run_plain``).

Tiles: :data:`DEFAULT_TILES` per arch; with ``MOEGEMM_AUTOTUNE=1`` the first
call of each (nextPow2(M), N, K, G, device) times :data:`AUTOTUNE_TILES` and
keeps the fastest in ``$MOEGEMM_CACHE_DIR/flydsl_<layout>_tiles.json`` (default
``~/.cache/moegemm``). The setting exists on AMD only: these tiles are compiled
here, never measured on AMD hardware, so a deployment measures its own (the
triton backend's table is measured on the H200 and nothing tunes it at run
time). Every tile passes :func:`check_tile` (the per-arch LDS budget) before it
is traced.

Operands keep their natural shapes (:func:`_jit_tensor`): FlyDSL packs each
extent as an int32 and each stride as an int64, so launches of any size the
server accepts pack (a DeepSeek-V3 layer's weights are 7.5e9 bytes);
:func:`pack_arguments` runs FlyDSL's own packing without a device.

Verification here: compiled and ISA-checked for gfx942 and gfx950 without a
GPU (:func:`compile_only`, driven by ``_flydsl_isa.py``), large launches
packed from meta tensors, and its own source executed on the CPU
(``testing_flydsl``: FlyDSL's names stood in for) against the float64 reference;
never executed on AMD hardware in this repository's CI.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import threading
from pathlib import Path

import torch

from ._backend import BLOCK, Backend, BackendUnavailable, check_operands
from ._flydsl_tiles import (
    AUTOTUNE_TILES,
    DEFAULT_TILES,
    FP8_DTYPE,
    LDS_BUDGET,
    MFMA_INSTRUCTION,
    SUPPORTED_ARCHS,
    WEIGHT_LAYOUTS,
    FlyTile,
    TileTooLarge,
    check_arch,
    check_tile,
    fit_tile,
)
from .layout import preshuffle

__all__ = [
    "AUTOTUNE_TILES",
    "DEFAULT_TILES",
    "FP8_DTYPE",
    "LDS_BUDGET",
    "MFMA_INSTRUCTION",
    "SUPPORTED_ARCHS",
    "FlyTile",
    "TileTooLarge",
    "autotune_key",
    "check_tile",
    "compile_only",
    "create",
    "device_arch",
    "run_plain",
    "run_preshuffled",
]

log = logging.getLogger(__name__)

_ALIGN = 16  # bytes: the kernel issues 16-byte vector loads from each base pointer

_lock = threading.Lock()
# (KernelShape, m_sizes dtype, device) -> CompiledFunction: FlyDSL loads the code object into the
# device current when it compiles, so each device has its own.
_launchers: dict[tuple, object] = {}
_arch_of: dict[torch.device, str] = {}
_tuned: dict[str, dict[str, FlyTile]] = {}  # layout -> autotune key -> winner


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _compile_only_mode() -> bool:
    return _env_flag("COMPILE_ONLY")


def _import_kernel_module():
    """Import FlyDSL and the kernel module, or raise BackendUnavailable. Once it is loaded, a
    later import of Triton by the caller changes nothing: the kernel module stays in use."""
    module = sys.modules.get("moegemm.kernels._flydsl_gemm")
    if module is not None:
        return module
    if "triton" in sys.modules:
        raise BackendUnavailable("flydsl cannot load: triton is already imported in this process")
    try:
        return importlib.import_module("moegemm.kernels._flydsl_gemm")
    except ImportError as exc:
        raise BackendUnavailable(f"flydsl cannot load: {exc}") from exc


def device_arch(device: torch.device) -> str:
    """The gfx target of ``device``: its ``gcnArchName``, or ``FLYDSL_GPU_ARCH`` in compile-only mode.

    Raises BackendUnavailable when the device is not a supported ROCm GPU.
    """
    if _compile_only_mode() and os.environ.get("FLYDSL_GPU_ARCH"):
        arch = os.environ["FLYDSL_GPU_ARCH"].strip().lower()
    else:
        if not torch.version.hip:
            raise BackendUnavailable(
                "flydsl needs a ROCm build of torch (torch.version.hip is unset)"
            )
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise BackendUnavailable(f"flydsl needs a ROCm GPU, got {device}")
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
    if arch not in SUPPORTED_ARCHS:
        raise BackendUnavailable(f"flydsl kernel targets {', '.join(SUPPORTED_ARCHS)}, not {arch}")
    return arch


def pin_target(arch: str) -> None:
    """Make FlyDSL compile for ``arch``, the device's (read from torch), before it loads.

    FlyDSL takes its target from ``ARCH``, then ``FLYDSL_GPU_ARCH`` or
    ``HSA_OVERRIDE_GFX_VERSION``, then ``rocm_agent_enumerator``, and else guesses
    gfx942: a host whose ``ARCH`` names its CPU (``x86_64``), or an MI350 container
    without the enumerator, would build code for another target. ``FLYDSL_GPU_ARCH``
    naming another gfx target than the device is refused (BackendUnavailable); a
    stray ``ARCH`` is overridden in this process, with a warning.
    """
    named = os.environ.get("FLYDSL_GPU_ARCH", "").strip().lower().split(":")[0]
    if named and named != arch:
        raise BackendUnavailable(f"FLYDSL_GPU_ARCH={named} but the device is {arch}")
    if not named:
        os.environ["FLYDSL_GPU_ARCH"] = arch
    stray = os.environ.get("ARCH")
    if stray is not None:
        if stray.strip().lower() != arch:
            log.warning("ARCH=%s is not this device's target (%s): FlyDSL compiles for %s",
                        stray, arch, arch)
        os.environ["ARCH"] = arch


def _arch(device: torch.device) -> str:
    arch = _arch_of.get(device)
    if arch is None:
        arch = _arch_of[device] = device_arch(device)
    return arch


# --------------------------------------------------------------------------- compile


_INT32_MAX = 2**31 - 1
# Room the launcher's int32 grid arithmetic needs above M + G: the tallest tile's rows.
_GRID_ROOM = max(t.block_m for t in AUTOTUNE_TILES)


def _jit_tensor(flyc, t: torch.Tensor):
    """``t`` with its natural shape, layout-dynamic, so one compile serves every M and G.

    FlyDSL packs every dynamic extent as an int32 and every dynamic stride as an
    int64. Flattened operands made ``G * N * K`` (or ``M * N``) an extent, which
    failed to pack past 2^31 (a DeepSeek-V3 layer is 7.5e9 weight bytes); with
    natural shapes each extent is one of M, G, N, K, K/128, N/128, each checked
    below 2^31 by :func:`_check_call`, and the large products are int64 strides.
    fp8 tensors travel as uint8 (the kernel moves bytes).
    """
    raw = t.view(torch.uint8) if t.element_size() == 1 else t
    return flyc.from_torch_tensor(raw, assumed_align=_ALIGN).mark_layout_dynamic()


def _operands(m: int, g: int, n: int, k: int, m_sizes_dtype: torch.dtype, device="meta",
              out_dtype: torch.dtype = torch.bfloat16):
    """Placeholder operands of a launch of these sizes (meta tensors: no memory)."""
    fp8 = torch.uint8
    return (
        torch.empty(m, k, dtype=fp8, device=device),
        torch.empty(g, n, k, dtype=fp8, device=device),
        torch.empty(m, k // BLOCK, dtype=torch.float32, device=device),
        torch.empty(g, k // BLOCK, n // BLOCK, dtype=torch.float32, device=device),
        torch.empty(g, dtype=m_sizes_dtype, device=device),
        torch.empty(m, n, dtype=out_dtype, device=device),
    )


def pack_arguments(launcher, tensors, m: int, g: int) -> list:
    """The kernel-argument slots FlyDSL fills for one launch, filled from ``tensors``.

    This runs FlyDSL's own host-side packing (its ``__c_abi_spec__`` fill of
    each argument, as every launch does) without a device or a compiled
    kernel, so a launch whose sizes cannot be packed fails here the way it
    would on a GPU (``struct.error``). Returns the filled ctypes storages in
    argument order: per tensor its pointer and its layout buffer (the int32
    extents, then the int64 strides), then M, G and the (null) stream.
    """
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl.compiler.jit_executor import build_abi_storage
    from flydsl.compiler.jit_function import _build_call_spec

    args = (*(_jit_tensor(flyc, t) for t in tensors), m, g, fx.Stream(None))
    launcher._ensure_sig()
    spec = [slot for slot in _build_call_spec(launcher._sig, args) if slot[2] is not None]
    storages, _ = build_abi_storage([ctype for _, ctype, _ in spec])
    for (index, _, fill), storage in zip(spec, storages, strict=True):
        fill(args[index], storage)
    return storages


_OUT_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _kernel_shape(module, arch: str, layout: str, tile: FlyTile, n: int, k: int,
                  out_dtype: torch.dtype = torch.bfloat16):
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
    tile = check_tile(fit_tile(tile, n, k), arch)
    return module.KernelShape(arch=arch, weight_layout=layout, tile=tile, n=n, k=k,
                              out_dtype=_OUT_DTYPES[out_dtype])


def compile_only(
    arch: str,
    layout: str,
    tile: FlyTile,
    n: int = 512,
    k: int = 1024,
    m_sizes_dtype: torch.dtype = torch.int64,
    *,
    m: int = 64,
    g: int = 4,
    out_dtype: torch.dtype = torch.bfloat16,
):
    """Trace and compile one kernel for ``arch`` without a GPU (FlyDSL's ``COMPILE_ONLY=1``).

    The arguments of a launch with ``m`` rows and ``g`` groups are packed first,
    through FlyDSL's own packing, from meta tensors of those sizes: any launch
    size can be checked with no memory. Returns the ``@flyc.jit`` launcher.

    The process must run with ``COMPILE_ONLY=1`` and ``FLYDSL_GPU_ARCH=arch``
    (FlyDSL reads the target from there) and a linker at
    ``$ROCM_PATH/llvm/bin/ld.lld``; ``FLYDSL_DEBUG_DUMP_ASM=1`` makes FlyDSL
    write the ISA. Raises TileTooLarge before tracing when ``tile`` exceeds the
    arch's LDS budget.
    """
    check_arch(arch)
    if not _compile_only_mode() or os.environ.get("FLYDSL_GPU_ARCH", "").lower() != arch:
        raise RuntimeError(
            f"compile_only needs COMPILE_ONLY=1 and FLYDSL_GPU_ARCH={arch} in the environment"
        )
    check_tile(fit_tile(tile, n, k), arch)  # before importing anything heavy
    module = _import_kernel_module()
    import flydsl.compiler as flyc

    shape = _kernel_shape(module, arch, layout, tile, n, k, out_dtype)
    _check_sizes(m, n, k, g)
    # Meta tensors: the sizes are real (a DeepSeek-V3 layer packs as it would on a
    # GPU) but nothing is allocated. Every tensor is layout-dynamic, so the code
    # compiled does not depend on M or G.
    tensors = _operands(m, g, n, k, m_sizes_dtype, out_dtype=out_dtype)
    launcher = module.build_launcher(shape)
    pack_arguments(launcher, tensors, m, g)
    flyc.compile(launcher, *(_jit_tensor(flyc, t) for t in tensors), m, g)
    return launcher


def _launch(shape_key, module, flyc, args: tuple, m: int, g: int, stream) -> None:
    """Run the compiled kernel for ``shape_key``, compiling (and launching) it on first use."""
    fn = _launchers.get(shape_key)
    if fn is not None:
        fn(*args, m, g, stream)
        return
    with _lock:
        fn = _launchers.get(shape_key)
        if fn is None:
            # flyc.compile launches once with live device arguments, so this call is the run.
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"flydsl kernel {shape_key[0]} is not compiled yet; run it once before graph capture"
                )
            launcher = module.build_launcher(shape_key[0])
            _launchers[shape_key] = flyc.compile(launcher, *args, m, g, stream)
            return
    fn(*args, m, g, stream)


# --------------------------------------------------------------------------- run


def _check_sizes(m: int, n: int, k: int, g: int) -> None:
    """Refuse sizes FlyDSL cannot pack: each extent (and the scalars M, G) is an int32, and
    the launcher's int32 grid, ``(M + block_m - 1) // block_m + G - 1``, must not wrap."""
    for what, size in (("M", m), ("N", n), ("K", k), ("G", g)):
        if size > _INT32_MAX:
            raise ValueError(f"{what} = {size} is past the int32 range the kernel's arguments use")
    if m + g + _GRID_ROOM > _INT32_MAX:
        raise ValueError(f"M + G = {m + g} leaves no room for the launch grid's int32 arithmetic")


def _check_call(xq, wq, x_scale, w_scale, m_sizes, out, fp8_dtype) -> None:
    """The cheap checks a launch needs; none reads tensor contents."""
    if xq.dtype != fp8_dtype or wq.dtype != fp8_dtype:
        raise TypeError(f"this device computes in {fp8_dtype}, got xq {xq.dtype} and wq {wq.dtype}")
    if out.dtype not in _OUT_DTYPES:  # float32: the expert FFN's h
        raise TypeError(f"the flydsl kernel writes bfloat16 or float32, got out {out.dtype}")
    _check_sizes(*check_operands(xq, wq, x_scale, w_scale, m_sizes, out))
    for what, t in (
        ("xq", xq),
        ("wq", wq),
        ("x_scale", x_scale),
        ("w_scale", w_scale),
        ("m_sizes", m_sizes),
        ("out", out),
    ):
        if not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        if t.data_ptr() % _ALIGN:
            raise ValueError(f"{what} must start on a {_ALIGN}-byte boundary")


def _run(layout: str, xq, wq, x_scale, w_scale, m_sizes, out, tile: FlyTile | None) -> torch.Tensor:
    arch = _arch(xq.device)
    _check_call(xq, wq, x_scale, w_scale, m_sizes, out, FP8_DTYPE[arch])
    m = xq.shape[0]
    g, n, k = wq.shape
    if m == 0:
        return out
    module = _import_kernel_module()
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    if tile is None:
        tile = _tile_for(layout, arch, xq, wq, x_scale, w_scale, m_sizes, out)
    shape = _kernel_shape(module, arch, layout, tile, n, k, out.dtype)
    args = tuple(_jit_tensor(flyc, t) for t in (xq, wq, x_scale, w_scale, m_sizes, out))
    stream = fx.Stream(torch.cuda.current_stream(xq.device))
    _launch((shape, m_sizes.dtype, xq.device), module, flyc, args, m, g, stream)
    return out


def run_preshuffled(
    xq, wq_shuffled, x_scale, w_scale, m_sizes, out, *, tile: FlyTile | None = None
):
    """SPEC 1 into ``out`` with weights in the MFMA B layout of SPEC 1.3; returns ``out``.

    ``tile`` overrides the default (or autotuned) tile; it is checked against the
    arch's LDS budget first and raises TileTooLarge if it does not fit.
    """
    return _run("preshuffled", xq, wq_shuffled, x_scale, w_scale, m_sizes, out, tile)


def run_plain(xq, wq, x_scale, w_scale, m_sizes, out, *, tile: FlyTile | None = None):
    """SPEC 1 into ``out`` with plain row-major ``[G, N, K]`` weights; returns ``out``."""
    return _run("plain", xq, wq, x_scale, w_scale, m_sizes, out, tile)


# --------------------------------------------------------------------------- autotune


def autotune_key(m: int, n: int, k: int, g: int, device_name: str,
                 out_dtype: torch.dtype = torch.bfloat16) -> str:
    """The autotune cache key: ``nextPow2(M):N:K:G:out:device name`` (out ``bf16`` or ``f32``:
    the float32 epilogue stores twice the bytes, so it has its own winner).

    The weight layout is not in the key: each layout has its own file.
    """
    m_bucket = 1 if m <= 1 else 1 << (m - 1).bit_length()
    return f"{m_bucket}:{n}:{k}:{g}:{_OUT_DTYPES[out_dtype]}:{device_name}"


def _cache_file(layout: str) -> Path:
    root = os.environ.get("MOEGEMM_CACHE_DIR") or Path.home() / ".cache" / "moegemm"
    return Path(root) / f"flydsl_{layout}_tiles.json"


def _load_tuned(layout: str) -> dict[str, FlyTile]:
    """The winners on disk for ``layout`` (read once per process)."""
    tuned = _tuned.get(layout)
    if tuned is None:
        try:
            raw = json.loads(_cache_file(layout).read_text())
            if not all(isinstance(value, list) and len(value) == 3
                       and all(type(size) is int and size > 0 for size in value)
                       for value in raw.values()):
                raise TypeError("a tile is a list of three positive int sizes")
            tuned = {key: FlyTile(*value) for key, value in raw.items()}
        except (OSError, ValueError, TypeError, AttributeError, RecursionError):
            # Unreadable, not a map of tiles, or nested past the parser: tuned again.
            tuned = {}
        _tuned[layout] = tuned
    return tuned


def _save_tuned(layout: str) -> None:
    path = _cache_file(layout)
    raw = {key: [t.block_m, t.block_n, t.block_k] for key, t in _tuned[layout].items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(raw, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new file
    except OSError as exc:
        log.warning("cannot save flydsl autotune results to %s: %s", path, exc)


def _tile_for(layout, arch, xq, wq, x_scale, w_scale, m_sizes, out) -> FlyTile:
    """The default tile, or with MOEGEMM_AUTOTUNE=1 the fastest candidate for this shape."""
    default = DEFAULT_TILES[arch]
    if not _env_flag("MOEGEMM_AUTOTUNE"):
        return default
    g, n, k = wq.shape
    key = autotune_key(xq.shape[0], n, k, g, torch.cuda.get_device_name(xq.device), out.dtype)
    tuned = _load_tuned(layout)
    if key in tuned and _runs(tuned[key], n, k, arch):  # else a file's bad entry: tuned again
        return tuned[key]
    if torch.cuda.is_current_stream_capturing():
        return default  # never benchmark inside a graph capture
    best, best_ms = default, float("inf")
    for tile in AUTOTUNE_TILES:
        if not _runs(tile, n, k, arch):
            continue
        ms = _time_tile(layout, tile, xq, wq, x_scale, w_scale, m_sizes, out)
        log.info("flydsl autotune %s: tile %s %.4f ms", key, tile, ms)
        if ms < best_ms:
            best, best_ms = tile, ms
    tuned[key] = best
    _save_tuned(layout)
    return best


def _runs(tile: FlyTile, n: int, k: int, arch: str) -> bool:
    """Whether ``tile``, fitted to N and K, is well formed and fits ``arch``'s LDS."""
    try:
        check_tile(fit_tile(tile, n, k), arch)
    except ValueError:  # TileTooLarge included
        return False
    return True


def _time_tile(layout, tile, xq, wq, x_scale, w_scale, m_sizes, out, reps: int = 5) -> float:
    """Median milliseconds of one launch with ``tile`` (after a compile-and-warm-up run)."""
    run = run_preshuffled if layout == "preshuffled" else run_plain
    run(xq, wq, x_scale, w_scale, m_sizes, out, tile=tile)
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(xq, wq, x_scale, w_scale, m_sizes, out, tile=tile)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


# --------------------------------------------------------------------------- backend


def _prepare_weights(wq: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return preshuffle(wq), w_scale.contiguous()


def create(device: torch.device) -> Backend:
    """The FlyDSL Backend for a ROCm ``device`` (gfx942 or gfx950); BackendUnavailable otherwise."""
    device = torch.device(device)
    arch = device_arch(device)
    pin_target(arch)
    _import_kernel_module()  # fail here, in the selector, rather than on the first request

    def run(xq, wq_prepared, x_scale, w_scale, m_sizes, out):
        return run_preshuffled(xq, wq_prepared, x_scale, w_scale, m_sizes, out)

    return Backend(
        name="flydsl",
        device=device,
        fp8_dtype=FP8_DTYPE[arch],
        weight_layout="preshuffled",
        prepare_weights=_prepare_weights,
        run=run,
        run_plain=run_plain,
        capture_safe=True,
    )
