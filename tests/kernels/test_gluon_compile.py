"""The Gluon prefill schedule (``gluon_ws``, ``kernels/_gluon_gemm.py``) compiles clean for sm_90 on the CPU.

No GPU: ``triton.compile`` with a Hopper target and the ptxas Triton ships, the
arguments and options ``triton_kernel.launch_plan`` gives it. Clean means no
register spills, shared memory within one block's limit, no wgmma serialisation
warnings, the FP8 wgmma in the PTX, the producer and consumer register budgets
handed out with setmaxnreg, and a scratch for the two descriptors made on the
device -- in every form a launch takes (plain, weights by address, the server
graph's activations by address and row map; bf16 and float32 out).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from moegemm.kernels import triton_kernel as tk
from sm90_compile import GLUON_FORMS, PTXAS, report

if not PTXAS.exists():
    pytest.skip("Triton's ptxas is not installed", allow_module_level=True)


@pytest.mark.parametrize("addrs,service,out", GLUON_FORMS, ids=lambda v: str(v))
@pytest.mark.parametrize("m,n,k,g", [(65536, 4096, 7168, 256), (16384, 7168, 2048, 384)])
def test_every_form_compiles_clean_for_sm90(m, n, k, g, addrs, service, out):
    cfg = tk.default_config(m, n, k, g)
    assert cfg.schedule == "gluon_ws"
    found = report(cfg, m, n, k, g, addrs, service, out)
    assert "error" not in found, found
    assert found["spill_bytes"] == 0
    assert found["fits_smem"], found["smem"]
    assert found["serialised"] == []
    # Two consumer warpgroups, each issuing 4 wgmma of K = 32 per 128-wide half of a K block.
    assert found["wgmma"] == 16
    assert {"232", "40"} <= set(found["setmaxnreg"])
    assert found["scratch"] >= 2 * 128  # two TMA descriptors of 128 bytes, per program


def test_ring_depth_sets_shared_memory():
    # One stage: a 128 x 128 activation tile and a 256 x 128 weight tile, fp8 (48 KiB), and its
    # two mbarriers (8 bytes each; alignment may absorb one).
    m, n, k, g = 65536, 4096, 7168, 256
    three = report(tk.TileConfig("gluon_ws", 128, 256, 4, 3, group_tiles_m=8), m, n, k, g)["smem"]
    four = report(tk.TileConfig("gluon_ws", 128, 256, 4, 4, group_tiles_m=8), m, n, k, g)["smem"]
    assert 48 * 1024 < four - three <= 48 * 1024 + 64
