"""A new shape's kernels compile in a child process, not in the serving one (GPU).

Each test points Triton at a fresh on-disk cache, so the child must compile
what the engine's captures will launch; the engine's own warm-ups must then
compile nothing (``Backend.ahead.compiles()``, process-wide, does not move
during the load) and its answers stay bit-identical to ``backend.run``. A
kernel whose specialisation the child got wrong would be compiled by the
engine -- unless this process compiled it already, so the loads use shapes no
other test here uses, and this module is best run in a process of its own.
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.version.hip:
    pytest.skip("needs an NVIDIA CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs compute capability 9.0 (Hopper)", allow_module_level=True)
triton = pytest.importorskip("triton")
import triton.language as tl
from moegemm.kernels import get_backend, quantize_activations
from moegemm.kernels.testing import random_m_sizes, random_problem
from moegemm.server import _ahead
from moegemm.server.engine import Engine
from moegemm.server.experts import ExpertSet
from server_support import bf16_rows, gemm_call

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
MAX_BUCKET = 64


@pytest.fixture
def backend(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # the child inherits it
    b = get_backend(DEV, "triton")
    assert b.ahead is not None
    return b


@pytest.fixture
def children(monkeypatch):
    """The jobs handed to children and what each answered."""
    seen = []
    real = _ahead.compile_ahead

    def spy(job, *args, **kwargs):
        seen.append((job, real(job, *args, **kwargs)))
        return seen[-1][1]

    monkeypatch.setattr(_ahead, "compile_ahead", spy)
    return seen


def _weights(g, n, k, gen, name):
    p = random_problem(1, n, k, g, device=DEV, generator=gen)
    return SimpleNamespace(name=name, G=g, N=n, K=k, layout="plain", wq=p.wq, w_scale=p.w_scale,
                           bytes=p.wq.numel() + 4 * p.w_scale.numel(), created="")


def _load(engine, build, after=None):
    """Load on the engine's loader (as a route does); the process's compiles meanwhile, and
    ``after(engine)``'s result."""
    compiles = engine.backend.ahead.compiles

    async def scenario():
        before = compiles()
        built = await engine.load(build)
        during = compiles() - before
        return built, during, (await after(built) if after else None)

    engine.start()
    try:
        return asyncio.run(scenario())
    finally:
        engine.close()


def test_a_new_gemm_shape_compiles_nothing_in_the_serving_process(backend, children):
    gen = torch.Generator(device=DEV).manual_seed(16)
    g, n, k = 6, 384, 640
    ws = _weights(g, n, k, gen, "new")
    parts = []
    for m in (1, 5, 37):
        sizes = random_m_sizes(g, m).tolist()
        p = random_problem(m, n, k, g, device=DEV, generator=gen, m_sizes=torch.tensor(sizes))
        parts.append((p.xq.cpu(), p.x_scale.cpu(), sizes))
    x = torch.randn(9, k, generator=gen, device=DEV).to(torch.bfloat16)
    parts.append((x.cpu(), None, random_m_sizes(g, 9).tolist()))
    engine = Engine(backend, max_bucket_m=MAX_BUCKET)

    async def answers(built):
        return [await engine.submit(gemm_call(built, *part)) for part in parts]

    _, during, outs = _load(engine, lambda: ws, answers)
    [(job, compiled)] = children
    assert [(w.G, w.N, w.K) for w in job.gemm] == [(g, n, k)] and not job.experts
    assert compiled, "the child compiled nothing into a fresh cache"
    assert during == 0, f"{during} kernels compiled in the serving process"
    assert engine._executor.captured(g, n, k, ws.wq, ws.w_scale)
    for (xh, xsh, sizes), out in zip(parts, outs):
        xq, xs = (xh.to(DEV), xsh.to(DEV)) if xsh is not None else \
            quantize_activations(xh.to(DEV), FP8)
        want = torch.empty((xq.shape[0], n), dtype=torch.bfloat16, device=DEV)
        backend.run(xq, ws.wq, xs, ws.w_scale, torch.tensor(sizes, device=DEV), want)
        assert torch.equal(bf16_rows(out).to(DEV), want)


