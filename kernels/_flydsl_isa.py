"""Compile the FlyDSL kernel without a GPU and read facts off its ISA (what CI checks).

Each case compiles in its own subprocess: an LLVM instruction-selection failure
aborts the process that hit it, and FlyDSL must never share a process with
Triton. The child is this module run as a script::

    python -m moegemm.kernels._flydsl_isa --arch gfx950 --layout preshuffled --tile 64x128x128

It exits 0 after compiling (the ISA lands in ``FLYDSL_DUMP_DIR``, with the
code object and the compile time beside it) and :data:`REJECTED` when the tile
fails the LDS budget check, which runs before anything is traced. ``--m`` and
``--g`` size the launch whose arguments are packed first (meta tensors: a
DeepSeek-V3 layer costs no memory). :func:`compile_case` sets up the child's environment
(``COMPILE_ONLY=1``, ``FLYDSL_GPU_ARCH``, ``FLYDSL_DEBUG_DUMP_ASM=1``, the
compile cache off, ``ROCM_PATH`` holding ``llvm/bin/ld.lld``) and parses the
ISA into :class:`IsaFacts`.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ._flydsl_tiles import FlyTile, TileTooLarge

REJECTED = 3  # exit status of a child whose tile failed the LDS budget check

_MNEMONIC = re.compile(r"^\s+([a-z][a-z0-9_]*)\b", re.MULTILINE)
_LABEL = re.compile(r"^(\.LBB\d+_\d+):")
_BRANCH = re.compile(r"^\s+s_c?branch\w*\s+(\.LBB\d+_\d+)")

# Per-lane bytes of one LDS access, by mnemonic suffix.
_LDS_BYTES = {"b32": 4, "b64": 8, "b96": 12, "b128": 16, "u8": 1, "u16": 2, "b16": 2, "b8": 1}

# VGPRs a SIMD holds per lane (CDNA3/CDNA4, wave64: architectural + accumulation
# registers share 512), and LDS per CU.
_VGPR_FILE = 512
_LDS_PER_CU = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
_MAX_WAVES_PER_SIMD = 8


def _lds_access_bytes(mnemonic: str) -> int:
    return _LDS_BYTES.get(mnemonic.rsplit("_", 1)[-1], 4)


@dataclass(frozen=True)
class LoopFacts:
    """The instruction mix of the kernel's K loop: the backward-branching region with the most MFMAs.

    ``after`` is the mix from the loop's closing branch to the kernel's last
    MFMA: the peeled last K step, which should load nothing from memory.
    """

    instructions: Counter
    after: Counter

    def count(self, prefix: str) -> int:
        return sum(n for m, n in self.instructions.items() if m.startswith(prefix))

    @property
    def mfma(self) -> int:
        return self.count("v_mfma")

    @property
    def valu(self) -> int:
        """Vector ALU instructions other than MFMA (moves, address math, scale math, conversions)."""
        return self.count("v_") - self.mfma

    @property
    def vmem_loads(self) -> int:
        return self.count("global_load") + self.count("buffer_load")

    @property
    def lds_reads(self) -> int:
        return self.count("ds_read") + self.count("ds_load")

    @property
    def lds_writes(self) -> int:
        return self.count("ds_write") + self.count("ds_store")

    @property
    def lds_read_bytes(self) -> int:
        """Bytes one wave reads from LDS per iteration (64 lanes)."""
        return 64 * sum(
            n * _lds_access_bytes(m)
            for m, n in self.instructions.items()
            if m.startswith(("ds_read", "ds_load"))
        )

    @property
    def valu_per_mfma(self) -> float:
        return self.valu / self.mfma if self.mfma else float("inf")


def k_loop(text: str) -> LoopFacts | None:
    """The K loop of a kernel's ISA, or None when it has no loop around an MFMA (fully unrolled)."""
    lines = text.split(".amdgpu_metadata", 1)[0].splitlines()
    labels = {}
    best = None
    for i, line in enumerate(lines):
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = i
            continue
        branch = _BRANCH.match(line)
        if branch and branch.group(1) in labels:  # a backward branch closes a loop
            loop = LoopFacts(_mix(lines[labels[branch.group(1)] : i + 1]), Counter())
            if loop.mfma and (best is None or loop.mfma > best[0].mfma):
                best = (loop, i)
    if best is None:
        return None
    loop, end = best
    last_mfma = max(
        (i for i, line in enumerate(lines) if line.lstrip().startswith("v_mfma")), default=end
    )
    return dataclasses.replace(loop, after=_mix(lines[end + 1 : last_mfma + 1]))


