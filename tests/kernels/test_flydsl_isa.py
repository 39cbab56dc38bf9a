"""The FlyDSL kernel compiles for gfx942 and gfx950, and its ISA is what we intend.

No AMD GPU is needed: FlyDSL compiles with ``COMPILE_ONLY=1`` and writes the
final ISA, one subprocess per case (``moegemm.kernels._flydsl_isa``). What this
proves: each (arch x layout) kernel with its default tile compiles, issues the
arch's MFMA and not the other arch's, uses no scratch and spills nothing, and
allocates exactly the LDS the budget check accounts for; every autotune
candidate either compiles or is turned away by the budget check, per arch.
What it cannot prove: that the kernel computes the right numbers (never
executed on AMD hardware here; see test_flydsl_model.py for the addressing).

Skips when FlyDSL or ld.lld is missing, unless MOEGEMM_REQUIRE_ROCM_TOOLCHAIN=1
(CI sets it), which turns the skip into a failure.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from moegemm.kernels._flydsl_isa import compile_case, toolchain_problem
from moegemm.kernels._flydsl_tiles import (
    AUTOTUNE_TILES,
    DEFAULT_TILES,
    LDS_BUDGET,
    MFMA_INSTRUCTION,
    SUPPORTED_ARCHS,
    WEIGHT_LAYOUTS,
    FlyTile,
)

# DeepSeek-V3's expert down-projection: K = 2048 is 16 steps of 128, N = 7168.
N, K = 7168, 2048

_problem = toolchain_problem()
if _problem is not None and os.environ.get("MOEGEMM_REQUIRE_ROCM_TOOLCHAIN") == "1":
    raise RuntimeError(f"MOEGEMM_REQUIRE_ROCM_TOOLCHAIN=1 but {_problem}")
pytestmark = pytest.mark.skipif(_problem is not None, reason=f"ROCm compile toolchain: {_problem}")

DEFAULT_CASES = [
    (arch, layout, DEFAULT_TILES[arch]) for arch in SUPPORTED_ARCHS for layout in WEIGHT_LAYOUTS
]
CANDIDATE_CASES = [
    (arch, "preshuffled", tile) for arch in SUPPORTED_ARCHS for tile in AUTOTUNE_TILES
]


def _case_id(case) -> str:
    arch, layout, tile = case
    return f"{arch}-{layout}-{tile}"


@pytest.fixture(scope="module")
def compiled():
    """Every case compiled once, two subprocesses at a time (CI has two cores)."""
    cases = list(dict.fromkeys(DEFAULT_CASES + CANDIDATE_CASES))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {case: pool.submit(compile_case, *case, n=N, k=K) for case in cases}
        return {case: future.result() for case, future in futures.items()}


def _mfma_per_step(arch: str, tile: FlyTile) -> int:
    """MFMAs one wave issues per K step: 16x16 tiles x 128-wide blocks x (4 on gfx942, 1 on gfx950)."""
    tiles = (tile.block_m // 16) * (tile.block_n // 4 // 16) * (tile.block_k // 128)
    return tiles * (4 if arch == "gfx942" else 1)


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=_case_id)
def test_default_tile_compiles_to_the_intended_isa(compiled, case):
    arch, _, tile = case
    result = compiled[case]
    assert result.returncode == 0, result.stderr[-4000:]
    isa = result.isa
    (other,) = [a for a in SUPPORTED_ARCHS if a != arch]
    assert isa.count(MFMA_INSTRUCTION[arch]) >= _mfma_per_step(arch, tile)
    assert isa.count(MFMA_INSTRUCTION[other]) == 0
    assert isa.scratch_bytes == 0
    assert (isa.vgpr_spills, isa.sgpr_spills) == (0, 0)
    assert not [m for m in isa.instructions if m.startswith("scratch_")]
    assert isa.lds_bytes == tile.lds_bytes <= LDS_BUDGET[arch]
    # 16-byte moves: global A/B loads, the swizzled LDS stores and the MFMA operand reads.
    assert isa.count("global_load_dwordx4") > 0
    assert isa.count("ds_write_b128") > 0 and isa.count("ds_read_b128") > 0


@pytest.mark.parametrize("case", CANDIDATE_CASES, ids=_case_id)
def test_autotune_candidate_compiles_or_is_rejected_by_the_budget(compiled, case):
    arch, _, tile = case
    result = compiled[case]
    if tile.lds_bytes > LDS_BUDGET[arch]:
        assert result.rejected, (
            f"{tile} exceeds {arch}'s LDS but was not rejected: {result.stderr[-2000:]}"
        )
        assert f"{tile.lds_bytes} bytes of LDS" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.isa.count(MFMA_INSTRUCTION[arch]) >= _mfma_per_step(arch, tile)
    assert result.isa.lds_bytes == tile.lds_bytes
    assert result.isa.scratch_bytes == 0


def test_the_budget_check_has_teeth_on_gfx942():
    """At least one candidate must exceed gfx942's 64 KiB, or the rejection path goes untested."""
    assert any(t.lds_bytes > LDS_BUDGET["gfx942"] for t in AUTOTUNE_TILES)
    assert all(t.lds_bytes <= LDS_BUDGET["gfx950"] for t in AUTOTUNE_TILES)


def test_an_oversized_tile_is_rejected_before_compiling():
    tile = FlyTile(512, 128, 256)  # 270 KiB of LDS: more than either arch has
    for arch in SUPPORTED_ARCHS:
        result = compile_case(arch, "preshuffled", tile, n=N, k=K)
        assert result.rejected, result.stderr[-2000:]
        assert result.isa is None
        assert f"{arch} gives a workgroup {LDS_BUDGET[arch]}" in result.stderr
