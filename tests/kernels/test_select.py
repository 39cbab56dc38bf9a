"""The backend selector: reference on CPU, MOEGEMM_BACKEND honoured, GPU modules kept apart."""

import sys
import types

import pytest
import torch
from moegemm.kernels import Backend, BackendUnavailable, _select, get_backend, reference


@pytest.fixture(autouse=True)
def fresh_selector(monkeypatch):
    monkeypatch.delenv("MOEGEMM_BACKEND", raising=False)
    _select._clear_cache()
    yield
    _select._clear_cache()


@pytest.fixture
def fake_gpu(monkeypatch):
    """Fake triton/flydsl backend modules; records which ones were imported."""
    imported = []
    available = set()

    def import_module(name):
        backend = name.rsplit(".", 1)[1].removesuffix("_kernel")
        imported.append(backend)

        def create(device):
            if backend not in available:
                raise BackendUnavailable(f"fake {backend} cannot run")
            return Backend(
                backend,
                device,
                torch.float8_e4m3fn,
                "plain",
                reference._prepare_weights,
                reference._run,
                True,
            )

        return types.SimpleNamespace(create=create)

    monkeypatch.setattr(_select.importlib, "import_module", import_module)
    for library in ("triton", "flydsl"):
        monkeypatch.delitem(sys.modules, library, raising=False)
    return imported, available


def test_cpu_gets_the_reference_once():
    backend = get_backend("cpu")
    assert backend.name == "reference"
    assert backend.fp8_dtype == torch.float8_e4m3fn
    assert backend.weight_layout == "plain" and not backend.capture_safe
    assert get_backend(torch.device("cpu")) is backend


def test_env_names_the_backend(monkeypatch):
    monkeypatch.setenv("MOEGEMM_BACKEND", "reference")
    assert get_backend("cpu").name == "reference"
    _select._clear_cache()
    monkeypatch.setenv("MOEGEMM_BACKEND", "triton")
    with pytest.raises(BackendUnavailable):
        get_backend("cpu")  # an explicit GPU backend never falls back silently
    monkeypatch.setenv("MOEGEMM_BACKEND", "cublas")
    with pytest.raises(ValueError, match="MOEGEMM_BACKEND"):
        get_backend("cpu")


def test_explicit_name_overrides_env(monkeypatch):
    monkeypatch.setenv("MOEGEMM_BACKEND", "flydsl")
    assert get_backend("cpu", "reference").name == "reference"


def test_nvidia_tries_triton_only(fake_gpu, monkeypatch):
    imported, available = fake_gpu
    monkeypatch.setattr(torch.version, "hip", None)
    available.add("triton")
    assert get_backend("cuda:0").name == "triton"
    assert imported == ["triton"]


def test_nvidia_falls_back_to_reference(fake_gpu, monkeypatch):
    imported, _ = fake_gpu
    monkeypatch.setattr(torch.version, "hip", None)
    assert get_backend("cuda:0").name == "reference"
    assert imported == ["triton"]


def test_rocm_tries_flydsl_only(fake_gpu, monkeypatch):
    """Our Triton kernels are Hopper's (triton_kernel.create refuses ROCm): on ROCm,
    auto never imports them, and without FlyDSL the reference serves (an audit: the
    README named Triton the fallback, and auto imported it only to be refused)."""
    imported, available = fake_gpu
    monkeypatch.setattr(torch.version, "hip", "7.0")
    available.update({"flydsl", "triton"})
    assert get_backend("cuda:0").name == "flydsl"
    assert imported == ["flydsl"]
    _select._clear_cache()
    available.discard("flydsl")
    assert get_backend("cuda:1").name == "reference"
    assert imported == ["flydsl", "flydsl"]


def test_explicit_backend_refuses_when_rival_is_loaded(fake_gpu, monkeypatch):
    imported, available = fake_gpu
    available.add("flydsl")
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setenv("MOEGEMM_BACKEND", "flydsl")
    with pytest.raises(BackendUnavailable, match="triton is already imported"):
        get_backend("cuda:0")
    assert imported == []


def test_explicit_gpu_backend_that_fails_raises(fake_gpu, monkeypatch):
    imported, _ = fake_gpu
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("MOEGEMM_BACKEND", "triton")
    with pytest.raises(BackendUnavailable, match="fake triton"):
        get_backend("cuda:0")
    assert imported == ["triton"]


def test_a_second_device_never_gets_the_rival(fake_gpu, monkeypatch):
    """FlyDSL imports its library late: once it runs on one device, no triton anywhere."""
    imported, available = fake_gpu
    monkeypatch.setattr(torch.version, "hip", "7.0")
    available.update({"flydsl", "triton"})
    assert get_backend("cuda:0").name == "flydsl"
    available.discard("flydsl")
    assert get_backend("cuda:1").name == "reference"
    assert imported == ["flydsl", "flydsl"]


def test_a_triton_imported_after_flydsl_runs_keeps_flydsl_on_other_devices(fake_gpu, monkeypatch):
    """A caller's late ``import triton`` (vLLM, ``torch.compile``) once FlyDSL runs here: the
    next device still gets FlyDSL, not the slow reference (it did, with only a warning)."""
    imported, available = fake_gpu
    monkeypatch.setattr(torch.version, "hip", "7.0")
    available.add("flydsl")
    assert get_backend("cuda:0").name == "flydsl"
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    assert get_backend("cuda:1").name == "flydsl"
    assert imported == ["flydsl", "flydsl"]
