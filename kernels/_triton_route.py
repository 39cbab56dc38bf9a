"""The two Triton kernels around a moe graph's FFN: routing tokens to experts, combining back.

| tensor         | shape        | dtype   | meaning |
|----------------|--------------|---------|---------|
| `ids`          | `[2 Tb k]`   | int32   | `topk_ids` row-major, the bucket's `Tb` tokens (real ones first): int32 ids, or int64 ids as (low, high) word pairs |
| `wide`         | `[]`         | int64   | 1 when `ids` holds int64 ids, 0 for int32 (a device word: one graph serves both) |
| `weights`      | `[Tb * k]`   | float32 | `topk_weights`, the same layout |
| `tokens`       | `[]`         | int64   | real tokens `T <= Tb` (a device scalar: no host read) |
| `m_sizes`      | `[G]`        | int64   | out: rows per expert |
| `pos`          | `[Tb * k]`   | int64   | out: the expert-order row of each (token, slot) |
| `src`          | `[Tb * k]`   | int64   | out: the token each expert-order row comes from |
| `live`         | `[]`         | int64   | out: rows that belong to an expert (`sum(m_sizes)`) |
| `flags`        | `[Tb]`       | int8    | out: 1 where a real token's routing is bad (SPEC 2.2 `bad_routing`) |

``ids`` arrive as the caller sent them, int32 or int64, with no host pass over
them: an int64 id whose high word is not zero (or whose low word passes
int32's range) is read as -1, which is refused like any id outside ``[0, G)``.

``route`` is a stable counting sort: program ``g`` (one per expert, plus one
for the rows that go to no expert) counts the entries routed below ``g``
(its first row) and to ``g``, then gives its entries consecutive rows in
(token, slot) order. Entries of padding tokens (``t >= T``) and ids outside
``[0, G)`` go to the extra group past the last expert, which no GEMM tile
stores, so a bad id never indexes out of bounds; one more program checks
every real token (ids in range and distinct, weights finite). The answer does
not depend on the order the programs run in: no atomics.

``route`` with ``quantize`` (bf16 tokens) also gathers and quantizes the
rows it routes, ``gather_quantize_triton`` bit for bit, in the same launch
(one kernel node less in a moe graph; worth it for a few rows only, see
``_ffn_graphs.ROUTE_QUANTIZES_UP_TO``): ``S`` programs per expert share its rows (program ``(g, s)``
takes rows ``start + s, start + s + S, ...``), each reading back the ``src``
words its own threads stored (a barrier between).

``quantize_scatter`` (bf16 tokens, more rows than the routing quantizes): each
token quantized once and stored at each of its k routed rows (``pos``), the
same bits as gathering then quantizing every routed row, with a k-th of the
work (v14: the per-row gather-quantize took 8.8 us of Qwen3-30B's 256-token
graph).

``combine``: ``out[t] = bf16(sum_j weights[t, j] * y[pos[t, j]])``, the sum in
float32 in slot order, one multiply and one add per slot (no contraction).

Both equal their torch definitions in ``_ffn_graphs`` bit for bit
(``tests/server/test_ffn_gpu.py``). Imported only with the triton backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from moegemm.kernels._backend import BLOCK
from moegemm.kernels._triton_act import (
    _FORMAT,
    _round_to_bf16,
    check_gather_quantize,
    quantize_row,
    quantized_chunk,
    row_chunk,
    store_chunk,
)
from moegemm.kernels._triton_keys import settle
from moegemm.kernels.quant import fp8_max

_CHUNK = 1024
_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _expert_of(ids_ptr, i, mask, wide):
    """Entry ``i``'s expert: an int32 id as it is, an int64 id (two words) as its low word
    when its high word is 0, else -1."""
    lo = tl.load(ids_ptr + i * (1 + wide), mask=mask, other=0)
    hi = tl.load(ids_ptr + i * 2 + 1, mask=mask & (wide != 0), other=0)
    return tl.where(hi == 0, lo, -1)


@triton.jit
def _check_tokens(ids_ptr, w_ptr, flags_ptr, T, wide, bucket_tokens: tl.constexpr, G: tl.constexpr,
                  K: tl.constexpr, KP: tl.constexpr, TBLOCK: tl.constexpr):
    """``flags[t]`` = 1 where real token ``t``'s routing is bad: an id outside ``[0, G)``, two
    equal ids, or a weight that is not finite (SPEC 2.2 ``bad_routing``)."""
    jj = tl.arange(0, KP)[None, :]
    for t0 in range(0, bucket_tokens, TBLOCK):
        tt = t0 + tl.arange(0, TBLOCK)[:, None]
        slot = (tt < bucket_tokens) & (jj < K)
        e = _expert_of(ids_ptr, tt * K + jj, slot, wide)
        w = tl.load(w_ptr + tt * K + jj, mask=slot, other=0.0)
        bad = (e < 0) | (e >= G) | (w != w) | (tl.abs(w) > _FLT_MAX)  # noqa: PLR0124
        for m in tl.static_range(K):
            em = tl.sum(tl.where(jj == m, e, 0), axis=1)
            bad = bad | ((jj != m) & (e == em[:, None]))
        bad = bad & slot & (tt < T)
        tok = t0 + tl.arange(0, TBLOCK)
        tl.store(flags_ptr + tok, tl.max(bad.to(tl.int8), axis=1), mask=tok < bucket_tokens)


@triton.jit
def _route_kernel(ids_ptr, wide_ptr, w_ptr, tokens_ptr, m_sizes_ptr, pos_ptr, src_ptr, live_ptr, flags_ptr,
                  x_ptr, aq_ptr, scale_ptr, x_flags_ptr, FP8_MAX,
                  bucket_tokens: tl.constexpr, R: tl.constexpr, G: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                  CHUNK: tl.constexpr, TBLOCK: tl.constexpr, QUANT: tl.constexpr, S: tl.constexpr,
                  H: tl.constexpr, BLOCKS: tl.constexpr, FNUZ: tl.constexpr, BIAS: tl.constexpr,
                  MIN_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr):
    g = tl.program_id(0)
    part = tl.program_id(1)
    T = tl.load(tokens_ptr)
    wide = tl.load(wide_ptr).to(tl.int32)
    if g > G:
        # The last program checks every real token, beside the routing programs rather than
        # after one of them (its loads and reductions were that program's tail).
        if part == 0:
            _check_tokens(ids_ptr, w_ptr, flags_ptr, T, wide, bucket_tokens, G, K, KP, TBLOCK)
        return
    below = tl.zeros([CHUNK], dtype=tl.int32)
    own = tl.zeros([CHUNK], dtype=tl.int32)
    for c in range(0, R, CHUNK):
        i = c + tl.arange(0, CHUNK)
        e = _expert_of(ids_ptr, i, i < R, wide)
        eff = tl.where((i // K < T) & (e >= 0) & (e < G), e, G)
        eff = tl.where(i < R, eff, G + 1)
        below += (eff < g).to(tl.int32)
        own += (eff == g).to(tl.int32)
    start = tl.sum(below, axis=0).to(tl.int64)
    if part == 0:
        if g < G:
            tl.store(m_sizes_ptr + g, tl.sum(own, axis=0).to(tl.int64))
        else:
            tl.store(live_ptr, start)
    run = start
    for c in range(0, R, CHUNK):
        i = c + tl.arange(0, CHUNK)
        e = _expert_of(ids_ptr, i, i < R, wide)
        eff = tl.where((i // K < T) & (e >= 0) & (e < G), e, G)
        mine = (eff == g) & (i < R)
        m = mine.to(tl.int64)
        row = run + tl.cumsum(m, axis=0) - m
        tl.store(pos_ptr + i, row, mask=mine)
        tl.store(src_ptr + row, (i // K).to(tl.int64), mask=mine)
        run += tl.sum(m, axis=0)
    if QUANT:
        tl.debug_barrier()  # this program's src words, stored above by its threads
        r = start + part  # a while loop: the interpreter takes no run-time range bounds
        while r < run:
            token = tl.load(src_ptr + r)
            quantize_row(x_ptr, token, r, aq_ptr, scale_ptr, x_flags_ptr, FP8_MAX, H, BLOCKS, FNUZ,
                         BIAS, MIN_NORMAL, SUB_SCALE)
            r += S


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, tokens_ptr, stride_y, stride_out,
                    H: tl.constexpr, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    if t >= tl.load(tokens_ptr):
        return
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(pos_ptr + t * K + j)
        w = tl.load(w_ptr + t * K + j)
        y = tl.load(y_ptr + row * stride_y + cols, mask=inside, other=0.0).to(tl.float32)
        acc = acc + w * y
    # Rounded with integer operations (exact on a GPU and in the interpreter), then cast.
    tl.store(out_ptr + t * stride_out + cols, _round_to_bf16(acc).to(tl.bfloat16), mask=inside)


@triton.jit
def _quantize_scatter_kernel(x_ptr, pos_ptr, aq_ptr, scale_ptr, flags_ptr, FP8_MAX, K: tl.constexpr,
                             H: tl.constexpr, BLOCKS: tl.constexpr, FNUZ: tl.constexpr,
                             BIAS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    flag = tl.full([], 0, tl.int32)
    for c in range(0, H // 128, BLOCKS):
        code, scale, bad = quantized_chunk(x_ptr, t, c, FP8_MAX, H, BLOCKS, FNUZ, BIAS,
                                           MIN_NORMAL, SUB_SCALE)
        for j in range(K):
            store_chunk(code, scale, tl.load(pos_ptr + t * K + j), c, aq_ptr, scale_ptr, H, BLOCKS)
        flag = flag | bad
    tl.store(flags_ptr + t, flag)


def route(ids: torch.Tensor, wide: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor,
          G: int, k: int, m_sizes: torch.Tensor, pos: torch.Tensor, src: torch.Tensor,
          live: torch.Tensor, flags: torch.Tensor, quantize: tuple | None = None) -> None:
    """Fill ``m_sizes``, ``pos``, ``src``, ``live`` and ``flags`` (see the table) for the
    ``len(flags)`` bucket tokens; capture-safe. ``ids``: int32 words, at least
    ``2 * len(flags) * k`` of them.

    ``quantize``: ``(x, (xq, x_scale), x_flags)``: also the routed rows of bf16 tokens
    ``x`` ``[Tb, H]`` quantized, ``xq[r], x_scale[r]`` from token ``src[r]`` (``R = Tb * k``
    rows), and ``x_flags[t]`` 1 where token ``t`` holds NaN or Inf:
    ``gather_quantize_triton(x, src, x_flags, (xq, x_scale))`` bit for bit."""
    bucket_tokens = flags.shape[0]
    if bucket_tokens == 0:
        return
    if ids.dtype != torch.int32 or ids.numel() < 2 * bucket_tokens * k:
        raise ValueError(f"ids must be int32 words, 2 per entry, got {ids.dtype} {ids.numel()}")
    rows = bucket_tokens * k
    if quantize is None:
        x = xq = x_scale = x_flags = flags
        H, blocks, parts, limit, fnuz = BLOCK, 1, 1, 1.0, False
    else:
        x, (xq, x_scale), x_flags = quantize
        H = check_gather_quantize(x, (xq, x_scale), rows)
        blocks, _ = row_chunk(H, rows)
        # Programs per expert: as many as its mean rows (each row's loads wait on the src word
        # before them: a program walks its rows one by one), 32 at most.
        parts = min(32, triton.next_power_of_2(triton.cdiv(rows, G + 1)))
        limit, fnuz = fp8_max(xq.dtype), xq.dtype == torch.float8_e4m3fnuz
        xq = xq.view(torch.uint8)
    bias, min_normal, sub_scale = _FORMAT[fnuz]
    _route_kernel[(G + 2, parts)](
        ids, wide, weights, tokens, m_sizes, pos, src, live, flags, x, xq, x_scale, x_flags, limit,
        bucket_tokens=bucket_tokens, R=rows, G=G, K=k, KP=triton.next_power_of_2(k), CHUNK=_CHUNK,
        TBLOCK=max(1, _CHUNK // triton.next_power_of_2(k)), QUANT=quantize is not None, S=parts,
        H=H, BLOCKS=blocks, FNUZ=fnuz, BIAS=bias, MIN_NORMAL=min_normal, SUB_SCALE=sub_scale,
        num_warps=4 if H <= 16 * BLOCK else 8, enable_fp_fusion=False,
    )


def combine(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor,
            k: int, out: torch.Tensor) -> None:
    """``out[t] = bf16(sum_j weights[t*k+j] * y[pos[t*k+j]])`` for ``t < tokens``; capture-safe."""
    bucket_tokens, H = out.shape
    if bucket_tokens == 0:
        return
    block_h = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(bucket_tokens, triton.cdiv(H, block_h))](
        y, pos, weights, out, tokens, y.stride(0), out.stride(0), H=H, K=k, BLOCK_H=block_h,
        num_warps=4, enable_fp_fusion=False,
    )


def quantize_scatter(x: torch.Tensor, pos: torch.Tensor, k: int, flags: torch.Tensor,
                     out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each bucket token of bf16 ``x`` ``[Tb, H]`` quantized once and stored at its ``k``
    routed rows ``pos[t*k + j]`` of ``out = (xq [Tb*k, H], x_scale [Tb*k, H/128])``;
    ``flags[t]`` = 1 where token ``t`` holds NaN or Inf. ``gather_quantize_triton(x, src,
    flags, out)`` bit for bit (``pos`` and ``src`` being the routing's inverse maps), with a
    k-th of its quantization work: a routed token is quantized once, not once per expert.
    Capture-safe."""
    bucket_tokens = x.shape[0]
    xq, x_scale = out
    H = check_gather_quantize(x, out, bucket_tokens * k)
    if bucket_tokens == 0:
        return xq, x_scale
    fnuz = xq.dtype == torch.float8_e4m3fnuz
    bias, min_normal, sub_scale = _FORMAT[fnuz]
    blocks, warps = row_chunk(H, bucket_tokens)
    _quantize_scatter_kernel[(bucket_tokens,)](
        x, pos, xq.view(torch.uint8), x_scale, flags, fp8_max(xq.dtype),
        K=k, H=H, BLOCKS=blocks, FNUZ=fnuz, BIAS=bias, MIN_NORMAL=min_normal,
        SUB_SCALE=sub_scale, num_warps=warps, enable_fp_fusion=False,
    )
    return xq, x_scale

# Every kernel's cache key as any process computes it, whatever it launches first (_triton_keys).
settle(globals())
