"""A one-token moe graph in two Triton kernels: up (w13), then down (w2) with the combine.

| tensor        | shape      | dtype     | meaning |
|---------------|------------|-----------|---------|
| `x`           | `[1, H]`   | bf16, or fp8 e4m3fn with `x_scale` `[1, H/128]` float32 | the token |
| `ids`         | `[2k]`     | int32     | its `topk_ids` as words: int32 ids, or int64 ids as (low, high) pairs (``_triton_route``) |
| `wide`        | `[]`       | int64     | 1 when `ids` holds int64 ids |
| `weights`     | `[k]`      | float32   | its `topk_weights` |
| `tokens`      | `[]`       | int64     | real tokens (1; a device word as for the routing kernel) |
| `table13`, `table2` | `[2]` | int64    | `w13`'s and `w2`'s `wq` and `w_scale` base addresses (the family's words) |
| `h`           | `[k, 2I]`  | float32   | out of the up kernel: slot j's `x @ w13[e_j]^T`, the grouped path's `h` row |
| `parts`       | `[k, H]`   | float32   | workspace: slot j's `y` (rounded to bf16) |
| `counts`      | `[H/64]`   | int32     | zero, and left zero: the down kernel's arrival counters |
| `q`, `qs`     | `[P, K]`, `[P, K/128]` | fp8, float32 | scratch: each of a kernel's ``P`` tile programs' quantized row (K = H up, I down) |
| `out`         | `[1, H]`   | bf16      | `sum_j weights[j] * y_j` |
| `x_flags`, `route_flags` | `[1]` | int8 | the token's NaN/Inf (and bad scale) flags, its routing flag (SPEC 2.2) |

Why two kernels are enough at one token: a token's top-k ids are distinct when
they are valid, so each expert the token names gets exactly one row of the
grouped GEMMs, and that row is the token itself. There is nothing to sort,
gather or scatter; expert ``e_j``'s weights are read once, by the programs of
slot ``j``. (From two tokens an expert may get several rows: the grouped path.)

- **up** (grid: 1 + slot ``j`` x tiles of ``2I``): program 0 writes the token's
  flags and the routing flags (``_check_tokens``, the routing kernel's check), a
  program of its own so that no tile carries it on its tail. Each other program
  reads its slot's id (a bad id reads expert 0: nothing out of bounds, and the
  flags refuse the call), quantizes the token's bf16 blocks as ``quantize_row``
  does into its own scratch row (fp8 tokens: read as given) and computes its
  tile of ``h[j]``.
- **down + combine** (grid: tiles of ``H`` x slot ``j``): each program computes
  SiLU(gate) * up and its fp8 blocks from ``h[j]`` as ``_silu_mul_quant_kernel``
  does (into its scratch row), multiplies by ``w2[e_j]``, rounds ``y_j`` to bf16
  as the w2 GEMM stores it, and parks it in ``parts``; the last program of a tile
  to arrive sums ``weights[j] * y_j`` in float32 in slot order and rounds once,
  as ``_combine_kernel`` does (no atomics on values: the order is fixed). The
  slots are programs of their own, not a loop in one: at Qwen3-30B's H = 2048 the
  tiles of H alone are 16-32 programs for 132 SMs.

The quantization runs once per program before its K loop (a reduction and IEEE
divisions on every block's way to the tensor cores would lengthen each
iteration), so the loop is the decode GEMM's: the operand's and the weights'
loads, the dot, the promotion. The loop waits on memory only for its copies:
the scales of every block are loaded before it (the weights' at the program's
head, beside the id), and up to 6 blocks are in flight (``pipeline_stages``).
At one token every program streams its whole tile after its prologue, so the
head of a program is kept to one round trip before its weights' address is
known (``_slot_expert``).

**Bit for bit the grouped path.** A merged launch (several calls in a bucket of
2+ tokens) runs the grouped path; a lone call must get the same bits
(SPEC 5.1). Every element here is computed as the grouped GEMM's tile for the
bucket's ``k`` rows computes it (``triton_kernel.default_config``: the executor
merges calls only across buckets whose tiles are equal): the same 128-wide K
blocks in order, the same dot shapes (the token repeated over the tile's
``BLOCK_M`` rows; the weight tile is the MMA's M side, whose height does not
change an element), ``acc = fma(dot, x_scale * w_scale, acc)`` (the GEMM's
promotion, contracted there: ``enable_fp_fusion`` is off here for the
quantization's sake, so the fma is written out), split-K partials summed in
split order, ``decode_pair``'s odd last block paired with itself at scale 0.
The quantization, activation and roundings are the shared ``@triton.jit``
helpers of ``_triton_act``. ``tests/server/test_moe_token_gpu.py`` checks the
bits on the device. Imported only with the triton backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from moegemm.kernels._backend import BLOCK
from moegemm.kernels._triton_act import (
    _FORMAT,
    _INTERPRETED,
    _round_to_bf16,
    nan_inf_flag,
    quantize_blocks,
    silu_mul,
)
from moegemm.kernels._triton_gemm import _weights
from moegemm.kernels.quant import fp8_max
from moegemm.kernels.triton_kernel import SMS, default_config

from ._triton_keys import settle
from ._triton_route import _FLT_MAX, _check_tokens

# A kernel's weight tile is 128 rows where that still gives every SM (``SMS``, the H200's)
# a program, else 64 (a 128-row tile keeps more loads in flight per program).
# Shared memory an SM gives the pipeline stages of the programs it holds (of its 227 KiB):
# more stages only while every program of the grid still fits at once.
_STAGES_SMEM = 200 * 1024


# A split's K blocks, as ``_k_range`` gives them: [lo, hi). Constexpr functions, not
# expressions in the kernel: the interpreter makes every assigned value a tensor.
@triton.constexpr_function
def _split_lo(s, per, kb):
    return min(s * per, kb)


@triton.constexpr_function
def _split_hi(s, per, kb):
    return min(s * per + per, kb)


@triton.constexpr_function
def _pair_tail(s, per, kb, pair):
    """1 where ``decode_pair`` ends split ``s`` on an odd block paired with itself."""
    return (_split_hi(s, per, kb) - _split_lo(s, per, kb)) % 2 if pair else 0


@triton.constexpr_function
def _pow2(n):
    return triton.next_power_of_2(n)


@triton.constexpr_function
def _chunk(kb):
    """Blocks of 128 a program quantizes at once before its K loop (bounds its registers)."""
    return min(16, triton.next_power_of_2(kb))


@triton.jit
def _quantize_into(src_ptr, up_ptr, q_ptr, qs_ptr, FP8_MAX, KB: tl.constexpr, ACT: tl.constexpr,
                   FNUZ: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                   SUB_SCALE: tl.constexpr, INTERPRETED: tl.constexpr):
    """A row's ``KB`` blocks quantized into ``q`` (fp8) and ``qs`` (scales): the bf16 row at
    ``src_ptr`` (``quantize_row``'s arithmetic), or with ``ACT`` SiLU(gate) * up of the
    float32 gate row at ``src_ptr`` and up row at ``up_ptr`` (the activation kernel's).
    Done once, before the K loop, so the loop's body is the GEMM's: an operand's loads, not
    a reduction and IEEE divisions on each block's way to the tensor cores."""
    CH: tl.constexpr = _chunk(KB)
    for c0 in tl.static_range(0, KB, CH):
        blk = c0 + tl.arange(0, CH)
        col = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
        inside = blk[:, None] < KB
        x = tl.load(src_ptr + col, mask=inside, other=0.0).to(tl.float32)
        if ACT:
            x = silu_mul(x, tl.load(up_ptr + col, mask=inside, other=0.0), INTERPRETED)
        code, scale = quantize_blocks(x, FP8_MAX, FNUZ, BIAS, MIN_NORMAL, SUB_SCALE)
        tl.store(q_ptr + col, code.to(tl.uint8).to(tl.float8e4nv, bitcast=True), mask=inside)
        tl.store(qs_ptr + blk, scale, mask=blk < KB)
    tl.debug_barrier()  # the K loop reads back what this program's threads stored


@triton.jit
def _x_flags(x_ptr, xs_ptr, KB: tl.constexpr, FP8_IN: tl.constexpr):
    """The token's flags as ``bad_rows`` gives them: bf16 NaN/Inf 1; fp8 a scale not finite
    and > 0 2 (its codes are not checked, SPEC 2.2) (int32)."""
    CH: tl.constexpr = _chunk(KB)
    flag = tl.full([], 0, dtype=tl.int32)
    for c0 in tl.static_range(0, KB, CH):
        blk = c0 + tl.arange(0, CH)
        if FP8_IN:
            scale = tl.load(xs_ptr + blk, mask=blk < KB, other=1.0)
            good = (scale > 0.0) & (scale <= _FLT_MAX)
            flag = flag | (tl.max((~good).to(tl.int32), axis=0) << 1)
        else:
            col = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
            x = tl.load(x_ptr + col, mask=blk[:, None] < KB, other=0.0).to(tl.float32)
            flag = flag | nan_inf_flag(x).to(tl.int32)
    return flag


@triton.jit
def _w_scales(ws_ptr, WS_STEP: tl.constexpr, KB: tl.constexpr):
    """The weight tile's scales of every K block (``ws_ptr``: K block 0's, ``WS_STEP`` apart),
    ``[next_power_of_2(KB)]`` float32 (0 past ``KB``). Loaded at the head of a program, so
    their round trip overlaps its prologue (:func:`_row_tile` says why)."""
    blk = tl.arange(0, _pow2(KB))
    return tl.load(ws_ptr + blk * WS_STEP, mask=blk < KB, other=0.0)


@triton.jit
def _row_tile(a_ptr, as_ptr, w_ptrs, ws_ptr, ws_all, WS_STEP: tl.constexpr, KB: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
              PAIR: tl.constexpr, EVICT_W: tl.constexpr):
    """One weight tile times the fp8 row at ``a_ptr`` (scales at ``as_ptr``), as the decode
    GEMMs compute it: ``acc`` ``[BLOCK_N, BLOCK_M]``, every column the row's (its loads
    repeat the row over the token tile, as the GEMM's clamp repeats a group's last row),
    float32 unrounded.

    ``w_ptrs``: the tile's first K block ``[BLOCK_N, 128]``; ``ws_ptr``: its weight-scale
    column at K block 0 (``WS_STEP`` apart per block), ``ws_all`` those scales
    (:func:`_w_scales`). ``_k_range``'s splits, each summed from zero, added in split order
    (``_split_k_finish``); within a split ``acc = fma(dot, x_scale * w_scale, acc)`` block
    by block (``decode_kernel``; ``decode_pair`` the same, its odd last block paired with
    itself scaled by ``x_scale * (w_scale * 0)``).

    The products ``x_scale * w_scale`` of every block are taken before the loop (the same
    float32 products) and block ``kb``'s picked out in the loop as its sum with zeros: the
    product's bits, or ``+0.0`` for ``-0.0``, which changes no ``fma`` here (``acc`` starts
    at ``+0.0`` and an fma gives ``-0.0`` only from ``-0.0``, so it is never ``-0.0``, and
    ``d * (+-0) + acc`` is then the same for either sign; ``d`` infinite or NaN gives NaN
    either way). No load is left on the loop's path (a scale load per block, each a round
    trip that the next blocks' copies queued behind, was the loop's pace)."""
    PER: tl.constexpr = (KB + SPLIT_K - 1) // SPLIT_K
    rows = tl.arange(0, BLOCK_M)
    a_ptrs = a_ptr + rows[:, None] * 0 + tl.arange(0, 128)[None, :]
    as_ptrs = as_ptr + rows * 0
    blk = tl.arange(0, _pow2(KB))
    scales = tl.load(as_ptr + blk, mask=blk < KB, other=0.0) * ws_all
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb in range(_split_lo(s, PER, KB), _split_hi(s, PER, KB) - _pair_tail(s, PER, KB, PAIR)):
            a = tl.load(a_ptrs + kb * 128)
            w = tl.load(w_ptrs + kb * 128, eviction_policy=EVICT_W)
            scale = tl.sum(tl.where(blk == kb, scales, 0.0), axis=0)
            acc = tl.fma(tl.dot(w, tl.trans(a)), scale, acc)
        if _pair_tail(s, PER, KB, PAIR) == 1:
            last = _split_hi(s, PER, KB) - 1
            a = tl.load(a_ptrs + last * 128)
            w = tl.load(w_ptrs + last * 128, eviction_policy=EVICT_W)
            xs = tl.load(as_ptrs + last)
            ws = tl.load(ws_ptr + last * WS_STEP)
            part = tl.dot(w, tl.trans(a))
            acc = tl.fma(part, (xs * ws)[None, :], acc)
            acc = tl.fma(part, (xs * (ws * 0.0))[None, :], acc)
        if s == 0:
            total = acc
        else:
            total = total + acc
    return total


@triton.jit
def _slot_expert(ids_ptr, wide_ptr, j, G: tl.constexpr):
    """Slot ``j``'s expert as int64, as ``_triton_route._expert_of`` reads it; a bad id (refused by the
    routing flag) reads expert 0. Both readings of the words are loaded beside ``wide``
    (``ids`` holds 2k words either way), so the weights' address waits on one round trip
    to memory, not on ``wide`` and then the id (two, at the head of every program)."""
    wide = tl.load(wide_ptr)
    narrow = tl.load(ids_ptr + j)
    lo = tl.load(ids_ptr + 2 * j)
    hi = tl.load(ids_ptr + 2 * j + 1)
    e = tl.where(wide != 0, tl.where(hi == 0, lo, -1), narrow)
    return tl.where((e >= 0) & (e < G), e, 0).to(tl.int64)


@triton.jit
def _store_column(row_ptr, offs_n, acc, BLOCK_M: tl.constexpr):
    """Column 0 of ``acc`` ``[BLOCK_N, BLOCK_M]`` (the row's) at ``row_ptr[offs_n]``, its bits as
    they are."""
    m = tl.arange(0, BLOCK_M)[None, :]
    tl.store(row_ptr + offs_n[:, None] + m * 0, acc, mask=m == 0)


@triton.jit
def _weight_tile(table_ptr, e, tile, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Expert ``e``'s weight tile ``tile`` (rows ``tile * BLOCK_N ...`` of its ``[N, K]``) through
    the family's address table: ``(offs_n, w_ptrs [BLOCK_N, 128], ws_ptr)`` at K block 0."""
    w_base, ws_base = _weights(table_ptr, table_ptr, True)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_ptrs = w_base + e * (N * K) + offs_n.to(tl.int64)[:, None] * K + tl.arange(0, 128)[None, :]
    ws_ptr = ws_base + e * ((K // 128) * (N // 128)) + (tile * BLOCK_N) // 128
    return offs_n, w_ptrs, ws_ptr


@triton.jit
def _up_kernel(x_ptr, xs_ptr, ids_ptr, wide_ptr, wts_ptr, tokens_ptr, table_ptr, h_ptr,
               q_ptr, qs_ptr, x_flags_ptr, route_flags_ptr, FP8_MAX,
               G: tl.constexpr, H: tl.constexpr, N: tl.constexpr, TOP_K: tl.constexpr,
               KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
               SPLIT_K: tl.constexpr, PAIR: tl.constexpr, FP8_IN: tl.constexpr,
               EVICT_W: tl.constexpr, FNUZ: tl.constexpr, BIAS: tl.constexpr,
               MIN_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr, INTERPRETED: tl.constexpr):
    pid = tl.program_id(0)
    if pid == 0:
        # The token's flags and the routing check in a program of their own (the first to
        # start), beside the tiles rather than on one tile's tail.
        tl.store(x_flags_ptr, _x_flags(x_ptr, xs_ptr, H // 128, FP8_IN).to(tl.int8))
        _check_tokens(ids_ptr, wts_ptr, route_flags_ptr, tl.load(tokens_ptr),
                      tl.load(wide_ptr).to(tl.int32), 1, G, TOP_K, KP, 1)
        return
    TILES: tl.constexpr = N // BLOCK_N
    j = (pid - 1) // TILES
    tile = (pid - 1) % TILES
    e = _slot_expert(ids_ptr, wide_ptr, j, G)
    offs_n, w_ptrs, ws_ptr = _weight_tile(table_ptr, e, tile, N, H, BLOCK_N)
    ws_all = _w_scales(ws_ptr, N // 128, H // 128)
    if FP8_IN:
        a_ptr, as_ptr = x_ptr, xs_ptr
    else:  # each program quantizes the token into its own rows of q and qs
        row = (pid - 1).to(tl.int64)
        a_ptr, as_ptr = q_ptr + row * H, qs_ptr + row * (H // 128)
        _quantize_into(x_ptr, x_ptr, a_ptr, as_ptr, FP8_MAX, H // 128, False, FNUZ, BIAS,
                       MIN_NORMAL, SUB_SCALE, INTERPRETED)
    acc = _row_tile(a_ptr, as_ptr, w_ptrs, ws_ptr, ws_all, N // 128, H // 128, BLOCK_N, BLOCK_M,
                    SPLIT_K, PAIR, EVICT_W)
    _store_column(h_ptr + j * N, offs_n, acc, BLOCK_M)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, wide_ptr, wts_ptr, table_ptr, q_ptr, qs_ptr, parts_ptr,
                 counts_ptr, out_ptr, FP8_MAX, G: tl.constexpr, H: tl.constexpr,
                 I: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, PAIR: tl.constexpr,
                 EVICT_W: tl.constexpr, FNUZ: tl.constexpr, BIAS: tl.constexpr,
                 MIN_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr, INTERPRETED: tl.constexpr):
    tile = tl.program_id(0)
    j = tl.program_id(1)
    e = _slot_expert(ids_ptr, wide_ptr, j, G)
    offs_n, w_ptrs, ws_ptr = _weight_tile(table_ptr, e, tile, H, I, BLOCK_N)
    ws_all = _w_scales(ws_ptr, H // 128, I // 128)
    # Each program activates and quantizes slot j's h row into its own rows of q and qs.
    pid = (tile * TOP_K + j).to(tl.int64)
    a_ptr, as_ptr = q_ptr + pid * I, qs_ptr + pid * (I // 128)
    _quantize_into(h_ptr + j * (2 * I), h_ptr + j * (2 * I) + I, a_ptr, as_ptr, FP8_MAX, I // 128,
                   True, FNUZ, BIAS, MIN_NORMAL, SUB_SCALE, INTERPRETED)
    acc = _row_tile(a_ptr, as_ptr, w_ptrs, ws_ptr, ws_all, H // 128, I // 128, BLOCK_N, BLOCK_M,
                    SPLIT_K, PAIR, EVICT_W)
    # y_j as the w2 GEMM stores it (bf16), parked until the tile's last slot arrives.
    _store_column(parts_ptr + j * H, offs_n, _round_to_bf16(acc), BLOCK_M)
    tl.debug_barrier()  # every thread's part is written before one thread announces it
    arrived = tl.atomic_add(counts_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == TOP_K - 1:
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in tl.static_range(TOP_K):  # the combine: slot order, one multiply and one add each
            w = tl.load(wts_ptr + i)
            y = tl.load(parts_ptr + i * H + offs_n, cache_modifier=".cg")
            total = total + w * y
        tl.store(out_ptr + offs_n, _round_to_bf16(total).to(tl.bfloat16))
        tl.store(counts_ptr + tile, 0)


def _gemm_tile(rows: int, n: int, k: int, g: int, device: torch.device) -> tuple[int, int, bool]:
    """(token tile, split-K ways, pairs) of the grouped GEMM's tile for ``rows`` rows: the
    arithmetic the one-token kernels reproduce."""
    config = default_config(rows, n, k, g)
    if not config.swap_ab:
        raise ValueError(f"a {rows}-row launch runs {config.key()}, not a decode tile")
    split = max(1, min(config.split_k, k // BLOCK))
    return config.block_m, split, config.schedule == "decode_pair"


def weight_tile(top_k: int, n: int) -> tuple[int, int]:
    """(rows of a program's weight tile, warps) for ``top_k`` slots of ``n`` outputs: 128
    rows (8 warps, as the decode GEMMs' 128-row tiles) where ``top_k * n / 128`` programs
    still fill the SMs, else 64 (4 warps: one warpgroup)."""
    return (128, 8) if top_k * n // 128 >= SMS else (64, 4)


def pipeline_stages(programs: int, rows: int, token_tile: int, kb: int) -> int:
    """``num_stages`` of a kernel whose ``programs`` each stream ``kb`` K blocks of ``rows``
    weight rows (and the ``token_tile`` rows of the operand): the K loop keeps up to 6
    blocks in flight (``stages - 1``; the grouped decode tile keeps 4, two pairs), as many
    as the SMs' shared memory holds for every program at once, and at least 2.

    Why: each program's loop waits on memory once per ``stages - 1`` blocks, and at one
    token a program streams its whole tile (Qwen3-30B: 16 and 6 blocks) after its prologue;
    more bytes in flight per program is what the grouped GEMM has and this loop had not."""
    per_sm = -(-programs // SMS)
    fit = _STAGES_SMEM // (per_sm * (rows + token_tile) * BLOCK)
    return max(3, min(kb + 1, 7, fit))


def counts_words(H: int) -> int:
    """The int32 counters the down kernel needs (its most tiles: 64 rows each)."""
    return H // 64


def moe_token(x: torch.Tensor, x_scale: torch.Tensor | None, ids: torch.Tensor,
              wide: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor,
              table13: torch.Tensor, table2: torch.Tensor, G: int, I: int, h: torch.Tensor,
              parts: torch.Tensor, counts: torch.Tensor, out: torch.Tensor,
              x_flags: torch.Tensor, route_flags: torch.Tensor) -> None:
    """One token's moe (the table) in two launches; capture-safe, no host reads. ``k`` is
    ``weights``' length."""
    k, H = weights.shape[0], x.shape[1]
    if x.shape[0] != 1 or H % BLOCK or I % BLOCK or not x.is_contiguous():
        raise ValueError(f"x must be one contiguous row of H % 128 == 0, got {tuple(x.shape)}")
    if tuple(h.shape) != (k, 2 * I) or h.dtype != torch.float32 or not h.is_contiguous():
        raise ValueError(f"h must be contiguous float32 [{k}, {2 * I}]")
    if parts.dtype != torch.float32 or parts.numel() < k * H or counts.numel() < counts_words(H):
        raise ValueError("parts must hold k * H float32, counts H / 64 int32")
    if ids.dtype != torch.int32 or ids.numel() < 2 * k:
        raise ValueError(f"ids must be int32 words, 2 per slot, got {ids.dtype} {ids.numel()}")
    fp8 = torch.float8_e4m3fn  # what the triton backend computes in
    if x.dtype == torch.bfloat16:
        fp8_in, xs = False, x
    elif x.dtype == fp8 and x_scale is not None:
        fp8_in, xs = True, x_scale
    else:
        raise TypeError(f"x must be bf16, or e4m3fn with x_scale, got {x.dtype}")
    bias, min_normal, sub_scale = _FORMAT[False]
    common = {"FNUZ": False, "BIAS": bias, "MIN_NORMAL": min_normal, "SUB_SCALE": sub_scale,
              "EVICT_W": "evict_first", "INTERPRETED": _INTERPRETED, "enable_fp_fusion": False}
    dev = x.device
    bm, split, pair = _gemm_tile(k, 2 * I, H, G, dev)
    bn, warps = weight_tile(k, 2 * I)
    tiles = k * (2 * I // bn)  # program 0 checks the token and its routing, 1.. the tiles
    scratch = 1 if fp8_in else tiles  # (fp8 tokens are read as given)
    q = torch.empty((scratch, H), dtype=fp8, device=dev)
    qs = torch.empty((scratch, H // BLOCK), dtype=torch.float32, device=dev)
    _up_kernel[(tiles + 1,)](
        x, xs, ids, wide, weights, tokens, table13, h, q, qs, x_flags, route_flags, fp8_max(fp8),
        G=G, H=H, N=2 * I, TOP_K=k, KP=triton.next_power_of_2(k), BLOCK_N=bn, BLOCK_M=bm,
        SPLIT_K=split, PAIR=pair, FP8_IN=fp8_in, num_warps=warps,
        num_stages=pipeline_stages(tiles + 1, bn, bm, H // BLOCK), **common)
    bm, split, pair = _gemm_tile(k, H, I, G, dev)
    bn, warps = weight_tile(k, H)
    grid = (H // bn, k)
    q = torch.empty((grid[0] * grid[1], I), dtype=fp8, device=dev)
    qs = torch.empty((grid[0] * grid[1], I // BLOCK), dtype=torch.float32, device=dev)
    _down_kernel[grid](
        h, ids, wide, weights, table2, q, qs, parts, counts, out, fp8_max(fp8),
        G=G, H=H, I=I, TOP_K=k, BLOCK_N=bn, BLOCK_M=bm, SPLIT_K=split, PAIR=pair,
        num_warps=warps, num_stages=pipeline_stages(grid[0] * grid[1], bn, bm, I // BLOCK),
        **common)

# Every kernel's cache key as any process computes it, whatever it launches first (_triton_keys).
settle(globals())
