"""The images, the Compose file and the manifests agree with the server.

Every MOEGEMM_* name they set is a field of `Settings` (or a variable read where it applies,
`config.OTHER_ENVIRONMENT`: the images name their backend), every value they set parses, the
port, entry point, probes and user line up, and the ROCm and CUDA variants differ only where
the vendor does. Plain file parsing: no tools.
"""

from __future__ import annotations

import json
import os
import shlex
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml
from moegemm.server.config import OTHER_ENVIRONMENT, Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "deploy" / "Dockerfile.cuda"]
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose.yaml"
ENV_FILE = ROOT / "deploy" / "moegemm.env"
PREFIX = "MOEGEMM_"


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def _dockerfile(path: Path) -> dict:
    info: dict = {"env": {}, "expose": [], "user": None}
    for keyword, args in _instructions(path):
        if keyword == "ENV":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                info["env"][key] = value
        elif keyword == "EXPOSE":
            info["expose"] += [int(p.split("/")[0]) for p in args.split()]
        elif keyword == "ENTRYPOINT":
            info["entrypoint"] = json.loads(args)
        elif keyword == "CMD":
            info["cmd"] = json.loads(args)
        elif keyword == "USER":
            info["user"] = args
        elif keyword == "HEALTHCHECK":
            info["healthcheck"] = json.loads(args[args.index("CMD") + 3 :])
    return info


