"""The Triton persistent prefill schedules (``persistent_ws``, ``persistent_tma``) compile for sm_90
on the CPU in every form a launch takes: plain pointers (the public function), the server gemm
graph's activations by address stored in place, that with the rows' check inside (``FLAGS``: a
lone call's graph; ``persistent_tma`` only, ``persistent_ws`` takes none) and the merged calls'
row map. Clean: no register spill, no wgmma
serialisation warning, shared memory within a block's limit; ``persistent_ws`` still split into
its warp-specialised partitions (Triton 3.6's pass refuses some code in the loop: a reduction,
a scan, and it would silently run the tile unspecialised) and ``persistent_tma`` within the
registers that keep its two programs an SM."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from moegemm.kernels import triton_kernel as tk
from sm90_compile import PTXAS, report

if not PTXAS.exists():
    pytest.skip("Triton's ptxas is not installed", allow_module_level=True)

# The table's tiles: seed m1024 n2048 k7168 (persistent_ws), Mixtral-8x7B w2 at 256 tokens
# (persistent_tma, 64-row tiles, two programs an SM).
SHAPES = [(1024, 2048, 7168, 8, "persistent_ws"), (512, 4096, 14336, 8, "persistent_tma")]
# Spill bytes ptxas reports (Triton 3.6): persistent_ws's merged-call form (the row map) 24, as
# before the rows' check went in (session 31, measured on both); none elsewhere.
ROW_MAP_SPILL = {"persistent_ws": 24, "persistent_tma": 0}
# (addrs, service, row_map, flags)
FORMS = [(False, False, False, False), (True, True, False, False), (True, True, False, True),
         (True, True, True, False)]


def _cases():
    for shape in SHAPES:
        for form, name in zip(FORMS, ("public", "in_place", "lone", "merged"), strict=True):
            if shape[-1] == "persistent_ws" and form[3]:
                continue  # no check inside (triton_kernel.checks_rows): the check kernel runs first
            yield pytest.param(*shape, *form, id=f"{shape[-1]}-{name}")


@pytest.mark.parametrize("m,n,k,g,schedule,addrs,service,row_map,flags", list(_cases()))
def test_every_form_compiles_clean_for_sm90(m, n, k, g, schedule, addrs, service, row_map, flags):
    cfg = tk.default_config(m, n, k, g)
    assert cfg.schedule == schedule, cfg.key()
    found = report(cfg, m, n, k, g, addrs, service, "bf16", row_map, flags)
    assert "error" not in found, found
    assert found["spill_bytes"] <= (ROW_MAP_SPILL[schedule] if row_map else 0), found
    assert found["serialised"] == [], found
    assert found["fits_smem"], found
    if schedule == "persistent_ws":
        assert found["partitions"] >= 2, found  # the producer and the consumers
    else:
        # Two programs an SM of 128 threads: at most 65536 / 256 registers a thread.
        assert cfg.per_sm == 2 and found["regs"] <= 256, found
