"""The Triton kernel reading its weight addresses from a device table (graph sharing).

A CUDA graph freezes kernel arguments, weight pointers included, so a graph
captured for one weight set cannot serve another. This launcher runs the
triton backend's kernel body (``grouped_fp8_kernel``, unchanged) from a thin
wrapper kernel that first loads the ``wq`` and ``w_scale`` addresses from a
two-entry int64 device table. The graph pool rewrites the table (16 bytes,
stream-ordered) before each replay, so one graph per ``(G, N, K)`` and bucket
serves every weight set of that shape.

Seam note: this belongs in ``kernels/`` as ``Backend.run_table``; it lives here
until the triton backend offers it, and is used only when it does not.
Tile configurations come from the backend's table (``default_config``), never
from autotuning: tuning would benchmark inside a capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from moegemm.kernels import triton_kernel as tk
from moegemm.kernels._triton_gemm import grouped_fp8_kernel


@triton.jit
def grouped_fp8_table_kernel(
    x_ptr, table_ptr, xs_ptr, m_sizes_ptr, out_ptr,
    M, N, K, G,
    stride_xm, stride_wg, stride_wn, stride_xsm, stride_wsg, stride_wsk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    G_POW2: tl.constexpr, SWAP_AB: tl.constexpr, EVICT_W: tl.constexpr,
    GROUP_TILES_M: tl.constexpr, PRELOAD_SCALES: tl.constexpr, SCALE_CHUNK: tl.constexpr,
):
    """``grouped_fp8_kernel`` with ``w_ptr = table[0]``, ``ws_ptr = table[1]``."""
    w_ptr = tl.load(table_ptr).to(tl.pointer_type(tl.float8e4nv))
    ws_ptr = tl.load(table_ptr + 1).to(tl.pointer_type(tl.float32))
    # Loaded addresses carry no alignment facts; the weights and scales are
    # allocator blocks (256-byte aligned), and 16 keeps the loads vectorised.
    w_ptr = tl.multiple_of(w_ptr, 16)
    ws_ptr = tl.multiple_of(ws_ptr, 16)
    grouped_fp8_kernel(
        x_ptr, w_ptr, xs_ptr, ws_ptr, m_sizes_ptr, out_ptr,
        M, N, K, G,
        stride_xm, stride_wg, stride_wn, stride_xsm, stride_wsg, stride_wsk, stride_om,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, G_POW2=G_POW2, SWAP_AB=SWAP_AB,
        EVICT_W=EVICT_W, GROUP_TILES_M=GROUP_TILES_M, PRELOAD_SCALES=PRELOAD_SCALES,
        SCALE_CHUNK=SCALE_CHUNK,
    )


def run_table(xq: torch.Tensor, table: torch.Tensor, x_scale: torch.Tensor,
              m_sizes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """SPEC 1 into ``out`` with contiguous ``[G, N, K]`` weights found through ``table``.

    ``table`` is int64 ``[2]`` on the device: the addresses of ``wq`` (fp8
    e4m3fn, contiguous ``[G, N, K]``) and ``w_scale`` (float32, contiguous
    ``[G, K/128, N/128]``). G, N, K come from ``m_sizes``, ``out`` and ``xq``.
    """
    m, k = xq.shape
    g, n = m_sizes.shape[0], out.shape[1]
    if m == 0:
        return out
    config = tk.default_config(m, n, k, g)
    num_m = tk.row_tile_bound(m, g, config.block_m)
    kb, nb = k // 128, n // 128
    grouped_fp8_table_kernel[(num_m * (n // config.block_n),)](
        xq, table, x_scale, m_sizes, out,
        m, n, k, g,
        xq.stride(0), n * k, k, x_scale.stride(0), kb * nb, nb, out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        G_POW2=max(16, tk._next_pow2(g)), SWAP_AB=config.swap_ab, EVICT_W=config.evict_w,
        GROUP_TILES_M=config.group_tiles_m,
        # Mirrors tk.launch: keep in step with the backend's own launcher.
        PRELOAD_SCALES=config.preload_scales and config.block_n <= 128,
        SCALE_CHUNK=min(config.scale_chunk, tk._next_pow2(kb)),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
