"""Block-wise FP8 quantization (SPEC 1.1) and the e4m3fn <-> e4m3fnuz conversion (SPEC 1.2).

Every function here is plain torch: it runs on CPU and GPU tensors and reads no
tensor contents on the host, so it may be captured into a CUDA/HIP graph.
"""

from __future__ import annotations

import math

import torch

from ._backend import BLOCK

# The SPEC names the two maxima explicitly; torch.finfo agrees, but a table keeps
# an unsupported dtype from silently getting some other format's maximum.
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}

# A block of zeros still gets a positive, finite scale (SPEC 1.1).
_AMAX_FLOOR = 1e-12


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 e4m3 format: 448 for e4m3fn, 240 for e4m3fnuz."""
    try:
        return _FP8_MAX[dtype]
    except KeyError:
        raise TypeError(
            f"fp8 dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {dtype}"
        ) from None


def _check_float_input(t: torch.Tensor, what: str) -> None:
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{what} must be bfloat16, float16 or float32, got {t.dtype}")


def _scale_of(amax: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(floor, scale)``: ``max(amax, 1e-12)`` (in place) and ``floor / limit``, the scale
    rounded the same on every device.

    Dividing by a Python number lets torch multiply by its reciprocal instead,
    rounded differently on the CPU and on CUDA: the H200's scales came out one
    ulp away from the CPU reference's, and so did some quantized values. A
    tensor divisor is a true IEEE division everywhere.
    """
    floor = amax.clamp_(min=_AMAX_FLOOR)
    return floor, floor / torch.full_like(floor, limit)


# float32 NaN bits with the sign clear: :func:`fp8_nearest`'s NaN, 0x7F in e4m3fn (0x80 in fnuz).
_POSITIVE_NAN = 0x7FC00000


