"""The Gluon prefill kernel (``kernels/_gluon_gemm.py``) compiles clean for sm_90 on the CPU.

No GPU: ``triton.compile`` with a Hopper target and the ptxas Triton ships.
Clean means no register spills, shared memory within one block's limit, no
wgmma serialisation warnings, the FP8 wgmma in the PTX, and the producer and
consumer register budgets handed out with setmaxnreg. Skipped where Triton has
no Gluon.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from sm90_compile import GLUON_VARIANTS, PTXAS, gluon_report  # noqa: E402

if not PTXAS.exists():
    pytest.skip("Triton's ptxas is not installed", allow_module_level=True)


@pytest.mark.parametrize("name,g,out", [("s4p", 256, "bf16"), ("s6p", 384, "bf16"), ("s5", 8, "bf16"),
                                        ("s5p", 128, "fp32"), ("w4", 256, "bf16")])
def test_variant_compiles_clean_for_sm90(name, g, out):
    report = gluon_report(g, out, **GLUON_VARIANTS[name])
    assert "error" not in report, report
    assert report["spill_bytes"] == 0
    assert report["fits_smem"], report["smem"]
    assert report["serialised"] == []
    # Two consumer warpgroups, each issuing 4 wgmma of K = 32 per 128-wide K block (and half).
    assert report["wgmma"] >= 8 and report["wgmma"] % 8 == 0
    assert {"232", "40"} <= set(report["setmaxnreg"])


def test_ring_depth_sets_shared_memory():
    # One stage: a 128 x 128 activation tile and a 128 x 128 weight tile, fp8 (32 KiB), and its
    # two mbarriers (8 bytes each, aligned).
    four = gluon_report(256, "bf16", **GLUON_VARIANTS["s4p"])["smem"]
    five = gluon_report(256, "bf16", **GLUON_VARIANTS["s5p"])["smem"]
    assert 32 * 1024 + 16 <= five - four <= 32 * 1024 + 64
