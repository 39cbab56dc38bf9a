"""The Triton kernels that quantize on the GPU compile for sm_90 on the CPU, with the rounding's
arithmetic as the interpreter runs it.

``_triton_act``'s ``silu_mul_quant`` and gather-and-quantize kernels, and the one-token moe
kernels (``_triton_moe_token``: the up kernel quantizes the token, the down kernel the
activation), compiled as their launchers compile them, in both fp8 formats. The CPU tests run
them in Triton's interpreter (``test_triton_act.py``, ``test_moe_token.py``); what the GPU runs
is this PTX, so it must hold the same operations: IEEE float32 division (``div.rn.f32``, never
the approximate ``div.full.f32`` Triton's ``/`` gives), float-to-int conversions that truncate
(``cvt.rzi``) and float64 products rounded to nearest (exact here: at most 29 significant bits),
and no register spills.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from moegemm.kernels import _triton_act as ta
from sm90_compile import PTXAS, compile_sm90, moe_token_report, ptxas_report

if not PTXAS.exists():
    pytest.skip("Triton's ptxas is not installed", allow_module_level=True)

POINTERS = ("h_ptr", "aq_ptr", "scale_ptr", "rows_ptr", "x_ptr", "gather_ptr", "flags_ptr")


def _compiled(kind: str, fnuz: bool):
    bias, min_normal, sub_scale = ta._FORMAT[fnuz]
    formats = {"FNUZ": fnuz, "BIAS": bias, "MIN_NORMAL": min_normal, "SUB_SCALE": sub_scale}
    if kind == "silu_mul_quant":  # the launch silu_mul_quant_triton makes for I = 2048
        sig = {"h_ptr": "*fp32", "aq_ptr": "*u8", "scale_ptr": "*fp32", "rows_ptr": "*i64",
               "stride_h": "i64", "stride_aq": "i64", "stride_scale": "i64", "FP8_MAX": "fp32"}
        consts = {"I": 2048, "HAS_ROWS": True, "BLOCKS": 8, "INTERPRETED": False, **formats}
        return compile_sm90(ta._silu_mul_quant_kernel, sig, consts,
                            {"num_warps": 4, "enable_fp_fusion": False},
                            [a for a in sig if a in POINTERS])
    sig = {"x_ptr": "*bf16", "gather_ptr": "*i64", "gather_stride": "i64", "aq_ptr": "*u8",
           "scale_ptr": "*fp32", "flags_ptr": "*i8", "FP8_MAX": "fp32"}
    # the launches gather_quantize_triton makes for K = 7168: few rows (a whole row at once) or
    # many (chunks of 8 blocks)
    blocks, warps = ta.row_chunk(7168, 8 if kind == "gather_quantize_few" else 2048)
    return compile_sm90(ta._gather_quant_kernel, sig, {"K": 7168, "BLOCKS": blocks, **formats},
                        {"num_warps": warps, "enable_fp_fusion": False}, [a for a in sig if a in POINTERS])


def _rounding_ops(kernel) -> list[str]:
    """The kernel's arithmetic PTX operations, having checked the rounding's: IEEE float32
    division only, truncating float-to-int conversions, and no register spill."""
    ops = re.findall(r"^\s*((?:div|mul|sub|fma|cvt)\.[\w.]+)", kernel.asm["ptx"], re.MULTILINE)
    assert "div.rn.f32" in ops, "the quotient by the scale must be an IEEE division"
    assert not [o for o in ops if o.startswith("div.") and o != "div.rn.f32"], ops
    assert "cvt.rzi.s32.f32" in ops  # a subnormal value's whole steps: truncated, as numpy does
    found = ptxas_report(kernel)
    assert found["spill_bytes"] == 0, found
    return ops


@pytest.mark.parametrize("fnuz", [False, True], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("kind", ["silu_mul_quant", "gather_quantize", "gather_quantize_few"])
def test_quantizing_kernels_compile_with_the_rounding_they_are_tested_with(kind, fnuz):
    ops = _rounding_ops(_compiled(kind, fnuz))
    f64 = [o for o in ops if o.endswith(".f64") and o.split(".")[0] in ("mul", "sub", "fma")]
    assert f64 and all(".rn." in o or o == "mul.f64" for o in f64), f64


@pytest.mark.parametrize("fp8_in", [False, True], ids=["bf16-token", "fp8-token"])
def test_one_token_moe_kernels_compile_clean(fp8_in):
    """DeepSeek-V3's layer (G 256, H 7168, I 2048, top-8): no spill in either kernel."""
    for found in moe_token_report(256, 7168, 2048, 8, fp8_in):
        assert found["spill_bytes"] == 0, found


@pytest.mark.parametrize("tokens", [16, 4096], ids=["whole-rows", "chunks"])
@pytest.mark.parametrize("kind", ["route", "quantize_scatter"])
def test_moe_row_quantizers_compile_clean(kind, tokens):
    """The moe path's row quantization at DeepSeek-V3's H 7168, top-8, G 256, as ``route`` and
    ``quantize_scatter`` launch it for a bucket of ``tokens`` (16: 128 rows, each quantized
    whole; 4096: in chunks of 8 blocks, ``row_chunk``): the rounding's operations, no spill."""
    import triton
    from moegemm.kernels import _triton_route as tr

    bias, min_normal, sub_scale = ta._FORMAT[False]
    formats = {"FNUZ": False, "BIAS": bias, "MIN_NORMAL": min_normal, "SUB_SCALE": sub_scale}
    H, k, G = 7168, 8, 256
    blocks, warps = ta.row_chunk(H, tokens * k if kind == "route" else tokens)
    quant = {"x_ptr": "*bf16", "aq_ptr": "*u8", "scale_ptr": "*fp32", "FP8_MAX": "fp32"}
    if kind == "route":
        sig = {"ids_ptr": "*i32", "wide_ptr": "*i64", "w_ptr": "*fp32", "tokens_ptr": "*i64",
               "m_sizes_ptr": "*i64", "pos_ptr": "*i64", "src_ptr": "*i64", "live_ptr": "*i64",
               "flags_ptr": "*i8", **quant, "x_flags_ptr": "*i8"}
        consts = {"bucket_tokens": tokens, "R": tokens * k, "G": G, "K": k, "KP": k,
                  "CHUNK": tr._CHUNK, "TBLOCK": tr._CHUNK // k, "QUANT": True, "H": H,
                  "S": min(32, triton.next_power_of_2(triton.cdiv(tokens * k, G + 1))),
                  "BLOCKS": blocks, **formats}
        fn, warps = tr._route_kernel, 8  # route's warps follow H
    else:
        sig = {"x_ptr": "*bf16", "pos_ptr": "*i64", "aq_ptr": "*u8", "scale_ptr": "*fp32",
               "flags_ptr": "*i8", "FP8_MAX": "fp32"}
        consts = {"K": k, "H": H, "BLOCKS": blocks, **formats}
        fn = tr._quantize_scatter_kernel
    _rounding_ops(compile_sm90(fn, sig, consts, {"num_warps": warps, "enable_fp_fusion": False},
                               [a for a in sig if a.endswith("_ptr")]))
