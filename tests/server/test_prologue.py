"""The fused check-and-regroup kernel equals the torch ops it replaces, bit for bit (GPU).

``_prologue.check_and_gather`` must give the rows in gather order, their scales,
and the per-row flags of ``_checks.bad_rows`` -- with NaN codes, NaN/Inf and
bad scales planted in some rows -- and executors with and without it must
answer merged calls identically, bad rows included. Skipped without an NVIDIA
GPU and triton.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.version.hip:
    pytest.skip("needs an NVIDIA CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from moegemm.kernels import get_backend
from moegemm.kernels._triton_prologue import check_and_gather
from moegemm.kernels.testing import random_m_sizes, random_problem
from moegemm.server._checks import _bad_rows_torch
from moegemm.server._executor import Executor
from moegemm.server._graphs import GraphPool
from moegemm.server._staging import Staging
from server_support import bf16_rows, gemm_call

DEV = torch.device("cuda")


def _rows_with_bad_values(dtype, rows, k, gen):
    """Random rows of ``dtype``; a few hold NaN codes (fp8: not flagged) / NaN / Inf."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        bits = torch.randint(0, 256, (rows, k), generator=gen, device=DEV, dtype=torch.int32)
        bits = bits.to(torch.uint8)
        nan = 0x80 if dtype == torch.float8_e4m3fnuz else 0x7F
        # Only planted rows may hold the NaN codes.
        clean = bits.clone()
        clean[(clean & 0x7F) == 0x7F] = 0x11
        clean[clean == 0x80] = 0x12
        bits = clean
        for r in range(0, rows, 5):
            bits[r, (r * 37) % k] = nan | (0x80 if dtype == torch.float8_e4m3fn and r % 2 else 0)
        return bits.view(dtype)
    x = torch.randn((rows, k), generator=gen, device=DEV).to(dtype)
    for r in range(0, rows, 5):
        x[r, (r * 37) % k] = (float("nan"), float("inf"), -float("inf"))[r % 3]
    return x


def _scales_with_bad_values(rows, kb, gen):
    s = torch.rand((rows, kb), generator=gen, device=DEV) + 1e-3
    bad = (float("nan"), float("inf"), 0.0, -1.0, -float("inf"))
    for r in range(2, rows, 7):
        s[r, (r * 3) % kb] = bad[r % len(bad)]
    return s


def _gather_as_torch(x, xs, gather):
    """``check_and_gather`` over ``gather``; asserts the rows and scales it copies are
    ``index_select``'s, bit for bit; returns its flags and ``bad_rows``' (the torch ops')."""
    fp8 = x.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    rows = gather.shape[0]
    # Poisoned bytes, as many as the rows hold (a 16-bit row is twice its width in bytes).
    xg = torch.full((rows, x.shape[1] * x.element_size()), 0xEE, dtype=torch.uint8,
                    device=DEV).view(x.dtype)
    xsg = None if xs is None else torch.full((rows, xs.shape[1]), float("nan"), device=DEV)
    flags = torch.full((x.shape[0],), 99, dtype=torch.int8, device=DEV)
    check_and_gather(x, xs, gather, xg, xsg, flags)
    torch.cuda.synchronize()
    bits = torch.uint8 if fp8 else torch.int16
    assert torch.equal(xg.view(bits), x.view(bits).index_select(0, gather))
    if xs is not None:
        assert torch.equal(xsg.view(torch.int32), xs.index_select(0, gather).view(torch.int32))
    return flags, _bad_rows_torch(x, xs)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz,
                                   torch.bfloat16, torch.float16])
