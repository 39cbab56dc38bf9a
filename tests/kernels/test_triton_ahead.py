"""The triton backend counts and names the kernels its process compiles (``kernels/_triton_ahead.py``).

No GPU: ``triton.compile`` for an sm_90 target runs the compiler (and so the
listener) on the CPU, into a fresh on-disk cache.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl
from moegemm.kernels import _triton_ahead
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _copy_rows(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def _compile(block: int):
    src = ASTSource(_copy_rows, {"src_ptr": "*fp32", "dst_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                    {"BLOCK": block}, {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))


def test_a_compilation_is_counted_and_named_and_a_cache_hit_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ahead = _triton_ahead.create()
    before = ahead.compiles()
    _compile(128)
    assert ahead.compiles() == before + 1
    assert ahead.compiled_since(before) == ["_copy_rows(div16: dst_ptr,src_ptr; BLOCK=128)"]
    _compile(128)  # the on-disk cache's
    assert ahead.compiles() == before + 1
    _compile(256)
    assert ahead.compiled_since(before) == ["_copy_rows(div16: dst_ptr,src_ptr; BLOCK=128)",
                                            "_copy_rows(div16: dst_ptr,src_ptr; BLOCK=256)"]
    assert ahead.compiled_since(before + 1) == ["_copy_rows(div16: dst_ptr,src_ptr; BLOCK=256)"]


def test_processes_sharing_a_job_compile_every_launch_exactly_once(monkeypatch):
    """``compile_only(share=(i, n))``: of n processes walking the same launches, each launch is
    compiled (``warmup=True``) in exactly one, whichever its arguments, and skipped in the
    others; outside the context a launch runs as asked."""
    import torch

    _triton_ahead._install_compile_only()
    compiled = []
    monkeypatch.setattr(_triton_ahead, "_original",
                        lambda fn, *args, grid, warmup, **kw: compiled.append((args[2], kw, warmup)))
    src = torch.empty(4096, dtype=torch.float32)
    launches = [(n, block) for n in (1, 16, 100, 4096, 1 << 33) for block in (64, 128, 256, 512)]
    count = 3
    for mine in range(count):
        with _triton_ahead.compile_only(share=(mine, count)):
            for n, block in launches:
                _copy_rows[(1,)](src, src[1:], n, BLOCK=block)
    assert all(warmup for *_, warmup in compiled)
    got = sorted((n, kw["BLOCK"]) for n, kw, _ in compiled)
    assert got == sorted(launches)  # every launch once, in one share or another
    shares = [{(n, b) for n, b in launches
               if _triton_ahead.share_of(_copy_rows, (src, src[1:], n), {"BLOCK": b}) % count == i}
              for i in range(count)]
    assert all(shares), "a share with nothing in it: the digest does not spread these launches"
    compiled.clear()
    _copy_rows[(1,)](src, src, 7, BLOCK=64)
    assert compiled == [(7, {"BLOCK": 64}, False)]


def test_the_share_digest_reads_no_address_or_identity():
    """Two processes must agree: the same launch from other tensors at the same alignment, or
    another object of the same type, gets the same digest; an argument that specialises the
    kernel differently (alignment, dtype, 1, a multiple of 16, past int32) may change it."""
    import torch

    a, b = torch.empty(64), torch.empty(64)
    digest = _triton_ahead.share_of
    assert digest(_copy_rows, (a, b, 100), {"BLOCK": 64}) == digest(_copy_rows, (b, a, 100), {"BLOCK": 64})
    assert digest(_copy_rows, (a, object(), 3), {}) == digest(_copy_rows, (a, object(), 3), {})
    assert digest(_copy_rows, (a, b, 100), {}) == digest(_copy_rows, (a, b, 99), {})  # neither 1 nor 16k
    different = {digest(_copy_rows, args, {}) for args in
                 [(a, b, 100), (a[1:], b, 100), (a.half(), b, 100), (a, b, 1), (a, b, 32), (a, b, 1 << 40)]}
    assert len(different) == 6
