"""The fused check-and-regroup kernel, run by Triton's interpreter on the CPU.

The same comparison as ``test_prologue.py`` (which runs the compiled kernel on
a GPU), on small shapes: rows in gather order, their scales bit for bit, and
the flags of ``_checks._bad_rows_torch`` with NaN codes, NaN/Inf and bad scales
planted; one row a program and blocks of rows a program (the last block
partly past the rows), the regroup word 1 (copies) and 0 (flags only, nothing
copied). The interpreter is chosen when the kernel is defined, so the check
runs in a fresh process with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BAD_SCALES = (float("nan"), float("inf"), 0.0, -1.0, -float("inf"))


def compare_on_cpu() -> None:
    from moegemm.kernels import _triton_prologue

    # Blocks of rows: PROGRAMS lowered so that these few rows take 4 to 16 a program.
    assert _triton_prologue.block_sizes(33, 256, 2)[0] == 1
    assert _triton_prologue.block_sizes(65536, 7168, 56) == (64, 128, 64)
    for programs, block_rows in ((1024, (1, 1, 1)), (3, (1, 4, 16))):
        _triton_prologue.PROGRAMS = programs
        assert tuple(_triton_prologue.block_sizes(r, 256, 2)[0] for r in (1, 7, 33)) == block_rows
        compare_blocks()
        compare_routed()


def compare_routed() -> None:
    """A moe launch's gather: each routed row's token, ``k`` rows a token, over ``x``'s
    tokens alone (the launch's rows outnumber them)."""
    from moegemm.kernels._triton_prologue import check_and_gather
    from moegemm.server._checks import _bad_rows_torch

    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        tokens, k, width = 9, 4, 256
        if dtype == torch.bfloat16:
            x, xs = torch.randn((tokens, width), generator=gen).to(dtype), None
            x[3, 17] = float("inf")
        else:
            bits = torch.randint(0, 256, (tokens, width), generator=gen).to(torch.uint8)
            bits[(bits & 0x7F) == 0x7F] = 0x11
            x = bits.view(dtype)
            xs = torch.rand((tokens, width // 128), generator=gen) + 1e-3
            xs[3, 1] = float("nan")
        gather = torch.arange(tokens).repeat_interleave(k)[torch.randperm(tokens * k, generator=gen)]
        xg = torch.empty((tokens * k, width), dtype=dtype)
        xsg = None if xs is None else torch.empty((tokens * k, width // 128))
        flags = torch.full((tokens,), 99, dtype=torch.int8)
        check_and_gather(x, xs, gather, xg, xsg, flags)
        bits_dtype = torch.int16 if dtype == torch.bfloat16 else torch.uint8
        assert torch.equal(xg.view(bits_dtype), x.view(bits_dtype).index_select(0, gather))
        if xs is not None:
            assert torch.equal(xsg.view(torch.int32), xs.index_select(0, gather).view(torch.int32))
        assert torch.equal(flags, _bad_rows_torch(x, xs)) and flags.nonzero().tolist() == [[3]]


def compare_blocks() -> None:
    from moegemm.kernels._triton_prologue import check_and_gather
    from moegemm.server._checks import _bad_rows_torch

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.bfloat16, torch.float16):
        fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
        for rows, k in ((1, 128), (7, 384), (33, 256)):
            if fp8:
                bits = torch.randint(0, 256, (rows, k), generator=gen).to(torch.uint8)
                bits[(bits & 0x7F) == 0x7F] = 0x11
                bits[bits == 0x80] = 0x12
                for r in range(0, rows, 5):
                    nan = 0x80 if dtype == torch.float8_e4m3fnuz else (0xFF if r % 2 else 0x7F)
                    bits[r, (r * 37) % k] = nan
                x = bits.view(dtype)
                xs = torch.rand((rows, k // 128), generator=gen) + 1e-3
                for r in range(2, rows, 7):
                    xs[r, (r * 3) % (k // 128)] = BAD_SCALES[r % len(BAD_SCALES)]
            else:
                x = torch.randn((rows, k), generator=gen).to(dtype)
                for r in range(0, rows, 5):
                    x[r, (r * 37) % k] = (float("nan"), float("inf"), -float("inf"))[r % 3]
                xs = None
            pairs = torch.empty((rows, 2), dtype=torch.int64)  # the meta layout: stride 2
            pairs[:, 0] = torch.randperm(rows, generator=gen)
            gather = pairs[:, 0]
            xg = torch.full_like(x.view(torch.uint8), 0xEE).view(dtype)
            xsg = None if xs is None else torch.full_like(xs, float("nan"))
            flags = torch.full((rows,), 99, dtype=torch.int8)
            check_and_gather(x, xs, gather, xg, xsg, flags)
            bits_dtype = torch.uint8 if fp8 else torch.int16
            assert torch.equal(xg.view(bits_dtype), x.view(bits_dtype).index_select(0, gather))
            if xs is not None:
                assert torch.equal(xsg.view(torch.int32),
                                   xs.index_select(0, gather).view(torch.int32))
            want = _bad_rows_torch(x, xs)
            assert torch.equal(flags, want), (dtype, rows, k, flags, want)
            assert want.any() or (fp8 and rows < 3)  # fp8: scales flag (from row 2), codes never
            # The regroup word: 1 copies as above, 0 writes the flags and copies nothing.
            for word in (1, 0):
                xg2 = torch.full_like(x.view(torch.uint8), 0xEE).view(dtype)
                xsg2 = None if xs is None else torch.full_like(xs, float("nan"))
                flags.fill_(99)
                check_and_gather(x, xs, gather, xg2, xsg2, flags, regroup=torch.tensor([word]))
                assert torch.equal(flags, want), (dtype, rows, k, word)
                if word:
                    assert torch.equal(xg2.view(bits_dtype), xg.view(bits_dtype))
                    assert xs is None or torch.equal(xsg2.view(torch.int32), xsg.view(torch.int32))
                else:
                    assert (xg2.view(torch.uint8) == 0xEE).all()
                    assert xs is None or xsg2.isnan().all()


def test_check_and_gather_in_the_triton_interpreter():
    pytest.importorskip("triton")
    here = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_prologue_cpu; " \
           "test_prologue_cpu.compare_on_cpu()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
