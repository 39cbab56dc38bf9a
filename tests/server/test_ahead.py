"""Compiling a new shape's kernels ahead (server/_ahead.py), the parts a CPU can check:
the child's job and its stand-in tensors, and the fall-back when a child fails (real
spawned processes). The compile itself is checked on the GPU (test_ahead_gpu.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from types import SimpleNamespace

import pytest
import torch
from moegemm.kernels import get_backend
from moegemm.kernels._backend import Backend, CompileAhead
from moegemm.server import _ahead
from moegemm.server._ahead import Job, TensorSpec, Weights

FP8 = torch.float8_e4m3fn


def _set(g, n, k, name="w"):
    wq = torch.zeros((g, n, k), dtype=FP8)
    ws = torch.ones((g, k // 128, n // 128), dtype=torch.float32)
    return SimpleNamespace(name=name, G=g, N=n, K=k, wq=wq, w_scale=ws)


def _backend_with_ahead() -> Backend:
    ref = get_backend("cpu", "reference")
    ahead = CompileAhead(compile_only=contextlib.nullcontext, compiles=lambda: 0)
    return Backend(**{**ref.__dict__, "name": "triton", "ahead": ahead})


@pytest.mark.parametrize("offset", [0, 5, 16, 33])
def test_a_stand_in_specialises_like_the_tensor_it_stands_for(offset):
    """Shape, strides, dtype, contiguity and the data's 16-byte alignment (all a kernel's
    specialisation reads of a pointer) are the real tensor's; no memory is behind it."""
    base = torch.zeros(offset + 2 * 3 * 256, dtype=FP8)
    real = base[offset:].view(2, 3, 256)
    spec = TensorSpec.of(real)
    assert spec == TensorSpec((2, 3, 256), (768, 256, 1), "float8_e4m3fn", real.data_ptr() % 16)
    s = spec.stand_in()
    assert s.device.type == "meta"
    assert (s.shape, s.stride(), s.dtype) == (real.shape, real.stride(), real.dtype)
    assert s.is_contiguous() and s.data_ptr() % 16 == real.data_ptr() % 16


def test_a_float32_stand_in_keeps_its_alignment_and_strides():
    base = torch.ones(1 + 4 * 6, dtype=torch.float32)
    real = base[1:].view(4, 6)[:, :3]  # not contiguous, 4 bytes past alignment (or 20)
    s = TensorSpec.of(real).stand_in()
    assert (s.shape, s.stride(), s.is_contiguous()) == (real.shape, real.stride(), False)
    assert s.data_ptr() % 16 == real.data_ptr() % 16


def test_the_job_lists_the_new_sets_and_the_engines_settings():
    backend = _backend_with_ahead()
    a, b = _set(8, 256, 512, "a"), _set(4, 512, 256, "b")
    es = SimpleNamespace(G=4, H=256, I=128, w13=_set(4, 256, 256), w2=_set(4, 256, 128))
    job = _ahead.make_job(backend, 1024, (1, 2, 8), [a, b], [es])
    assert job.backend == "triton" and job.device == "cpu"
    assert job.max_bucket_m == 1024 and job.top_k == (1, 2, 8)
    assert [(w.G, w.N, w.K) for w in job.gemm] == [(8, 256, 512), (4, 512, 256)]
    assert job.gemm[0].wq == TensorSpec.of(a.wq)
    assert job.gemm[1].w_scale == TensorSpec.of(b.w_scale)
    [e] = job.experts
    assert (e.G, e.H, e.I) == (4, 256, 128)
    assert (e.w13.N, e.w13.K, e.w2.N, e.w2.K) == (256, 256, 256, 128)
    assert pickle.loads(pickle.dumps(job)) == job  # what the spawned child receives
    stand = e.stand_in()
    assert stand.w2.wq.shape == (4, 256, 128) and stand.w2.wq.device.type == "meta"
    assert "G=8 N=256 K=512" in job.describe() and "experts G=4 H=256 I=128" in job.describe()


def test_no_job_without_new_shapes_or_for_a_backend_that_compiles_in_process():
    assert _ahead.make_job(_backend_with_ahead(), 1024, (8,), [], []) is None
    reference = get_backend("cpu", "reference")
    assert reference.ahead is None
    assert _ahead.make_job(reference, 1024, (8,), [_set(8, 256, 512)], []) is None


