"""The triton backend's :class:`~moegemm.kernels._backend.CompileAhead`.

A launch under :func:`compile_only` is Triton's own warm-up
(``JITFunction.run(..., warmup=True)``): the kernel is specialised on the
arguments exactly as a real launch would be (constexprs, each int's ``== 1`` and
``% 16 == 0``, each pointer's 16-byte alignment), compiled into Triton's
on-disk cache (``TRITON_CACHE_DIR``) and not launched. Tensors are read for
their dtype and ``data_ptr()`` only, so a ``meta`` tensor of the right
alignment stands in for memory the compiling process does not have.

Several processes can share one job: under ``compile_only(share=(i, n))`` a
launch is compiled only when :func:`share_of` its arguments, a digest of what
specialises it, is ``i`` modulo ``n``, and skipped otherwise. The digest reads
nothing that differs between processes (no address, no object identity), so
the ``n`` processes that walk the same launches compile each kernel in exactly
one of them.

:func:`compiles` counts the compilations of this process through Triton's
compilation listener (``triton.knobs.compilation.listener``), which Triton
calls with ``cache_hit=False`` only when it ran the compiler;
:func:`compiled_since` names the last of them (kernel, its 16-divisible
arguments and constexprs), so that a warning about kernels compiled where
none should be says which.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections import deque
from collections.abc import Iterator

import triton
from triton.runtime.jit import JITFunction

from ._backend import CompileAhead

_local = threading.local()
_lock = threading.Lock()
_original = None  # JITFunction.run before _install_compile_only wrapped it
_listening = False
_compiled = 0
_named: deque[tuple[int, str]] = deque(maxlen=256)  # (ordinal, description) of the last compilations


def _install_compile_only() -> None:
    """Route every JIT launch through a check of this thread's compile-only flag (once)."""
    global _original
    with _lock:
        if _original is not None:
            return
        _original = JITFunction.run

        def run(self, *args, grid, warmup, **kwargs):
            share = getattr(_local, "only", None)
            if share is None:
                return _original(self, *args, grid=grid, warmup=warmup, **kwargs)
            mine, count = share
            if count > 1 and share_of(self, args, kwargs) % count != mine:
                return None  # another process of the job compiles this one
            return _original(self, *args, grid=grid, warmup=True, **kwargs)

        JITFunction.run = run


def _spec(value) -> str:
    """What of one launch argument can make another kernel, in a form every process writes alike."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return repr(value)
    if isinstance(value, int):  # Triton specialises 1, multiples of 16 and the integer width
        return f"i{int(value == 1)}{int(value % 16 == 0)}{value.bit_length() > 31}"
    if isinstance(value, float):
        return "f"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(map(_spec, value)) + ")"
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return f"{value.dtype}@{value.data_ptr() % 16}"
    return type(value).__name__


def share_of(fn, args, kwargs) -> int:
    """A digest of a launch's kernel and the arguments that specialise it (CRC-32: the same in
    every process)."""
    text = ";".join([getattr(fn, "__name__", type(fn).__name__), *map(_spec, args),
                     *(f"{k}={_spec(v)}" for k, v in sorted(kwargs.items()))])
    return zlib.crc32(text.encode())


@contextlib.contextmanager
def compile_only(share: tuple[int, int] = (0, 1)) -> Iterator[None]:
    """Within: this thread's Triton launches compile (into the on-disk cache) and run nothing;
    ``share=(i, n)``: only the launches whose :func:`share_of` is ``i`` modulo ``n`` compile, the
    others are skipped (process ``i`` of ``n`` sharing a job)."""
    _install_compile_only()
    before = getattr(_local, "only", None)
    _local.only = share
    try:
        yield
    finally:
        _local.only = before


def _listen() -> None:
    """Count compilations from now on (once per process; an earlier listener still hears them)."""
    global _listening
    with _lock:
        if _listening:
            return
        earlier = triton.knobs.compilation.listener

        def heard(*, src, metadata, metadata_group, times, cache_hit) -> None:
            global _compiled
            if not cache_hit:
                with _lock:
                    _compiled += 1
                    _named.append((_compiled, _describe(src)))
            if earlier is not None:
                earlier(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                        cache_hit=cache_hit)

        triton.knobs.compilation.listener = heard
        _listening = True


def _describe(src) -> str:
    """A compiled kernel in a line: its name, the arguments specialised as multiples of 16 and its
    constexprs (what the compile-ahead child has to have guessed alike)."""
    names = getattr(getattr(src, "fn", None), "arg_names", None) or []

    def arg(key) -> str:  # keys are (argument index,) tuples
        return names[key[0]] if isinstance(key, tuple) and key and key[0] < len(names) else str(key)

    divisible = sorted(arg(k) for k, v in getattr(src, "attrs", {}).items() if "tt.divisibility" in str(v))
    consts = ",".join(f"{arg(k)}={v}" for k, v in sorted(getattr(src, "constants", {}).items()))
    return f"{getattr(src, 'name', '?')}(div16: {','.join(divisible)}; {consts})"


def compiles() -> int:
    """How many kernels this process has compiled since the backend was created."""
    return _compiled


def compiled_since(count: int) -> list[str]:
    """The kernels this process compiled after its ``count``-th compilation (the last 256 kept)."""
    with _lock:
        return [text for ordinal, text in _named if ordinal > count]


def create() -> CompileAhead:
    """The triton backend's CompileAhead (starts counting this process's compilations)."""
    _listen()
    return CompileAhead(compile_only=compile_only, compiles=compiles, compiled_since=compiled_since)
