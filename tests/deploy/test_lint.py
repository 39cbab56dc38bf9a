"""Lint and schema checks of the deployment files, with the tools that
.ci/deploy-tools.sh installs (hadolint, kubernetes-validate, check-jsonschema,
docker-compose). Without a tool these tests skip, except in CI (CI set), where
a missing tool is a failure: the checks must not go quietly missing there.
Each check also runs on a broken file, to show that it can fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = [ROOT / "Dockerfile", *sorted(DEPLOY.rglob("Dockerfile*"))]
MANIFESTS = sorted((DEPLOY / "k8s").rglob("*.yaml"))
COMPOSE = DEPLOY / "compose.yaml"
# The oldest Kubernetes the manifests claim (PreStop exec, policy/v1 PDB,
# startup probes are all older) and the newest whose schemas the tool ships.
K8S_VERSIONS = ["1.30.0", "1.37.0"]


def _tool(name: str) -> str:
    # The venv's bin first: pytest may run as .venv/bin/python without activation.
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        message = f"{name} is not installed: run .ci/deploy-tools.sh"
        if os.environ.get("CI") or os.environ.get("MOEGEMM_REQUIRE_DEPLOY_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


def _run(*args: str, stdin: str | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, input=stdin, capture_output=True, text=True, cwd=cwd, timeout=120, check=False
    )


def test_the_deployment_files_exist():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.cuda"]
    assert len(MANIFESTS) >= 6 and COMPOSE.exists()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint_passes(dockerfile):
    result = _run(_tool("hadolint"), "--no-color", str(dockerfile))
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile():
    bad = "FROM ubuntu:latest\nRUN pip install requests\n"
    result = _run(_tool("hadolint"), "--no-color", "-", stdin=bad)
    assert result.returncode != 0
    assert "DL3007" in result.stdout and "DL3013" in result.stdout


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_match_the_schemas(version):
    tool = _tool("kubernetes-validate")
    result = _run(tool, "--strict", "-k", version, *map(str, MANIFESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    # Every document was checked, none skipped for an unknown kind.
    passed = result.stdout.count(" passed for resource ") + result.stderr.count(" passed for ")
    assert passed >= len(MANIFESTS), result.stdout + result.stderr


def test_kubernetes_validation_catches_a_misspelled_field(tmp_path):
    deployment = (DEPLOY / "k8s" / "rocm" / "deployment.yaml").read_text()
    assert "failureThreshold: 180" in deployment
    bad = tmp_path / "deployment.yaml"
    bad.write_text(deployment.replace("failureThreshold: 180", "failureTreshold: 120"))
    result = _run(_tool("kubernetes-validate"), "--strict", "-k", K8S_VERSIONS[-1], str(bad))
    assert result.returncode != 0
    assert "failureTreshold" in result.stdout + result.stderr


def test_compose_file_matches_the_compose_spec():
    tool = _tool("check-jsonschema")
    result = _run(tool, "--builtin-schema", "vendor.compose-spec", str(COMPOSE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_schema_check_catches_a_misspelled_key(tmp_path):
    bad = tmp_path / "compose.yaml"
    text = COMPOSE.read_text()
    assert "    ports: [" in text
    bad.write_text(text.replace("    ports: [", "    prots: [", 1))
    result = _run(_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad))
    assert result.returncode != 0
    assert "prots" in result.stdout + result.stderr


@pytest.mark.parametrize("profile", ["rocm", "cuda"])
def test_docker_compose_loads_each_profile(profile):
    # `config` resolves anchors, env files and interpolation without an engine.
    tool = _tool("docker-compose")
    result = _run(tool, "-f", str(COMPOSE), "--profile", profile, "config", "--services")
    assert result.returncode == 0, result.stderr
    services = result.stdout.split()
    assert len(services) >= 2 and all(profile in s for s in services), services
