"""The FlyDSL kernel compiles for gfx942 and gfx950, and its ISA is what we intend.

No AMD GPU is needed: FlyDSL compiles with ``COMPILE_ONLY=1`` and writes the
final ISA, one subprocess per case (``moegemm.kernels._flydsl_isa``). What this
proves: each (arch x layout) kernel with its default tile compiles, issues the
arch's MFMA and no other (on gfx950 with no data-format modifier, so e4m3 on
both sides, and both scale operands the constant E8M0 2^0), uses no scratch and
spills nothing, and allocates exactly the LDS the budget check accounts for; its K loop issues at
most 5 VALU instructions per MFMA, its last K step loads nothing, and its
occupancy is the pinned waves-per-EU at two values of K; the arguments of a
DeepSeek-V3-sized launch (G=256, N=4096, K=7168, M=32768) and of one with
M * N >= 2^31 pack through FlyDSL's own packing (meta tensors, no memory) and
compile, per arch and layout; every autotune candidate either compiles or is
turned away by the budget check, per arch.
What it cannot prove: that the kernel computes the right numbers (never
executed on AMD hardware here; see test_flydsl_model.py for the addressing).

Skips when FlyDSL or ld.lld is missing, unless MOEGEMM_REQUIRE_ROCM_TOOLCHAIN=1
(CI sets it), which turns the skip into a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from moegemm.kernels._flydsl_isa import (
    compile_case,
    rocm_path,
    toolchain_problem,
    waves_per_simd,
)
from moegemm.kernels._flydsl_tiles import (
    AUTOTUNE_TILES,
    DEFAULT_TILES,
    LDS_BUDGET,
    MFMA_INSTRUCTION,
    SUPPORTED_ARCHS,
    WAVES_PER_EU,
    WEIGHT_LAYOUTS,
    FlyTile,
    waves_per_eu,
)

# DeepSeek-V3's expert down-projection: K = 2048 is 16 steps of 128, N = 7168.
N, K = 7168, 2048

# Launches whose sizes once failed to pack (flattened operands had int32 extents
# of G*N*K or M*N): (G, N, K, M).
LARGE_LAUNCHES = {
    "dsv3": (256, 4096, 7168, 32768),  # DeepSeek-V3's up-projection: 7.5e9 weight bytes
    "mn": (8, 4096, 512, 2**19 + 128),  # M * N past 2^31 output elements
}
VALU_PER_MFMA_MAX = 5  # the seed kernel's figure on gfx950 (issue 18)

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
LARGE_CASES = [
    (arch, layout, launch)
    for arch in SUPPORTED_ARCHS
    for layout in WEIGHT_LAYOUTS
    for launch in sorted(LARGE_LAUNCHES)
]


def _case_id(case) -> str:
    arch, layout, tile = case
    return f"{arch}-{layout}-{tile}"


@pytest.fixture(scope="module")
def compiled():
    """Every case compiled once, two subprocesses at a time (CI has two cores).

    Keys: ``(arch, layout, tile)`` at N, K; ``(arch, layout, launch)`` for the
    large launches, packed at their full sizes with the default tile.
    """
    cases = list(dict.fromkeys(DEFAULT_CASES + CANDIDATE_CASES))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {case: pool.submit(compile_case, *case, n=N, k=K) for case in cases}
        for arch in SUPPORTED_ARCHS:  # the float32 epilogue (the expert FFN's h)
            futures[(arch, "f32")] = pool.submit(
                compile_case, arch, "preshuffled", DEFAULT_TILES[arch], n=N, k=K, out="f32"
            )
        for arch, layout, launch in LARGE_CASES:
            g, n, k, m = LARGE_LAUNCHES[launch]
            futures[(arch, layout, launch)] = pool.submit(
                compile_case, arch, layout, DEFAULT_TILES[arch], n=n, k=k, m=m, g=g
            )
        return {case: future.result() for case, future in futures.items()}


def _mfma_per_step(arch: str, tile: FlyTile) -> int:
    """MFMAs one wave issues per K step: 16x16 tiles x 128-wide blocks x (4 on gfx942, 1 on gfx950)."""
    tiles = (tile.block_m // 16) * (tile.block_n // 4 // 16) * (tile.block_k // 128)
    return tiles * (4 if arch == "gfx942" else 1)


def _assert_intended_mfma(isa, arch: str, tile: FlyTile) -> None:
    """Every MFMA is the arch's, at least a K step's worth; on gfx950 each reads e4m3 on both
    sides (no ``cbsz``/``blgp``: those pick e5m2 or fp6/fp4) with the neutral E8M0 scale (the
    float32 scales are applied in software), a register set to 0x7f for both operands."""
    mfmas = sum(n for m, n in isa.instructions.items() if m.startswith("v_mfma"))
    assert isa.count(MFMA_INSTRUCTION[arch]) == mfmas >= _mfma_per_step(arch, tile)
    if arch == "gfx950":
        assert isa.mfma_modifiers == Counter({"op_sel_hi:[0,0,0]": mfmas})
        assert isa.mfma_scale_sources == Counter({"v_mov_b32_e32 0x7f": 2 * mfmas})
    else:
        assert not isa.mfma_modifiers and not isa.mfma_scale_sources


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=_case_id)
def test_default_tile_compiles_to_the_intended_isa(compiled, case):
    arch, _, tile = case
    result = compiled[case]
    assert result.returncode == 0, result.stderr[-4000:]
    isa = result.isa
    _assert_intended_mfma(isa, arch, tile)
    assert isa.scratch_bytes == 0
    assert (isa.vgpr_spills, isa.sgpr_spills) == (0, 0)
    assert not [m for m in isa.instructions if m.startswith("scratch_")]
    assert not isa.narrow_addresses  # every load and store through a 64-bit address
    assert isa.lds_bytes == tile.lds_bytes <= LDS_BUDGET[arch]
    # 16-byte moves: global A/B loads, the swizzled LDS stores and the MFMA operand reads.
    assert isa.count("global_load_dwordx4") > 0
    assert isa.count("ds_write_b128") > 0 and isa.count("ds_read_b128") > 0
    # The code object's .text, read from the compiled module (what bench/rocm_isa.py reports).
    assert 4096 < isa.code_bytes < 64 * 1024 and isa.compile_seconds > 0


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_the_float32_epilogue_compiles_and_stores_dwords(compiled, arch):
    """Out float32 (the expert FFN's h, server/_ffn_graphs.H_DTYPE): the same kernel, its epilogue
    storing each sum as a dword where the bf16 one stores shorts."""
    result = compiled[(arch, "f32")]
    assert result.returncode == 0, result.stderr[-4000:]
    isa, bf16 = result.isa, compiled[(arch, "preshuffled", DEFAULT_TILES[arch])].isa
    assert isa.scratch_bytes == 0 and (isa.vgpr_spills, isa.sgpr_spills) == (0, 0)
    assert isa.count("global_store_dword") > 0 and bf16.count("global_store_dword") == 0
    assert not isa.narrow_addresses
    assert not [m for m in isa.instructions if m.startswith("global_store_short")]
    assert isa.count(MFMA_INSTRUCTION[arch]) == bf16.count(MFMA_INSTRUCTION[arch])
    assert isa.lds_bytes == bf16.lds_bytes


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=_case_id)
def test_k_loop_is_lean_and_the_last_step_loads_nothing(compiled, case):
    """VALU per MFMA in the K loop at most the seed's 5; after the loop, MFMAs but no memory loads."""
    arch, _, tile = case
    loop = compiled[case].isa.loop
    assert loop is not None, "no K loop found in the ISA"
    assert loop.mfma == _mfma_per_step(arch, tile)  # one K step per iteration
    assert loop.valu_per_mfma <= VALU_PER_MFMA_MAX, (
        f"{loop.valu} VALU for {loop.mfma} MFMA: {sorted(loop.instructions.items())}"
    )
    # The peeled last step: its MFMAs follow the loop, with no global or buffer load.
    assert sum(n for m, n in loop.after.items() if m.startswith("v_mfma")) == loop.mfma
    assert not [m for m in loop.after if m.startswith(("global_load", "buffer_load"))]


@pytest.mark.parametrize("case", LARGE_CASES, ids=_case_id)
def test_large_launches_pack_and_compile(compiled, case):
    """The arguments of the launch pack at full size (the child packs before compiling)."""
    arch = case[0]
    result = compiled[case]
    assert result.returncode == 0, result.stderr[-4000:]
    _assert_intended_mfma(result.isa, arch, DEFAULT_TILES[arch])
    assert result.isa.scratch_bytes == 0
    # Past 2^31 elements: int64 offsets only reach memory through 64-bit addresses.
    assert not result.isa.narrow_addresses


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=_case_id)
def test_occupancy_is_pinned_whatever_k(compiled, case):
    """K = 2048 and K = 7168: the same waves per SIMD, the pinned waves-per-EU, within its registers."""
    arch, layout, tile = case
    pinned = waves_per_eu(arch, tile)
    for isa in (compiled[case].isa, compiled[(arch, layout, "dsv3")].isa):
        assert isa.vgprs + isa.agprs <= 512 // pinned
        assert waves_per_simd(arch, isa.vgprs, isa.agprs, isa.lds_bytes) == pinned
        assert (isa.vgpr_spills, isa.scratch_bytes) == (0, 0)