_INSTRUCTION = re.compile(r"^\s+([a-z][a-z0-9_]*)\s+(.*?)\s*(?:;.*)?$")
_MODIFIER = re.compile(r"\s+([a-z_]+):(\[[^\]]*\]|\S+)")
# Memory stores: their first operand is an address or data, not a register they write.
_STORES = ("ds_write", "ds_store", "global_store", "buffer_store", "scratch_store", "flat_store")
_VREG = re.compile(r"^v(\d+)$|^v\[(\d+):(\d+)\]$")


def _vregs(operand: str) -> range:
    """The VGPRs an operand names (``v7``, ``v[4:11]``); empty for anything else."""
    match = _VREG.match(operand)
    if match is None:
        return range(0)
    if match.group(1) is not None:
        return range(int(match.group(1)), int(match.group(1)) + 1)
    return range(int(match.group(2)), int(match.group(3)) + 1)


def mfma_operands(text: str) -> tuple[Counter, Counter]:
    """Each MFMA's modifiers (``cbsz:1``: the A operand's data format, ``blgp``, ``abid``,
    ``op_sel_hi:[...]``), counted, and the instruction that last wrote each scale operand
    of a scaled MFMA (gfx950's ``v_mfma_scale_*``: its fifth and sixth operands) before it
    in the text, counted (``"v_mov_b32_e32 0x7f"``: the constant E8M0 2^0). In text order:
    the kernel sets its scale registers once, ahead of the loop."""
    lines = text.split(".amdgpu_metadata", 1)[0].splitlines()
    written: dict[int, str] = {}  # VGPR -> its last writer, as "mnemonic sources"
    modifiers, scale_sources = Counter(), Counter()
    for line in lines:
        match = _INSTRUCTION.match(line)
        if match is None or match.group(1).startswith("."):
            continue
        mnemonic, rest = match.groups()
        found = _MODIFIER.findall(rest)
        operands = [o.strip() for o in _MODIFIER.sub("", rest).split(",")]
        if mnemonic.startswith("v_mfma"):
            modifiers.update(f"{name}:{value}" for name, value in found)
            if mnemonic.startswith("v_mfma_scale"):
                for operand in operands[4:6]:
                    regs = _vregs(operand)
                    scale_sources.update(
                        [written.get(regs[0], "unwritten") if len(regs) == 1 else operand]
                    )
        if not mnemonic.startswith(_STORES) and operands:
            for reg in _vregs(operands[0]):  # the destination
                written[reg] = " ".join([mnemonic, *operands[1:]])
    return modifiers, scale_sources


def _mix(lines: list[str]) -> Counter:
    return Counter(m for m in _MNEMONIC.findall("\n".join(lines)) if not m.startswith("."))


