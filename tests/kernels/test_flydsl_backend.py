"""The FlyDSL backend's host side: tile checks, arch detection, selection, autotune cache, ISA parsing.

None of this imports FlyDSL: the checks that must run before tracing are plain
Python, and the module keeps FlyDSL out of any process that merely imports it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from moegemm.kernels import BackendUnavailable
from moegemm.kernels import flydsl_kernel as fk
from moegemm.kernels._flydsl_isa import mfma_operands, parse_isa
from moegemm.kernels._flydsl_tiles import (
    AUTOTUNE_TILES,
    DEFAULT_TILES,
    LDS_BUDGET,
    FlyTile,
    TileTooLarge,
    check_tile,
    fit_tile,
)


def test_importing_the_backend_does_not_import_flydsl():
    code = (
        "import sys\n"
        "import moegemm.kernels.flydsl_kernel, moegemm.kernels._flydsl_isa\n"
        "assert 'flydsl' not in sys.modules, sorted(m for m in sys.modules if 'fly' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("arch", sorted(DEFAULT_TILES))
def test_default_tiles_pass_their_arch_checks(arch):
    assert check_tile(DEFAULT_TILES[arch], arch) is DEFAULT_TILES[arch]


def test_lds_budget_is_per_arch():
    tile = FlyTile(128, 128, 256)  # 2 x (32 KiB A + 1 KiB scales) = 66 KiB
    assert tile.lds_bytes == 2 * (128 * 256 + 4 * 128 * 2)
    with pytest.raises(TileTooLarge, match=r"67584 bytes of LDS.*gfx942 gives a workgroup 65536"):
        check_tile(tile, "gfx942")
    assert check_tile(tile, "gfx950") is tile
    with pytest.raises(TileTooLarge, match="gfx950 gives a workgroup 163840"):
        check_tile(FlyTile(512, 128, 256), "gfx950")


def test_every_candidate_is_judged_by_the_budget_alone():
    """Each candidate is well formed; only LDS decides whether an arch takes it."""
    for arch, budget in LDS_BUDGET.items():
        for tile in AUTOTUNE_TILES:
            if tile.lds_bytes > budget:
                with pytest.raises(TileTooLarge):
                    check_tile(tile, arch)
            else:
                check_tile(tile, arch)


@pytest.mark.parametrize(
    ("tile", "message"),
    [
        (FlyTile(48, 128, 128), "block_m"),
        (FlyTile(64, 96, 128), "block_n"),
        (FlyTile(64, 1024, 128), "block_n"),
        (FlyTile(64, 128, 192), "block_k"),
        (FlyTile(64, 128, 64), "block_k"),
    ],
)
def test_malformed_tiles_are_refused(tile, message):
    with pytest.raises(ValueError, match=message):
        check_tile(tile, "gfx950")


def test_unknown_arch_is_refused():
    with pytest.raises(ValueError, match="gfx90a"):
        check_tile(DEFAULT_TILES["gfx942"], "gfx90a")


def test_fit_tile_shrinks_to_divide_n_and_k():
    assert fit_tile(FlyTile(64, 256, 256), 384, 384) == FlyTile(64, 128, 128)
    assert fit_tile(FlyTile(64, 256, 256), 512, 1024) == FlyTile(64, 256, 256)
    assert fit_tile(FlyTile(32, 512, 128), 640, 128) == FlyTile(32, 128, 128)
    # block_k steps down by 128 blocks: 384 over K = 1024 is 256 (halving gave 96, no tile).
    assert fit_tile(FlyTile(32, 128, 384), 128, 1024) == FlyTile(32, 128, 256)
    assert fit_tile(FlyTile(32, 128, 384), 128, 640) == FlyTile(32, 128, 128)
    # A block_k off the 128 grid (a damaged tuning cache) comes back as it was, for
    # check_tile to refuse: never a loop without end, never a negative size.
    for bad in (100, 96):
        assert fit_tile(FlyTile(32, 128, bad), 128, 1024).block_k == bad
        with pytest.raises(ValueError, match="block_k"):
            check_tile(fit_tile(FlyTile(32, 128, bad), 128, 1024), "gfx942")


def test_device_arch_in_compile_only_mode(monkeypatch):
    monkeypatch.setenv("COMPILE_ONLY", "1")
    monkeypatch.setenv("FLYDSL_GPU_ARCH", "GFX950")
    assert fk.device_arch(torch.device("cpu")) == "gfx950"
    monkeypatch.setenv("FLYDSL_GPU_ARCH", "gfx1201")
    with pytest.raises(BackendUnavailable, match="gfx1201"):
        fk.device_arch(torch.device("cpu"))


@pytest.mark.skipif(bool(torch.version.hip), reason="this box has ROCm torch")
def test_pin_target_makes_flydsl_compile_for_the_device(monkeypatch):
    """An audit: nothing made FlyDSL's target the device's. FlyDSL reads ARCH first, then
    FLYDSL_GPU_ARCH, then rocm_agent_enumerator, and guesses gfx942."""
    monkeypatch.delenv("FLYDSL_GPU_ARCH", raising=False)
    monkeypatch.delenv("HSA_OVERRIDE_GFX_VERSION", raising=False)
    monkeypatch.setenv("ARCH", "x86_64")  # a build host's variable
    fk.pin_target("gfx950")
    assert os.environ["FLYDSL_GPU_ARCH"] == "gfx950" and os.environ["ARCH"] == "gfx950"
    monkeypatch.setenv("FLYDSL_GPU_ARCH", "gfx942")
    with pytest.raises(BackendUnavailable, match="FLYDSL_GPU_ARCH=gfx942 but the device is gfx950"):
        fk.pin_target("gfx950")
    monkeypatch.setenv("FLYDSL_GPU_ARCH", "gfx950:sramecc+:xnack-")  # feature flags: the same target
    fk.pin_target("gfx950")
    assert os.environ["FLYDSL_GPU_ARCH"] == "gfx950:sramecc+:xnack-"
    if importlib.util.find_spec("flydsl") is None:
        if os.environ.get("MOEGEMM_REQUIRE_ROCM_TOOLCHAIN") == "1":
            pytest.fail("MOEGEMM_REQUIRE_ROCM_TOOLCHAIN=1 but FlyDSL is not installed")
        pytest.skip("FlyDSL is not installed: its own choice of target is unchecked")
    # FlyDSL's own choice, in a process of its own (never next to Triton).
    code = ("from moegemm.kernels import flydsl_kernel as fk; fk.pin_target('gfx950'); "
            "from flydsl.compiler.backends.rocm import RocmBackend; "
            "print(RocmBackend.detect_target().arch)")
    env = {k: v for k, v in os.environ.items() if k not in ("FLYDSL_GPU_ARCH", "COMPILE_ONLY")}
    env["ARCH"] = "x86_64"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "gfx950"


def test_create_is_unavailable_without_rocm(monkeypatch):
    monkeypatch.delenv("COMPILE_ONLY", raising=False)
    with pytest.raises(BackendUnavailable, match="ROCm"):
        fk.create(torch.device("cuda", 0))


def test_the_kernel_is_not_loaded_next_to_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", object())
    with pytest.raises(BackendUnavailable, match="triton is already imported"):
        fk._import_kernel_module()


def test_autotune_key_buckets_m_by_powers_of_two():
    for m, bucket in ((1, 1), (2, 2), (83, 128), (1335, 2048), (4096, 4096)):
        assert fk.autotune_key(m, 7168, 2048, 256, "AMD Instinct MI300X") == \
            f"{bucket}:7168:2048:256:bf16:AMD Instinct MI300X"


def test_autotune_key_tells_the_output_dtypes_apart():
    """The expert FFN's float32 h and a gemm's bf16 out of one shape tune separately."""
    bf16 = fk.autotune_key(83, 4096, 7168, 256, "MI300X")
    f32 = fk.autotune_key(83, 4096, 7168, 256, "MI300X", torch.float32)
    assert bf16 != f32 and f32 == "128:4096:7168:256:f32:MI300X"


def test_autotune_winners_persist_per_layout(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fk, "_tuned", {})
    key = fk.autotune_key(100, 512, 1024, 8, "MI355X")
    fk._load_tuned("preshuffled")[key] = FlyTile(128, 64, 256)
    fk._save_tuned("preshuffled")
    monkeypatch.setattr(fk, "_tuned", {})
    assert fk._load_tuned("preshuffled") == {key: FlyTile(128, 64, 256)}
    assert fk._load_tuned("plain") == {}
    assert (tmp_path / "flydsl_preshuffled_tiles.json").exists()


@pytest.mark.parametrize("text", ["[]", "[" * 100_000, '{"1:512:1024:8:bf16:x": "abc"}',
                                  '{"k": [1, 2]}', "not json"])
def test_an_autotune_cache_that_is_no_map_of_tiles_is_tuned_again(monkeypatch, tmp_path, text):
    """A cache file some other tool or a crash left is read as empty (each of these raised
    on every autotuned call, or made a tile of strings)."""
    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fk, "_tuned", {})
    (tmp_path / "flydsl_plain_tiles.json").write_text(text)
    assert fk._load_tuned("plain") == {}


def test_autotune_looks_up_the_winner_of_the_calls_output_dtype(monkeypatch):
    """The call site passes ``out``'s dtype: a float32 ``h`` gets the f32 winner."""
    monkeypatch.setenv("MOEGEMM_AUTOTUNE", "1")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "MI300X")
    bf16, f32 = FlyTile(128, 64, 256), FlyTile(64, 128, 256)
    monkeypatch.setattr(fk, "_tuned", {"plain": {
        fk.autotune_key(5, 256, 256, 3, "MI300X"): bf16,
        fk.autotune_key(5, 256, 256, 3, "MI300X", torch.float32): f32}})
    xq, wq, xs, ws, ms, out = _call_args()
    assert fk._tile_for("plain", "gfx950", xq, wq, xs, ws, ms, out) == bf16
    assert fk._tile_for("plain", "gfx950", xq, wq, xs, ws, ms, out.float()) == f32