def test_a_failed_child_is_logged_and_the_load_compiles_in_process(caplog):
    """A real spawned child whose job cannot run (no CUDA here for the triton backend):
    None comes back at once, with the reason logged."""
    job = Job("triton", "cpu", 256, (8,), (Weights.of(_set(8, 256, 512)),), ())
    with caplog.at_level(logging.WARNING, logger="moegemm.server.ahead"):
        assert _ahead.compile_ahead(job, timeout_s=120) is None
    [record] = [r for r in caplog.records if r.name == "moegemm.server.ahead"]
    assert "compiling in-process" in record.getMessage()
    assert "BackendUnavailable" in record.getMessage() or "RuntimeError" in record.getMessage()


def test_children_sharing_a_job_that_fails_are_all_ended_and_logged_once(caplog, monkeypatch):
    """Three real children share the job; each fails (no CUDA here): one warning, None, and no
    child left running."""
    import multiprocessing

    monkeypatch.setattr(_ahead, "children", lambda device, need: 3)
    job = Job("triton", "cpu", 256, (8,), (Weights.of(_set(8, 256, 512)),), ())
    with caplog.at_level(logging.WARNING, logger="moegemm.server.ahead"):
        assert _ahead.compile_ahead(job, timeout_s=120) is None
    [record] = [r for r in caplog.records if r.name == "moegemm.server.ahead"]
    assert "of 3" in record.getMessage() and "compiling in-process" in record.getMessage()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("moegemm-compile")]


def test_a_child_counts_the_largest_familys_buffers_at_the_largest_bucket():
    """A child holds one family's static buffers at the largest bucket while it warms it up: at
    65536 rows a DeepSeek-V3 expert-set shape's take ~4.7 GiB (the children sharing a job are
    bounded by free memory at that much each), at 8192 rows the floor of 2 GiB holds them."""
    from moegemm.server._ahead import Experts

    ds = Experts(256, 7168, 2048, Weights(256, 4096, 7168, None, None), Weights(256, 7168, 2048, None, None))
    big = Job("triton", "cuda:0", 65536, (8,), (ds.w13, ds.w2), (ds,))
    assert 4 << 30 < big.child_bytes() < 6 << 30
    assert Job("triton", "cuda:0", 8192, (8,), (ds.w13,), (ds,)).child_bytes() == _ahead.MIN_FREE_BYTES
    assert Job("triton", "cuda:0", 65536, (8,), (ds.w2,), ()).child_bytes() < big.child_bytes()


