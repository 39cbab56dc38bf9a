"""Captured and merged execution return exactly what the eager path returns (GPU).

Each check runs the same fresh random calls through executors that differ only
in one respect -- graphs on or off, calls merged or one by one, a shared
weight table or one weight set per graph -- and demands bit-identical outputs,
plus the SPEC tolerance against the float64 oracle. Skipped without an NVIDIA
Hopper GPU and triton.
"""

from __future__ import annotations

import dataclasses
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
from moegemm.server._executor import Executor
from moegemm.server._graphs import LAUNCH_ALLOWANCE, Family, GraphPool
from moegemm.server._staging import Staging
from server_support import bf16_rows, device_held, gemm_call

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
N, K = 512, 1024
MAX_BUCKET = 1024


@pytest.fixture(scope="module")
def backend():
    b = get_backend(DEV, "triton")
    assert b.capture_safe
    return b


def _executor(backend, *, graphs: bool, table: bool = True, max_bucket: int = MAX_BUCKET):
    """Without ``table``, the backend as one without an address launcher (FlyDSL's way:
    the weights' own pointers, one graph per weight set)."""
    if not table:
        backend = dataclasses.replace(backend, run_addressed=None)
    pool = GraphPool(backend, max_bucket, graphs=graphs)
    return Executor(pool, Staging(DEV))


def _weights(g: int, gen: torch.Generator, name: str = "w"):
    p = random_problem(1, N, K, g, device=DEV, generator=gen)
    return SimpleNamespace(name=name, G=g, N=N, K=K, wq=p.wq, w_scale=p.w_scale)


def _part(g: int, m: int, kind: str, gen: torch.Generator):
    """A call's host tensors (x, x_scale or None, m_sizes)."""
    sizes = random_m_sizes(g, m).tolist()
    if kind == "bf16":
        x = torch.randn(m, K, generator=gen, device=DEV).to(torch.bfloat16).cpu()
        return x, None, sizes
    p = random_problem(m, N, K, g, device=DEV, generator=gen, m_sizes=torch.tensor(sizes))
    return p.xq.cpu(), p.x_scale.cpu(), sizes


def _check_spec(ws, part, out: torch.Tensor) -> None:
    x, xs, sizes = part
    xq, xs = x.to(DEV), None if xs is None else xs.to(DEV)
    if xs is None:
        xq, xs = quantize_activations(xq, FP8)
    ref = reference_float64(xq, ws.wq, xs, ws.w_scale, torch.tensor(sizes, device=DEV))
    out = out.to(DEV)
    if out.shape[0]:
        assert torch.isfinite(out.float()).all()
        assert rel_error(out, ref) <= SPEC_TOLERANCE


def _run(ex, ws, parts):
    """``Executor.run`` on validated calls of ``parts`` (one dtype): bf16 outs, launches."""
    ex.staging.enter()
    results, launches = ex.run(ws, [gemm_call(ws, *p) for p in parts])
    torch.cuda.synchronize()
    assert all(not f.any() for _, f in results)  # finite inputs: no row flagged
    return [bf16_rows(out) for out, _ in results], launches


@pytest.fixture
def gen():
    return torch.Generator(device=DEV).manual_seed(torch.seed())