def test_a_new_expert_shape_compiles_nothing_in_the_serving_process(backend, children, caplog):
    # What the child compiled, in the report if this fails (the engine's warning names what the
    # serving process compiled). Under an 8-worker spread of the server GPU tests this process
    # compiled _route_kernel and _up_kernel again, with the child's very specialisations: their
    # cache keys depended on which kernel a process hashed first (kernels/_triton_keys.py).
    caplog.set_level(logging.DEBUG, logger="moegemm.server.ahead")
    gen = torch.Generator(device=DEV).manual_seed(17)
    g, h, i = 10, 384, 256
    es = ExpertSet("ex", g, h, i, _weights(g, 2 * i, h, gen, "ex.w13"),
                   _weights(g, h, i, gen, "ex.w2"), created="", source="test")
    engine = Engine(backend, max_bucket_m=MAX_BUCKET, moe_top_k=(8,))
    _, during, _ = _load(engine, lambda: es)
    [(job, compiled)] = children
    assert {(w.G, w.N, w.K) for w in job.gemm} == {(g, 2 * i, h), (g, h, i)}
    assert [(e.G, e.H, e.I) for e in job.experts] == [(g, h, i)] and job.top_k == (8,)
    assert compiled, "the child compiled nothing into a fresh cache"
    assert during == 0, f"{during} kernels compiled in the serving process"
    assert engine._experts.graphs.prepared(es, (8,))


@triton.jit
def _fill(out_ptr, value, n, BLOCK: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + at, value, mask=at < n)


def test_compile_only_launches_compile_into_the_cache_and_run_nothing(backend, tmp_path):
    out = torch.zeros(1000, dtype=torch.float32, device=DEV)
    before = backend.ahead.compiles()
    with backend.ahead.compile_only():
        _fill[(8,)](out, 3.0, out.numel(), BLOCK=128)
    torch.cuda.synchronize()
    assert not out.any()  # nothing ran
    assert backend.ahead.compiles() == before + 1
    assert any((tmp_path / "triton").rglob("*.cubin"))
    _fill[(8,)](out, 3.0, out.numel(), BLOCK=128)  # outside: runs, compiles nothing more
    torch.cuda.synchronize()
    assert bool((out == 3.0).all()) and backend.ahead.compiles() == before + 1


def test_compile_only_gluon_launches_compile_and_run_nothing(backend, tmp_path):
    """The many-expert prefill tile (a Gluon kernel) takes part in compile-only launches: the
    server's form compiles into the cache and runs nothing, and the real launch after it
    compiles nothing more."""
    from moegemm.kernels import triton_kernel as tk

    gen = torch.Generator(device=DEV).manual_seed(18)
    m, n, k, g = 4000, 768, 640, 64
    config = tk.default_config(m, n, k, g)
    assert config.schedule == "gluon_ws_store"  # the Gluon store-warp tile (K <= 5120)
    p = random_problem(m, n, k, g, device=DEV, generator=gen)
    words = torch.tensor([p.wq.data_ptr(), p.w_scale.data_ptr(), p.xq.data_ptr(), p.x_scale.data_ptr()],
                         device=DEV)
    rows = torch.arange(m, device=DEV)
    out = torch.zeros((m, n), dtype=torch.bfloat16, device=DEV)
    before = backend.ahead.compiles()
    with backend.ahead.compile_only():
        tk.run_addressed(p.xq, words[:2], p.x_scale, p.m_sizes, out, groups=g, inputs=words[2:], out_rows=rows)
    torch.cuda.synchronize()
    assert not out.any()  # nothing ran
    assert backend.ahead.compiles() == before + 1
    tk.run_addressed(p.xq, words[:2], p.x_scale, p.m_sizes, out, groups=g, inputs=words[2:], out_rows=rows)
    torch.cuda.synchronize()
    assert backend.ahead.compiles() == before + 1
    want = torch.empty_like(out)
    backend.run(p.xq, p.wq, p.x_scale, p.w_scale, p.m_sizes, want)
    assert torch.equal(out, want)
