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
