"""The torch reference backend and the float64 oracle (SPEC 1).

``grouped_gemm`` evaluates the SPEC formula in the order the GPU kernels do: per
128-wide K block a dot product (exact), scaled by ``x_scale[r, kb] * w_scale[g, kb, n // 128]``
(in float64, rounded once to float32), the blocks summed in float32, the sum cast to
bfloat16 (or kept float32 when ``out`` is float32). It runs on any device, reads ``m_sizes`` on the host (so it is not
capture-safe) and handles every valid input: M = 0, empty groups, any G.

``reference_float64`` is the same formula in float64: the oracle of the tests.
``ffn_reference_float64`` and ``moe_reference_float64`` evaluate the expert
FFN chain of SPEC 5.1 and 5.2 in float64 on top of it.
"""

from __future__ import annotations

import torch

from ._backend import BLOCK, Backend, check_operands, operand_shapes

# Rows per chunk are chosen so the [K/128, rows, N] float32 block products stay
# near this many elements (~128 MiB): fast batched matmuls without a memory blow-up
# at K = 7168, N = 4096.
_CHUNK_ELEMENTS = 1 << 25

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _host_sizes(m_sizes: torch.Tensor, rows: int) -> list[int]:
    sizes = [int(s) for s in m_sizes.tolist()]
    if any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(f"m_sizes must be >= 0 and sum to M={rows}, got {sizes}")
    return sizes


def _check_fp8(xq, wq) -> None:
    # The public entry checks the full contract; the backend and the oracle guard direct
    # callers (tests, the server) against the mistakes that would silently give garbage.
    if xq.dtype not in _FP8_DTYPES or wq.dtype not in _FP8_DTYPES:
        raise TypeError(f"xq and wq must be fp8 e4m3, got {xq.dtype} and {wq.dtype}")


