"""Compile the triton kernel for sm_90 on a machine without a GPU and report what matters.

    python bench/sm90_compile.py [--addresses]    # the table and its sweep neighbours on four shapes
    python bench/sm90_compile.py --gluon          # the Gluon schedules (gluon_ws and its variants) in every form
    python bench/sm90_compile.py --moe-token      # the one-token moe kernels (kernels/_triton_moe_token)
    python bench/sm90_compile.py --decode         # the decode tiles as decode_sweep times them

For each tile configuration: registers, spill bytes and ptxas's wgmma
serialisation warnings (C7514/C7515, which mean the tensor cores wait for
every instruction), shared memory (over 227 KiB cannot launch), and whether
Triton split the tile over warp-specialised partitions. Uses only the ptxas
that ships with triton; constexprs and 16-divisibility as ``_launch`` would
give them for the shape. Never collected by pytest.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes of dynamic shared memory one block may have on sm_90
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
CUOBJDUMP = PTXAS.parent / "cuobjdump"


def compile_sm90(fn, signature: dict, constexprs: dict, options: dict, divisible=(), gluon: bool = False):
    """A compiled kernel for sm_90 (``signature`` maps every non-constexpr argument to its type;
    ``divisible`` names the arguments a launch would see as multiples of 16; ``gluon``: a
    ``@gluon.jit`` kernel)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    src = (GluonASTSource if gluon else ASTSource)(fn, sig, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=options)


def ptxas_report(kernel) -> dict:
    """Registers, spills and serialisation warnings from running ptxas -v on the kernel's PTX."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        done = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.o")],
                              check=True, capture_output=True, text=True)
    text = done.stdout + done.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return {"regs": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else None,
            "serialised": sorted(set(re.findall(r"\((C75\d\d)\)", text)))}


def compile_config(cfg, m: int, n: int, k: int, g: int, addrs: bool = False, service: bool = False,
                   out: str = "bf16", row_map: bool = True, flags: bool = False, extra: dict | None = None):
    """``cfg``'s kernel compiled as ``triton_kernel._launch`` would launch it on (m, n, k, g);
    ``addrs``: the weights by address; ``service``: also the activations by address and
    (``row_map``, else stored in place: a lone prefill call's graph) the output through a row
    map, as a server graph launches it; ``out``: bf16 or fp32; ``flags``: the rows' check
    inside (a lone call's graph: in place on a persistent tile); ``extra``: more constexprs (an experiment's)."""
    from moegemm.kernels import triton_kernel as tk

    fn = tk.SCHEDULES[cfg.schedule]
    addrs = addrs or service
    sig = {"x_ptr": "*i64" if service else "*fp8e4nv", "w_ptr": "*i64" if addrs else "*fp8e4nv",
           "xs_ptr": "*i64" if service else "*fp32", "ws_ptr": "*i64" if addrs else "*fp32",
           "m_sizes_ptr": "*i64", "out_ptr": f"*{out}", "map_ptr": "*i64",
           "M": "i32", "N": "i32", "K": "i32", "G": "i32", "stride_xm": "i32",
           "stride_wg": "i32", "stride_wn": "i32", "stride_xsm": "i32", "stride_wsg": "i32", "stride_wsk": "i32",
           "stride_om": "i32", "stride_map": "i32"}
    values = {"M": m, "N": n, "K": k, "G": g, "stride_xm": k, "stride_wg": n * k, "stride_wn": k,
              "stride_xsm": k // 128, "stride_wsg": (k // 128) * (n // 128), "stride_wsk": n // 128, "stride_om": n,
              "stride_map": 2}
    # Triton specialises an int argument of 1 as a constant; none of these is 1 for real shapes.
    divisible = [a for a, t in sig.items() if t.startswith("*")] + [a for a, v in values.items() if v % 16 == 0]
    g_pow2 = max(16, triton.next_power_of_2(g))
    consts = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": 128, "ADDRS": addrs,
              "X_WORDS": service, "ROW_MAP": service and row_map, "G_POW2": g_pow2}
    if cfg.swap_ab:
        if cfg.schedule == "decode":  # split-K and preloading: the single-block kernel's only
            split_k = max(1, min(cfg.split_k, k // 128))
            if split_k > 1:
                sig.update({"part_ptr": "*fp32", "count_ptr": "*i32"})
                divisible += ["part_ptr", "count_ptr"]
            else:
                consts.update({"part_ptr": None, "count_ptr": None})
            consts.update(SPLIT_K=split_k, PRELOAD=cfg.preload, CHUNK=tk.scale_chunk(cfg, k) if cfg.preload else 16)
        sig["flags_ptr"] = "*i8" if flags else "*i64"  # a lone call's graph: the check inside
        divisible.append("flags_ptr")
        consts.update(EVICT_W=cfg.evict_w, GROUP_TILES_M=cfg.group_tiles_m,
                      FLAGS=flags, KB_POW2=triton.next_power_of_2(k // 128) if flags else 1)
    elif cfg.schedule == "persistent_ws":  # no check inside (triton_kernel.checks_rows)
        consts.update(GROUP_TILES_M=cfg.group_tiles_m)
    else:  # the other persistent schedules
        sig["work_ptr"] = "*i32"
        divisible.append("work_ptr")
        sig["flags_ptr"] = "*i8" if flags else "*i64"  # a lone call's graph: the check inside
        divisible.append("flags_ptr")
        consts.update(GROUP_TILES_M=cfg.group_tiles_m, FLAGS=flags)
    consts.update(extra or {})
    # Keep the kernel's argument order (the signature dict is ordered by the caller).
    order = list(fn.arg_names)
    sig = {a: sig[a] for a in order if a in sig}
    if cfg.schedule in tk.GLUON_SCHEDULES:  # launch_plan's options for them
        consts["STAGES"] = cfg.num_stages
        return compile_sm90(fn, sig, consts, {"num_warps": cfg.num_warps, "maxnreg": tk._GLUON_MAXNREG},
                            divisible, gluon=True)
    return compile_sm90(fn, sig, consts, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}, divisible)


def sass(kernel) -> list[tuple[int, str]]:
    """The kernel's SASS (Triton's cuobjdump) as ``(address, instruction)`` in program order."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        text = subprocess.run([str(CUOBJDUMP), "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout
    return [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,6})\*/\s+([^;]*);", text)]