def _manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def _one(kind: str, name: str | None = None) -> dict:
    found = [
        d
        for d in _manifests()
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def _deployments() -> dict[str, dict]:
    return {
        vendor: yaml.safe_load((K8S / vendor / "deployment.yaml").read_text())
        for vendor in ("rocm", "cuda")
    }


def _env_file(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: {line!r} is not NAME=value"
            pairs[key.strip()] = value
    return pairs


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _settings_from(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings as the server would read them from exactly this environment."""
    for key in [k for k in os.environ if k.startswith(PREFIX)]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Settings()


def _field(name: str) -> str:
    assert name.startswith(PREFIX), name
    return name[len(PREFIX) :].lower()


def _all_env_names() -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for path in DOCKERFILES:
        names[path.name] = {k for k in _dockerfile(path)["env"] if k.startswith(PREFIX)}
    names["moegemm.env"] = set(_env_file(ENV_FILE))
    for service, spec in _compose()["services"].items():
        names[f"compose {service}"] = set(spec.get("environment", {}))
    names["configmap"] = set(_one("ConfigMap", "moegemm-config")["data"])
    for vendor, deployment in _deployments().items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        names[f"{vendor} deployment"] = {e["name"] for e in container.get("env", [])}
    return names


def test_every_env_name_is_a_settings_field():
    fields = set(Settings.model_fields)
    for where, names in _all_env_names().items():
        assert names or where.startswith("compose "), f"{where} sets no MOEGEMM_ variable"
        unknown = {n for n in names if not n.startswith(PREFIX)
                   or (_field(n) not in fields and n not in OTHER_ENVIRONMENT)}
        assert not unknown, f"{where} sets {sorted(unknown)}, which nothing reads"


def test_env_names_are_checked_against_real_fields():
    # The check above would pass vacuously if Settings had no fields.
    assert {"host", "port", "device", "token", "admin_token", "weights_dir", "preload"} <= set(
        Settings.model_fields
    )
    assert _field("MOEGEMM_ADMIN_TOKEN") == "admin_token"


def test_image_settings_parse_and_listen_on_the_exposed_port(monkeypatch):
    for path in DOCKERFILES:
        image = _dockerfile(path)
        settings = _settings_from(image["env"], monkeypatch)
        # 127.0.0.1, the server's default, would be unreachable from outside.
        assert settings.host == "0.0.0.0", path.name
        assert image["expose"] == [settings.port], path.name
        assert str(settings.weights_dir) == "/weights"
        assert settings.token is None and settings.admin_token is None  # never baked in


def test_entry_point_is_moegemm_serve_with_a_device_flag(capsys):
    (script,) = entry_points(group="console_scripts", name="moegemm")
    assert script.value == "moegemm.cli:main"
    from moegemm.cli import main

    for path in DOCKERFILES:
        image = _dockerfile(path)
        assert image["entrypoint"] == ["moegemm", "serve"], path.name
        assert "cmd" not in image, "settings come from the environment, not arguments"
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    assert "--device" in capsys.readouterr().out


def test_images_agree_with_each_other_and_run_unprivileged():
    rocm, cuda = (_dockerfile(p) for p in DOCKERFILES)
    # Each names its vendor's kernel: one that cannot load stops the server (no silent
    # fallback to the reference), as MOEGEMM_DEVICE=cuda stops one without its GPU.
    assert rocm["env"].pop("MOEGEMM_BACKEND") == "flydsl"
    assert cuda["env"].pop("MOEGEMM_BACKEND") == "triton"
    cuda_env = {k: v for k, v in cuda["env"].items() if k.startswith(PREFIX)}
    rocm_env = {k: v for k, v in rocm["env"].items() if k.startswith(PREFIX)}
    assert rocm_env == cuda_env
    for image in (rocm, cuda):
        assert image["expose"] == rocm["expose"]
        assert image["user"] not in (None, "0", "root") and image["user"].split(":")[0].isdigit()
        probe = " ".join(image["healthcheck"])
        assert "/v1/health/live" in probe and "MOEGEMM_PORT" in probe


def test_compose_services_parse_and_map_the_container_port(monkeypatch):
    image_env = _dockerfile(DOCKERFILES[0])["env"]
    port = int(image_env["MOEGEMM_PORT"])
    compose = _compose()
    assert compose["services"]
    host_ports = {}
    for service, spec in compose["services"].items():
        env = {**image_env, **_env_file(ENV_FILE), **spec.get("environment", {})}
        env["MOEGEMM_TOKEN"] = "t"  # what secrets.env would add
        settings = _settings_from(env, monkeypatch)
        assert settings.port == port
        (mapping,) = spec["ports"]
        host, container = mapping.split(":")
        assert int(container) == port, service
        host_ports.setdefault(tuple(spec["profiles"]), []).append(int(host))
        mounts = {v["target"]: v for v in spec["volumes"]}
        assert mounts[str(settings.weights_dir)]["read_only"] is True
        assert any(f["path"].endswith("moegemm.env") for f in spec["env_file"])
    # One process per GPU: within a profile, each on its own host port.
    for profile, ports in host_ports.items():
        assert len(ports) == len(set(ports)) >= 2, profile


def test_kubernetes_settings_parse_and_probes_hit_the_health_endpoints(monkeypatch):
    config = _one("ConfigMap", "moegemm-config")["data"]
    secret = _one("Secret", "moegemm-tokens")["stringData"]
    for vendor, deployment in _deployments().items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["envFrom"] == [{"configMapRef": {"name": "moegemm-config"}}]
        env = dict(config)
        for var in container["env"]:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "moegemm-tokens" and ref["key"] in secret, vendor
            env[var["name"]] = secret[ref["key"]]
        settings = _settings_from(env, monkeypatch)
        assert settings.token is not None and settings.host == "0.0.0.0"
        (port,) = container["ports"]
        assert port["containerPort"] == settings.port and port["name"] == "http"
        for probe, path in (
            ("livenessProbe", "/v1/health/live"),
            ("readinessProbe", "/v1/health/ready"),
            ("startupProbe", "/v1/health/ready"),
        ):
            assert container[probe]["httpGet"] == {"path": path, "port": "http"}, (vendor, probe)
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "graph capture"
        # Drain: a preStop pause, then SIGTERM, inside the grace period.
        pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod["terminationGracePeriodSeconds"] >= pause + 30
        assert pod["securityContext"]["runAsNonRoot"] is True
        # A review: the kubelet's service links for the Service named moegemm are MOEGEMM_*
        # variables (MOEGEMM_PORT=tcp://...: exit 2 without the ConfigMap's MOEGEMM_PORT).
        _one("Service", "moegemm")
        assert pod["enableServiceLinks"] is False
        image_user = _dockerfile(DOCKERFILES[0])["user"].split(":")[0]
        assert str(pod["securityContext"]["runAsUser"]) == image_user
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts[str(settings.weights_dir)]["readOnly"] is True


def test_rocm_and_cuda_deployments_differ_only_by_vendor():
    rocm, cuda = _deployments()["rocm"], _deployments()["cuda"]
    rocm_c = rocm["spec"]["template"]["spec"]["containers"][0]
    cuda_c = cuda["spec"]["template"]["spec"]["containers"][0]
    assert rocm_c["resources"]["limits"]["amd.com/gpu"] == 1
    assert cuda_c["resources"]["limits"]["nvidia.com/gpu"] == 1

    def neutral(node: object) -> object:
        # The same tree with the vendor's names replaced by one placeholder.
        if isinstance(node, dict):
            return {neutral(k): neutral(v) for k, v in node.items()}
        if isinstance(node, list):
            return [neutral(v) for v in node]
        if isinstance(node, str):
            for vendor in ("amd.com/gpu", "nvidia.com/gpu"):
                node = node.replace(vendor, "GPU")
            return node.replace("-rocm", "-VENDOR").replace("-cuda", "-VENDOR")
        return node

    rocm_pod = rocm["spec"]["template"]["spec"]
    rocm_pod["securityContext"].pop("supplementalGroups")  # the video group: AMD only
    assert neutral(rocm) == neutral(cuda)


def test_services_and_budget_select_the_pods():
    labels = _deployments()["rocm"]["spec"]["template"]["metadata"]["labels"]
    port = _deployments()["rocm"]["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    services = [d for d in _manifests() if d["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {"moegemm", "moegemm-pods"}
    for service in services:
        assert service["spec"]["selector"].items() <= labels.items()
        assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    headless = next(s for s in services if s["metadata"]["name"] == "moegemm-pods")
    assert headless["spec"]["clusterIP"] == "None"
    pdb = _one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    claim = _one("PersistentVolumeClaim")["metadata"]["name"]
    volumes = _deployments()["cuda"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "weights", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}} in (
        volumes
    )


def test_dockerignore_lets_in_exactly_what_the_images_copy():
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "everything is out unless let in"
    let_in = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    for path in DOCKERFILES:
        copied = set()
        for keyword, args in _instructions(path):
            if keyword == "COPY":
                copied |= {src.rstrip("/") for src in args.split()[:-1]}
        assert copied == let_in, path.name
        assert all((ROOT / src).exists() for src in copied)