def test_every_compilable_candidate_has_a_pinned_occupancy():
    for arch in SUPPORTED_ARCHS:
        for tile in {*AUTOTUNE_TILES, DEFAULT_TILES[arch]}:
            if tile.lds_bytes <= LDS_BUDGET[arch]:
                assert str(tile) in WAVES_PER_EU[arch], (arch, tile)


_PACK_CHECK = """
import json, struct, sys
import torch
from moegemm.kernels import flydsl_kernel as fk
from moegemm.kernels._flydsl_gemm import KernelShape, build_launcher
from moegemm.kernels._flydsl_tiles import DEFAULT_TILES
g, n, k, m = (int(v) for v in sys.argv[1:5])
launcher = build_launcher(KernelShape("gfx950", "preshuffled", DEFAULT_TILES["gfx950"], n, k))
tensors = fk._operands(m, g, n, k, torch.int64)
slots = fk.pack_arguments(launcher, tensors, m, g)
layouts = [bytes(slots[2 * i + 1]) for i in range(len(tensors))]
packed = []
for t, raw in zip(tensors, layouts):
    rank = t.dim()
    packed.append(list(struct.unpack("<" + "i" * rank + "q" * (rank - 1), raw)))
expected = [list(t.shape) + list(t.stride()[:-1]) for t in tensors]
try:
    fk.pack_arguments(launcher, [t.reshape(-1) for t in tensors], m, g)
    flat = "packed"
except struct.error as exc:
    flat = f"struct.error: {exc}"
print(json.dumps({"packed": packed, "expected": expected, "scalars": [slots[-3].value, slots[-2].value], "flat": flat}))
"""


@pytest.mark.parametrize("launch", sorted(LARGE_LAUNCHES))
def test_packed_arguments_are_the_natural_shapes(launch):
    """FlyDSL's packing of a large launch: int32 extents and int64 strides equal to the tensors'.

    The flattened operands of the old launcher fail to pack at these sizes (the
    bug): the check has teeth.
    """
    g, n, k, m = LARGE_LAUNCHES[launch]
    env = dict(os.environ, COMPILE_ONLY="1", FLYDSL_GPU_ARCH="gfx950", ROCM_PATH=str(rocm_path()))
    proc = subprocess.run(
        [sys.executable, "-c", _PACK_CHECK, str(g), str(n), str(k), str(m)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["packed"] == report["expected"]
    assert report["scalars"] == [m, g]
    assert report["flat"].startswith("struct.error"), report["flat"]


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
    _assert_intended_mfma(result.isa, arch, tile)
    assert result.isa.lds_bytes == tile.lds_bytes
    assert (result.isa.scratch_bytes, result.isa.vgpr_spills) == (0, 0)


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