def k_loop_local_loads(kernel) -> int:
    """Local-memory loads (``LDL``: spilled values brought back) inside a Gluon kernel's K loops,
    read from its SASS (Triton's cuobjdump): the innermost loops (a conditional backward branch
    and what lies between its target and it; ptxas's out-of-line blocks jump back
    unconditionally) holding a K block's scale promotion (128 or more FFMA)."""
    code = sass(kernel)
    loops = []
    for at, op in code:
        back = re.search(r"^@!?U?P\w+\s+BRA\b.*?0x([0-9a-f]+)\s*$", op)
        if back and int(back.group(1), 16) < at:
            body = [o for a, o in code if int(back.group(1), 16) <= a <= at]
            if sum(o.split()[0].startswith("FFMA") or " FFMA" in o for o in body) >= 128:
                loops.append((int(back.group(1), 16), at, body))
    inner = [lp for lp in loops if not any(o is not lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    return sum(sum("LDL" in o.split()[0] or " LDL" in o for o in body) for _, _, body in inner)


def report(cfg, m, n, k, g, addrs: bool = False, service: bool = False, out: str = "bf16",
           row_map: bool = True, flags: bool = False) -> dict:
    """Registers (for Gluon: the entry cap; setmaxnreg hands the consumers their share), spills,
    serialisation warnings, shared memory, partitions and the wgmma count of one compiled form
    (Gluon: also the K loops' local-memory loads)."""
    from moegemm.kernels import triton_kernel as tk

    try:
        kernel = compile_config(cfg, m, n, k, g, addrs, service, out, row_map, flags)
    except Exception as exc:  # noqa: BLE001  report and go on
        return {"config": cfg.key(), "error": str(exc).splitlines()[-1][:160]}
    ptx = kernel.asm["ptx"]
    info = {"config": cfg.key(), "smem": kernel.metadata.shared,
            "partitions": kernel.asm["ttgir"].count("partition"),
            "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
            "wgmma": ptx.count("wgmma.mma_async"), "scratch": kernel.metadata.global_scratch_size}
    info.update(ptxas_report(kernel))
    info["fits_smem"] = info["smem"] <= SMEM_LIMIT
    if cfg.schedule in tk.GLUON_SCHEDULES:
        info["k_loop_ldl"] = k_loop_local_loads(kernel)
    return info


def moe_token_report(G: int, H: int, I: int, k: int, fp8_in: bool) -> list[dict]:
    """The one-token moe kernels (``kernels/_triton_moe_token.py``) compiled as ``moe_token`` launches
    them for a top-``k`` token of a (G, H, I) set: the up kernel, and with a bf16 token the
    down kernel; registers, spills, shared memory and the stages the rule gave."""
    import triton
    from moegemm.kernels import _triton_moe_token as mt
    from moegemm.kernels._triton_act import _FORMAT

    bias, min_normal, sub_scale = _FORMAT[False]
    common = {"FNUZ": False, "BIAS": bias, "MIN_NORMAL": min_normal, "SUB_SCALE": sub_scale,
              "EVICT_W": "evict_first", "INTERPRETED": False}
    token = "*fp8e4nv" if fp8_in else "*bf16"
    up = ({"x_ptr": token, "xs_ptr": "*fp32" if fp8_in else token, "ids_ptr": "*i32", "wide_ptr": "*i64",
           "wts_ptr": "*fp32", "tokens_ptr": "*i64", "table_ptr": "*i64", "h_ptr": "*fp32",
           "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "x_flags_ptr": "*i8", "route_flags_ptr": "*i8",
           "FP8_MAX": "fp32"}, 2 * I, H)
    down = ({"h_ptr": "*fp32", "ids_ptr": "*i32", "wide_ptr": "*i64", "wts_ptr": "*fp32",
             "table_ptr": "*i64", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "parts_ptr": "*fp32",
             "counts_ptr": "*i32", "out_ptr": "*bf16", "FP8_MAX": "fp32"}, H, I)
    found = []
    for fn, (sig, n, kk) in ((mt._up_kernel, up), (mt._down_kernel, down))[:1 if fp8_in else 2]:
        bm, split, pair = mt._gemm_tile(k, n, kk, G, None)
        bn, warps = mt.weight_tile(k, n)
        programs = k * (n // bn) + (1 if fn is mt._up_kernel else 0)
        stages = mt.pipeline_stages(programs, bn, bm, kk // 128)
        consts = {"G": G, "TOP_K": k, "BLOCK_N": bn, "BLOCK_M": bm, "SPLIT_K": split, "PAIR": pair,
                  **common}
        if fn is mt._up_kernel:
            consts.update(H=H, N=2 * I, KP=triton.next_power_of_2(k), FP8_IN=fp8_in)
        else:
            consts.update(H=H, I=I)
        sig = {a: sig[a] for a in fn.arg_names if a in sig}
        kernel = compile_sm90(fn, sig, consts, {"num_warps": warps, "num_stages": stages,
                                                "enable_fp_fusion": False},
                              [a for a, t in sig.items() if t.startswith("*")])
        found.append({"kernel": fn.__name__, "rows": bn, "warps": warps, "stages": stages,
                      "split_k": split, "smem": kernel.metadata.shared, **ptxas_report(kernel)})
    return found


GLUON_FORMS = [(addrs, service, row_map, flags, out)
               for addrs, service, row_map, flags in ((False, False, False, False), (True, False, False, False),
                                                      (True, True, False, False), (True, True, False, True),
                                                      (True, True, True, False))
               for out in ("bf16", "fp32") if not (flags and out == "fp32")]
"""Every form a launch of ``gluon_ws`` takes: plain pointers (the public function), the weights by
address (ADDRS: the expert FFN's), the activations by address stored in place (ADDRS + X_WORDS),
the server gemm graph's lone call (that with the rows' check inside, FLAGS: bf16 out) and merged
calls (with ROW_MAP); bf16 and float32 out."""


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addresses", action="store_true", help="the weights by address (the server's graphs)")
    parser.add_argument("--gluon", action="store_true", help="the Gluon prefill kernel's variants instead")
    parser.add_argument("--moe-token", action="store_true", help="the one-token moe kernels instead")
    parser.add_argument("--decode", action="store_true",
                        help="the decode tiles the table gives (service form), as decode_sweep times them")
    args = parser.parse_args()
    from moegemm.kernels import triton_kernel as tk

    if args.decode:
        import decode_sweep

        for cfg, (m, n, k, g) in decode_sweep.tile_classes():
            for _, preload, stages in decode_sweep.VARIANTS:
                c = decode_sweep.variant_config(cfg, preload, stages, n, g)
                if c is None:
                    continue
                print(f"m{m} n{n} k{k} g{g}", report(c, m, n, k, g, service=True), flush=True)
        return

    if args.moe_token:  # Qwen3-30B-A3B, DeepSeek-V3, and the GPU test's split-K set, at top-8 and 1
        for G, H, I in ((128, 2048, 768), (256, 7168, 2048), (8, 1152, 4224)):
            for k, fp8_in in ((8, False), (8, True), (1, False)):
                for row in moe_token_report(G, H, I, k, fp8_in):
                    print(f"G{G} H{H} I{I} top-{k} {'fp8' if fp8_in else 'bf16'}", row, flush=True)
        return

    if args.gluon:
        for m, n, k, g in ((65536, 4096, 7168, 256), (16384, 7168, 2048, 384), (8192, 16384, 5120, 128),
                           (65536, 2048, 768, 128)):
            table = tk.default_config(m, n, k, g)
            for schedule in tk.GLUON_SCHEDULES:  # gluon_ws and its issue-15 variants, on its tile
                cfg = replace(table, schedule=schedule)  # the table's tile
                for addrs, service, row_map, flags, out in GLUON_FORMS:
                    if schedule == "gluon_ws_store" and out == "fp32":
                        continue  # tile_for_out runs it as gluon_ws
                    print(f"{schedule} m{m} n{n} k{k} g{g} addrs={addrs} service={service} row_map={row_map} "
                          f"flags={flags} {out}", report(cfg, m, n, k, g, addrs, service, out, row_map, flags),
                          flush=True)
        return
    import bench_kernels as bk

    jobs = [(cfg, m, n, k, g) for m, n, k, g in ((16384, 2048, 7168, 8), (16384, 7168, 2304, 8),
                                                 (32768, 4096, 7168, 256), (32, 1280, 8192, 8))
            for cfg in [tk.default_config(m, n, k, g), *bk.sweep_configs(m, n, k, g)]]
    for cfg, m, n, k, g in jobs:
        print(f"m{m} n{n} k{k} g{g}", report(cfg, m, n, k, g, args.addresses), flush=True)


if __name__ == "__main__":
    main()
