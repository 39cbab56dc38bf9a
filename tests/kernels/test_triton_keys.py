"""Every Triton function's cache key is the same in every process, whatever the process hashes
(launches) first (``kernels/_triton_keys.py``).

Each probe runs in a fresh interpreter (a key is computed once per process). Without
``settle`` at the kernel modules' import, 11 of the functions here got keys that move with the
order (``_route_kernel``, ``_up_kernel``, ``gluon_ws_store_kernel``...), and a compile-ahead
child's binaries were missed by the serving process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
import moegemm.kernels

# Every kernel module: the package's files that define Triton or Gluon functions.
MODULES = tuple(sorted(p.stem for p in Path(moegemm.kernels.__file__).parent.glob("*.py")
                       if re.search(r"^@(triton|gluon)\.jit", p.read_text(), re.MULTILINE)))

# The probe imports every kernel module, hashes the functions named on its command line first,
# in that order (the rest after, sorted), and prints every key. With ``--strict`` (first) it
# fails instead where Triton merges a callee that was not hashed before its caller: the
# order-dependent case, whichever way a callee is reached.
_PROBE = f"""
import importlib, json, sys
from triton.runtime import jit
if sys.argv[1:2] == ["--strict"]:
    merge = jit.DependenciesFinder._update_hash
    def strict(self, func):
        if func.hash is None:
            raise AssertionError(f"{{func.__name__}} hashed inside its caller {{self.name}}")
        return merge(self, func)
    jit.DependenciesFinder._update_hash = strict
    del sys.argv[1]
fns = {{}}
for m in {MODULES!r}:
    mod = importlib.import_module("moegemm.kernels." + m)
    for name, value in vars(mod).items():
        if isinstance(value, jit.JITCallable) and value.fn.__module__ == mod.__name__:
            fns[m + "." + name] = value
first = sys.argv[1:]
for name in first + sorted(set(fns) - set(first)):
    fns[name].cache_key
print(json.dumps({{name: fn.cache_key for name, fn in fns.items()}}))
"""


def _keys(*args: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiling runtime's keys
    done = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True,
                          timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_kernel_module_is_found_and_settles_its_keys():
    assert {"_triton_act", "_triton_gemm", "_gluon_gemm", "_triton_route", "_triton_moe_token",
            "_triton_prologue"} <= set(MODULES)
    root = Path(moegemm.kernels.__file__).parent
    assert [m for m in MODULES if "\nsettle(globals())\n" not in (root / f"{m}.py").read_text()] == []


def test_no_function_is_hashed_before_a_function_it_calls():
    assert len(_keys("--strict")) > 50  # every kernel module's functions were found


def test_the_cache_keys_do_not_depend_on_which_kernel_a_process_uses_first():
    # The session-19 case (the one-token up kernel before the routing kernel, as a process that
    # served one-token moe calls first), callees before callers, and callers before callees.
    plain = _keys()
    for first in (("_triton_moe_token._up_kernel", "_triton_route._route_kernel"),
                  ("_triton_route._check_tokens", "_triton_act.quantize_row"),
                  ("_gluon_gemm.gluon_ws_store_kernel", "_triton_act._silu_mul_quant_kernel",
                   "_triton_moe_token._down_kernel", "_triton_route._quantize_scatter_kernel")):
        moved = {name for name, key in _keys(*first).items() if key != plain[name]}
        assert not moved, f"hashing {first} first moved the keys of {sorted(moved)}"
