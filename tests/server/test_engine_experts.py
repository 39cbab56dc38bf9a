"""Expert calls (SPEC 5.1 ffn, 5.2 moe) through the engine's one entry on the CPU.

They batch as gemm calls do (the loop and the worker, the merge window, the
queue bound, deadlines), and merged answers equal alone ones bit for bit: each
caller gets its own rows, a bad call fails alone, and a call joins only
batches whose bucket runs its own bucket's tiles (``Backend.tile_key``). Their
graphs are prepared when a set loads, on the loader thread, never by a call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
import torch
from ffn_support import (
    FFN_TOLERANCE,
    answer_rows,
    expert_set,
    ffn_call,
    ffn_float64,
    moe_call,
    moe_float64,
    pooled_error,
    quantized,
    random_routing,
    random_x,
)
from moegemm.client._errors import BadRouting, DeadlineExceeded, NotFinite, Overloaded
from moegemm.kernels.reference import create as reference_backend
from moegemm.kernels.testing import random_m_sizes
from moegemm.server._graphs import bucket_for
from moegemm.server.engine import SMALL_ROWS, Engine
from moegemm.server.experts import ExpertSet

FP8 = torch.float8_e4m3fn
G, H, I = 5, 256, 256


@pytest.fixture(scope="module")
def es():
    return expert_set(G, H, I, FP8, "cpu", torch.Generator().manual_seed(torch.seed()))


def _engine(*, loop: bool, merge_window_us: int = 500, max_bucket_m: int = 64,
            backend=None, **kw) -> Engine:
    engine = Engine(backend or reference_backend(torch.device("cpu")),
                    max_bucket_m=max_bucket_m, merge_window_us=merge_window_us, **kw)
    if loop:
        engine._loop_rows = SMALL_ROWS  # as on a GPU
    engine.start()
    return engine


def _spy(engine):
    """Record every expert batch the engine runs: (on the main thread?, its calls)."""
    seen = []
    real = engine._experts.run_calls

    def spy(es, batch):
        seen.append((threading.current_thread() is threading.main_thread(), list(batch)))
        return real(es, batch)

    engine._experts.run_calls = spy
    return seen


def _answers(engine, calls):
    async def go():
        return await asyncio.gather(*(engine.submit(c) for c in calls), return_exceptions=True)

    try:
        return asyncio.run(go())
    finally:
        engine.close()


def _alone(make_calls):
    """Each call's answer from an engine that never merges."""
    return _answers(_engine(loop=False, merge_window_us=0), make_calls())