@pytest.mark.parametrize(("cpus", "count"), [(1, 1), (2, 1), (6, 3), (16, 8), (64, 8)])
def test_a_job_is_shared_by_half_the_cpus_at_most_eight(monkeypatch, cpus, count):
    monkeypatch.setattr(_ahead.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(_ahead, "cpu_quota", lambda: None)
    assert _ahead.children(torch.device("cpu")) == count


@pytest.mark.parametrize(("cpu_max", "count"), [("400000 100000\n", 2), ("max 100000\n", 8),
                                                ("150000 100000\n", 1), ("1600000 100000", 8)])
def test_a_container_cpu_limit_bounds_the_children(monkeypatch, tmp_path, cpu_max, count):
    """A cgroup's CPU limit counts as the CPUs (children past it would be throttled with the
    calls); no limit, the affinity's 64 CPUs give 8."""
    (tmp_path / "cpu.max").write_text(cpu_max)
    monkeypatch.setattr(_ahead, "_CPU_MAX", str(tmp_path / "cpu.max"))
    monkeypatch.setattr(_ahead.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert _ahead.children(torch.device("cpu")) == count
    monkeypatch.setattr(_ahead, "_CPU_MAX", str(tmp_path / "absent"))
    monkeypatch.setattr(_ahead, "_CFS", (str(tmp_path / "q"), str(tmp_path / "p")))
    (tmp_path / "q").write_text("200000\n")
    (tmp_path / "p").write_text("100000\n")
    assert _ahead.children(torch.device("cpu")) == 1  # cgroup v1: 2 CPUs
    (tmp_path / "q").write_text("-1\n")
    assert _ahead.cpu_quota() is None


def test_a_child_that_does_not_answer_in_time_is_ended(caplog):
    job = Job("triton", "cpu", 256, (8,), (Weights.of(_set(8, 256, 512)),), ())
    with caplog.at_level(logging.WARNING, logger="moegemm.server.ahead"):
        assert _ahead.compile_ahead(job, timeout_s=0.01) is None
    assert any("no answer in" in r.getMessage() for r in caplog.records)


def test_a_closing_engine_stops_waiting_for_its_child():
    """The engine's stop event ends the wait within about a second and the child is
    killed, whatever the timeout (a server shutting down never waits on a compile)."""
    import threading
    import time

    stop = threading.Event()
    stop.set()
    job = Job("triton", "cpu", 256, (8,), (Weights.of(_set(8, 256, 512)),), ())
    started = time.monotonic()
    assert _ahead.compile_ahead(job, timeout_s=600, stop=stop) is None
    assert time.monotonic() - started < 30  # the child's own start dominates


def test_the_reference_backend_loads_without_a_child(monkeypatch):
    """CPU engines (reference backend, no graphs) keep compiling nothing ahead."""
    import asyncio

    from moegemm.server.engine import Engine

    def refuse(job, timeout_s=None, stop=None):
        raise AssertionError("no child for the reference backend")

    monkeypatch.setattr(_ahead, "compile_ahead", refuse)
    engine = Engine(get_backend("cpu", "reference"), max_bucket_m=256)
    engine.start()
    try:
        ws = _set(8, 256, 512)
        assert asyncio.run(engine.load(lambda: ws)) is ws
    finally:
        engine.close()


def test_a_set_compiled_ahead_for_this_process_needs_no_second_child(monkeypatch):
    """Another engine of the process (tests make many) loads it without a child; other
    settings or another shape still get one."""
    monkeypatch.setattr(_ahead, "_done", set())
    backend = _backend_with_ahead()
    a, b = _set(8, 256, 512, "a"), _set(4, 512, 256, "b")
    job = _ahead.make_job(backend, 1024, (8,), [a], [])
    _ahead._done.update(job.key(w) for w in job.gemm)
    assert _ahead.make_job(backend, 1024, (8,), [a], []) is None
    again = _ahead.make_job(backend, 1024, (8,), [a, b], [])
    assert [(w.G, w.N, w.K) for w in again.gemm] == [(4, 512, 256)]
    assert _ahead.make_job(backend, 2048, (8,), [a], []) is not None


def test_a_child_answers_the_count_and_the_names_of_what_it_compiled(monkeypatch):
    """The child's answer (``_child``, run here with its job's work replaced): ("ok", how many
    kernels it compiled, their names), which the parent logs at debug level."""
    sent = []
    answer = SimpleNamespace(send=sent.append, close=lambda: None)
    monkeypatch.setattr(_ahead, "_die_with_parent", lambda parent: None)
    monkeypatch.setattr(_ahead, "yield_cpu", lambda: None)
    monkeypatch.setattr(_ahead, "run_job",
                        lambda job, share: (2, ["_route_kernel(div16: ids_ptr; G=8)", "_up_kernel()"]))
    job = Job("triton", "cpu", 256, (8,), (Weights.of(_set(8, 256, 512)),), ())
    _ahead._child(job, answer, (0, 1), os.getpid())
    assert sent == [("ok", 2, ["_route_kernel(div16: ids_ptr; G=8)", "_up_kernel()"])]
    monkeypatch.setattr(_ahead, "run_job", lambda job, share: 1 / 0)
    sent.clear()
    _ahead._child(job, answer, (0, 1), os.getpid())
    assert sent == [("failed", "ZeroDivisionError: division by zero")]


def test_a_child_of_a_server_that_is_process_1_stays(monkeypatch):
    """A review: a child took "my parent is process 1" for "my parent died", so in a container
    whose first process is the server (the images' exec-form ENTRYPOINT) every child left at
    once and each load compiled in-process. It compares with its parent's pid instead."""
    exits = []
    monkeypatch.setattr(_ahead.ctypes, "CDLL", lambda *args, **kwargs: SimpleNamespace(
        prctl=lambda *a: 0))
    monkeypatch.setattr(_ahead.os, "_exit", exits.append)
    monkeypatch.setattr(_ahead.os, "getppid", lambda: 1)
    _ahead._die_with_parent(1)  # the server is process 1 and alive
    assert exits == []
    _ahead._die_with_parent(4242)  # the server died: the child was handed to process 1
    assert exits == [1]
