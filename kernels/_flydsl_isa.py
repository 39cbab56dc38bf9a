"""Compile the FlyDSL kernel without a GPU and read facts off its ISA (what CI checks).

Each case compiles in its own subprocess: an LLVM instruction-selection failure
aborts the process that hit it, and FlyDSL must never share a process with
Triton. The child is this module run as a script::

    python -m moegemm.kernels._flydsl_isa --arch gfx950 --layout preshuffled --tile 64x128x128

It exits 0 after compiling (the ISA lands in ``FLYDSL_DUMP_DIR``) and
:data:`REJECTED` when the tile fails the LDS budget check, which runs before
anything is traced. :func:`compile_case` sets up the child's environment
(``COMPILE_ONLY=1``, ``FLYDSL_GPU_ARCH``, ``FLYDSL_DEBUG_DUMP_ASM=1``, the
compile cache off, ``ROCM_PATH`` holding ``llvm/bin/ld.lld``) and parses the
ISA into :class:`IsaFacts`.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ._flydsl_tiles import FlyTile, TileTooLarge

REJECTED = 3  # exit status of a child whose tile failed the LDS budget check

_MNEMONIC = re.compile(r"^\s+([a-z][a-z0-9_]*)\b", re.MULTILINE)


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
    return IsaFacts(
        instructions=instructions,
        lds_bytes=_metadata_int(text, "group_segment_fixed_size"),
        scratch_bytes=_metadata_int(text, "private_segment_fixed_size"),
        vgpr_spills=_metadata_int(text, "vgpr_spill_count"),
        sgpr_spills=_metadata_int(text, "sgpr_spill_count"),
        vgprs=_metadata_int(text, "vgpr_count"),
        agprs=_metadata_int(text, "agpr_count"),
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
    timeout: float = 300,
) -> CompileResult:
    """Compile one (arch, layout, tile) case in a subprocess and parse its ISA."""
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
    args = parser.parse_args(argv)
    from .flydsl_kernel import compile_only

    try:
        compile_only(args.arch, args.layout, args.tile, n=args.n, k=args.k)
    except TileTooLarge as exc:
        sys.stderr.write(f"rejected: {exc}\n")
        return REJECTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