def _to_fp8(values: torch.Tensor, floor: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``values`` rounded to ``fp8_dtype`` as SPEC 1.1 has it: the exact quotient
    ``values * FP8_MAX / floor`` (``floor`` = ``max(amax, 1e-12)``, the block's real scale's
    numerator, 1e-12 being float32's) to nearest even, never past the format's maximum.

    The quotient is taken in float64 (``values * FP8_MAX`` exact, one rounding in the
    division, at most 2^-53 of it): for 16- and 32-bit floats it lies on the same side of every
    float32 value as the exact one, and on one only where the exact one is (a 28-bit numerator
    over a 24-bit floor is either a 24-bit value or at least 2^-48 of itself away from each).
    It is then rounded to odd in float32 (the neighbour whose last bit is 1, unless exact), 20
    bits more than fp8 keeps, so the cast to fp8 rounds the exact quotient, ties included. The
    quotient by the float32-rounded scale, or its float32 rounding, differs on about 0.1 % of
    bf16 values, whose exact quotients are ties (``0.2578125 * 448 / 2.75`` is 42, between 40
    and 44): what a float64 evaluation of SPEC 1.1 gives is this (for bf16 and fp16 inputs;
    torch's float64 cast rounds through float32). ``_triton_act._fp8_bits`` gives the same bits
    with a float32 division and an exact float64 comparison.
    """
    limit = fp8_max(fp8_dtype)
    return fp8_nearest(values.double().mul_(limit).div_(floor.double()), fp8_dtype)


def fp8_nearest(exact: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """float64 ``exact`` rounded once to ``fp8_dtype``, to nearest even, clamped to the
    format's maximum (NaN stays NaN). torch's cast from float64 rounds through float32 and so
    twice: rounding to odd in float32 first (20 bits more than fp8 keeps) makes the second
    rounding the only one."""
    limit = fp8_max(fp8_dtype)
    v = exact.float()
    over = v.double().sub_(exact)  # v's side of the quotient: exact (two close float64 values)
    bits = v.view(torch.int32)
    down = ((over > 0) == (v > 0)).to(torch.int32)  # above the quotient in magnitude
    # Past float32's range v is infinite: kept, so the clamp saturates it as any large value.
    odd = torch.where((over != 0) & (v != 0) & v.isfinite(), (bits - down) | 1, bits)
    # One NaN code whatever the NaN's sign: a float64 NaN made on CUDA (``inf / inf``) is
    # negative, a float32 one positive, and x86's are negative.
    odd.masked_fill_(v.isnan(), _POSITIVE_NAN)
    # Clamping matters: torch's cast does not saturate, an overflow would be NaN. NaN stays.
    return odd.view(torch.float32).clamp_(-limit, limit).to(fp8_dtype)


# Elements :func:`_to_fp8` takes at once: its temporaries (float64 copies among them: about 36
# bytes an element, the peak RSS of quantize_weights on the CPU) stay under a GiB whatever the
# tensor.
_SLICE_ELEMENTS = 1 << 24


def _in_slices(values: torch.Tensor, floor: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """:func:`_to_fp8` over slices of dim 0 (``floor`` has ``values``' dim 0); in one piece, with
    no copy, where that fits one slice (every call but a prefill's)."""
    per = max(1, _SLICE_ELEMENTS // max(1, math.prod(values.shape[1:])))
    if values.shape[0] <= per:
        return _to_fp8(values, floor, fp8_dtype)
    out = torch.empty(values.shape, dtype=fp8_dtype, device=values.device)
    for i in range(0, values.shape[0], per):
        out[i:i + per] = _to_fp8(values[i:i + per], floor[i:i + per], fp8_dtype)
    return out


def quantize_activations(
    x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations per token and per 128-wide K block (SPEC 1.1).

    ``x`` is ``[M, K]`` bfloat16/float16/float32 with ``K % 128 == 0``. Returns
    ``(xq, x_scale)``: ``xq`` ``[M, K]`` in ``fp8_dtype`` and ``x_scale``
    ``[M, K/128]`` float32, with ``x ~= xq * x_scale`` block-wise.
    """
    limit = fp8_max(fp8_dtype)
    _check_float_input(x, "x")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"K must be a multiple of {BLOCK}, got K={k}")
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    floor, scale = _scale_of(amax, limit)
    xq = _in_slices(blocks, floor, fp8_dtype).reshape(m, k).contiguous()  # (row-major, SPEC 1)
    return xq, scale.reshape(m, k // BLOCK).contiguous()


def quantize_weights(
    w: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights per group and per 128x128 block of ``[N, K]`` (SPEC 1.1).

    ``w`` is ``[G, N, K]`` (or ``[N, K]``) bfloat16/float16/float32 with
    ``N % 128 == 0`` and ``K % 128 == 0``. Returns ``(wq, w_scale)``: ``wq`` of
    ``w``'s shape in ``fp8_dtype`` and ``w_scale`` ``[G, K/128, N/128]`` (or
    ``[K/128, N/128]``) float32 -- note the K-major scale layout of the SPEC.
    """
    limit = fp8_max(fp8_dtype)
    _check_float_input(w, "w")
    if w.dim() not in (2, 3):
        raise ValueError(f"w must be [G, N, K] or [N, K], got shape {tuple(w.shape)}")
    *lead, n, k = w.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"N and K must be multiples of {BLOCK}, got N={n}, K={k}")
    nb, kb = n // BLOCK, k // BLOCK
    blocks = w.float().reshape(*lead, nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)  # [..., nb, 1, kb, 1]
    floor, scale = _scale_of(amax, limit)
    wq = _in_slices(blocks.reshape(-1, BLOCK, kb, BLOCK), floor.reshape(-1, 1, kb, 1),
                    fp8_dtype).reshape(w.shape).contiguous()  # (row-major: what grouped_gemm takes)
    w_scale = scale.reshape(*lead, nb, kb).transpose(-1, -2).contiguous()
    return wq, w_scale


def fn_to_fnuz(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-encode e4m3fn data as e4m3fnuz, exactly (SPEC 1.2).

    The bits are kept (an fnuz pattern is worth half the fn one), the scales
    doubled, 0x80 (-0 in fn, NaN in fnuz) becomes 0x00, and fn's NaN (0x7F, 0xFF:
    +-240 in fnuz, had their bits been kept) becomes fnuz's NaN, 0x80: a NaN stays
    one, as ``fnuz_to_fn`` keeps it. Returns new tensors.

    A scale over float32's largest / 2 cannot double: its block keeps the scale and
    its codes are re-encoded at the same value instead, exact up to fnuz's 240 (a
    larger code times such a scale is past float32's range already). ``scale`` is
    per element (``q``'s shape), per activation block (``[..., M, K/128]``) or per
    weight block (``[..., K/128, N/128]``).
    """
    if q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fn_to_fnuz expects torch.float8_e4m3fn data, got {q.dtype}")
    fn_bits = q.view(torch.uint8)
    bits = torch.where(fn_bits == 0x80, torch.zeros_like(fn_bits), fn_bits)
    doubled = scale * 2
    kept = torch.isinf(doubled) & torch.isfinite(scale)
    bits = torch.where(_per_element(kept, q.shape), _fnuz_of_the_same_value(bits), bits)
    bits = torch.where((fn_bits & 0x7F) == 0x7F, torch.full_like(bits, 0x80), bits)
    return bits.view(torch.float8_e4m3fnuz), torch.where(kept, scale, doubled)


def _fnuz_of_the_same_value(bits: torch.Tensor) -> torch.Tensor:
    """fn bit patterns (0x80 already 0x00) as the fnuz patterns of the same values, in
    uint8 arithmetic (no float copy of the data): a normal's exponent field one higher
    (fnuz's bias is 8, fn's 7), a subnormal's mantissa doubled into the low exponent bit,
    and fn's top binade (256-448) saturated to fnuz's largest, 240 (0x7F); fn's NaN is
    made fnuz's by the caller."""
    low = bits & 0x7F
    value = torch.where(low < 0x08, low * 2, low + 0x08)
    value = torch.where(low >= 0x78, torch.full_like(low, 0x7F), value)
    return torch.where(value == 0, value, (bits & 0x80) | value)


def _per_element(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A per-block tensor spread over the elements of data of ``shape`` (``fn_to_fnuz``'s layouts)."""
    if blocks.shape == shape:
        return blocks
    *lead, rows, k = shape
    if tuple(blocks.shape) == (*lead, rows, k // BLOCK):  # activations' x_scale
        return blocks.repeat_interleave(BLOCK, dim=-1)
    if tuple(blocks.shape) == (*lead, k // BLOCK, rows // BLOCK):  # weights' w_scale
        return blocks.transpose(-1, -2).repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    raise ValueError(f"scale of shape {tuple(blocks.shape)} is per element, per activation block or "
                     f"per weight block of data {tuple(shape)}")


def fnuz_to_fn(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert e4m3fnuz data to e4m3fn values at the same scale (SPEC 1.2).

    Every fnuz value fits in fn; values below 2^-6 may lose their last mantissa
    bit (round to nearest even). The bits are never reinterpreted: fnuz's block
    maxima 0x7F/0xFF are +-240, but NaN in fn. Returns ``(q_fn, scale)``, the
    scale tensor unchanged.
    """
    if q.dtype != torch.float8_e4m3fnuz:
        raise TypeError(f"fnuz_to_fn expects torch.float8_e4m3fnuz data, got {q.dtype}")
    return q.to(torch.float32).to(torch.float8_e4m3fn), scale
