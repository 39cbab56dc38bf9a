"""What every kernel backend provides (the seam between kernels and server)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal

import torch

WeightLayout = Literal["plain", "preshuffled"]

BLOCK = 128
"""Width of a scale block along K (and along N for weights): SPEC 1."""


def check_operands(xq, wq, x_scale, w_scale, m_sizes, out=None) -> tuple[int, int, int, int]:
    """The scales' and sizes' dtypes and :func:`operand_shapes`: ``(M, N, K, G)``, or
    TypeError / ValueError. Every entry that launches (the public function, each backend's
    ``run``) checks its operands here, then what only it needs (its fp8 format, the output
    dtypes it writes, contiguity, alignment). Reads no tensor contents."""
    for what, t in (("x_scale", x_scale), ("w_scale", w_scale)):
        if t.dtype != torch.float32:
            raise TypeError(f"{what} must be float32, got {t.dtype}")
    if m_sizes.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"m_sizes must be int64 or int32, got {m_sizes.dtype}")
    return operand_shapes(xq, wq, x_scale, w_scale, m_sizes, out)


def operand_shapes(xq, wq, x_scale, w_scale, m_sizes, out=None) -> tuple[int, int, int, int]:
    """SPEC 1's shapes of a grouped GEMM's operands (and ``out``'s if given): ``(M, N, K,
    G)``, or ValueError (the float64 oracle takes scales of any float dtype)."""
    if xq.dim() != 2:
        raise ValueError(f"xq must be 2-D [M, K], got shape {tuple(xq.shape)}")
    if wq.dim() != 3:
        raise ValueError(f"wq must be 3-D [G, N, K], got shape {tuple(wq.shape)}")
    m, k = xq.shape
    g, n, wk = wq.shape
    if wk != k:
        raise ValueError(f"wq's K ({wk}) differs from xq's K ({k})")
    if g < 1:
        raise ValueError("wq must hold at least one group (G >= 1)")
    if n < 1 or k < 1 or n % BLOCK or k % BLOCK:
        raise ValueError(f"N and K must be positive multiples of {BLOCK}, got N={n}, K={k}")
    expected = {
        "x_scale": (x_scale, (m, k // BLOCK)),
        "w_scale": (w_scale, (g, k // BLOCK, n // BLOCK)),
        "m_sizes": (m_sizes, (g,)),
    }
    if out is not None:
        expected["out"] = (out, (m, n))
    for what, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{what} must have shape {list(shape)}, got {list(t.shape)}")
    return m, n, k, g


def weight_addresses(wq: torch.Tensor, w_scale: torch.Tensor) -> tuple[int, int]:
    """``wq``'s and ``w_scale``'s base addresses: the two int64 words ``Backend.run_addressed``
    reads a weight set from. A server writes them into its graphs' buffers; a test or benchmark
    puts them on the device itself (``torch.tensor(weight_addresses(wq, w_scale), device=...)``).

    ``wq`` fp8 ``[G, N, K]`` (either e4m3 format, in the backend's weight layout) and
    ``w_scale`` float32 ``[G, K/128, N/128]``, both contiguous, on one device: a weight set as a
    server's store holds it (the kernel finds group g at g strides past each base). Raw
    addresses: the caller keeps the tensors alive while the words are in use.
    """
    shape = wq.shape  # once: a server checks the words at each launch
    if (wq.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) or len(shape) != 3 or not wq.is_contiguous()
            or w_scale.dtype != torch.float32 or not w_scale.is_contiguous()
            or w_scale.shape != (shape[0], shape[2] // BLOCK, shape[1] // BLOCK) or w_scale.device != wq.device):
        raise ValueError("launches by address need contiguous fp8 wq [G, N, K] and float32 w_scale "
                         f"[G, K/128, N/128] on one device, got {wq.dtype} {tuple(wq.shape)} and "
                         f"{w_scale.dtype} {tuple(w_scale.shape)}")
    return wq.data_ptr(), w_scale.data_ptr()


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this device or in this process."""


@dataclass(frozen=True)
class CompileAhead:
    """How a backend's kernels compile in another process, before a capture here needs them.

    - ``compile_only(share=(i, n))``: a context in which this thread's launches
      of the backend's kernels compile them into its on-disk cache and launch
      nothing (their outputs keep whatever they held): a process that compiles
      for another one runs the other's warm-ups under it. With ``n`` processes
      walking the same warm-ups, process ``i`` compiles its share of the
      kernels and each kernel is compiled in exactly one of them.
    - ``compiles()``: how many kernels this process has compiled so far; a
      kernel loaded from the on-disk cache does not count.
    - ``compiled_since(n)``: those compiled after the ``n``-th, each in a line
      (what a warning names; empty where the backend cannot say).
    """

    compile_only: Callable[..., AbstractContextManager[None]]
    compiles: Callable[[], int]
    compiled_since: Callable[[int], list[str]] = lambda _count: []


@dataclass(frozen=True)
class FfnKernels:
    """The expert FFN's kernels around its two GEMMs (``server/_ffn_graphs.py``), where a backend
    has them; the server runs its torch versions (same answers) where it has none.

    - ``silu_mul_quant(h, fp8_dtype, *, rows)``: SPEC 5.1's activation of the first ``rows``
      rows of ``h`` ``[rows, 2I]`` and its quantization: ``(hq, h_scale)``;
    - ``route(...)`` / ``combine(...)`` / ``quantize_scatter(...)``: moe's routing of tokens to
      per-expert rows, the weighted sum back per token, and bf16 tokens quantized once and
      stored at their k rows;
    - ``moe_token(...)``: a lone token's whole moe body in two kernels.

    Their arguments are the triton backend's (``_triton_route``, ``_triton_moe_token``); all
    are capture-safe.
    """

    silu_mul_quant: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    route: Callable[..., None]
    combine: Callable[..., None]
    quantize_scatter: Callable[..., None]
    moe_token: Callable[..., None]


@dataclass(frozen=True)
class Backend:
    """One way of computing the grouped GEMM on one device.

    ``prepare_weights`` runs once when a weight set is loaded and returns the
    weights in ``weight_layout``. ``run`` computes SPEC 1 into ``out`` and
    returns it; on a GPU it reads no tensor contents on the host, launches no
    helper kernels, and may be captured into a CUDA/HIP graph. ``run_plain``, required where
    ``weight_layout`` is preshuffled (None where it is plain): ``run`` on plain ``[G, N, K]``
    weights, what the public ``grouped_gemm`` runs instead of preparing the weights on every
    call.

    Optional, for a server's graphs (None where the backend has none):

    - ``run_addressed(xq, addresses, x_scale, m_sizes, out, *, groups, inputs=None,
      out_rows=None, flags=None)``: ``run`` with the weight set given as two int64 device
      words, the base addresses of its contiguous ``wq`` and ``w_scale`` (in
      that order): one graph captured per (G, N, K) then serves every weight
      set of that shape by rewriting the words. ``inputs``: two more words
      holding the activations' and scales' base addresses (``xq``/``x_scale``
      then give only shape and strides); ``out_rows``: int64 ``[M]``, row r
      stored at ``out[out_rows[r]]``. Same kernel, same tile, same bits as ``run``.
      ``flags`` (int8; only where ``checks_rows`` is True for the launch, and where
      ``persistent`` is too only with no ``out_rows``): the launch also writes each
      grouped row's scale check (``bad_rows`` of fp8 rows) at its stored place, so a
      lone call's graph needs no check kernel.
    - ``check_and_gather(x, x_scale, gather, x_out, scale_out, flags, *,
      regroup=None)``: one kernel that checks the rows' contents (the server's
      ``bad_rows``) and regroups them (``x_out = x[gather]``; not at all when
      the int64 device word ``regroup`` holds 0); capture-safe.
    - ``gather_quantize(x, gather, flags, (xq, x_scale))``: bf16 rows ``x[gather]``
      quantized (SPEC 1.1, ``quantize_activations`` bit for bit) into ``xq`` and
      ``x_scale``, and ``flags[gather[r]]`` set as ``bad_rows`` sets it, in one
      kernel; capture-safe.
    - ``persistent(m, n, k, g)``: whether a launch of ``m`` rows runs a persistent tile
      (one program per SM slot for the whole launch): a lone call's graph then stores
      its rows in place (they are in group order).
    - ``checks_rows(m, n, k, g)``: whether a bf16 launch of ``m`` rows can check the rows
      itself (``run_addressed``'s ``flags``): a lone call's graph is then that one kernel;
      where it cannot, the server's check kernel runs before it.
    - ``tile_key(m, n, k, g, out_dtype)``: a key of the tile (schedule, tile
      sizes, split-K) a launch of ``m`` rows runs: launches whose keys are
      equal compute each output row alike, bit for bit, whatever the other
      rows hold (the server merges expert calls only then, SPEC 5.1). A
      backend whose rows never depend on M returns one constant.
    - ``ffn``: the expert FFN's kernels around its GEMMs (:class:`FfnKernels`).
    - ``ahead``: the backend's kernels can be compiled in a separate process,
      into a cache this one then loads them from (:class:`CompileAhead`; the
      server compiles a new shape's kernels so, ``server/_ahead.py``). None:
      they compile in the process that launches them.
    """

    name: str
    device: torch.device
    fp8_dtype: torch.dtype
    weight_layout: WeightLayout
    prepare_weights: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    run: Callable[..., torch.Tensor]
    # run(xq, wq_prepared, x_scale, w_scale, m_sizes, out) -> out; out bf16 or float32
    capture_safe: bool = False
    run_plain: Callable[..., torch.Tensor] | None = None
    run_addressed: Callable[..., torch.Tensor] | None = None
    check_and_gather: Callable[..., None] | None = None
    gather_quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    tile_key: Callable[[int, int, int, int, torch.dtype], Hashable] | None = None
    persistent: Callable[[int, int, int, int], bool] | None = None
    checks_rows: Callable[[int, int, int, int], bool] | None = None
    ffn: FfnKernels | None = None
    ahead: CompileAhead | None = None

    def __post_init__(self) -> None:
        if (self.run_plain is None) != (self.weight_layout == "plain"):
            raise ValueError(
                f"backend {self.name!r}: run_plain is required with preshuffled weights and "
                "only with them"
            )
