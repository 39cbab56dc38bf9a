"""SiLU(gate) * up fused with the 1x128 fp8 quantization of its output (SPEC 5.1), in Triton.

    aq, a_scale = silu_mul_quant_triton(h, fp8_dtype)

| tensor    | shape       | dtype                  | meaning |
|-----------|-------------|------------------------|---------|
| `h`       | `[M, 2I]`   | float32 (or bfloat16)  | the w13 GEMM's output: gate columns `0..I-1`, up `I..2I-1` |
| `aq`      | `[M, I]`    | fp8 e4m3fn or e4m3fnuz | `a = silu(gate) * up` (float32, unrounded) quantized per 128-wide block |
| `a_scale` | `[M, I/128]`| float32                | the blocks' dequant scales (SPEC 1.1) |
| `rows`    | `[]`        | int64 (optional)       | rows to compute; rows at or past it are left untouched |

One read of ``h`` and one write of ``aq`` and ``a_scale``: the kernel between
the two GEMMs of an expert-FFN graph. It is the torch definition
(``moegemm.kernels.activation.silu_mul_quant``) bit for bit:

- ``silu(v) = v / (1 + exp(-v))`` with IEEE division (``div_rn``: Triton's
  ``/`` is an approximate division on NVIDIA) and the math library's ``expf``
  (libdevice/ocml, what torch's kernels call); the product stays float32, quantized
  as it is (not rounded to bf16 first: a rounding there moves codes across fp8
  midpoints);
- the scale is ``max(amax, 1e-12) / FP8_MAX`` with IEEE division, NaN
  propagated as torch's ``amax``/``clamp`` propagate it, and each code the exact
  quotient ``a * FP8_MAX / max(amax, 1e-12)`` rounded to nearest even
  (``quant._to_fp8``): the float32 quotient finds its fp8 interval, an exact
  float64 comparison with the interval's midpoint picks the end;
- the rounding to fp8 is done with integer operations (subnormals included), so
  both formats and both vendors' GPUs give the same bits without a hardware
  conversion instruction that only one of them has;
- no multiply-add contraction (``enable_fp_fusion=False``): torch rounds each
  product and sum separately.

``rows`` (a device scalar) lets a graph captured for a bucket of rows skip the
rows past the call's real ones without a host read.

The per-block arithmetic is three ``@triton.jit`` helpers (``silu_mul``,
``quantize_blocks``, ``nan_inf_flag``) that the one-token moe kernels
(``kernels/_triton_moe_token.py``) call too: one definition, the same bits.

``gather_quantize_triton`` is the same quantization for the rows a graph
gathers (bf16 inputs): rows ``gather`` of ``x`` quantized, with their NaN/Inf
flags, in one kernel instead of a gather, a check and torch's seven
quantization kernels (``quantize_activations`` and ``_checks.bad_rows`` bit for
bit).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._backend import BLOCK
from ._triton_keys import settle
from .quant import fp8_max

# Triton's interpreter (TRITON_INTERPRET=1, read when a kernel is defined) runs the CPU tests.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _round_to_bf16(v):
    """float32 ``v`` rounded to the nearest bf16 (ties to even), as float32 (moe's
    combine rounds with it). Integer operations rather than a cast: the
    interpreter's cast truncates.
    """
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    rounded = tl.where(v != v, bits | 0x400000, rounded)  # noqa: PLR0124 (NaN stays NaN)
    return rounded.to(tl.float32, bitcast=True)


# The two formats' exponent bias, smallest normal and subnormal step (2^(-BIAS - 2)) inverse.
_FORMAT = {False: (7, 0.015625, 512.0), True: (8, 0.0078125, 1024.0)}


@triton.jit
def _fp8_bits(v, x, floor, FP8_MAX, FNUZ: tl.constexpr, BIAS: tl.constexpr,
              MIN_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr):
    """e4m3fn / e4m3fnuz bits (int32) of the exact quotient ``x * FP8_MAX / floor`` (``floor``
    float64, one per row), to nearest even (``quant._to_fp8``, bit for bit). ``v`` is the
    float32 quotient by the rounded scale, clamped to the format's max (or NaN): within 1.5
    float32 ulps of the exact one, it finds the fp8 interval; the sign of ``|x| * FP8_MAX - mid
    * floor`` (two products exact in float64: the same in the interpreter) says which end the
    exact quotient rounds to, ``mid`` being the interval's midpoint, and 0 is a tie (to even).
    No float64 division: the GPU's is slow."""
    raw = v.to(tl.int32, bitcast=True)
    negative = raw < 0
    a = tl.abs(v)
    # The interval's low end as a code (its mantissa's last bit is the code's) and its
    # midpoint: a normal value's 3 mantissa bits kept; a subnormal one's whole steps (exact).
    kept = a.to(tl.int32, bitcast=True) & -1048576
    steps = (a * SUB_SCALE).to(tl.int32)
    subnormal = a < MIN_NORMAL
    code = tl.where(subnormal, steps, (kept >> 20) - ((127 - BIAS) << 3))
    mid = tl.where(subnormal, (steps.to(tl.float32) + 0.5) * (1.0 / SUB_SCALE),
                   (kept | 524288).to(tl.float32, bitcast=True))
    side = tl.abs(x).to(tl.float64) * FP8_MAX - mid.to(tl.float64) * floor
    code += ((side > 0) | ((side == 0) & ((code & 1) == 1))).to(tl.int32)
    if FNUZ:
        # No negative zero in fnuz (0x80 is its NaN).
        code = tl.where(negative & (code != 0), code | 0x80, code)
        code = tl.where(v != v, 0x80, code)  # noqa: PLR0124 (NaN)
    else:
        code = tl.where(negative, code | 0x80, code)
        code = tl.where(v != v, 0x7F, code)  # noqa: PLR0124 (one NaN code: quant._to_fp8)
    return code


