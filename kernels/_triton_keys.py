"""Triton cache keys that do not depend on the order a process first uses its kernels in.

Triton 3.6 hashes a ``@triton.jit`` / ``@gluon.jit`` function once per process, the first time
its key is needed (its first launch, or the first launch of a caller), and a caller's key takes
in the constexpr globals its callees read only if each callee was hashed *before* the caller
(``DependenciesFinder._update_hash`` merges the callee's ``used_global_vals`` before it asks for
the callee's key). So one kernel gets different on-disk cache keys in processes that first
launched their kernels in different orders. The compile-ahead child (``server/_ahead.py``) and
the serving process then disagree: a test process that had launched ``_up_kernel`` before
``_route_kernel`` (both call ``_check_tokens``, which reads the constexpr ``_FLT_MAX``) missed
the child's binaries of both and compiled them again itself (session 19; 11 of the 78 kernel
functions here, ``gluon_ws_store_kernel`` among them, have keys that move with the order).

:func:`settle` hashes a module's functions callees first, when the module is imported (each
kernel module calls it last), before anything can launch them: every process then computes the
same key for every kernel, each caller's with all its callees' globals.
"""

from __future__ import annotations

from types import CodeType, ModuleType

from triton import knobs
from triton.runtime.jit import JITCallable


def _names(code: CodeType) -> set[str]:
    """The global and attribute names a function's code reads, nested code included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names(const)
    return names


def _callees(fn: JITCallable) -> list[JITCallable]:
    """The Triton functions ``fn`` may call: its globals by name, and ``module.name`` for the
    modules it reads (in a fixed order)."""
    names = sorted(_names(fn.fn.__code__))
    found = []
    for name in names:
        value = fn.__globals__.get(name)
        if isinstance(value, JITCallable):
            found.append(value)
        elif isinstance(value, ModuleType):
            found += [v for v in (getattr(value, n, None) for n in names) if isinstance(v, JITCallable)]
    return found


def settle(namespace: dict) -> None:
    """Compute the cache key of every Triton function in ``namespace`` (a module's globals),
    each after the keys of the functions it calls. Nothing under ``TRITON_INTERPRET=1``: the
    interpreter compiles nothing, and its ``@triton.jit`` functions are not Triton's JIT
    functions (a Gluon function that reads one cannot be hashed there)."""
    if knobs.runtime.interpret:
        return
    done: set[int] = set()

    def visit(fn: JITCallable) -> None:
        if id(fn) in done:
            return
        done.add(id(fn))
        for callee in _callees(fn):
            visit(callee)
        fn.cache_key  # noqa: B018 -- computed (and kept by Triton) now, in this order

    for value in list(namespace.values()):
        if isinstance(value, JITCallable):
            visit(value)
