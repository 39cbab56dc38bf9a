"""One kernel at the head of each captured graph: check the rows, regroup them.

Every launch first checks what the callers' rows hold (``_checks.bad_rows``:
NaN/Inf in 16-bit rows, scales that are not finite and > 0) and puts the rows
in per-expert order (``gather``). A lone call's rows are already in that
order: with a ``regroup`` word that holds 0 the kernel only checks (the GEMM
then reads the rows where they arrived), so the graph moves no row twice. In torch that is about fifteen small kernels
per graph (comparisons, reductions, casts, two ``index_select``), each a few
microseconds of a lone call's latency; here it is one program per row that
reads the row once, copies it (and its scales) to its place and writes its
flags. The answer is the same, bit for bit (``tests/server/test_prologue.py``
on a GPU); the CPU and backends without Triton keep the torch ops.

The triton backend hands it to the server (``Backend.check_and_gather``); only imported
with that backend: never into a process holding FlyDSL.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Exponent bits of the 16-bit floats: all ones is Inf or NaN.
_EXPONENT = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


@triton.jit
def _check_gather(x_ptr, xs_ptr, gather_ptr, xg_ptr, xsg_ptr, flags_ptr, regroup_ptr, gather_stride,
                  K: tl.constexpr, KB: tl.constexpr, FLOAT16: tl.constexpr, EXPONENT: tl.constexpr,
                  HAS_SCALE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                  HAS_REGROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = tl.load(gather_ptr + row * gather_stride).to(tl.int64)
    if HAS_REGROUP:
        copy = tl.load(regroup_ptr) != 0
    else:
        copy = row >= 0  # always
    seen = tl.zeros([BLOCK_K], dtype=tl.int32)
    if FLOAT16:
        # 16-bit rows are checked for NaN/Inf (the server quantizes them), copied or not.
        for k0 in tl.static_range(0, K, BLOCK_K):  # K is one per weight-set shape
            offs = k0 + tl.arange(0, BLOCK_K)
            inside = offs < K
            bits = tl.load(x_ptr + src * K + offs, mask=inside, other=0)
            tl.store(xg_ptr + row * K + offs, bits, mask=inside & copy)
            seen = seen | ((bits & EXPONENT) == EXPONENT).to(tl.int32)
    elif copy:
        # fp8 rows: SPEC 2.2 checks their scales, not their codes; read only to regroup.
        for k0 in tl.static_range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            inside = offs < K
            tl.store(xg_ptr + row * K + offs, tl.load(x_ptr + src * K + offs, mask=inside), mask=inside)
    flag = tl.max(seen, axis=0)
    if HAS_SCALE:
        offs = tl.arange(0, BLOCK_S)
        inside = offs < KB
        scale = tl.load(xs_ptr + src * KB + offs, mask=inside, other=1.0)
        tl.store(xsg_ptr + row * KB + offs, scale, mask=inside & copy)
        # NaN fails both comparisons; +Inf fails the second (the largest float32).
        good = (scale > 0.0) & (scale <= 3.4028234663852886e38)
        flag = flag | (tl.max((~good).to(tl.int32), axis=0) << 1)
    tl.store(flags_ptr + src, flag.to(tl.int8))


def check_and_gather(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    gather: torch.Tensor,
    x_out: torch.Tensor,
    scale_out: torch.Tensor | None,
    flags: torch.Tensor,
    *,
    regroup: torch.Tensor | None = None,
) -> None:
    """``x_out = x[gather]``, ``scale_out = x_scale[gather]``, ``flags = bad_rows(x, x_scale)``.

    ``x`` ``[rows, K]`` (fp8 of either format, bf16 or fp16) and ``x_scale``
    ``[rows, K/128]`` float32 (or None) are contiguous CUDA tensors; ``gather``
    is ``[rows]`` int64 (any stride), a permutation of ``range(rows)``;
    ``flags`` ``[rows]`` int8 is indexed like ``x`` (input order). No host
    reads: capture-safe. ``regroup``: an int64 device word read at run time; 0 means
    only the flags are written (``gather`` is the identity and ``x_out`` unused).
    """
    rows, K = x.shape
    if rows == 0:
        return
    float16 = x.dtype in _EXPONENT
    if not float16 and x.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        raise TypeError(f"x must be fp8, bf16 or fp16, got {x.dtype}")
    view = torch.int16 if float16 else torch.uint8
    has_scale = x_scale is not None
    KB = x_scale.shape[1] if has_scale else 1
    _check_gather[(rows,)](
        x.view(view), x_scale if has_scale else x.view(view), gather, x_out.view(view),
        scale_out if has_scale else x_out.view(view), flags, gather if regroup is None else regroup,
        gather.stride(0), K=K, KB=KB,
        FLOAT16=float16, EXPONENT=_EXPONENT.get(x.dtype, 0), HAS_SCALE=has_scale,
        BLOCK_K=min(4096, triton.next_power_of_2(K)), BLOCK_S=triton.next_power_of_2(KB),
        HAS_REGROUP=regroup is not None, num_warps=4,
    )