# 4999 and 70000 rows: blocks of 8 and 64 rows a program, the last one partly past the rows.
@pytest.mark.parametrize("rows,k", [(1, 128), (7, 7168), (300, 1024), (64, 8448), (4999, 1024), (70000, 256)])
def test_check_and_gather_equals_the_torch_ops(dtype, rows, k):
    gen = torch.Generator(device=DEV).manual_seed(rows * 131 + k)
    x = _rows_with_bad_values(dtype, rows, k, gen)
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    xs = _scales_with_bad_values(rows, k // 128, gen) if fp8 else None
    # The meta buffer's layout: (gather, scatter) pairs, so gather has stride 2.
    pairs = torch.empty((rows, 2), dtype=torch.int64, device=DEV)
    pairs[:, 0] = torch.randperm(rows, generator=gen, device=DEV)
    flags, want = _gather_as_torch(x, xs, pairs[:, 0])
    assert torch.equal(flags, want)
    # Both kinds of rows were there (fp8: bad scales from row 2; a NaN code is no flag).
    assert (want.any() or (fp8 and rows < 3)) and (rows == 1 or not want.all())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("tokens,k", [(37, 8), (8192, 8)])
def test_check_and_gather_reads_each_routed_row_from_its_token(dtype, tokens, k):
    """A moe launch's gather: ``k`` rows a token in expert order, read from ``x``'s tokens
    alone (the launch's rows outnumber them); every token's flag as ``bad_rows`` sets it."""
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    width = 2048
    x = _rows_with_bad_values(dtype, tokens, width, gen)
    fp8 = dtype == torch.float8_e4m3fn
    xs = _scales_with_bad_values(tokens, width // 128, gen) if fp8 else None
    gather = torch.arange(tokens, device=DEV).repeat_interleave(k)
    flags, want = _gather_as_torch(x, xs, gather[torch.randperm(tokens * k, generator=gen, device=DEV)])
    assert torch.equal(flags, want) and want.any() and not want.all()


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("merged", [True, False])
def test_executors_with_and_without_it_answer_alike(kind, merged):
    """fp8 calls (the check and regroup kernel; a lone decode call's check inside its GEMM) and
    bf16 calls (checked, regrouped and quantized in one kernel) answer as the torch ops do,
    merged and alone, replayed and eager, a bad row in one call."""
    backend = get_backend(DEV, "triton")
    gen = torch.Generator(device=DEV).manual_seed(7)
    g, n, k = 8, 256, 1024
    p = random_problem(1, n, k, g, device=DEV, generator=gen)
    ws = SimpleNamespace(name="w", G=g, N=n, K=k, wq=p.wq, w_scale=p.w_scale)
    parts = []
    for i, m in enumerate((3, 5, 40, 17)):
        sizes = random_m_sizes(g, m).tolist()
        q = random_problem(m, n, k, g, device=DEV, generator=gen, m_sizes=torch.tensor(sizes))
        if kind == "bf16":
            x, xs = torch.randn((m, k), generator=gen, device=DEV).to(torch.bfloat16).cpu(), None
            if i == 2:
                x[5, 1] = float("inf")  # one bad row in one call
        else:
            x, xs = q.xq.cpu(), q.x_scale.cpu()
            if i == 2:
                xs[5, 1] = float("nan")  # one bad row in one call
        parts.append((x, xs, sizes))
    got = {}
    for fused in (True, False):
        for graphs in (True, False):
            unfused = dataclasses.replace(backend, check_and_gather=None, gather_quantize=None)
            pool = GraphPool(backend if fused else unfused, 64, graphs=graphs)
            assert (pool.check_and_gather is not None) == fused
            ex = Executor(pool, Staging(DEV))
            ex.prepare(g, n, k, ws.wq, ws.w_scale)
            ex.staging.enter()
            calls = [gemm_call(ws, *part) for part in parts]
            if merged:
                results, _ = ex.run(ws, calls)
            else:
                results = [ex.run(ws, [call])[0][0] for call in calls]
            torch.cuda.synchronize()
            got[fused, graphs] = [(bf16_rows(out).clone(), np.array(flags, copy=True))
                                  for out, flags in results]
    base = got[False, False]
    assert base[2][1].any() and not any(f.any() for i, (_, f) in enumerate(base) if i != 2)
    for results in got.values():
        for (out, flags), (want, want_flags) in zip(results, base):
            assert torch.equal(out.view(torch.int16), want.view(torch.int16))
            assert (flags == want_flags).all()
