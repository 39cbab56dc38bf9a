"""Captured and merged execution return exactly what the eager path returns (GPU).

Each check runs the same fresh random calls through executors that differ only
in one respect -- graphs on or off, calls merged or one by one, a shared
weight table or one weight set per graph -- and demands bit-identical outputs,
plus the SPEC tolerance against the float64 oracle. Skipped without an NVIDIA
Hopper GPU and triton.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.version.hip:
    pytest.skip("needs an NVIDIA CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs compute capability 9.0 (Hopper)", allow_module_level=True)
pytest.importorskip("triton")

from moegemm.kernels import get_backend, quantize_activations, reference_float64
from moegemm.kernels.testing import SPEC_TOLERANCE, random_m_sizes, random_problem, rel_error
from moegemm.server._executor import Executor, Part
from moegemm.server._graphs import GraphPool
from moegemm.server._staging import Staging

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
N, K = 512, 1024
MAX_BUCKET = 1024


@pytest.fixture(scope="module")
def backend():
    b = get_backend(DEV, "triton")
    assert b.capture_safe
    return b


def _executor(backend, *, graphs: bool, table: bool = True, max_bucket: int = MAX_BUCKET,
              driver: bool = True):
    pool = GraphPool(backend, max_bucket, graphs=graphs, weight_table=table)
    return Executor(pool, Staging(DEV, driver=driver))


def _weights(g: int, gen: torch.Generator):
    p = random_problem(1, N, K, g, device=DEV, generator=gen)
    return SimpleNamespace(G=g, N=N, K=K, wq=p.wq, w_scale=p.w_scale)


def _part(g: int, m: int, kind: str, gen: torch.Generator) -> Part:
    sizes = random_m_sizes(g, m).tolist()
    if kind == "bf16":
        x = torch.randn(m, K, generator=gen, device=DEV).to(torch.bfloat16).cpu()
        return Part(x, None, sizes)
    p = random_problem(m, N, K, g, device=DEV, generator=gen, m_sizes=torch.tensor(sizes))
    return Part(p.xq.cpu(), p.x_scale.cpu(), sizes)


def _check_spec(ws, part: Part, out: torch.Tensor) -> None:
    xq, xs = part.x.to(DEV), None if part.x_scale is None else part.x_scale.to(DEV)
    if xs is None:
        xq, xs = quantize_activations(xq, FP8)
    ref = reference_float64(xq, ws.wq, xs, ws.w_scale, torch.tensor(part.m_sizes, device=DEV))
    if out.shape[0]:
        assert torch.isfinite(out.float()).all()
        assert rel_error(out, ref) <= SPEC_TOLERANCE


def _run(ex, ws, parts):
    outs, flags, launches = ex.run(ws, parts)
    torch.cuda.synchronize()
    assert all(not f.any() for f in flags)  # finite inputs: no row flagged
    return outs, launches


@pytest.fixture
def gen():
    return torch.Generator(device=DEV).manual_seed(torch.seed())


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_captured_equals_eager(backend, kind, gen):
    g = 8
    ws = _weights(g, gen)
    captured, eager = _executor(backend, graphs=True), _executor(backend, graphs=False)
    assert captured.prepare(g, N, K, ws.wq, ws.w_scale) == 2 * len(captured.pool.buckets)
    for m in (1, 7, 83, 128, 1000):
        part = _part(g, m, kind, gen)
        [got], launches = _run(captured, ws, [part])
        [want], eager_launches = _run(eager, ws, [part])
        assert (launches.graph, launches.eager) == (1, 0)
        assert (eager_launches.graph, eager_launches.eager) == (0, 1)
        assert torch.equal(got, want), f"M={m}: max diff {(got.float() - want.float()).abs().max()}"
        _check_spec(ws, part, got)


@pytest.mark.parametrize("driver", [True, False], ids=["driver_copies", "torch_copies"])
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_merged_equals_one_by_one(backend, kind, driver, gen):
    """Merged calls (each caller's rows copied by the driver to their place, or
    gathered on the host and copied by torch) equal each call run alone."""
    g = 8
    ws = _weights(g, gen)
    merged_ex = _executor(backend, graphs=True, driver=driver)
    eager = _executor(backend, graphs=False)
    merged_ex.prepare(g, N, K, ws.wq, ws.w_scale)
    parts = [_part(g, m, kind, gen) for m in (3, 50, 1, 17, 0, 128)]
    if driver:  # the raw path, not the general one
        merged_ex._run_direct = None
    outs, launches = _run(merged_ex, ws, parts)
    assert launches.graph == 1  # one launch for all six calls
    for part, out in zip(parts, outs):
        [alone], _ = _run(eager, ws, [part])
        assert torch.equal(out, alone)
        _check_spec(ws, part, out)


def test_chunks_above_the_largest_bucket(backend, gen):
    g = 8
    ws = _weights(g, gen)
    captured = _executor(backend, graphs=True, max_bucket=256)
    eager = _executor(backend, graphs=False, max_bucket=256)
    captured.prepare(g, N, K, ws.wq, ws.w_scale)
    parts = [_part(g, 700, "fp8", gen), _part(g, 90, "fp8", gen)]
    outs, launches = _run(captured, ws, parts)
    assert launches.graph == 4  # 790 rows in chunks of 256
    want, _ = _run(eager, ws, parts)
    for part, out, ref in zip(parts, outs, want):
        assert torch.equal(out, ref)
        _check_spec(ws, part, out)


def test_weight_sets_of_one_shape_share_graphs(backend, gen):
    g = 8
    a, b = _weights(g, gen), _weights(g, gen)
    captured = _executor(backend, graphs=True)
    plain = _executor(backend, graphs=False, table=False)  # backend.run, no table
    captured.prepare(g, N, K, a.wq, a.w_scale)
    assert captured.pool.run_table is not None  # the table launcher passed its self-check
    held = captured.pool.graph_count()
    assert captured.prepare(g, N, K, b.wq, b.w_scale) == 0  # nothing new to capture
    assert captured.pool.graph_count() == held
    for ws in (a, b, a):
        part = _part(g, 83, "fp8", gen)
        [got], launches = _run(captured, ws, [part])
        [want], _ = _run(plain, ws, [part])
        assert launches.graph == 1
        assert torch.equal(got, want)
        _check_spec(ws, part, got)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_the_lone_lane_equals_the_general_path(backend, kind, gen):
    """A lone call taken straight from its wire fields (``Engine.gemm_lone``) answers
    exactly what the general path answers, bit for bit, and refuses NaN rows alike."""
    import asyncio

    import numpy as np
    from moegemm.client._errors import NotFinite
    from moegemm.server._tensors import WIRE_NAMES
    from moegemm.server.engine import Engine

    g = 8
    ws = _weights(g, gen)
    ws.name = "w"
    engine = Engine(backend, max_bucket_m=256, inline_when_idle=True)
    engine.start()
    try:
        asyncio.run(engine.run(lambda: engine.prepare(ws)))
        for m in (1, 7, 130, 256):
            part = _part(g, m, kind, gen)
            body = {"x": _wire(part.x), "m_sizes": _wire(torch.tensor(part.m_sizes))}
            if part.x_scale is not None:
                body["x_scale"] = _wire(part.x_scale)
            lane = engine.gemm_lone(ws, body, None, True)
            assert lane is not None, "the lane did not take a plain lone call"
            got = torch.from_numpy(np.ascontiguousarray(lane)).view(torch.bfloat16)
            want = asyncio.run(engine.gemm(ws, part.x, part.x_scale,
                                           torch.tensor(part.m_sizes), alone=False))
            assert got.shape == want.shape and torch.equal(got, want)
            _check_spec(ws, part, got.to(DEV))
        # A NaN row: the same error as the general path, from the device's flags.
        bad = part.x.clone()
        bad.view(torch.uint8)[0, 0] = 0x7F if kind == "fp8" else 0
        if kind == "bf16":
            bad[0, 0] = float("nan")
        body["x"] = _wire(bad)
        with pytest.raises(NotFinite):
            engine.gemm_lone(ws, body, None, True)
        with pytest.raises(NotFinite):
            asyncio.run(engine.gemm(ws, bad, part.x_scale, torch.tensor(part.m_sizes)))
        assert WIRE_NAMES[backend.fp8_dtype] == "float8_e4m3fn"
    finally:
        engine.close()


def _wire(t: torch.Tensor) -> dict:
    """The decoded wire map of a CPU tensor (as the server's body decoder hands it over)."""
    from moegemm.server._tensors import WIRE_NAMES

    t = t.contiguous()
    return {"dtype": WIRE_NAMES[t.dtype], "shape": list(t.shape),
            "data": t.view(-1).view(torch.uint8).numpy().tobytes()}


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_loop_batches_equal_the_worker(backend, kind, gen):
    """Concurrent calls merged on the event loop's thread (``loop_batches``) answer
    exactly what the worker answers one call at a time, bit for bit."""
    import asyncio
    import threading

    from moegemm.server.engine import Engine

    g = 8
    ws = _weights(g, gen)
    ws.name = "w"
    parts = [_part(g, m, kind, gen) for m in (1, 7, 33, 128, 1, 300, 64, 5)]
    answers = {}
    for loop in (True, False):
        engine = Engine(backend, max_bucket_m=1024, merge_window_us=500 if loop else 0,
                        loop_batches=loop, loop_max_rows=1024)
        engine.start()
        seen = []
        real = engine._outcomes

        def spy(batch, real=real, seen=seen):
            seen.append((threading.current_thread() is threading.main_thread(), len(batch)))
            return real(batch)

        engine._outcomes = spy

        async def calls(engine=engine):
            await engine.run(lambda: engine.prepare(ws))
            return await asyncio.gather(*(engine.gemm(ws, p.x, p.x_scale,
                                                      torch.tensor(p.m_sizes)) for p in parts))

        try:
            answers[loop] = asyncio.run(calls())
        finally:
            engine.close()
        if loop:
            assert all(on_loop for on_loop, _ in seen) and max(n for _, n in seen) > 1
        else:
            assert seen == [(False, 1)] * len(parts)
    for part, a, b in zip(parts, answers[True], answers[False]):
        assert a.shape == b.shape and torch.equal(a, b)
        _check_spec(ws, part, a.to(DEV))


def test_wire_calls_merged_equal_the_general_path(backend, gen):
    """Plain bodies merged in loop batches straight from their wire fields
    (``Engine.gemm_wire``: fp8 and bf16 at once, ragged sizes, a NaN row in one) answer
    exactly what the general path answers one by one with torch copies."""
    import asyncio

    import numpy as np
    from moegemm.client._errors import NotFinite
    from moegemm.server.engine import Engine

    g = 8
    ws = _weights(g, gen)
    ws.name = "w"
    parts = [_part(g, m, kind, gen) for m, kind in
             ((1, "fp8"), (7, "bf16"), (130, "fp8"), (1, "fp8"), (64, "bf16"), (300, "fp8"))]
    bad = parts[3].x.clone()
    bad.view(torch.uint8)[0, 0] = 0x7F  # an fp8 NaN encoding
    parts.append(Part(bad, parts[3].x_scale, parts[3].m_sizes))
    bodies = []
    for p in parts:
        body = {"x": _wire(p.x), "m_sizes": _wire(torch.tensor(p.m_sizes))}
        if p.x_scale is not None:
            body["x_scale"] = _wire(p.x_scale)
        bodies.append(body)
    wire_engine = Engine(backend, max_bucket_m=1024, merge_window_us=500, loop_batches=True,
                         loop_max_rows=1024)
    general = Engine(backend, max_bucket_m=1024, raw_copies=False)
    launches = []
    real = wire_engine._executor.run_raw_many

    def spy(ws_, family, calls):
        launches.append(len(calls))
        return real(ws_, family, calls)

    wire_engine._executor.run_raw_many = spy
    for e in (wire_engine, general):
        e.start()
    try:
        async def run_all():
            for e in (wire_engine, general):
                await e.run(lambda e=e: e.prepare(ws))
            got = await asyncio.gather(*(wire_engine.gemm_wire(ws, b, None) for b in bodies),
                                       return_exceptions=True)
            want = [await general.gemm(ws, p.x, p.x_scale, torch.tensor(p.m_sizes))
                    for p in parts[:-1]]
            return got, want

        got, want = asyncio.run(run_all())
    finally:
        wire_engine.close()
        general.close()
    assert isinstance(got[-1], NotFinite)
    assert sorted(launches) == [2, 5]  # bf16 calls in one launch, fp8 ones in another
    for p, out, ref in zip(parts, got, want):
        assert out is not None
        out = torch.from_numpy(np.ascontiguousarray(out)).view(torch.bfloat16)
        assert out.shape == ref.shape and torch.equal(out, ref)
        _check_spec(ws, p, out.to(DEV))