def grouped_gemm(
    xq: torch.Tensor,
    wq: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    m_sizes: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """SPEC 1 in plain torch: bf16 ``[M, N]`` from plain ``[G, N, K]`` weights.

    Writes into ``out`` (bf16 ``[M, N]``, or float32: the float32 sum
    unrounded) when given and returns it.
    """
    _check_fp8(xq, wq)
    check_operands(xq, wq, x_scale, w_scale, m_sizes, out)
    m, k = xq.shape
    _, n, _ = wq.shape
    kb = k // BLOCK
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device)
    chunk = max(1, _CHUNK_ELEMENTS // (kb * n))
    start = 0
    for group, rows in enumerate(_host_sizes(m_sizes, m)):
        if rows == 0:
            continue
        # [kb, 128, N]: each K block of this expert's weights, ready for bmm.
        w = wq[group].double().reshape(n, kb, BLOCK).permute(1, 2, 0)
        ws = w_scale[group].double()  # [kb, N / 128]
        for lo in range(start, start + rows, chunk):
            hi = min(lo + chunk, start + rows)
            x = xq[lo:hi].double().reshape(hi - lo, kb, BLOCK).transpose(0, 1)  # [kb, rows, 128]
            # The dot per K block is exact in float64 (128 products of two fp8 values,
            # multiples of 2^-18 below 2^43), so every row's answer is the same bits however
            # many rows share the launch (a float32 bmm's kernel, and so its summation order,
            # changes with the row count).
            partial = torch.bmm(x, w)  # [kb, rows, N]
            # Scaled in float64 by the two scales' product (exact there), per 128 columns, then
            # rounded once to float32: no step can leave float32's range where the answer is
            # inside it (x_scale 1e35 with w_scale 1e-35: SPEC 1's finite answer).
            scale = x_scale[lo:hi].double().t().unsqueeze(2) * ws.unsqueeze(1)  # [kb, rows, N / 128]
            partial.view(kb, hi - lo, n // BLOCK, BLOCK).mul_(scale.unsqueeze(3))
            partial = partial.float()
            acc = partial[0]
            for block in range(1, kb):  # the K blocks summed in order, whatever the shape
                acc += partial[block]
            out[lo:hi] = acc.to(out.dtype)
        start += rows
    return out


def reference_float64(
    xq: torch.Tensor,
    wq: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    m_sizes: torch.Tensor,
) -> torch.Tensor:
    """The SPEC 1 formula evaluated in float64: ``[M, N]`` float64, the test oracle.

    ``wq`` is plain ``[G, N, K]``. The scales are folded into the operands before
    one float64 matmul per group: the same sum as the SPEC, at float64 rounding.
    """
    _check_fp8(xq, wq)
    operand_shapes(xq, wq, x_scale, w_scale, m_sizes)
    m, k = xq.shape
    _, n, _ = wq.shape
    kb = k // BLOCK
    out = torch.zeros((m, n), dtype=torch.float64, device=xq.device)
    start = 0
    for group, rows in enumerate(_host_sizes(m_sizes, m)):
        if rows == 0:
            continue
        stop = start + rows
        x = xq[start:stop].double().reshape(rows, kb, BLOCK)
        x = (x * x_scale[start:stop].double().unsqueeze(2)).reshape(rows, k)
        w = wq[group].double().reshape(n // BLOCK, BLOCK, kb, BLOCK)
        # w_scale[g, kb, nb] scales weight block (nb, kb).
        w = w * w_scale[group].double().t().reshape(n // BLOCK, 1, kb, 1)
        out[start:stop] = x @ w.reshape(n, k).t()
        start = stop
    return out


def _quantize_float64(a: torch.Tensor, fp8_dtype: torch.dtype):
    """SPEC 1.1 activation quantization of float64 ``a`` ``[M, K]``, scales in float64."""
    from .quant import fp8_max, fp8_nearest

    m, k = a.shape
    blocks = a.reshape(m, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / fp8_max(fp8_dtype)
    aq = fp8_nearest(blocks / scale, fp8_dtype).reshape(m, k)
    return aq, scale.reshape(m, k // BLOCK)


def ffn_reference_float64(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w13q: torch.Tensor,
    w13_scale: torch.Tensor,
    w2q: torch.Tensor,
    w2_scale: torch.Tensor,
    m_sizes: torch.Tensor,
    fp8_dtype: torch.dtype,
) -> torch.Tensor:
    """SPEC 5.1 in float64: ``[M, H]`` float64 for rows grouped per expert.

    ``h`` (the w13 GEMM) and ``a = silu(h[:I]) * h[I:]`` stay unrounded in
    float64; ``aq`` is quantized from that ``a`` in ``fp8_dtype`` (the format
    the device computes in), and the w2 GEMM is the float64 SPEC 1 formula.
    """
    h = reference_float64(xq, w13q, x_scale, w13_scale, m_sizes)
    inter = w13q.shape[1] // 2
    if w2q.dim() != 3 or w2q.shape[2] != inter or w2q.shape[0] != w13q.shape[0]:
        raise ValueError(
            f"w2 must be [G, H, I] = [{w13q.shape[0]}, {xq.shape[1]}, {inter}], "
            f"got {tuple(w2q.shape)}"
        )
    gate, up = h[:, :inter], h[:, inter:]
    a = gate / (1.0 + torch.exp(-gate)) * up
    aq, a_scale = _quantize_float64(a, fp8_dtype)
    return reference_float64(aq, w2q, a_scale, w2_scale, m_sizes)


def moe_reference_float64(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w13q: torch.Tensor,
    w13_scale: torch.Tensor,
    w2q: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fp8_dtype: torch.dtype,
) -> torch.Tensor:
    """SPEC 5.2 in float64: ``out[t] = sum_j topk_weights[t, j] * ffn_{topk_ids[t, j]}(x[t])``.

    ``xq`` ``[T, H]`` fp8 with ``x_scale`` (quantize bf16 inputs first, as the
    server does); ``topk_ids`` ``[T, k]`` in ``[0, G)``; returns float64 ``[T, H]``.
    """
    tokens, k = topk_ids.shape
    groups = w13q.shape[0]
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    rows = order // k  # the token each expert row comes from
    m_sizes = torch.bincount(flat, minlength=groups)
    y = ffn_reference_float64(xq[rows], x_scale[rows], w13q, w13_scale, w2q, w2_scale,
                              m_sizes, fp8_dtype)
    weights = topk_weights.reshape(-1).double()[order]
    out = torch.zeros((tokens, xq.shape[1]), dtype=torch.float64, device=xq.device)
    return out.index_add_(0, rows, y * weights.unsqueeze(1))


def _prepare_weights(wq: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return wq.contiguous(), w_scale.contiguous()


def _run(xq, wq, x_scale, w_scale, m_sizes, out):
    return grouped_gemm(xq, wq, x_scale, w_scale, m_sizes, out)


def create(device: torch.device) -> Backend:
    """The reference backend for ``device`` (any device torch runs on)."""
    return Backend(
        name="reference",
        device=torch.device(device),
        fp8_dtype=torch.float8_e4m3fn,
        weight_layout="plain",
        prepare_weights=_prepare_weights,
        run=_run,
        capture_safe=False,
        tile_key=_one_tile,
    )


def _one_tile(m: int, n: int, k: int, g: int, out_dtype: torch.dtype) -> str:
    # Every row's bits are independent of the other rows (see grouped_gemm).
    return "reference"
