"""The ROCm image's defaults start the server on the FlyDSL backend (compile-only, no GPU).

The closest honest check without AMD hardware: ``moegemm serve`` runs with the
ROCm Dockerfile's own ``ENV`` defaults, in FlyDSL's compile-only mode for each
arch, with the image's own ``MOEGEMM_DEVICE=cuda`` (which compile-only mode lets through
with no GPU: elsewhere a GPU that is not there stops the server at once) and its own
``MOEGEMM_BACKEND=flydsl``.
The server must get through its settings, the backend selector and FlyDSL's
import, log the FlyDSL backend with the arch's fp8 encoding and the preshuffled
weight layout, and then fail only at its first device call (the graph pool),
exiting non-zero. What it cannot show: anything after that first device call.
And where FlyDSL cannot load, the image's server stops, naming why, instead of serving
from the reference.

Skips when FlyDSL or ld.lld is missing, unless MOEGEMM_REQUIRE_ROCM_TOOLCHAIN=1.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from moegemm.kernels._flydsl_isa import rocm_path, toolchain_problem
from moegemm.kernels._flydsl_tiles import FP8_DTYPE, SUPPORTED_ARCHS

ROOT = Path(__file__).resolve().parents[2]

_problem = toolchain_problem()
if _problem is not None and os.environ.get("MOEGEMM_REQUIRE_ROCM_TOOLCHAIN") == "1":
    raise RuntimeError(f"MOEGEMM_REQUIRE_ROCM_TOOLCHAIN=1 but {_problem}")
pytestmark = pytest.mark.skipif(_problem is not None, reason=f"ROCm compile toolchain: {_problem}")


def _image_env() -> dict[str, str]:
    """The ``ENV`` pairs of the ROCm Dockerfile (continuation lines joined)."""
    env, pending = {}, ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        instruction = pending + line
        pending = ""
        keyword, _, args = instruction.partition(" ")
        if keyword.upper() == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(args))
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(arch: str, tmp: Path, before: str = "") -> subprocess.CompletedProcess:
    """``moegemm serve`` with the image's settings, after the Python statement ``before``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEGEMM_")}
    env.update(_image_env())
    env.update(
        MOEGEMM_HOST="127.0.0.1",  # the image listens on 0.0.0.0:8000; a test may not
        MOEGEMM_PORT=str(_free_port()),
        MOEGEMM_WEIGHTS_DIR=str(tmp),
        MOEGEMM_CACHE_DIR=str(tmp / "cache"),
        COMPILE_ONLY="1",
        FLYDSL_GPU_ARCH=arch,
        ROCM_PATH=str(rocm_path()),
        PYTHONUNBUFFERED="1",
    )
    # The entry point, `moegemm serve`.
    code = f"{before}\nimport sys\nfrom moegemm.cli import main\nsys.exit(main(['serve']))"
    argv = [sys.executable, "-c", code]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, check=False)


def test_the_image_env_names_the_defaults_this_test_relies_on():
    env = _image_env()
    assert env["MOEGEMM_DEVICE"] == "cuda" and env["MOEGEMM_BACKEND"] == "flydsl"


def test_the_image_stops_where_flydsl_cannot_load(tmp_path):
    """Triton already in the process (a plugin's import, say) keeps FlyDSL out (_select.py):
    the image's server exits naming that, where ``auto`` would serve from the reference."""
    pytest.importorskip("triton")
    proc = _serve(SUPPORTED_ARCHS[0], tmp_path, before="import triton")
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "flydsl cannot load: triton is already imported" in log, log[-4000:]
    assert "backend reference" not in log and "graph_pool_handle" not in log


def test_rocm_image_defaults_start_on_the_flydsl_backend(tmp_path):
    with ThreadPoolExecutor(max_workers=len(SUPPORTED_ARCHS)) as pool:
        runs = dict(
            zip(
                SUPPORTED_ARCHS,
                pool.map(lambda a: _serve(a, tmp_path / a), SUPPORTED_ARCHS),
                strict=True,
            )
        )
    for arch, proc in runs.items():
        log = proc.stdout + proc.stderr
        chosen = re.search(r"device cuda:0, backend (\w+) \(([\w.]+), (\w+) weights\)", log)
        assert chosen, f"{arch}: the server never chose a backend:\n{log[-4000:]}"
        assert chosen.groups() == ("flydsl", str(FP8_DTYPE[arch]), "preshuffled"), log[-4000:]
        # It stops at the first device call, not at an import or a setting.
        assert proc.returncode != 0
        assert "graph_pool_handle" in log, log[-4000:]
        assert "BackendUnavailable" not in log and "ImportError" not in log
