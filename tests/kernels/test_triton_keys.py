"""Every Triton function's cache key is the same in every process, whatever the process hashes
(launches) first (``kernels/_triton_keys.py``).

Each order runs in a fresh interpreter (a key is computed once per process). Without
``settle`` at the kernel modules' import, 11 of the functions here got keys that move with the
order (``_route_kernel``, ``_up_kernel``, ``gluon_ws_store_kernel``...), and a compile-ahead
child's binaries were missed by the serving process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("triton")

MODULES = ("_triton_act", "_triton_gemm", "_gluon_gemm", "_triton_route", "_triton_moe_token",
           "_triton_prologue")

# Hash the functions named on the command line first, in that order (the rest after, sorted),
# then print every key.
_PROBE = f"""
import importlib, json, sys
from triton.runtime.jit import JITCallable
fns = {{}}
for m in {MODULES!r}:
    mod = importlib.import_module("moegemm.kernels." + m)
    for name, value in vars(mod).items():
        if isinstance(value, JITCallable) and value.fn.__module__ == mod.__name__:
            fns[m + "." + name] = value
first = sys.argv[1:]
for name in first + sorted(set(fns) - set(first)):
    fns[name].cache_key
print(json.dumps({{name: fn.cache_key for name, fn in fns.items()}}))
"""


def _keys(*first: str) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", _PROBE, *first], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_cache_keys_do_not_depend_on_which_kernel_a_process_uses_first():
    # The session-19 case (the one-token up kernel before the routing kernel, as a process that
    # served one-token moe calls first), callees before callers, and callers before callees.
    plain = _keys()
    assert len(plain) > 50  # every kernel module's functions were found
    for first in (("_triton_moe_token._up_kernel", "_triton_route._route_kernel"),
                  ("_triton_route._check_tokens", "_triton_act.quantize_row"),
                  ("_gluon_gemm.gluon_ws_store_kernel", "_triton_act._silu_mul_quant_kernel",
                   "_triton_moe_token._down_kernel", "_triton_route._quantize_scatter_kernel")):
        moved = {name for name, key in _keys(*first).items() if key != plain[name]}
        assert not moved, f"hashing {first} first moved the keys of {sorted(moved)}"
