"""The triton backend's :class:`~moegemm.kernels._backend.CompileAhead`.

A launch under :func:`compile_only` is Triton's own warm-up
(``JITFunction.run(..., warmup=True)``): the kernel is specialised on the
arguments exactly as a real launch would be (constexprs, each int's ``== 1`` and
``% 16 == 0``, each pointer's 16-byte alignment), compiled into Triton's
on-disk cache (``TRITON_CACHE_DIR``) and not launched. Tensors are read for
their dtype and ``data_ptr()`` only, so a ``meta`` tensor of the right
alignment stands in for memory the compiling process does not have.

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
from collections import deque
from collections.abc import Iterator

import triton
from triton.runtime.jit import JITFunction

from ._backend import CompileAhead

_local = threading.local()
_lock = threading.Lock()
_patched = False
_listening = False
_compiled = 0
_named: deque[tuple[int, str]] = deque(maxlen=256)  # (ordinal, description) of the last compilations


def _install_compile_only() -> None:
    """Route every JIT launch through a check of this thread's compile-only flag (once)."""
    global _patched
    with _lock:
        if _patched:
            return
        launch = JITFunction.run

        def run(self, *args, grid, warmup, **kwargs):
            return launch(self, *args, grid=grid, warmup=warmup or getattr(_local, "only", False),
                          **kwargs)

        JITFunction.run = run
        _patched = True


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """Within: this thread's Triton launches compile (into the on-disk cache) and run nothing."""
    _install_compile_only()
    before = getattr(_local, "only", False)
    _local.only = True
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