def waves_per_simd(arch: str, vgprs: int, agprs: int, lds_bytes: int) -> int:
    """Occupancy by registers and LDS: workgroups of 4 waves, one wave per SIMD each."""
    granule = 8
    regs = -(-vgprs // 4) * 4 + agprs if agprs else vgprs  # AGPRs start on a 4-aligned VGPR
    regs = max(granule, -(-regs // granule) * granule)
    by_regs = _VGPR_FILE // regs
    by_lds = _LDS_PER_CU[arch] // lds_bytes if lds_bytes else _MAX_WAVES_PER_SIMD
    return min(_MAX_WAVES_PER_SIMD, by_regs, by_lds)


def elf_text_bytes(elf: bytes) -> int:
    """Size of the ``.text`` section of a 64-bit little-endian ELF (an AMDGPU code object)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    for name, _type, _flags, _addr, _offset, size in sections:
        end = elf.index(b"\0", names_at + name)
        if elf[names_at + name : end] == b".text":
            return size
    raise ValueError("no .text section")


def code_object(ir_text: str) -> bytes:
    """The code object inside a compiled module's ``gpu.binary`` (MLIR's ``\\XX`` string escapes)."""
    match = re.search(r'bin = "((?:[^"\\]|\\.)*)"', ir_text)
    if match is None:
        raise ValueError("no gpu.binary object in the compiled module")
    raw, out, i = match.group(1), bytearray(), 0
    while i < len(raw):
        if raw[i] == "\\":
            if re.fullmatch(r"[0-9A-Fa-f]{2}", raw[i + 1 : i + 3]):
                out.append(int(raw[i + 1 : i + 3], 16))
                i += 3
                continue
            out.append(ord(raw[i + 1]))
            i += 2
            continue
        out.extend(raw[i].encode())
        i += 1
    return bytes(out)


_VMEM = tuple(f"{space}_{op}" for space in ("global", "buffer", "flat")
              for op in ("load", "store", "atomic"))


def narrow_addresses(text: str) -> list[str]:
    """The vector loads, stores and atomics of ``text`` whose instruction form addresses with
    fewer than 64 bits a lane: ``buffer_*`` (32-bit offsets), ``global_*`` on an SGPR base (a
    32-bit VGPR offset on it), and any form this does not read (``flat_*``, atomics,
    LDS-direct loads), for a person to look at. A ``global_*`` load or store through a VGPR
    pair with no SGPR base (``off``) passes. What this cannot see: a 64-bit address computed
    from a 32-bit product (the CPU emulator's int64 extents stand for that)."""
    narrow = []
    for line in text.split(".amdgpu_metadata", 1)[0].splitlines():
        match = _INSTRUCTION.match(line)
        if match is None or not match.group(1).startswith(_VMEM):
            continue
        mnemonic, rest = match.groups()
        parts = [p.strip() for p in rest.split(",")]
        at = 0 if mnemonic.startswith(_STORES) else 1  # a load's destination comes first
        pair = _VREG.match(parts[at]) if len(parts) > 2 and mnemonic.startswith(
            ("global_load", "global_store")) and "lds" not in mnemonic else None
        wide = pair is not None and pair.group(2) is not None and (
            int(pair.group(3)) == int(pair.group(2)) + 1 and parts[2].split()[0] == "off")
        if not wide:
            narrow.append(f"{mnemonic} {rest}")
    return narrow


@dataclass(frozen=True)
class IsaFacts:
    """What CI asserts about one compiled kernel, read from its ``.s`` file."""

    instructions: Counter  # mnemonic -> count
    lds_bytes: int  # .group_segment_fixed_size
    scratch_bytes: int  # .private_segment_fixed_size
    vgpr_spills: int
    sgpr_spills: int
    vgprs: int
    agprs: int
    loop: LoopFacts | None = None  # the K loop; None if the ISA has none
    # Each MFMA's modifiers and each scaled MFMA's scale sources (:func:`mfma_operands`).
    mfma_modifiers: Counter = dataclasses.field(default_factory=Counter)
    mfma_scale_sources: Counter = dataclasses.field(default_factory=Counter)
    narrow_addresses: list = dataclasses.field(default_factory=list)  # :func:`narrow_addresses`
    code_bytes: int | None = None  # .text of the code object, when the child saved it
    compile_seconds: float | None = None  # trace + compile, in the child

    def count(self, mnemonic: str) -> int:
        return self.instructions.get(mnemonic, 0)


@dataclass(frozen=True)
class CompileResult:
    """The outcome of one compile-only subprocess."""

    returncode: int
    stderr: str
    isa: IsaFacts | None  # None unless the compile succeeded

    @property
    def rejected(self) -> bool:
        return self.returncode == REJECTED


def _metadata_int(text: str, key: str) -> int:
    """The value of a code-object metadata key (``.key: N``); exactly one kernel per file."""
    values = re.findall(rf"^\s*(?:- )?\.{re.escape(key)}:\s*(\d+)\s*$", text, re.MULTILINE)
    if len(values) != 1:
        raise ValueError(f"expected one .{key} in the ISA, found {len(values)}")
    return int(values[0])


def parse_isa(text: str) -> IsaFacts:
    """Read the instruction mix and the resource metadata of one kernel's ISA."""
    body = text.split(".amdgpu_metadata", 1)[0]
    instructions = Counter(m for m in _MNEMONIC.findall(body) if not m.startswith("."))
    modifiers, scale_sources = mfma_operands(text)
    return IsaFacts(
        instructions=instructions,
        lds_bytes=_metadata_int(text, "group_segment_fixed_size"),
        scratch_bytes=_metadata_int(text, "private_segment_fixed_size"),
        vgpr_spills=_metadata_int(text, "vgpr_spill_count"),
        sgpr_spills=_metadata_int(text, "sgpr_spill_count"),
        vgprs=_metadata_int(text, "vgpr_count"),
        agprs=_metadata_int(text, "agpr_count"),
        loop=k_loop(text),
        mfma_modifiers=modifiers,
        mfma_scale_sources=scale_sources,
        narrow_addresses=narrow_addresses(text),
    )


def _find_lld() -> str | None:
    for name in ("ld.lld", "ld.lld-19", "ld.lld-20", "ld.lld-18"):
        found = shutil.which(name)
        if found:
            return found
    candidates = sorted(glob.glob("/usr/lib/llvm-*/bin/ld.lld"))
    return candidates[-1] if candidates else None


def rocm_path() -> Path | None:
    """A directory with ``llvm/bin/ld.lld`` for FlyDSL to link with, or None.

    ``ROCM_PATH`` when it has one; else a directory under ``MOEGEMM_CACHE_DIR``
    (default ``~/.cache/moegemm``) holding a link to the system's ``ld.lld``
    (Debian's ``lld-19``), made on first use.
    """
    given = os.environ.get("ROCM_PATH")
    if given and (Path(given) / "llvm" / "bin" / "ld.lld").exists():
        return Path(given)
    root = Path(os.environ.get("MOEGEMM_CACHE_DIR") or Path.home() / ".cache" / "moegemm") / "rocm"
    link = root / "llvm" / "bin" / "ld.lld"
    if link.exists():
        return root
    lld = _find_lld()
    if lld is None:
        return None
    link.parent.mkdir(parents=True, exist_ok=True)
    try:
        link.symlink_to(lld)
    except FileExistsError:
        pass  # another process made it first
    return root


def toolchain_problem() -> str | None:
    """Why compile-only checks cannot run here, or None when FlyDSL and a linker are present."""
    if importlib.util.find_spec("flydsl") is None:
        return "flydsl is not installed (pip install 'moegemm[rocm]')"
    if rocm_path() is None:
        return "no ld.lld found (apt-get install lld-19, or set ROCM_PATH to a ROCm install)"
    return None


def compile_case(
    arch: str,
    layout: str,
    tile: FlyTile,
    *,
    n: int = 512,
    k: int = 1024,
    m: int = 64,
    g: int = 4,
    out: str = "bf16",
    timeout: float = 300,
) -> CompileResult:
    """Compile one (arch, layout, tile) case in a subprocess and parse its ISA.

    The child first packs the arguments of a launch of ``m`` rows and ``g``
    groups (meta tensors), as a launch would. ``out``: the output's dtype,
    ``bf16`` or ``f32`` (the expert FFN's h).
    """
    root = rocm_path()
    if root is None:
        raise RuntimeError(toolchain_problem())
    with tempfile.TemporaryDirectory(prefix="moegemm-isa-") as dump:
        env = dict(os.environ)
        env.update(
            COMPILE_ONLY="1",
            FLYDSL_GPU_ARCH=arch,
            FLYDSL_DEBUG_DUMP_ASM="1",
            FLYDSL_DUMP_DIR=dump,
            FLYDSL_RUNTIME_ENABLE_CACHE="0",
            FLYDSL_RUNTIME_CACHE_DIR=os.path.join(dump, "cache"),
            ROCM_PATH=str(root),
        )
        env.pop("ARCH", None)  # FLYDSL_GPU_ARCH is the one the kernel's own checks read
        argv = [
            sys.executable,
            "-m",
            "moegemm.kernels._flydsl_isa",
            "--arch",
            arch,
            "--layout",
            layout,
            "--tile",
            str(tile),
            "--n",
            str(n),
            "--k",
            str(k),
            "--m",
            str(m),
            "--g",
            str(g),
            "--out",
            out,
        ]
        try:
            proc = subprocess.run(
                argv, env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            return CompileResult(
                returncode=-1, stderr=f"timed out after {timeout} s: {exc}", isa=None
            )
        isa = None
        if proc.returncode == 0:
            files = sorted(Path(dump).rglob("*final_isa.s"))
            if len(files) != 1:
                return CompileResult(proc.returncode, f"expected one ISA file, found {files}", None)
            isa = parse_isa(files[0].read_text())
            info = Path(dump) / "compile.json"
            if info.exists():
                extra = json.loads(info.read_text())
                isa = dataclasses.replace(
                    isa, code_bytes=extra["code_bytes"], compile_seconds=extra["seconds"]
                )
        return CompileResult(returncode=proc.returncode, stderr=proc.stderr, isa=isa)


def _parse_tile(text: str) -> FlyTile:
    m, n, k = (int(v) for v in text.lower().split("x"))
    return FlyTile(m, n, k)


def main(argv: list[str] | None = None) -> int:
    """The child: compile one case in this process (which must be in compile-only mode)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True)
    parser.add_argument("--layout", required=True, choices=("plain", "preshuffled"))
    parser.add_argument("--tile", required=True, type=_parse_tile, help="MxNxK, e.g. 64x128x128")
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--m", type=int, default=64, help="rows of the launch packed first")
    parser.add_argument("--g", type=int, default=4, help="groups of the launch packed first")
    parser.add_argument("--out", choices=("bf16", "f32"), default="bf16", help="output dtype")
    args = parser.parse_args(argv)
    import torch

    from .flydsl_kernel import compile_only

    start = time.perf_counter()
    try:
        out_dtype = torch.float32 if args.out == "f32" else torch.bfloat16
        launcher = compile_only(
            args.arch, args.layout, args.tile, n=args.n, k=args.k, m=args.m, g=args.g,
            out_dtype=out_dtype,
        )
    except TileTooLarge as exc:
        sys.stderr.write(f"rejected: {exc}\n")
        return REJECTED
    seconds = time.perf_counter() - start
    dump = os.environ.get("FLYDSL_DUMP_DIR")
    compiled = getattr(launcher, "_last_compiled", None)
    if dump and compiled is not None:
        elf = code_object(compiled[1]._ir_text)
        info = {"seconds": seconds, "code_bytes": elf_text_bytes(elf)}
        Path(dump, "compile.json").write_text(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
