"""``bench/sass_yield.py``, the yield hints ``bench/sass_ab.py`` times, on a binary compiled for
sm_90 on the CPU with the ptxas and cuobjdump Triton ships: it changes the yield hint and the
reuse flags of the FFMAs its rule names and nothing else, so the A/B times the same
instructions (the outputs' bits are compared on the device)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import sass_yield
from moegemm.kernels import triton_kernel as tk
from sm90_compile import PTXAS, compile_config

try:
    sass_yield.cuobjdump()
except RuntimeError:
    pytest.skip("Triton's cuobjdump is not installed", allow_module_level=True)
if not PTXAS.exists():
    pytest.skip("Triton's ptxas is not installed", allow_module_level=True)

CONTROL = sass_yield.YIELD_OFF | sass_yield.REUSE


@pytest.mark.parametrize("first,every", [(9 / 16, 1), (1.0, 2), (0.25, 1)])
def test_the_pass_changes_only_the_named_ffmas_control_bits(first, every):
    m, n, k, g = 65536, 7168, 2048, 256  # gluon_ws_store
    kernel = compile_config(tk.default_config(m, n, k, g), m, n, k, g)
    raw = kernel.asm["cubin"]  # as ptxas made it: nothing here installs a pass
    patched, changed = sass_yield.patch(raw, first, every)
    before, after = sass_yield.instructions(raw), sass_yield.instructions(patched)
    assert before.keys() == after.keys() == {kernel.name}
    old, new = before[kernel.name], after[kernel.name]
    runs = sass_yield.ffma_runs(old)
    assert len(runs) >= 4  # two consumer warpgroups, each promoting two halves of a K block
    named = {j for run in runs for j in run[:int(len(run) * first)][::every]}
    assert changed == len(named) > 0
    assert len(old) == len(new)
    for j, (a, b) in enumerate(zip(old, new, strict=True)):
        assert (a[0], a[1].replace(".reuse", ""), a[2]) == (b[0], b[1].replace(".reuse", ""), b[2])
        if j in named:
            assert b[3] == a[3] & ~CONTROL and ".reuse" not in b[1]
        else:
            assert b == a
    # Outside the function's instructions (headers, other sections) not a byte changed.
    start, size = sass_yield.text_sections(raw)[kernel.name]
    assert raw[:start] == patched[:start] and raw[start + size:] == patched[start + size:]
    # Applied again, it changes nothing.
    assert sass_yield.patch(patched, first, every) == (patched, 0)
