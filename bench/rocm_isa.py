"""Our FlyDSL kernel's ISA against the seed's, per K step, for gfx942 and gfx950, with no GPU.

    python bench/rocm_isa.py                                  # ours only
    python bench/rocm_isa.py --seed-mslk /path/to/MSLK \\
        --seed-python /path/to/venv-with-flydsl-0.2.4/bin/python  # and the seed's
    python bench/rocm_isa.py --out bench/results/rocm_isa      # also writes .json and .md
    python bench/rocm_isa.py --render bench/results/rocm_isa   # the .md again from the .json

Ours compiles through ``moegemm.kernels._flydsl_isa.compile_case`` (FlyDSL's
compile-only mode, one subprocess per case). The seed's kernel is MSLK's
``mslk/flydsl/kernels/gemm/grouped_gemm_blockscale_contiguous.py``: it is read
from the MSLK checkout the user names (never copied into this repository) and
compiled by the interpreter given with ``--seed-python``, which must hold the
FlyDSL version MSLK pins (``ci/flydsl_version.txt``, 0.2.4: it does not import
under 0.5.0). Both compile for the same (arch, layout, N, K, G) with their
default tiles (ours: :data:`DEFAULT_TILES`; the seed's: 128x128x128).

Columns, per K step of one wave: MFMA instructions, VMEM loads, LDS reads (and
the bytes one wave reads), LDS writes, VALU (every ``v_`` instruction but MFMA),
VALU per MFMA instruction and per 16x16x128 block product (the FLOP-fair one:
gfx942's MFMA covers K = 32, gfx950's scaled MFMA K = 128). "Per K step" is the
K loop's body when the ISA has a loop (ours); the seed unrolls K fully, so its
figures are whole-kernel counts divided by the number of K steps (marked ``*``:
they include its prologue and epilogue). Then VGPR/AGPR, LDS bytes, waves per
SIMD (bound by registers and by LDS, 4-wave workgroups), ``.text`` bytes and the
compile time (trace + compile, in the child). Static figures only: nothing here
has run on AMD hardware.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from moegemm.kernels._flydsl_isa import (
    IsaFacts,
    LoopFacts,
    code_object,
    compile_case,
    elf_text_bytes,
    parse_isa,
    rocm_path,
    waves_per_simd,
)
from moegemm.kernels._flydsl_tiles import DEFAULT_TILES, SUPPORTED_ARCHS, WEIGHT_LAYOUTS, FlyTile

# Three shapes of the seed table (../shared/bench/seed_shapes.json, G = 8):
# a decode-heavy up-projection, DeepSeek-V3's gate/up and its down-projection.
SHAPES = ((1280, 8192), (2048, 7168), (7168, 2304))
GROUPS = 8
SEED_TILE = FlyTile(128, 128, 128)

# Runs under the seed's interpreter: imports MSLK's kernel from the given
# checkout (its FlyDSL kernels only: the package's __init__ loads compiled ops)
# and compiles one case with placeholder CPU tensors, which FlyDSL's
# COMPILE_ONLY mode compiles without launching.
_SEED_CHILD = r"""
import os, sys, time, types
root, arch, layout = sys.argv[1], sys.argv[2], sys.argv[3]
n, k, g, m = (int(v) for v in sys.argv[4:8])
tm, tn, tk = (int(v) for v in sys.argv[8].split("x"))
package = types.ModuleType("mslk")
package.__path__ = [os.path.join(root, "mslk")]
sys.modules["mslk"] = package
import torch
from mslk.flydsl.kernels.gemm.grouped_gemm_blockscale_contiguous import (
    compile_grouped_gemm_blockscale_contiguous,
)
start = time.perf_counter()
launcher = compile_grouped_gemm_blockscale_contiguous(
    n=n, k=k, num_groups=g, tile_m=tm, tile_n=tn, tile_k=tk, scale_block_k=128,
    scale_block_n=128, out_dtype="bf16", b_preshuffled=layout == "preshuffled",
)
launcher(
    torch.empty(m, n, dtype=torch.bfloat16),
    torch.empty(m, k, dtype=torch.int8),
    torch.empty(g, n, k, dtype=torch.int8),
    torch.empty(m * (k // 128), dtype=torch.float32),
    torch.empty(g, k // 128, n // 128, dtype=torch.float32),
    torch.full((g,), m // g, dtype=torch.int64),
    m, n, k, g, m // tm + g, None,
)
print("SECONDS", time.perf_counter() - start)
"""


def _per_step(isa: IsaFacts, k_steps: int) -> tuple[LoopFacts, bool]:
    """The K loop's mix, or (fully unrolled) the whole kernel's divided later by ``k_steps``."""
    if isa.loop is not None:
        return isa.loop, False
    return LoopFacts(isa.instructions, Counter()), True


def _row(kernel, arch, layout, n, k, tile, isa: IsaFacts, seconds, code_bytes) -> dict:
    k_steps = k // tile.block_k
    mix, whole = _per_step(isa, k_steps)
    div = k_steps if whole else 1
    mfma_k = 32 if any(m.startswith("v_mfma_f32_16x16x32") for m in mix.instructions) else 128
    blocks = mix.mfma * mfma_k / 128  # 16x16x128 block products
    return {
        "kernel": kernel,
        "arch": arch,
        "layout": layout,
        "n": n,
        "k": k,
        "tile": str(tile),
        "per_step_from": "whole kernel / K steps" if whole else "K loop",
        "mfma": mix.mfma / div,
        "vmem_loads": mix.vmem_loads / div,
        "lds_reads": mix.lds_reads / div,
        "lds_read_kib": mix.lds_read_bytes / div / 1024,
        "lds_writes": mix.lds_writes / div,
        "valu": mix.valu / div,
        "valu_per_mfma": mix.valu / mix.mfma if mix.mfma else None,
        "valu_per_block": mix.valu / blocks if blocks else None,
        "vgprs": isa.vgprs,
        "agprs": isa.agprs,
        "lds_bytes": isa.lds_bytes,
        "waves_per_simd": waves_per_simd(arch, isa.vgprs, isa.agprs, isa.lds_bytes),
        "spills": isa.vgpr_spills + isa.sgpr_spills,
        "code_bytes": code_bytes,
        "compile_s": seconds,
    }


def ours(arch: str, layout: str, n: int, k: int) -> dict:
    tile = DEFAULT_TILES[arch]
    result = compile_case(arch, layout, tile, n=n, k=k, m=1024, g=GROUPS)
    if result.returncode != 0:
        raise RuntimeError(f"ours {arch} {layout} {n}x{k}: {result.stderr[-2000:]}")
    isa = result.isa
    return _row("ours", arch, layout, n, k, tile, isa, isa.compile_seconds, isa.code_bytes)


def seed(python: str, mslk: str, arch: str, layout: str, n: int, k: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="moegemm-seed-isa-") as dump:
        env = dict(os.environ)
        env.update(
            COMPILE_ONLY="1",
            ARCH=arch,  # FlyDSL 0.2.4 reads the target from ARCH
            FLYDSL_DUMP_IR="1",  # 0.2.4 writes the ISA only with every IR stage
            FLYDSL_DUMP_DIR=dump,
            FLYDSL_RUNTIME_ENABLE_CACHE="0",
            ROCM_PATH=str(rocm_path()),
        )
        argv = [python, "-c", _SEED_CHILD, mslk, arch, layout, str(n), str(k), str(GROUPS)]
        argv += ["1024", str(SEED_TILE)]
        proc = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=900, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"seed {arch} {layout} {n}x{k}: {proc.stderr[-2000:]}")
        seconds = float(proc.stdout.split("SECONDS", 1)[1].split()[0])
        (isa_file,) = Path(dump).rglob("*final_isa.s")
        (binary,) = Path(dump).rglob("*gpu_module_to_binary.mlir")
        isa = parse_isa(isa_file.read_text())
        code = elf_text_bytes(code_object(binary.read_text()))
    return _row("seed", arch, layout, n, k, SEED_TILE, isa, seconds, code)


_COLUMNS = (
    ("kernel", "kernel", "{}"),
    ("arch", "arch", "{}"),
    ("layout", "layout", "{}"),
    ("NxK", None, "{}"),
    ("tile", "tile", "{}"),
    ("VGPR", "vgprs", "{}"),
    ("AGPR", "agprs", "{}"),
    ("LDS B", "lds_bytes", "{}"),
    ("waves/SIMD", "waves_per_simd", "{}"),
    ("MFMA", "mfma", "{:.0f}"),
    ("VMEM ld", "vmem_loads", "{:.1f}"),
    ("LDS rd", "lds_reads", "{:.1f}"),
    ("LDS rd KiB", "lds_read_kib", "{:.1f}"),
    ("LDS wr", "lds_writes", "{:.1f}"),
    ("VALU", "valu", "{:.1f}"),
    ("VALU/MFMA", "valu_per_mfma", "{:.2f}"),
    ("VALU/16x16x128", "valu_per_block", "{:.2f}"),
    ("spills", "spills", "{}"),
    (".text KiB", "code_bytes", "{:.1f}"),
    ("compile s", "compile_s", "{:.1f}"),
)


def table(rows: list[dict]) -> str:
    lines = [
        "| " + " | ".join(c[0] for c in _COLUMNS) + " |",
        "|" + "---|" * len(_COLUMNS),
    ]
    for r in rows:
        cells = []
        for title, key, fmt in _COLUMNS:
            if key is None:
                cells.append(f"{r['n']}x{r['k']}")
                continue
            value = r[key]
            if key == "code_bytes" and value is not None:
                value = value / 1024
            text = "-" if value is None else fmt.format(value)
            if key == "mfma" and r["per_step_from"] != "K loop":
                text += "*"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def header(meta: dict) -> str:
    """What the table was made from, above it in the .md."""
    lines = [
        f"# {meta['what']}",
        "",
        f"Shapes (N x K, G = {meta['groups']}): "
        + ", ".join(f"{n}x{k}" for n, k in meta["shapes"])
        + f". Ours: FlyDSL {meta['flydsl']}.",
    ]
    if meta.get("seed_label"):
        lines.append(f"Seed: {meta['seed_label']}.")
    lines += [
        "Per K step of one wave; `*`: whole kernel / K steps (no K loop in the ISA).",
        "Compile times are wall seconds on the machine that ran it (see the JSON's",
        "`machine`); static figures only, nothing here ran on AMD hardware.",
        "",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed-mslk", help="an MSLK checkout (holds mslk/flydsl/kernels/gemm/)")
    parser.add_argument(
        "--seed-python", default=sys.executable, help="an interpreter with MSLK's FlyDSL (0.2.4)"
    )
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    parser.add_argument("--jobs", type=int, default=2, help="compiles at a time")
    parser.add_argument("--seed-label", help="what the seed is (checkout, commit, FlyDSL version)")
    parser.add_argument("--machine", default="", help="where it ran (for the compile times)")
    parser.add_argument("--render", metavar="OUT", help="rewrite OUT.md from OUT.json and stop")
    args = parser.parse_args(argv)
    if args.render:
        meta = json.loads(Path(args.render + ".json").read_text())
        meta.setdefault("flydsl", importlib.metadata.version("flydsl"))
        if args.seed_label:
            meta["seed_label"] = args.seed_label
        if args.machine:
            meta["machine"] = args.machine
        Path(args.render + ".json").write_text(json.dumps(meta, indent=1) + "\n")
        Path(args.render + ".md").write_text(header(meta) + table(meta["rows"]) + "\n")
        return 0

    cases = [(a, lay, n, k) for (n, k) in SHAPES for a in SUPPORTED_ARCHS for lay in WEIGHT_LAYOUTS]
    jobs = [(ours, case) for case in cases]
    if args.seed_mslk:
        jobs += [(lambda *c: seed(args.seed_python, args.seed_mslk, *c), case) for case in cases]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(fn, *case) for fn, case in jobs]
        rows = [f.result() for f in futures]
    rows.sort(key=lambda r: (r["n"], r["k"], r["arch"], r["layout"], r["kernel"]))
    text = table(rows)
    print(text)
    if args.out:
        meta = {
            "what": __doc__.splitlines()[0],
            "shapes": SHAPES,
            "groups": GROUPS,
            "flydsl": importlib.metadata.version("flydsl"),
            "seed_label": args.seed_label or (args.seed_mslk and f"MSLK at {args.seed_mslk}"),
            "machine": args.machine,
            "rows": rows,
        }
        Path(args.out + ".json").write_text(json.dumps(meta, indent=1) + "\n")
        Path(args.out + ".md").write_text(header(meta) + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
