"""Whether the working tree's Triton GEMM kernels compile to the SASS another revision's did.

    python bench/sass_same.py REV [--allow-immediates]   # e.g. HEAD~3: exit 1 if any form differs

Each tree's kernels compile afresh (a Triton cache of their own).

A refactor of a shipped kernel (removing a schedule nothing runs, renaming, moving code) keeps
the figures of record only if ptxas still emits what was measured. On a machine without a GPU
(triton's own ptxas and cuobjdump, ``sm90_compile.py``), this compiles the table's tile for
each shape below in the forms the library and the server launch (bf16 and float32 out; by
pointer; weights by address; rows by address through a row map; the rows' check inside) from
the working tree and from a ``git worktree`` of REV, and compares their instructions with
the constant-bank offsets of the parameters masked (removing a parameter moves them). A form
whose instructions match only with every immediate masked (two mbarriers' shared-memory slots
swapped, or a changed constant or offset) fails unless ``--allow-immediates``; its differing
instructions are printed. persistent_ws (Triton's warp_specialize) compiles so from one fresh
compile of the same source to the next: two arrives swap their mbarriers (session 58, against
HEAD itself). It compiles through ``sm90_compile.compile_config``, that script's
copy of ``launch_plan``'s arguments: a change to one must be made in the other. Forms not
compiled: the server's quantizing bf16 call and the FFN's float32 step by address (session 58's
review compiled them for the pair shapes by hand: the same). Never collected by pytest.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Decode (pairs and single blocks, split and preloaded), one-token and many-expert, the
# persistent and Gluon prefill tiles: (m, n, k, g).
SHAPES = ((1, 8192, 1024, 8), (2, 28672, 4096, 8), (128, 28672, 4096, 8), (2, 4096, 14336, 8),
          (3, 4096, 7168, 256), (64, 2048, 7168, 256), (1, 1536, 2048, 128), (1024, 7168, 2048, 8),
          (8192, 2048, 1408, 64), (65536, 4096, 7168, 256), (16384, 1408, 2048, 8), (8192, 1408, 2048, 128))
# (addrs, service, flags, out): compile_config's forms.
FORMS = ((False, False, False, "bf16"), (True, False, False, "bf16"), (True, True, False, "bf16"),
         (True, True, True, "bf16"), (False, False, False, "fp32"))
PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")
IMMEDIATE = re.compile(r"0x[0-9a-f]+")


def compile_all(out: str) -> None:
    """In a child whose ``moegemm`` is the tree under test: every (shape, form)'s SASS, as JSON."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sm90_compile
    from moegemm.kernels import triton_kernel as tk

    found = {}
    for m, n, k, g in SHAPES:
        cfg = tk.default_config(m, n, k, g)
        for addrs, service, flags, dtype in FORMS:
            if cfg.schedule == "gluon_ws_store" and dtype == "fp32":
                continue  # tile_for_out runs it as gluon_ws
            key = f"m{m} n{n} k{k} g{g} {cfg.key()} addrs={addrs} service={service} flags={flags} {dtype}"
            kernel = sm90_compile.compile_config(cfg, m, n, k, g, addrs=addrs, service=service,
                                                 flags=flags, out=dtype, row_map=not flags)
            found[key] = [PARAM.sub("c[param]", op) for _, op in sm90_compile.sass(kernel)]
    Path(out).write_text(json.dumps(found))


def run_tree(tree: Path, out: Path) -> dict:
    """The SASS of ``tree``'s kernels (``moegemm`` pointed at its packages)."""
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "moegemm"
        package.mkdir()
        for name in ("kernels", "server", "client"):
            (package / name).symlink_to(tree / name)
        for file in (tree / "moegemm").glob("*.py"):
            (package / file.name).write_bytes(file.read_bytes())
        # A cache of its own: every kernel compiled afresh, none found by a key both trees share.
        env = {"PYTHONPATH": tmp, "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
               "TRITON_CACHE_DIR": str(Path(tmp) / "triton-cache")}
        subprocess.run([sys.executable, "-P", str(tree / "bench" / "sass_same.py"), "--child", str(out)],
                       check=True, env=env, cwd=tmp)
    return json.loads(out.read_text())


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        compile_all(sys.argv[2])
        return 0
    rev, allow = sys.argv[1], "--allow-immediates" in sys.argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        old.mkdir()
        # REV's files without touching the repository (no worktree to leave behind).
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        # The child script is this tree's, so REV needs none of its own.
        (old / "bench" / "sass_same.py").write_bytes(Path(__file__).read_bytes())
        before = run_tree(old, Path(tmp) / "old.json")
        after = run_tree(ROOT, Path(tmp) / "new.json")
    differ = 0
    for key, ops in after.items():
        old_ops = before.get(key, [])
        if old_ops == ops:
            verdict = "same"
        elif [IMMEDIATE.sub("#", op) for op in old_ops] == [IMMEDIATE.sub("#", op) for op in ops]:
            verdict = "same but immediates" + (" (allowed)" if allow else "")
            differ += not allow
        else:
            verdict = "DIFFERS"
            differ += 1
        print(f"{verdict}  {key}  ({len(ops)} instructions, {len(old_ops)} before)")
        if verdict != "same":
            changed = [(a, b) for a, b in zip(old_ops, ops) if a != b]
            for a, b in changed[:4]:
                print(f"    {rev}: {a}\n    now: {b}")
    print(f"{len(after) - differ} of {len(after)} forms the same as {rev}")
    return 1 if differ else 0

if __name__ == "__main__":
    sys.exit(main())
