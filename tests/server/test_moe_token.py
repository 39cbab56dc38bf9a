"""The one-token moe kernels (``kernels/_triton_moe_token.py``) in Triton's interpreter (a fresh
process with ``TRITON_INTERPRET=1``), against the torch definitions.

- the up kernel's ``h`` equals the float64 GEMM of the token quantized as
  ``quantize_activations`` quantizes it (or the fp8 token as given), slot by slot;
- the down kernel's output equals, from that ``h``, ``silu_mul_quant`` (the torch
  definition), the float64 w2 GEMM rounded to bf16, and ``combine_torch``'s float32 sum
  in slot order, and the whole chain meets SPEC 5's bound against the float64 chain;
- bad ids (out of range, past int32 in int64 words, repeated), NaN/Inf weights, NaN/Inf
  bf16 tokens and fp8 tokens' bad scales are flagged as the grouped path flags them (the
  routing kernel's check, ``bad_rows``; an fp8 NaN code is no flag), and nothing reads
  out of bounds;
- the counters are left at zero.

Shapes reach the decode tiles' variants the kernels reproduce: ``decode_pair`` with an odd
block count (its tail), plain ``decode``, 8-warp pairs at G >= 64, split-K with an odd split.
The bits on the device: ``test_moe_token_gpu.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ffn_support import FFN_TOLERANCE, expert_set, moe_float64, quantized

FP8 = torch.float8_e4m3fn


def _table(ws) -> torch.Tensor:
    return torch.tensor([ws.wq.data_ptr(), ws.w_scale.data_ptr()], dtype=torch.int64)


def ids_words(ids: torch.Tensor, wide: int) -> torch.Tensor:
    """``ids`` as the moe buffers hold them (``test_ffn_graphs.ids_words``): int32 words."""
    if wide:
        return ids.to(torch.int64).view(torch.int32).clone()
    words = torch.full((2 * ids.numel(),), 12345, dtype=torch.int32)
    words[: ids.numel()] = ids.to(torch.int32)
    return words


def run_token(es, x, xs, ids, weights, wide: int) -> dict:
    """Both kernels on one token (CPU tensors): h, out, the flags, the counters after."""
    from moegemm.kernels._triton_moe_token import counts_words, moe_token

    k, H, I = ids.numel(), es.H, es.I
    got = {"h": torch.full((k, 2 * I), float("nan")),
           "out": torch.full((1, H), 7.0, dtype=torch.bfloat16),
           "x_flags": torch.full((1,), 9, dtype=torch.int8),
           "route_flags": torch.full((1,), 9, dtype=torch.int8),
           "counts": torch.zeros(counts_words(H), dtype=torch.int32)}
    parts = torch.full((k, H), float("nan"))
    moe_token(x, xs, ids_words(ids, wide), torch.tensor(wide), weights.float(), torch.tensor(1),
              _table(es.w13), _table(es.w2), es.G, I, got["h"], parts, got["counts"], got["out"],
              got["x_flags"], got["route_flags"])
    return got


def _slot_gemm(xq, xs, ws, e: int) -> torch.Tensor:
    """One row through expert ``e`` of weight set ``ws``, in float64 (SPEC 1)."""
    from moegemm.kernels import reference_float64

    sizes = torch.zeros(ws.wq.shape[0], dtype=torch.int64)
    sizes[e] = 1
    return reference_float64(xq, ws.wq, xs, ws.w_scale, sizes)


def _check_answer(es, x, xs, ids, weights, got) -> None:
    from moegemm.kernels import silu_mul_quant
    from moegemm.kernels.testing import rel_error
    from moegemm.server._ffn_graphs import combine_torch

    xq, xsq = quantized(x, xs, FP8)
    k = ids.numel()
    want_h = torch.cat([_slot_gemm(xq, xsq, es.w13, int(e)) for e in ids])
    assert rel_error(got["h"], want_h) <= 1e-5  # float32 sums of the same products
    aq, a_scale = silu_mul_quant(got["h"], FP8)
    y = torch.cat([_slot_gemm(aq[j : j + 1], a_scale[j : j + 1], es.w2, int(e))
                   for j, e in enumerate(ids)]).to(torch.bfloat16)
    want = torch.zeros((1, es.H), dtype=torch.bfloat16)
    combine_torch(y, torch.arange(k), weights.float(), torch.tensor(1), k, want)
    # The same bf16 y but for rare last-bit flips (float32 sums against float64 ones).
    assert rel_error(got["out"], want) <= 2e-3
    ref = moe_float64(es, xq, xsq, ids.view(1, k), weights.view(1, k), FP8)
    assert rel_error(got["out"], ref) <= FFN_TOLERANCE
    assert got["x_flags"].tolist() == [0] and got["route_flags"].tolist() == [0]
    assert not got["counts"].any()


def _token(H, gen, kind):
    x = torch.randn((1, H), generator=gen) * 3
    if kind == "bf16":
        return x.to(torch.bfloat16), None
    from moegemm.kernels import quantize_activations

    return quantize_activations(x, FP8)


def compare_on_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    # (G, H, I, k, wide, kind): w13 decode_pair with 3 K blocks (its odd tail), w2 pairs;
    # top-1, fp8 tokens; 8-warp pairs at G = 64, top-8; plain decode w13 and a w2 split
    # two ways over 33 K blocks (17 + 16: the odd tail inside a split).
    cases = ((5, 384, 256, 2, 0, "bf16"), (5, 384, 256, 1, 1, "fp8"), (64, 256, 128, 8, 1, "bf16"),
             (4, 256, 4224, 2, 0, "fp8"))
    for G, H, I, k, wide, kind in cases:
        es = expert_set(G, H, I, FP8, "cpu", gen)
        x, xs = _token(H, gen, kind)
        ids = torch.randperm(G, generator=gen)[:k]
        weights = torch.rand(k, generator=gen) + 0.05
        got = run_token(es, x, xs, ids, weights, wide)
        _check_answer(es, x, xs, ids, weights, got)
        if I < 4096:  # (the flags do not depend on the tile; the split case runs long here)
            _check_flags(es, x, xs, ids, weights, wide, kind)


def _check_flags(es, x, xs, ids, weights, wide, kind) -> None:
    """Each bad input flagged as the grouped path flags it; the counters stay at zero."""
    k, G = ids.numel(), es.G
    bad_ids = [G, -1, G + 1000] + ([1 << 40, (1 << 32) + int(ids[0])] if wide else [])
    cases = []
    for value in bad_ids:
        b = ids.clone()
        b[k - 1] = value
        cases.append((b, weights, "route"))
    if k > 1:
        dup = ids.clone()
        dup[1] = dup[0]
        cases.append((dup, weights, "route"))
    for value in (float("nan"), float("inf"), -float("inf")):
        bw = weights.clone()
        bw[0] = value
        cases.append((ids, bw, "route"))
    for b, bw, _ in cases:
        got = run_token(es, x, xs, b, bw, wide)
        assert got["route_flags"].tolist() == [1], (b, bw)
        assert got["x_flags"].tolist() == [0] and not got["counts"].any()
    if kind == "bf16":
        for value in (float("nan"), float("inf")):
            bad = x.clone()
            bad[0, es.H - 1] = value
            got = run_token(es, bad, None, ids, weights, wide)
            assert got["x_flags"].tolist() == [1] and got["route_flags"].tolist() == [0]
    else:
        bad = x.clone()
        bad.view(torch.uint8)[0, 5] = 0xFF  # an e4m3fn NaN code: no flag (SPEC 2.2: the scales)
        assert run_token(es, bad, xs, ids, weights, wide)["x_flags"].tolist() == [0]
        for value in (0.0, float("nan"), float("inf"), -1.0):
            bs = xs.clone()
            bs[0, -1] = value
            assert run_token(es, x, bs, ids, weights, wide)["x_flags"].tolist() == [2]


def test_moe_token_kernels_in_the_triton_interpreter():
    pytest.importorskip("triton")
    here = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_moe_token; " \
           "test_moe_token.compare_on_cpu()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=False, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


def test_pipeline_stages_keep_every_program_in_shared_memory():
    """The K loop's stages: up to 6 blocks in flight, never more than the K blocks, and more
    than the shipped 3 only while every program of the grid fits in the SMs' shared memory at
    once (a stage is the weight block and the token tile's block)."""
    pytest.importorskip("triton")
    from moegemm.kernels._triton_moe_token import _STAGES_SMEM, pipeline_stages
    from moegemm.kernels.triton_kernel import SMS

    # Qwen3-30B-A3B t1 (64-row tiles, 193 and 256 programs): the whole w2 K (6 blocks) in
    # flight; DeepSeek-V3 (128-row tiles): 4 blocks up (257 programs), down stays at 3 (448).
    assert pipeline_stages(193, 64, 16, 16) == 7 and pipeline_stages(256, 64, 16, 6) == 7
    assert pipeline_stages(257, 128, 16, 56) == 5 and pipeline_stages(448, 128, 16, 16) == 3
    for programs in (2, 33, 132, 133, 264, 265, 448, 1000):
        for rows in (64, 128):
            for kb in (1, 2, 6, 16, 56):
                stages = pipeline_stages(programs, rows, 16, kb)
                assert 3 <= stages <= max(3, min(kb + 1, 7))
                per_sm = -(-programs // SMS)
                assert stages == 3 or per_sm * stages * (rows + 16) * 128 <= _STAGES_SMEM
