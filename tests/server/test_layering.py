"""The seam between the server and the kernels (ARCHITECTURE.md, issue 15): the server reaches
kernels only through ``moegemm.kernels``' public names and the ``Backend`` a device has, never a
kernel module or a compiler, and never asks which backend it holds.

Read from the source (``ast``), so a new server module is held to it too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server"
# What a server module may import from the kernels package: its public API and the seam's types.
ALLOWED_KERNEL_MODULES = {"moegemm.kernels", "moegemm.kernels._backend"}
COMPILERS = ("triton", "flydsl", "_mlir")


def _modules():
    return sorted(SERVER.glob("*.py"))


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def _names_backend(node: ast.AST) -> bool:
    """``<...>backend.name`` (the backend's name, however the backend is reached)."""
    if not (isinstance(node, ast.Attribute) and node.attr == "name"):
        return False
    owner = node.value
    return (isinstance(owner, ast.Name) and owner.id == "backend") or (
        isinstance(owner, ast.Attribute) and owner.attr == "backend")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_server_modules_import_no_kernel_module_or_compiler(path):
    tree = ast.parse(path.read_text(), str(path))
    bad = [(line, name) for line, name in _imports(tree)
           if name.split(".")[0] in COMPILERS
           or (name.startswith("moegemm.kernels") and name not in ALLOWED_KERNEL_MODULES)]
    assert not bad, f"{path.name} imports {bad}: reach kernels through Backend (kernels/_backend.py)"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_server_modules_never_branch_on_the_backend_name(path):
    tree = ast.parse(path.read_text(), str(path))
    bad = [node.lineno for node in ast.walk(tree)
           if isinstance(node, ast.Compare) and any(_names_backend(n) for n in (node.left, *node.comparators))]
    assert not bad, f"{path.name} compares backend.name at lines {bad}: give Backend the capability instead"


def test_the_checks_see_what_they_look_for():
    # The two checks on snippets that break the rules (they must not pass vacuously).
    tree = ast.parse("import triton\nfrom moegemm.kernels._triton_route import route\n"
                     "if self.backend.name == 'triton':\n    pass\nif backend.name != 'x':\n    pass\n")
    names = [name for _, name in _imports(tree)]
    assert names == ["triton", "moegemm.kernels._triton_route"]
    compares = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)]
    assert [_names_backend(n.left) for n in compares] == [True, True]


def test_an_acceptor_process_imports_neither_torch_nor_the_sdk():
    """An acceptor process (``_acceptors.py``, spawned) reads HTTP and answers refusals with the
    contract's errors: it imports the client package for its error tree and media types alone,
    not the SDK's httpx or ml_dtypes (half a second of a respawn's start on the CPU box), nor
    torch."""
    code = ("import sys\n"
            "import moegemm.server._acceptor\n"
            "print(sorted(m for m in ('torch', 'httpx', 'ml_dtypes') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
