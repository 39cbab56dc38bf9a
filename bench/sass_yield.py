"""Yield hints on the block-scale promotion's FFMAs of a compiled sm_90 kernel (an experiment:
``bench/sass_ab.py`` times patched copies of the table's prefill binaries against them).

A Hopper SASS instruction is 128 bits; the high 64-bit word holds its scheduling control: stall
cycles (bits 41-44), the yield hint (bit 45, clear: let the warp scheduler switch warps after
this instruction), barriers and wait mask (46-57) and the operand reuse-cache flags (58-61).
ptxas emits the promotion ``acc += part * scale`` of a consumer warpgroup as runs of 64 FFMAs
with the yield hint off (bit 45 set) and the scale's register cached (reuse flags), so while one
consumer promotes, the other's wgmma issue and the producer's loads wait behind its FFMAs in
the scheduler of each SM sub-partition. DeepGEMM's SASS pass (``deep_gemm/jit/interleave_ffma``)
turns yield on for part of each such run; this is our own form of the idea: an FFMA given the
yield hint also has its reuse flags cleared (a warp switch invalidates the reuse cache, so the
instruction after it reads the register file). The control bits change neither the
instructions nor their dependences: the outputs' bits are the same (``sass_ab.py`` asserts it).
How the pass would ship (Triton's compile-stage hook on the Gluon kernels, a constexpr for
the cache key, its tests): ``bench/prepared/sass_yield_ship.patch``.

    python bench/sass_yield.py CUBIN [--first F] [--every E]   # what a patch would change
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

YIELD_OFF = 1 << 45  # set: the scheduler keeps issuing from this warp
REUSE = 0xF << 58
MIN_RUN = 8  # FFMAs in a row: shorter runs are not the promotion
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*\s*(0x[0-9a-f]{16})\s*\*/")
_HIGH = re.compile(r"^\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")

def cuobjdump() -> Path:
    """The cuobjdump Triton uses (``TRITON_CUOBJDUMP_PATH``, else the one its wheel ships);
    RuntimeError if there is none."""
    from triton import knobs

    return Path(knobs.nvidia.cuobjdump.path)


def text_sections(cubin: bytes) -> dict[str, tuple[int, int]]:
    """``{function name: (file offset, size)}`` of the cubin's ``.text.<name>`` sections (ELF64)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i):
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        return name, offset, size

    _, strtab, _ = header(shstrndx)
    found = {}
    for i in range(shnum):
        name_at, offset, size = header(i)
        name = cubin[strtab + name_at:cubin.index(b"\0", strtab + name_at)].decode()
        if name.startswith(".text."):
            found[name[len(".text."):]] = (offset, size)
    return found


def instructions(cubin: bytes) -> dict[str, list[tuple[int, str, int, int]]]:
    """``{function: [(offset in its section, text, low word, high word)]}`` from cuobjdump."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(cuobjdump()), "-sass", str(path)], check=True, capture_output=True,
                              text=True).stdout
    found: dict[str, list] = {}
    current = None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "Function :" in line:
            current = found.setdefault(line.split("Function :", 1)[1].strip(), [])
            continue
        m = _LINE.search(line)
        if m and current is not None:
            high = _HIGH.match(lines[i + 1]) if i + 1 < len(lines) else None
            if high is None:
                raise ValueError(f"cuobjdump gave no control word after {line!r}")
            current.append((int(m.group(1), 16), m.group(2).strip(), int(m.group(3), 16), int(high.group(1), 16)))
    return found


def ffma_runs(listing: list) -> list[list[int]]:
    """Indices into ``listing`` of each run of at least MIN_RUN consecutive FFMAs."""
    runs, current = [], []
    for i, (_off, text, _lo, _hi) in enumerate(listing):
        if re.match(r"^(@!?U?P\w+\s+)?FFMA\b", text):
            current.append(i)
            continue
        if len(current) >= MIN_RUN:
            runs.append(current)
        current = []
    if len(current) >= MIN_RUN:
        runs.append(current)
    return runs


def patch(cubin: bytes, first: float = 9 / 16, every: int = 1, functions=None,
          listings=None) -> tuple[bytes, int]:
    """The cubin with the yield hint on (and the reuse flags off) for every ``every``-th FFMA of
    the first ``first`` of each FFMA run, in ``functions`` (default: all); and how many changed.
    ``listings``: :func:`instructions` of ``cubin``, where the caller applies several rules to
    one binary (one cuobjdump run)."""
    data = bytearray(cubin)
    sections = text_sections(cubin)
    changed = 0
    for name, listing in (listings or instructions(cubin)).items():
        if functions is not None and name not in functions:
            continue
        base, size = sections[name]
        for run in ffma_runs(listing):
            for j in run[:int(len(run) * first)][::every]:
                off, _text, lo, hi = listing[j]
                at = base + off
                if off + 16 > size or struct.unpack_from("<QQ", data, at) != (lo, hi):
                    raise ValueError(f"{name}+{off:#x}: the cubin's bytes differ from cuobjdump's listing")
                new_hi = (hi & ~REUSE) & ~YIELD_OFF
                if new_hi != hi:
                    struct.pack_into("<Q", data, at + 8, new_hi)
                    changed += 1
    return bytes(data), changed


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cubin", type=Path)
    parser.add_argument("--first", type=float, default=9 / 16)
    parser.add_argument("--every", type=int, default=1)
    args = parser.parse_args()
    cubin = args.cubin.read_bytes()
    new, changed = patch(cubin, args.first, args.every)
    before, after = instructions(cubin), instructions(new)
    for name in before:
        runs = ffma_runs(before[name])
        diff = sum(1 for a, b in zip(before[name], after[name], strict=True) if a != b)
        texts_same = all(a[1].replace(".reuse", "") == b[1].replace(".reuse", "") and a[2] == b[2]
                         for a, b in zip(before[name], after[name], strict=True))
        print(f"{name}: {len(before[name])} instructions, FFMA runs {[len(r) for r in runs]}, "
              f"{diff} changed, the same instructions but reuse/yield: {texts_same}")
    print(f"changed {changed}")
    sys.exit(0 if changed else 1)


if __name__ == "__main__":
    main()