def _ffn_calls(es, gen, sizes_of_calls, bad=(), fp8_every: int = 3):
    """Validated ffn calls of these sizes (every ``fp8_every``-th fp8, the rest bf16)."""
    raw = []
    for i, m in enumerate(sizes_of_calls):
        x, xs = random_x(m, H, gen, FP8 if i % fp8_every == fp8_every - 1 else None)
        if i in bad:
            x[m // 2, 3] = float("nan")
        sizes = random_m_sizes(G, m, generator=gen).tolist()
        raw.append((x, xs, sizes))
    return raw, lambda: [ffn_call(es, *r) for r in raw]


@pytest.mark.parametrize("loop", [True, False])
def test_merged_ffn_calls_equal_alone_bit_for_bit(es, loop):
    gen = torch.Generator().manual_seed(torch.seed())
    raw, make = _ffn_calls(es, gen, [3, 1, 7, 0, 11, 2, 5, 9, 4, 6], bad={4})
    want = _alone(make)
    engine = _engine(loop=loop)
    seen = _spy(engine)
    got = _answers(engine, make())
    pairs = []
    for i, (g, w, (x, xs, sizes)) in enumerate(zip(got, want, raw)):
        if i == 4:
            assert isinstance(g, NotFinite) and isinstance(w, NotFinite)
            continue
        out = answer_rows(g, H)
        assert out.shape == (x.shape[0], H)
        assert torch.equal(out.view(torch.int16), answer_rows(w, H).view(torch.int16)), i
        if x.shape[0]:
            pairs.append((out, ffn_float64(es, *quantized(x, xs, FP8), sizes, FP8)))
    assert pooled_error(pairs) <= FFN_TOLERANCE
    assert max(len(b) for _, b in seen) > 1  # merged
    assert all(on_loop == loop for on_loop, _ in seen)
    # A merged batch is one input dtype: the fp8 calls (every third) never join bf16 ones.
    assert all(len({c.dtype for c in b}) == 1 for _, b in seen)


def test_merged_moe_calls_equal_alone_bit_for_bit(es):
    gen = torch.Generator().manual_seed(torch.seed())
    raw = []
    for i, (T, k) in enumerate([(3, 2), (1, 2), (4, 2), (2, 1), (5, 2), (1, 1), (3, 2)]):
        x, xs = random_x(T, H, gen, FP8 if i == 2 else None)
        ids, w = random_routing(T, G, k, gen, dtype=torch.int32 if i % 2 else torch.int64)
        if i == 4:
            ids[1, 1] = G  # bad routing: this call only
        raw.append((x, xs, ids, w))
    make = lambda: [moe_call(es, *r) for r in raw]
    want = _alone(make)
    engine = _engine(loop=True)
    seen = _spy(engine)
    got = _answers(engine, make())
    pairs = []
    for i, (g, w, (x, xs, ids, wt)) in enumerate(zip(got, want, raw)):
        if i == 4:
            assert isinstance(g, BadRouting) and isinstance(w, BadRouting)
            continue
        out = answer_rows(g, H)
        assert torch.equal(out.view(torch.int16), answer_rows(w, H).view(torch.int16)), i
        pairs.append((out, moe_float64(es, *quantized(x, xs, FP8), ids, wt, FP8)))
    assert pooled_error(pairs) <= FFN_TOLERANCE
    assert max(len(b) for _, b in seen) > 1
    for _, batch in seen:  # one top-k, one ids dtype, one x dtype per batch
        assert len({(c.top_k, c.ids_dtype, c.dtype) for c in batch}) == 1


def test_a_call_joins_only_batches_of_its_own_tiles(es):
    """A backend whose tile changes past 8 rows (as split-K does on the GPU): a batch's bucket
    always runs each member's own tiles, so no call of 5 or fewer rows ever lands in a
    16-row bucket, and calls on either side still merge."""
    backend = dataclasses.replace(reference_backend(torch.device("cpu")),
                                  tile_key=lambda m, n, k, g, dtype: m > 8)
    gen = torch.Generator().manual_seed(torch.seed())
    sizes = [5, 4, 3, 6, 2, 12, 3, 5, 9, 1, 4, 7, 20, 2]
    _, make = _ffn_calls(es, gen, sizes, fp8_every=len(sizes) + 1)  # all bf16
    calls = make()
    want = _alone(lambda: [dataclasses.replace(c, outcome=None, waiter=None) for c in calls])
    engine = _engine(loop=True, backend=backend)
    seen = _spy(engine)
    got = _answers(engine, calls)
    for g, w in zip(got, want):
        assert torch.equal(answer_rows(g, H).view(torch.int16), answer_rows(w, H).view(torch.int16))
    buckets = engine._experts.graphs.buckets
    for _, batch in seen:
        total = bucket_for(sum(c.rows for c in batch), buckets)
        for c in batch:
            assert (bucket_for(c.rows, buckets) > 8) == (total > 8), [x.rows for x in batch]
    assert any(len(b) > 1 and sum(c.rows for c in b) <= 8 for _, b in seen)
    assert any(len(b) > 1 and sum(c.rows for c in b) > 8 for _, b in seen)


def test_expert_calls_share_the_queue_bound_and_deadlines(es):
    gen = torch.Generator().manual_seed(torch.seed())
    engine = _engine(loop=False, queue_size=2)
    release = threading.Event()
    _, make = _ffn_calls(es, gen, [3, 4, 5, 2])
    ids, w = random_routing(2, G, 2, gen)
    late = moe_call(es, random_x(2, H, gen)[0], None, ids, w, deadline=time.monotonic() + 3600)

    async def scenario():
        held = asyncio.ensure_future(engine.run(release.wait))  # the worker is busy
        await asyncio.sleep(0.05)
        first, second, third, _ = make()
        late.deadline = time.monotonic() + 0.3
        a = asyncio.ensure_future(engine.submit(first))
        b = asyncio.ensure_future(engine.submit(late))
        await asyncio.sleep(0.02)
        with pytest.raises(Overloaded):
            await engine.submit(second)
        # The moe call's deadline passes while it waits: answered then, its place freed, the
        # worker still held.
        with pytest.raises(DeadlineExceeded):
            await b
        assert engine.queued() == 1 and not a.done()
        release.set()
        await held
        assert answer_rows(await a, H).shape == (3, H)
        assert engine.queued() == 0
        assert answer_rows(await engine.submit(third), H).shape == (5, H)

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        engine.close()


def _expert_set(name: str, gen) -> ExpertSet:
    """A real ExpertSet of the module's shape, as a load builds one."""
    ns = expert_set(G, H, I, FP8, "cpu", gen, name=name)
    return ExpertSet(name=name, G=G, H=H, I=I, w13=ns.w13, w2=ns.w2, created="", source="test")


def _buffered_shapes(graphs) -> set:
    """The (G, H, I) of the ffn/moe families whose buffers ``graphs`` holds."""
    return {(f.G, f.H, f.I) for f in graphs._buffers}


def _buffers_at_prepare(engine) -> None:
    """A set's prepare makes its families' static buffers, as its captures do on a GPU (no
    graphs on the CPU: only captures make them; batches never do)."""
    prepare, graphs = engine._experts.prepare, engine._experts.graphs

    def prepare_and_buffer(es):
        done = prepare(es)
        graphs.buffers(graphs.family(es, True))
        return done

    engine._experts.prepare = prepare_and_buffer


def test_graphs_are_prepared_at_load_on_the_loader_and_dropped_with_the_shape():
    gen = torch.Generator().manual_seed(torch.seed())
    engine = _engine(loop=True)
    _buffers_at_prepare(engine)
    prepared, captured = [], []
    prepare = engine._experts.prepare
    engine._experts.prepare = lambda es: prepared.append(
        (threading.current_thread().name, es.name)) or prepare(es)
    graphs = engine._experts.graphs
    graphs._capture = lambda *a: captured.append(a)

    async def scenario():
        a = await engine.load(lambda: _expert_set("a", gen))
        b = await engine.load(lambda: _expert_set("b", gen))
        assert [n for _, n in prepared] == ["a", "b"]
        assert all(t.startswith("moegemm-load") for t, _ in prepared)
        x, _ = random_x(6, H, gen)
        ids, w = random_routing(6, G, 2, gen)
        for es in (a, b):
            await engine.submit(ffn_call(es, x, None, [6] + [0] * (G - 1)))
            await engine.submit(moe_call(es, x, None, ids, w))
        assert len(prepared) == 2 and not captured  # calls never capture
        assert _buffered_shapes(graphs) == {(G, H, I)}
        await engine.forget_experts(a)  # b keeps the shape: its buffers stay
        assert _buffered_shapes(graphs) == {(G, H, I)}
        await engine.forget_experts(b)
        assert not graphs._buffers

    try:
        asyncio.run(scenario())
    finally:
        engine.close()


def test_a_set_loading_while_the_last_of_its_shape_goes_keeps_the_shapes_graphs():
    """The last set of a shape deleted while a new set of that shape loads: the deletion's
    release runs on the loader after that load, and the new set keeps the shape's graphs
    and buffers, swapped in yet or not (the release used to judge by the sets loaded when
    the deletion came, and dropped them: the new set's calls then ran without graphs)."""
    gen = torch.Generator().manual_seed(torch.seed())
    engine = _engine(loop=True)
    _buffers_at_prepare(engine)
    graphs = engine._experts.graphs
    go = threading.Event()

    def held_back(name):
        go.wait(30)
        return _expert_set(name, gen)

    async def scenario():
        a = await engine.load(lambda: _expert_set("a", gen))
        x, _ = random_x(4, H, gen)
        await engine.submit(ffn_call(a, x, None, [4] + [0] * (G - 1)))
        assert _buffered_shapes(graphs) == {(G, H, I)}
        loading = asyncio.ensure_future(engine.load(lambda: held_back("b")))
        await asyncio.sleep(0.05)  # b's load holds the loader
        released = asyncio.ensure_future(engine.forget_experts(a))
        await asyncio.sleep(0.05)
        go.set()
        b = await loading
        await released
        assert _buffered_shapes(graphs) == {(G, H, I)}
        await engine.forget_experts(b)
        assert not graphs._buffers

    try:
        asyncio.run(scenario())
    finally:
        go.set()
        engine.close()


def test_zero_row_calls_answer_empty(es):
    engine = _engine(loop=True)
    none = torch.zeros((0, 2), dtype=torch.int64)
    calls = [ffn_call(es, torch.zeros((0, H), dtype=torch.bfloat16), None, [0] * G),
             moe_call(es, torch.zeros((0, H), dtype=torch.bfloat16), None, none, none.float())]
    for out in _answers(engine, calls):
        assert answer_rows(out, H).shape == (0, H)