def _call_args(fp8=torch.float8_e4m3fnuz, m=5, n=256, k=256, g=3):
    return (
        torch.empty(m, k, dtype=fp8),
        torch.empty(g, n, k, dtype=fp8),
        torch.ones(m, k // 128),
        torch.ones(g, k // 128, n // 128),
        torch.tensor([2, 0, 3]),
        torch.empty(m, n, dtype=torch.bfloat16),
    )


def test_call_checks_refuse_what_the_kernel_cannot_read():
    fk._check_call(*_call_args(), torch.float8_e4m3fnuz)
    with pytest.raises(TypeError, match="computes in"):
        fk._check_call(*_call_args(torch.float8_e4m3fn), torch.float8_e4m3fnuz)
    xq, wq, xs, ws, ms, out = _call_args()
    with pytest.raises(ValueError, match="w_scale must have shape"):
        fk._check_call(xq, wq, xs, ws[:, :1], ms, out, torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="16-byte boundary"):
        fk._check_call(xq, wq, xs, ws, torch.tensor([0, 2, 0, 3])[1:], out, torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="contiguous"):
        fk._check_call(
            xq, wq, xs, ws, ms, torch.empty(256, 5, dtype=torch.bfloat16).t(), torch.float8_e4m3fnuz
        )
    # float32 out (the expert FFN's h) is written; other dtypes are refused.
    fk._check_call(xq, wq, xs, ws, ms, out.float(), torch.float8_e4m3fnuz)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        fk._check_call(xq, wq, xs, ws, ms, out.half(), torch.float8_e4m3fnuz)


_ISA = """\
grouped_fp8_gemm_kernel:
\ts_load_dwordx2 s[0:1], s[0:1], 0x0
\tv_mfma_f32_16x16x32_fp8_fp8 v[0:3], v[4:5], v[6:7], 0
\tv_mfma_f32_16x16x32_fp8_fp8 v[0:3], v[8:9], v[10:11], v[0:3]
\ts_endpgm
\t.amdgpu_metadata
---
amdhsa.kernels:
  - .agpr_count:     4
    .group_segment_fixed_size: 16896
    .private_segment_fixed_size: 0
    .sgpr_count:     49
    .sgpr_spill_count: 0
    .vgpr_count:     119
    .vgpr_spill_count: 2
\t.end_amdgpu_metadata
"""


def test_parse_isa_reads_instructions_and_resources():
    facts = parse_isa(_ISA)
    assert facts.count("v_mfma_f32_16x16x32_fp8_fp8") == 2
    assert facts.count("v_mfma_scale_f32_16x16x128_f8f6f4") == 0
    assert (facts.lds_bytes, facts.scratch_bytes, facts.vgprs, facts.agprs) == (16896, 0, 119, 4)
    assert (facts.vgpr_spills, facts.sgpr_spills) == (2, 0)
    with pytest.raises(ValueError, match="group_segment_fixed_size"):
        parse_isa(_ISA.replace(".group_segment_fixed_size", ".other"))


def test_narrow_addresses_are_the_forms_that_cannot_reach_past_2_31():
    """A global load or store through a 64-bit VGPR address with no SGPR base is 64-bit; a
    buffer one (32-bit offsets), a flat one, or a global one on an SGPR base (a 32-bit VGPR
    offset) is named."""
    wide = [
        "\tglobal_load_dwordx4 v[0:3], v[4:5], off",
        "\tglobal_load_dword v9, v[4:5], off offset:64",
        "\tglobal_store_short_d16_hi v[38:39], v36, off offset:32",
        "\tglobal_store_dword v[2:3], v1, off",
    ]
    narrow = [
        "\tbuffer_load_dwordx4 v[0:3], v4, s[8:11], 0 offen",
        "\tglobal_load_dwordx4 v[0:3], v4, s[2:3]",
        "\tglobal_store_short v5, v6, s[2:3] offset:32",
        "\tglobal_load_dword v9, v[4:6], off",
        "\tflat_load_dword v9, v[4:5]",
    ]
    isa = _ISA.replace("\ts_endpgm", "\n".join([*wide, *narrow, "\ts_endpgm"]))
    found = parse_isa(isa).narrow_addresses
    assert [f.split()[0] for f in found] == [n.split()[0] for n in narrow]
    assert parse_isa(_ISA).narrow_addresses == []


_SCALED = """\
grouped_fp8_gemm_kernel:
\tv_mov_b32_e32 v28, 0x7f
\tv_mov_b32_e32 v29, v3
\tv_mfma_scale_f32_16x16x128_f8f6f4 v[0:3], v[4:11], v[12:19], 0, v28, v28 op_sel_hi:[0,0,0]
\tv_mfma_scale_f32_16x16x128_f8f6f4 v[0:3], v[4:11], v[12:19], 0, v28, v29 op_sel_hi:[0,0,0] cbsz:1 blgp:1
\tv_mov_b32_e32 v28, v5
\tv_mfma_scale_f32_16x16x128_f8f6f4 v[0:3], v[4:11], v[12:19], 0, v28, v28 op_sel_hi:[0,0,0]
\ts_endpgm
"""


def test_parse_isa_reads_each_scaled_mfmas_format_and_scale_source():
    """What the ISA test pins on gfx950: modifiers that would read e5m2 (``cbsz``/``blgp``) and a
    scale register last written with anything but the constant 0x7f are told apart."""
    modifiers, sources = mfma_operands(_SCALED)
    assert modifiers == Counter({"op_sel_hi:[0,0,0]": 3, "cbsz:1": 1, "blgp:1": 1})
    assert sources == Counter({"v_mov_b32_e32 0x7f": 3, "v_mov_b32_e32 v3": 1,
                               "v_mov_b32_e32 v5": 2})
    assert mfma_operands(_ISA) == (Counter(), Counter())  # gfx942's MFMA takes no scales


def test_fit_tile_names_an_n_or_k_off_the_128_grid():
    """Not "tile 128x1x128": the dimension that is wrong, by name."""
    with pytest.raises(ValueError, match="N = 100 must be a positive multiple of 128"):
        fit_tile(FlyTile(128, 128, 128), 100, 256)
    with pytest.raises(ValueError, match="K = 320 must be a positive multiple of 128"):
        fit_tile(FlyTile(128, 128, 128), 256, 320)
    # A malformed block_n is left for check_tile to name, not halved into nonsense.
    with pytest.raises(ValueError, match="tile 64x96x128: block_n"):
        check_tile(fit_tile(FlyTile(64, 96, 128), 128, 128), "gfx942")


def test_call_checks_refuse_extents_past_int32():
    """Each extent travels as an int32 (FlyDSL's packing): M = 2^31 is refused before any launch."""
    m = 2**31
    xq = torch.empty(m, 128, dtype=torch.float8_e4m3fnuz, device="meta")
    args = (
        xq,
        torch.empty(1, 128, 128, dtype=torch.float8_e4m3fnuz, device="meta"),
        torch.empty(m, 1, device="meta"),
        torch.empty(1, 1, 1, device="meta"),
        torch.empty(1, dtype=torch.int64, device="meta"),
        torch.empty(m, 128, dtype=torch.bfloat16, device="meta"),
    )
    with pytest.raises(ValueError, match="M = 2147483648 is past the int32 range"):
        fk._check_call(*args, torch.float8_e4m3fnuz)
    # An M just inside int32 would wrap the launcher's int32 grid, (M + block_m - 1) // ...
    m = 2**31 - 100
    args = (torch.empty(m, 128, dtype=torch.float8_e4m3fnuz, device="meta"), args[1],
            torch.empty(m, 1, device="meta"), args[3], args[4],
            torch.empty(m, 128, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match="grid's int32 arithmetic"):
        fk._check_call(*args, torch.float8_e4m3fnuz)


def test_a_triton_imported_after_the_kernel_leaves_the_kernel_in_use(monkeypatch):
    """Once the kernel module is loaded, a caller's later ``import triton`` (vLLM,
    ``torch.compile``) must not make every launch refuse: FlyDSL is in the process already."""
    kernel = object()
    monkeypatch.setitem(sys.modules, "moegemm.kernels._flydsl_gemm", kernel)
    monkeypatch.setitem(sys.modules, "triton", object())
    assert fk._import_kernel_module() is kernel


def test_the_backend_runs_plain_weights_with_its_own_kernel(monkeypatch):
    """The public ``grouped_gemm`` gives plain weights to ``run_plain`` (the kernel's plain
    layout), not a preshuffled copy made on every call; the loaded sets stay preshuffled."""
    monkeypatch.setenv("COMPILE_ONLY", "1")
    monkeypatch.setenv("FLYDSL_GPU_ARCH", "gfx942")
    monkeypatch.setattr(fk, "pin_target", lambda arch: None)
    monkeypatch.setattr(fk, "_import_kernel_module", lambda: None)
    layouts = []
    monkeypatch.setattr(fk, "_run", lambda layout, *args: layouts.append(layout))
    backend = fk.create(torch.device("cuda", 0))
    assert backend.weight_layout == "preshuffled"
    backend.run_plain(*_call_args())
    backend.run(*_call_args())
    assert layouts == ["plain", "preshuffled"]


@pytest.mark.parametrize("text", ['{"1:512:1024:8:bf16:x": [128, 0, 128]}',
                                  '{"1:512:1024:8:bf16:x": [128, 128, 128, 1]}'])
def test_an_autotune_cache_with_a_tile_of_no_size_is_tuned_again(monkeypatch, tmp_path, text):
    """A zero size raised ZeroDivisionError on every autotuned call of that shape."""
    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fk, "_tuned", {})
    (tmp_path / "flydsl_preshuffled_tiles.json").write_text(text)
    assert fk._load_tuned("preshuffled") == {}


@pytest.mark.parametrize("bad", [FlyTile(48, 128, 128), FlyTile(128, 128, 64),
                                 FlyTile(512, 128, 1024)])  # the last: past gfx942's LDS
def test_an_autotune_winner_the_arch_cannot_run_is_tuned_again(monkeypatch, bad):
    """A cached tile that is malformed or does not fit the arch's LDS failed every call of its
    shape in ``check_tile``; it is timed afresh instead, among the candidates that fit."""
    monkeypatch.setenv("MOEGEMM_AUTOTUNE", "1")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "MI300X")
    monkeypatch.setattr(fk, "_tuned", {"plain": {fk.autotune_key(5, 256, 256, 3, "MI300X"): bad}})
    monkeypatch.setattr(fk, "_save_tuned", lambda layout: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    timed = []
    monkeypatch.setattr(fk, "_time_tile", lambda layout, tile, *args: timed.append(tile) or 1.0)
    tile = fk._tile_for("plain", "gfx942", *_call_args())
    assert timed and tile == timed[0] and check_tile(fit_tile(tile, 256, 256), "gfx942")