@triton.jit
def silu_mul(gate, up, INTERPRETED: tl.constexpr):
    """``silu(gate) * up`` in float32 as torch computes it (not rounded to bf16:
    kernels/activation.py says why): IEEE division, the math library's ``expf``."""
    if INTERPRETED:
        e = tl.exp(-gate)  # the interpreter has no libdevice; its tl.exp is numpy's expf
    else:
        e = libdevice.exp(-gate)
    return tl.math.div_rn(gate, 1.0 + e) * up


@triton.jit
def quantize_blocks(x, FP8_MAX, FNUZ: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                    SUB_SCALE: tl.constexpr):
    """float32 ``x`` ``[R, 128]``, each row one 128-wide block, quantized (SPEC 1.1): (the
    fp8 codes, int32 ``[R, 128]``; the blocks' scales ``[R]``). NaN propagates as torch's
    ``amax``/``clamp`` propagate it; every division IEEE; each code rounds the exact quotient
    ``x * FP8_MAX / max(amax, 1e-12)`` (:func:`_fp8_bits`)."""
    amax = tl.reduce(tl.abs(x), 1, _max_nan)
    floor = _max_nan(amax, 1e-12)
    scale = tl.math.div_rn(floor, tl.full(amax.shape, FP8_MAX, tl.float32))
    v = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    v = tl.minimum(tl.maximum(v, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                   propagate_nan=tl.PropagateNan.ALL)
    return _fp8_bits(v, x, floor.to(tl.float64)[:, None], FP8_MAX, FNUZ, BIAS, MIN_NORMAL,
                     SUB_SCALE), scale


@triton.jit
def nan_inf_flag(x):
    """1 (int8) where float32 ``x`` ``[R, C]`` holds NaN or Inf (exponent all ones), as
    ``_checks.bad_rows`` flags a bf16 row; else 0."""
    exponent = x.to(tl.int32, bitcast=True) & 0x7F800000
    return tl.max(tl.max((exponent == 0x7F800000).to(tl.int8), axis=1), axis=0)


@triton.jit
def _silu_mul_quant_kernel(h_ptr, aq_ptr, scale_ptr, rows_ptr, stride_h, stride_aq, stride_scale,
                           FP8_MAX, I: tl.constexpr, HAS_ROWS: tl.constexpr,
                           BLOCKS: tl.constexpr, FNUZ: tl.constexpr, BIAS: tl.constexpr,
                           MIN_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr,
                           INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if row >= tl.load(rows_ptr):
            return
    IB: tl.constexpr = I // 128
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    col = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
    inside = blk[:, None] < IB
    gate = tl.load(h_ptr + row * stride_h + col, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_h + I + col, mask=inside, other=0.0).to(tl.float32)
    a = silu_mul(gate, up, INTERPRETED)
    code, scale = quantize_blocks(a, FP8_MAX, FNUZ, BIAS, MIN_NORMAL, SUB_SCALE)
    tl.store(aq_ptr + row * stride_aq + col, code.to(tl.uint8), mask=inside)
    tl.store(scale_ptr + row * stride_scale + blk, scale, mask=blk < IB)


def silu_mul_quant_triton(
    h: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    rows: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_mul_quant(h, fp8_dtype)`` in one kernel: ``(aq [M, I], a_scale [M, I/128])``.

    ``h`` float32 or bf16 ``[M, 2I]`` (row stride free, columns contiguous) on a GPU;
    ``rows`` an optional int64 device scalar: rows ``>= rows`` are not computed
    (their outputs keep what they held). ``out`` optional preallocated
    ``(aq, a_scale)``. No host reads: capture-safe.
    """
    limit = fp8_max(fp8_dtype)
    if h.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"h must be float32 or bfloat16, got {h.dtype}")
    if h.dim() != 2 or h.shape[1] % (2 * BLOCK) or h.stride(1) != 1:
        raise ValueError(f"h must be [M, 2I] with I % {BLOCK} == 0, columns contiguous, "
                         f"got {tuple(h.shape)}")
    m, inter = h.shape[0], h.shape[1] // 2
    if out is None:
        aq = torch.empty((m, inter), dtype=fp8_dtype, device=h.device)
        a_scale = torch.empty((m, inter // BLOCK), dtype=torch.float32, device=h.device)
    else:
        aq, a_scale = out
        if aq.dtype != fp8_dtype or tuple(aq.shape) != (m, inter) or aq.stride(1) != 1 or \
                a_scale.dtype != torch.float32 or tuple(a_scale.shape) != (m, inter // BLOCK) \
                or a_scale.stride(1) != 1:
            raise ValueError("out must be (aq [M, I] in fp8_dtype, a_scale [M, I/128] float32)")
    if m == 0:
        return aq, a_scale
    fnuz = fp8_dtype == torch.float8_e4m3fnuz
    bias, min_normal, sub_scale = _FORMAT[fnuz]
    blocks = triton.next_power_of_2(min(8, inter // BLOCK))
    grid = (m, triton.cdiv(inter // BLOCK, blocks))
    _silu_mul_quant_kernel[grid](
        h, aq.view(torch.uint8), a_scale, h if rows is None else rows,
        h.stride(0), aq.stride(0), a_scale.stride(0), limit,
        I=inter, HAS_ROWS=rows is not None, BLOCKS=blocks,
        FNUZ=fnuz, BIAS=bias, MIN_NORMAL=min_normal, SUB_SCALE=sub_scale,
        INTERPRETED=_INTERPRETED,
        num_warps=4, enable_fp_fusion=False,
    )
    return aq, a_scale


@triton.jit
def _gather_quant_kernel(x_ptr, gather_ptr, gather_stride, aq_ptr, scale_ptr, flags_ptr, FP8_MAX,
                         K: tl.constexpr, BLOCKS: tl.constexpr, FNUZ: tl.constexpr,
                         BIAS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = tl.load(gather_ptr + row * gather_stride).to(tl.int64)
    quantize_row(x_ptr, src, row, aq_ptr, scale_ptr, flags_ptr, FP8_MAX, K, BLOCKS, FNUZ, BIAS,
                 MIN_NORMAL, SUB_SCALE)


# Rows up to which a row-quantizing program takes its whole row at once (:func:`row_chunk`): about
# two waves of the whole-row program, one an SM, on a Hopper part's 114-132 SMs.
_FEW_ROWS = 256


def row_chunk(k: int, rows: int) -> tuple[int, int]:
    """``(blocks, num_warps)``: how many 128-wide blocks a row-quantizing program
    (:func:`quantize_row`) takes at once, for ``rows`` rows of width ``k``.

    Up to ``_FEW_ROWS`` rows, the whole row, with 8 warps where it has 16 blocks or more: a
    row's loads are then all in flight at once, where chunks would wait one after another.
    More rows: chunks of 8 blocks with 4 warps where the row has more than 16 (a whole
    7168-wide row takes 168 registers a thread, one program an SM), else the whole row with 4
    warps. Measured on an H100 (session 40, call 3, ``bench/quant_speed.py --chunks``),
    gather_quantize at K 7168: whole 7.9 us against 8.9 in chunks at 256 rows, 14.2 against
    11.1 at 512; at K 2048, 8 warps 3.1 against 3.4 us at 256 rows, 10.7 against 9.9 at 2048;
    quantize_scatter at H 7168: whole 8.4 against 10.2 at 128 tokens, 21.5 against 17.7 at 512.
    """
    blocks = triton.next_power_of_2(k // BLOCK)
    if rows <= _FEW_ROWS:
        return blocks, 8 if blocks >= 16 else 4
    return (8 if blocks > 16 else blocks), 4


@triton.jit
def quantized_chunk(x_ptr, src, c, FP8_MAX, K: tl.constexpr, BLOCKS: tl.constexpr,
                    FNUZ: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                    SUB_SCALE: tl.constexpr):
    """Blocks ``c .. c + BLOCKS - 1`` of row ``src`` of bf16 ``x`` ``[*, K]`` quantized:
    ``(codes [BLOCKS, 128] uint8, scales [BLOCKS], flag)``, flag 1 where they hold NaN or
    Inf. Blocks past ``K / 128`` hold nothing meaningful (:func:`store_chunk` masks them)."""
    KB: tl.constexpr = K // 128
    blk = c + tl.arange(0, BLOCKS)
    col = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
    inside = blk[:, None] < KB
    x = tl.load(x_ptr + src * K + col, mask=inside, other=0.0).to(tl.float32)
    flag = nan_inf_flag(x)
    code, scale = quantize_blocks(x, FP8_MAX, FNUZ, BIAS, MIN_NORMAL, SUB_SCALE)
    return code.to(tl.uint8), scale, flag


@triton.jit
def store_chunk(code, scale, row, c, aq_ptr, scale_ptr, K: tl.constexpr, BLOCKS: tl.constexpr):
    """:func:`quantized_chunk`'s codes and scales into row ``row`` of ``aq`` and its scales."""
    KB: tl.constexpr = K // 128
    blk = c + tl.arange(0, BLOCKS)
    col = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(aq_ptr + row * K + col, code, mask=blk[:, None] < KB)
    tl.store(scale_ptr + row * KB + blk, scale, mask=blk < KB)


@triton.jit
def quantize_row(x_ptr, src, row, aq_ptr, scale_ptr, flags_ptr, FP8_MAX, K: tl.constexpr,
                 BLOCKS: tl.constexpr, FNUZ: tl.constexpr, BIAS: tl.constexpr,
                 MIN_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr):
    """Row ``src`` of bf16 ``x`` ``[*, K]`` quantized into row ``row`` of ``aq`` and its
    scales, ``BLOCKS`` blocks at a time (:func:`row_chunk`), ``flags[src]`` = 1 where it
    holds NaN or Inf (``gather_quantize_triton``'s program; moe's routing kernel runs it
    for the rows it routes)."""
    flag = tl.full([], 0, tl.int32)
    for c in range(0, K // 128, BLOCKS):
        code, scale, bad = quantized_chunk(x_ptr, src, c, FP8_MAX, K, BLOCKS, FNUZ, BIAS,
                                           MIN_NORMAL, SUB_SCALE)
        store_chunk(code, scale, row, c, aq_ptr, scale_ptr, K, BLOCKS)
        flag = flag | bad
    tl.store(flags_ptr + src, flag)


def check_gather_quantize(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor], rows: int) -> int:
    """Refuse arguments the gather-and-quantize programs cannot take; K. ``x``: contiguous
    bf16 ``[*, K]``, K % 128 == 0; ``out``: contiguous (xq ``[rows, K]``, x_scale ``[rows, K/128]``)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % BLOCK or not x.is_contiguous():
        raise ValueError(f"x must be contiguous bf16 [rows, K], K % 128 == 0, got {x.dtype} "
                         f"{tuple(x.shape)}")
    k = x.shape[1]
    xq, x_scale = out
    if tuple(xq.shape) != (rows, k) or tuple(x_scale.shape) != (rows, k // BLOCK) or \
            not (xq.is_contiguous() and x_scale.is_contiguous()):
        raise ValueError("out must be contiguous (xq [R, K], x_scale [R, K/128])")
    return k


def gather_quantize_triton(
    x: torch.Tensor,
    gather: torch.Tensor,
    flags: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``gather`` of bf16 ``x`` quantized (SPEC 1.1) into ``out = (xq [R, K], x_scale
    [R, K/128])``, and ``flags[gather[r]]`` = 1 where that row holds NaN or Inf, else 0.

    ``quantize_activations(x[gather])`` and ``_checks.bad_rows(x, None)`` bit for bit, in one
    kernel (one program per output row, ``R = len(gather)``, which may repeat rows: ``moe``
    gathers a token once per expert it goes to). ``gather`` int64 of any stride; capture-safe.
    """
    xq, x_scale = out
    fp8_dtype = xq.dtype
    limit = fp8_max(fp8_dtype)
    rows, k = gather.shape[0], check_gather_quantize(x, out, gather.shape[0])
    if rows == 0:
        return xq, x_scale
    fnuz = fp8_dtype == torch.float8_e4m3fnuz
    bias, min_normal, sub_scale = _FORMAT[fnuz]
    blocks, warps = row_chunk(k, rows)
    _gather_quant_kernel[(rows,)](
        x, gather, gather.stride(0), xq.view(torch.uint8), x_scale, flags, limit,
        K=k, BLOCKS=blocks, FNUZ=fnuz, BIAS=bias, MIN_NORMAL=min_normal,
        SUB_SCALE=sub_scale, num_warps=warps, enable_fp_fusion=False,
    )
    return xq, x_scale

# Every kernel's cache key as any process computes it, whatever it launches first (_triton_keys).
settle(globals())
