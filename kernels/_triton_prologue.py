"""One kernel at the head of a captured graph: check the rows, regroup them.

A launch first checks what the callers' rows hold (``_checks.bad_rows``:
NaN/Inf in 16-bit rows, scales that are not finite and > 0) and puts the rows
in per-expert order (``gather``); a lone fp8 call skips it where its GEMM checks
the rows' scales itself (``triton_kernel.run_addressed``'s ``flags``; every tile
but ``persistent_ws``: ``checks_rows``). A lone
call's rows are already in that order: in a graph that serves lone and merged
calls alike, a ``regroup`` word that holds 0 makes the kernel only check (the
GEMM then reads the rows where they arrived), so the graph moves no row twice. In torch that is about fifteen small kernels
per graph (comparisons, reductions, casts, two ``index_select``), each a few
microseconds of a lone call's latency; here it is one kernel that reads each
row once, copies it (and its scales) to its place and writes its flags.

A program takes a block of rows, not one: the check runs before a prefill
bucket's persistent GEMM in merged calls' graphs (``server/_graphs.py``; in a lone
fp8 call's on ``persistent_ws``), and one 4-warp program per row
(65536 at the largest bucket, each two dependent loads long) cost about 1 ns a
row there (Qwen3-30B w2 t8192 through the service graph: 340 us against 277 us
for the public entry, v16; measured apart by ``bench/gap_gluon.py``), where a
lone fp8 call's work is only its scales (24-224 bytes a row). The answer is the same, bit for bit (``tests/server/test_prologue.py``
on a GPU); the CPU and backends without Triton keep the torch ops.

The triton backend hands it to the server (``Backend.check_and_gather``); only imported
with that backend: never into a process holding FlyDSL.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_gemm import scale_flags
from ._triton_keys import settle

# Exponent bits of the 16-bit floats: all ones is Inf or NaN.
_EXPONENT = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


@triton.jit
def _check_gather(x_ptr, xs_ptr, gather_ptr, xg_ptr, xsg_ptr, flags_ptr, regroup_ptr, gather_stride, rows,
                  K: tl.constexpr, KB: tl.constexpr, FLOAT16: tl.constexpr, EXPONENT: tl.constexpr,
                  HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_S: tl.constexpr, HAS_REGROUP: tl.constexpr):
    """Rows ``[pid * BLOCK_R, pid * BLOCK_R + BLOCK_R)`` of the gather order: row r is the callers'
    row ``gather[r]``; its codes (16-bit: checked; copied when regrouping) in ``BLOCK_K``-wide
    column blocks, its scales in one block, its flag stored at the callers' index."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = row < rows
    src = tl.load(gather_ptr + row * gather_stride, mask=live, other=0).to(tl.int64)
    if HAS_REGROUP:
        copy = tl.load(regroup_ptr) != 0
    else:
        copy = tl.program_id(0) >= 0  # always
    seen = tl.zeros([BLOCK_R], dtype=tl.int32)
    if FLOAT16:
        # 16-bit rows are checked for NaN/Inf (the server quantizes them), copied or not.
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            inside = live[:, None] & (offs < K)[None, :]
            bits = tl.load(x_ptr + src[:, None] * K + offs[None, :], mask=inside, other=0)
            tl.store(xg_ptr + row[:, None] * K + offs[None, :], bits, mask=inside & copy)
            seen = seen | tl.max(((bits & EXPONENT) == EXPONENT).to(tl.int32), axis=1)
    elif copy:
        # fp8 rows: SPEC 2.2 checks their scales, not their codes; read only to regroup.
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            inside = live[:, None] & (offs < K)[None, :]
            tl.store(xg_ptr + row[:, None] * K + offs[None, :],
                     tl.load(x_ptr + src[:, None] * K + offs[None, :], mask=inside), mask=inside)
    flag = seen
    if HAS_SCALE:
        offs = tl.arange(0, BLOCK_S)
        inside = live[:, None] & (offs < KB)[None, :]
        scale = tl.load(xs_ptr + src[:, None] * KB + offs[None, :], mask=inside, other=1.0)
        tl.store(xsg_ptr + row[:, None] * KB + offs[None, :], scale, mask=inside & copy)
        flag = flag | scale_flags(scale)
    tl.store(flags_ptr + src, flag.to(tl.int8), mask=live)


# Rows a program takes: enough programs to keep every SM busy (PROGRAMS, about 8 per SM of an
# H200), up to 64 rows. Below PROGRAMS rows one row a program, the shape that is fastest where
# the rows are few and copied (merged calls: each program streams one row); at the largest
# buckets 64 rows, 1024 programs, all resident at once.
PROGRAMS = 1024
ROWS_PER_PROGRAM = 64
ELEMENTS = 8192  # the most codes (or scales) one load of a program covers: 64 per thread


def block_sizes(rows: int, K: int, KB: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_K, BLOCK_S) of a check over ``rows`` rows of ``K`` codes and ``KB`` scales."""
    block_s = triton.next_power_of_2(KB)
    block_r = min(ROWS_PER_PROGRAM, triton.next_power_of_2(triton.cdiv(rows, PROGRAMS)),
                  max(1, ELEMENTS // block_s))
    block_k = max(16, min(triton.next_power_of_2(K), ELEMENTS // block_r))
    return block_r, block_k, block_s


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

    ``x`` ``[n, K]`` (fp8 of either format, bf16 or fp16) and ``x_scale``
    ``[n, K/128]`` float32 (or None) are contiguous CUDA tensors; ``gather``
    is ``[rows]`` int64 (any stride) indexing ``x``'s rows: a permutation of
    ``range(n)`` (a gemm or ffn launch), or each routed row's token, ``k`` rows a
    token (a moe launch; every token's flag is then written by each of its rows,
    alike); ``x_out`` and ``scale_out`` have ``rows`` rows; ``flags`` ``[n]`` int8
    is indexed like ``x`` (input order). No host reads: capture-safe.
    ``regroup``: an int64 device word read at run time; 0 means only the flags are
    written (``gather`` is the identity and ``x_out`` unused).
    """
    rows, K = gather.shape[0], x.shape[1]
    if rows == 0:
        return
    float16 = x.dtype in _EXPONENT
    if not float16 and x.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        raise TypeError(f"x must be fp8, bf16 or fp16, got {x.dtype}")
    view = torch.int16 if float16 else torch.uint8
    has_scale = x_scale is not None
    KB = x_scale.shape[1] if has_scale else 1
    block_r, block_k, block_s = block_sizes(rows, K, KB)
    _check_gather[(triton.cdiv(rows, block_r),)](
        x.view(view), x_scale if has_scale else x.view(view), gather, x_out.view(view),
        scale_out if has_scale else x_out.view(view), flags, gather if regroup is None else regroup,
        gather.stride(0), rows, K=K, KB=KB,
        FLOAT16=float16, EXPONENT=_EXPONENT.get(x.dtype, 0), HAS_SCALE=has_scale,
        BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_S=block_s, HAS_REGROUP=regroup is not None, num_warps=4,
    )

# Every kernel's cache key as any process computes it, whatever it launches first (_triton_keys).
settle(globals())