def test_a_new_shapes_graph_memory_is_within_its_estimate(backend, gen):
    """What the weight store counts for a new shape before a load (``GraphPool.shape_bytes``:
    the static buffers and the largest graph's temporaries twice, the warm-up's and the
    capture's) covers what its graphs hold after it: the static buffers and one copy of
    the temporaries, up to the allocator's rounding."""
    g, max_bucket = 8, 16384
    ws = _weights(g, gen)
    ex = _executor(backend, graphs=True, max_bucket=max_bucket)
    estimate = ex.pool.shape_bytes(g, N, K)
    temporaries = max_bucket * (K + K // 128 * 4)
    static = estimate - 2 * temporaries - LAUNCH_ALLOWANCE
    before = device_held()
    ex.prepare(g, N, K, ws.wq, ws.w_scale)
    grown = device_held() - before
    assert static <= grown <= static + temporaries + (16 << 20), (grown, static, temporaries)
    assert ex.pool.shape_bytes(g, N, K) == 0
    # The graphs' temporaries sit free in their pool between replays: no new tensor can use
    # them, and a load's room check does not count them.
    from moegemm.server.store import reusable_cache

    pooled = torch.cuda.memory_reserved() - torch.cuda.memory_allocated() - reusable_cache(DEV)
    assert pooled >= temporaries


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_captured_equals_eager(backend, kind, gen):
    g = 8
    ws = _weights(g, gen)
    captured, eager = _executor(backend, graphs=True), _executor(backend, graphs=False)
    # One graph per bucket, two for fp8 decode buckets (a lone call's GEMM checks its rows)
    # and for prefill buckets (a lone call's rows stored in place).
    pool = captured.pool
    graphs = sum(len(pool.variants(Family(g, N, K, q), b)) for q in (False, True) for b in pool.buckets)
    assert len(captured.pool.buckets) * 3 < graphs < len(captured.pool.buckets) * 4
    assert captured.prepare(g, N, K, ws.wq, ws.w_scale) == graphs
    for m in (1, 7, 83, 128, 1000):
        part = _part(g, m, kind, gen)
        [got], launches = _run(captured, ws, [part])
        [want], eager_launches = _run(eager, ws, [part])
        assert (launches.graph, launches.eager) == (1, 0)
        assert (eager_launches.graph, eager_launches.eager) == (0, 1)
        assert torch.equal(got, want), f"M={m}: max diff {(got.float() - want.float()).abs().max()}"
        _check_spec(ws, part, got)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_merged_equals_one_by_one(backend, kind, gen):
    """Merged calls (each caller's rows copied to their place in the static buffers)
    equal each call run alone on the eager general path."""
    g = 8
    ws = _weights(g, gen)
    merged_ex = _executor(backend, graphs=True)
    eager = _executor(backend, graphs=False)
    merged_ex.prepare(g, N, K, ws.wq, ws.w_scale)
    parts = [_part(g, m, kind, gen) for m in (3, 50, 1, 17, 0, 128)]
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
    assert captured.captured(g, N, K, b.wq, b.w_scale)  # nothing new to capture
    assert captured.prepare(g, N, K, b.wq, b.w_scale) == 0
    assert captured.pool.graph_count() == held
    for ws in (a, b, a):
        part = _part(g, 83, "fp8", gen)
        [got], launches = _run(captured, ws, [part])
        [want], _ = _run(plain, ws, [part])
        assert launches.graph == 1
        assert torch.equal(got, want)
        _check_spec(ws, part, got)


@pytest.mark.parametrize("table", [True, False])
def test_routes_follow_replaced_and_captured_sets(backend, gen, table):
    """The graph path's lookups, memoised per set and dtype (``Executor._route``), follow
    new captures, a set's replacement (its graphs forgotten as ``Engine.forget`` does)
    and new tensors under the same object: every answer is the one ``backend.run`` gives
    for the weights the call names, by graph exactly when a graph for them exists."""
    g = 8
    captured = _executor(backend, graphs=True, table=table)
    plain = _executor(backend, graphs=False, table=False)
    a = _weights(g, gen, "a")
    part = _part(g, 5, "fp8", gen)
    [want], _ = _run(plain, a, [part])
    [got], launches = _run(captured, a, [part])  # nothing captured: eager
    assert (launches.graph, launches.eager) == (0, 1) and torch.equal(got, want)
    captured.prepare(g, N, K, a.wq, a.w_scale)
    assert (captured.pool.run_table is not None) == table  # (the table passed its check)
    [got], launches = _run(captured, a, [part])  # the capture is seen
    assert launches.graph == 1 and torch.equal(got, want)
    b = _weights(g, gen, "b")  # a's replacement: the same shape, other weights
    captured.pool.forget(a.wq)
    captured.prepare(g, N, K, b.wq, b.w_scale)
    [want_b], _ = _run(plain, b, [part])
    assert not torch.equal(want_b, want)
    for _ in range(2):
        [got], launches = _run(captured, b, [part])
        assert launches.graph == 1 and torch.equal(got, want_b)
        # A call still holding a: a's answer; by the shared graph with a weight table,
        # eagerly without one (a's own graphs were dropped).
        [got], launches = _run(captured, a, [part])
        assert launches.graph == (1 if table else 0) and torch.equal(got, want)
    a.wq, a.w_scale = b.wq, b.w_scale  # the same object, other tensors: b's answer
    [got], launches = _run(captured, a, [part])
    assert launches.graph == 1 and torch.equal(got, want_b)


def test_the_engine_equals_the_general_path_on_every_lane(backend, gen):
    """Concurrent calls through ``Engine.submit`` -- fp8 and bf16, ragged, small ones
    merged on the loop, a lone one at once, large ones on the worker, fp16 and fnuz
    converted, a NaN row in one -- answer exactly what the eager general path answers
    one by one, bit for bit, and the NaN call alone is refused."""
    import asyncio

    from moegemm.client._errors import NotFinite
    from moegemm.server.engine import Engine

    g = 8
    ws = _weights(g, gen)
    parts = [_part(g, m, kind, gen) for m, kind in
             ((1, "fp8"), (7, "bf16"), (130, "fp8"), (1, "fp8"), (64, "bf16"), (300, "fp8"),
              (256, "bf16"), (257, "fp8"), (2000, "fp8"))]
    parts.append((parts[0][0].float().half(), None, parts[0][2]))  # fp16: quantized
    x8, xs8, sizes8 = parts[2]
    tiny = x8.float().abs() < 2**-5  # fnuz -> fn exact at or above 2^-6 (SPEC 1.2)
    parts.append((x8.float().masked_fill(tiny, 0).mul(0.5).to(torch.float8_e4m3fnuz),
                  xs8 * 2, sizes8))
    bad = parts[3][1].clone()
    bad[0, 0] = float("nan")  # a NaN scale: refused (an fp8 NaN code is not, SPEC 2.2)
    parts.append((parts[3][0], bad, parts[3][2]))
    engine = Engine(backend, max_bucket_m=1024)
    general = Engine(backend, max_bucket_m=1024, graphs=False, merge_window_us=0)
    batches = []
    real = engine._executor.run

    def spy(ws_, calls):
        batches.append(len(calls))
        return real(ws_, calls)

    engine._executor.run = spy
    for e in (engine, general):
        e.start()
    try:
        async def run_all():
            for e in (engine, general):
                await e.run(lambda e=e: e.prepare(ws))
            lone = await engine.submit(gemm_call(ws, *parts[0]), alone=True)
            got = await asyncio.gather(*(engine.submit(gemm_call(ws, *p)) for p in parts),
                                       return_exceptions=True)
            want = [await general.submit(gemm_call(ws, *p)) for p in parts[:-1]]
            return lone, got, want

        lone, got, want = asyncio.run(run_all())
    finally:
        engine.close()
        general.close()
    assert isinstance(got[-1], NotFinite)
    assert max(batches) > 1  # some calls merged
    assert torch.equal(bf16_rows(lone), bf16_rows(want[0]))
    for p, out, ref in zip(parts, got, want):
        out, ref = bf16_rows(out), bf16_rows(ref)
        assert out.shape == ref.shape and torch.equal(out, ref)
        _check_spec(ws, p, out)


def test_a_load_and_its_capture_never_hold_the_calls(backend, gen):
    """While a weight set of a new shape is built and its graphs captured (the loader
    thread, its own stream, thread-local capture), another set's calls keep being
    answered, right; then the new set answers right too."""
    import asyncio
    import time

    from moegemm.server.engine import Engine

    a = _weights(8, gen, "a")
    engine = Engine(backend, max_bucket_m=1024)
    engine.start()
    try:
        async def scenario():
            await engine.run(lambda: engine.prepare(a))
            part = _part(8, 16, "fp8", gen)
            [want] = [await engine.submit(gemm_call(a, *part))]
            g2, loaded = 16, {}

            def build():
                time.sleep(0.2)  # a slow read, as from a file
                p = random_problem(1, N, K, g2, device=DEV)
                return SimpleNamespace(name="b", G=g2, N=N, K=K, wq=p.wq, w_scale=p.w_scale)

            load = asyncio.ensure_future(engine.load(build))
            answered = 0
            while not load.done():
                got = await engine.submit(gemm_call(a, *part), alone=True)
                assert torch.equal(bf16_rows(got), bf16_rows(want))
                answered += 1
                await asyncio.sleep(0)
            b = await load
            loaded["b"] = b
            part_b = _part(g2, 40, "bf16", gen)
            out_b = await engine.submit(gemm_call(b, *part_b))
            return answered, b, part_b, out_b

        answered, b, part_b, out_b = asyncio.run(scenario())
    finally:
        engine.close()
    assert answered >= 20, answered  # the calls went on during the load and capture
    assert engine._executor.captured(b.G, N, K, b.wq, b.w_scale)
    _check_spec(b, part_b, bf16_rows(out_b))


def test_the_last_set_of_a_shape_takes_its_graphs_and_buffers_with_it(backend, gen):
    """SPEC 2.1's DELETE returns a set's memory: when the last set of a shape is forgotten,
    the shape's graphs, static buffers and lanes go (on the loader, after loads already
    queued); while another set has the shape they stay. A later set of it captures anew and
    answers right."""
    import asyncio

    from moegemm.server.engine import Engine

    engine = Engine(backend, max_bucket_m=256)
    engine.start()
    pool = engine._executor.pool
    try:
        async def scenario():
            a, b = _weights(8, gen, "a"), _weights(8, gen, "b")
            for ws in (a, b):
                await engine.load(lambda ws=ws: ws)
            part = _part(8, 16, "bf16", gen)
            await engine.submit(gemm_call(a, *part))
            captured, held = pool.graph_count(), torch.cuda.memory_allocated(DEV)
            assert captured > 0 and len(pool._buffers) == 2
            engine.forget(a)
            # (a job on the loader: its jobs before it, the release's, have run)
            await asyncio.wrap_future(engine._loader.submit(lambda: None))
            assert pool.graph_count() == captured and len(pool._buffers) == 2  # b has it
            engine.forget(b)
            await asyncio.wrap_future(engine._loader.submit(lambda: None))
            assert pool.graph_count() == 0 and not pool._buffers and not engine._executor._routes
            torch.cuda.synchronize(DEV)
            assert torch.cuda.memory_allocated(DEV) < held  # (a and b's weights still held)
            c = await engine.load(lambda: _weights(8, gen, "c"))
            assert pool.graph_count() == captured
            out = await engine.submit(gemm_call(c, *part))
            _check_spec(c, part, bf16_rows(out))

        asyncio.run(scenario())
    finally:
        engine.close()
