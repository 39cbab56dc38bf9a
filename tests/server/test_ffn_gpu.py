"""The expert executor and FfnGraphs on the GPU: SPEC 5.1 ``ffn`` and 5.2 ``moe`` in
graphs captured when the set is prepared (as the engine's loader does at load).

Against the float64 chain (bound 3e-2): ragged groups with empty ones, M = 0,
1 and odd; top-k 1, 2 and 8, tokens whose experts are all empty but one;
calls past the largest bucket (chunks). Bit for bit: merged == unmerged (also
where the GEMMs' tile changes with the bucket, and through the engine), graph
== eager, int32 ids == int64 ids, the routing and combine kernels == their
torch definitions. No call captures a graph. Bad routing is answered
``bad_routing`` and leaves the next call's answer unchanged. Skipped without
an NVIDIA GPU and triton.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.version.hip:
    pytest.skip("needs an NVIDIA CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from ffn_support import (
    FFN_TOLERANCE,
    Runner,
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
    repeats,
)
from moegemm.kernels import get_backend
from moegemm.kernels._triton_route import combine, route
from moegemm.kernels.testing import random_m_sizes, rel_error
from moegemm.server._ffn_graphs import combine_torch, route_torch
from moegemm.server._graphs import LAUNCH_ALLOWANCE
from test_ffn_graphs import _route_quantizes_as_torch, ids_words

DEV = torch.device("cuda")
G, H, I = 8, 1024, 256
MAX_BUCKET = 64


@pytest.fixture(scope="module")
def backend():
    return get_backend(DEV)


@pytest.fixture(scope="module")
def fp8(backend):
    return backend.fp8_dtype


@pytest.fixture(scope="module")
def es(fp8):
    return expert_set(G, H, I, fp8, DEV, torch.Generator().manual_seed(torch.seed()))


@pytest.fixture(scope="module")
def graphs(backend, es):
    runner = Runner(backend, MAX_BUCKET)
    assert runner.prepare(es) > 0  # what the engine's loader does when a set loads
    return runner


@pytest.fixture(scope="module")
def eager(backend):
    return Runner(backend, MAX_BUCKET, graphs=False)


def _gen():
    return torch.Generator().manual_seed(torch.seed())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_ffn_meets_the_bound(graphs, es, fp8, kind):
    gen = _gen()
    for m in (1, 7, 63, 83, 150):  # 83 and 150: past the largest bucket, in chunks
        pairs = []
        for _ in range(repeats(m)):
            x, xs = random_x(m, H, gen, None if kind == "bf16" else fp8)
            sizes = random_m_sizes(G, m, generator=gen).tolist()
            out = graphs.ffn(es, x, xs, sizes)
            assert out.shape == (m, H) and out.dtype == torch.bfloat16
            assert out.device.type == "cpu"
            xq, xsq = quantized(x, xs, fp8)
            pairs.append((out, ffn_float64(es, xq, xsq, sizes, fp8)))
        assert pooled_error(pairs) <= FFN_TOLERANCE, m
    out = graphs.ffn(es, *random_x(0, H, gen, None if kind == "bf16" else fp8), [0] * G)
    assert out.shape == (0, H)
    assert graphs.graphs.replays > 0


def test_ffn_merged_equals_unmerged_and_graph_equals_eager(graphs, eager, es, fp8):
    gen = _gen()
    calls = []
    for m in (3, 0, 17, 1, 30):
        x, xs = random_x(m, H, gen, fp8)
        calls.append((x, xs, random_m_sizes(G, m, generator=gen).tolist()))
    merged = graphs.ffn_many(es, calls)
    for got, call in zip(merged, calls):
        alone = graphs.ffn(es, *call)
        assert torch.equal(_bits(got), _bits(alone))
        assert torch.equal(_bits(alone), _bits(eager.ffn(es, *call)))
    # Past the largest bucket: chunks, merged or not.
    big = [(random_x(m, H, gen, None)[0], None, random_m_sizes(G, m, generator=gen).tolist())
           for m in (40, 50)]
    for got, call in zip(graphs.ffn_many(es, big), big):
        assert torch.equal(_bits(got), _bits(graphs.ffn(es, *call)))


def test_ffn_bad_rows_are_refused_alone(graphs, es, fp8):
    from moegemm.client._errors import NotFinite

    gen = _gen()
    good = random_x(5, H, gen, None)[0], None, [5] + [0] * (G - 1)
    bad_x = random_x(4, H, gen, None)[0]
    bad_x[2, 9] = float("nan")
    got = graphs.ffn_many(es, [good, (bad_x, None, [0, 4] + [0] * (G - 2))])
    assert isinstance(got[1], NotFinite)
    assert torch.equal(_bits(got[0]), _bits(graphs.ffn(es, *good)))


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_moe_meets_the_bound(graphs, es, fp8, k, kind):
    gen = _gen()
    for T in (1, 5, 8, 37):  # 37 * 2 and 37 * 8 rows: past the largest bucket
        pairs = []
        for _ in range(repeats(T)):
            x, xs = random_x(T, H, gen, None if kind == "bf16" else fp8)
            ids, w = random_routing(T, G, k, gen)
            out = graphs.moe(es, x, xs, ids, w)
            assert out.shape == (T, H) and out.dtype == torch.bfloat16
            xq, xsq = quantized(x, xs, fp8)
            pairs.append((out, moe_float64(es, xq, xsq, ids, w, fp8)))
        assert pooled_error(pairs) <= FFN_TOLERANCE, (T, k)


@pytest.mark.parametrize("k", [1, 8])
def test_moe_with_all_experts_empty_but_k(graphs, eager, es, fp8, k):
    gen = _gen()
    x, _ = random_x(16, H, gen, None)
    ids, w = random_routing(16, G, k, gen, experts=[3] if k == 1 else list(range(G)))
    if k == 1:
        assert (ids == 3).all()
    out = graphs.moe(es, x, None, ids, w)
    xq, xsq = quantized(x, None, fp8)
    assert rel_error(out, moe_float64(es, xq, xsq, ids, w, fp8)) <= FFN_TOLERANCE
    assert torch.equal(_bits(out), _bits(eager.moe(es, x, None, ids, w)))
    assert torch.equal(_bits(out), _bits(graphs.moe(es, x, None, ids.to(torch.int32), w)))


def test_moe_graph_equals_eager(graphs, eager, es, fp8):
    gen = _gen()
    for T, k in ((1, 2), (13, 2), (6, 8), (33, 2)):
        x, xs = random_x(T, H, gen, fp8)
        ids, w = random_routing(T, G, k, gen)
        assert torch.equal(_bits(graphs.moe(es, x, xs, ids, w)), _bits(eager.moe(es, x, xs, ids, w)))
    none = torch.zeros((0, 2), dtype=torch.int64)
    assert graphs.moe(es, *random_x(0, H, gen, fp8), none, none.float()).shape == (0, H)


def test_bad_routing_is_refused_and_changes_nothing(graphs, es, fp8):
    from moegemm.client._errors import NotFinite

    gen = _gen()
    T, k = 6, 2
    x, _ = random_x(T, H, gen, None)
    ids, w = random_routing(T, G, k, gen)
    want = graphs.moe(es, x, None, ids, w)
    cases = []
    for bad in (G, -1, 2**40, -(2**62)):
        b = ids.clone()
        b[T - 1, 1] = bad
        cases.append((b, w))
    dup = ids.clone()
    dup[2, 1] = dup[2, 0]
    cases.append((dup, w))
    for value in (float("nan"), float("inf"), -float("inf")):
        bw = w.clone()
        bw[0, 0] = value
        cases.append((ids, bw))
    for b, bw in cases:
        with pytest.raises(Exception) as info:
            graphs.moe(es, x, None, b, bw)
        assert getattr(info.value, "code", None) == "bad_routing", (b, bw)
        assert info.value.status == 400
        assert torch.equal(_bits(graphs.moe(es, x, None, ids, w)), _bits(want))
    bad_x = x.clone()
    bad_x[1, 3] = float("inf")
    with pytest.raises(NotFinite):
        graphs.moe(es, bad_x, None, ids, w)
    assert torch.equal(_bits(graphs.moe(es, x, None, ids, w)), _bits(want))


def test_a_new_expert_shapes_graph_memory_is_within_its_estimate(backend, fp8):
    """What the store counts for a new expert-set shape's ffn and moe graphs
    (``FfnGraphs.shape_bytes``: the static buffers and the largest launch's chain twice, the
    warm-up's and the capture's) covers what its graphs hold after the load: the static
    buffers and their pool, which holds the chain and what the families' captures leave
    fragmented (H100, session 57: 344 MB held against 179 static and 127 of chain)."""
    from server_support import device_held

    g, h, i, max_bucket = 8, 1024, 512, 16384
    es = expert_set(g, h, i, fp8, DEV, _gen())
    runner = Runner(backend, max_bucket, top_ks=(2,))
    estimate = runner.graphs.shape_bytes(es, (2,))
    chain = max_bucket * (h + h // 128 * 4 + 2 * i * 4 + i + i // 128 * 4 + 2 * h)
    static = estimate - 2 * chain - LAUNCH_ALLOWANCE
    before = device_held()
    runner.prepare(es)
    grown = device_held() - before
    assert static + chain <= grown <= estimate, (grown, static, chain)
    assert runner.graphs.shape_bytes(es, (2,)) == 0


def test_route_and_combine_kernels_equal_their_torch_definitions():
    gen = _gen()
    for g, k, bucket, tokens, wide in ((5, 2, 4, 3, 1), (256, 8, 256, 200, 0), (128, 8, 1, 1, 1),
                                       (9, 6, 16, 11, 0), (64, 1, 64, 64, 1), (64, 1, 64, 60, 0)):
        ids = torch.stack([torch.randperm(g, generator=gen)[:k] for _ in range(bucket)])
        ids = ids.reshape(-1)
        w = torch.rand(bucket * k, generator=gen)
        if tokens > 2:
            ids[k] = g + 3
            ids[2 * k] = -1
            w[k * (tokens - 1)] = float("nan")
            if wide:
                ids[0] = (1 << 32) + 1  # its low word is a valid id: must still be refused
        words, w = ids_words(ids, wide).to(DEV), w.to(DEV)
        n = torch.tensor(tokens, device=DEV)
        got = []
        for fn in (route, route_torch):
            outs = (torch.full((g,), -5, dtype=torch.int64, device=DEV),
                    torch.full((bucket * k,), -5, dtype=torch.int64, device=DEV),
                    torch.full((bucket * k,), -5, dtype=torch.int64, device=DEV),
                    torch.tensor(-1, device=DEV),
                    torch.full((bucket,), 9, dtype=torch.int8, device=DEV))
            fn(words, torch.tensor(wide, device=DEV), w, n, g, k, *outs)
            got.append(outs)
        for a, b in zip(*got):
            assert torch.equal(a, b), (g, k, bucket, tokens)
        _route_quantizes_as_torch(words, torch.tensor(wide, device=DEV), w, n, g, k, bucket,
                                  got[0][2], gen, H=7168 if g == 256 else 384)
        y = torch.randn((bucket * k, 384), generator=gen).to(torch.bfloat16).to(DEV)
        pos, ww = got[0][1], w.nan_to_num()
        o1 = torch.zeros((bucket, 384), dtype=torch.bfloat16, device=DEV)
        o2 = o1.clone()
        combine(y, pos, ww, n, k, o1)
        combine_torch(y, pos, ww, n, k, o2)
        assert torch.equal(_bits(o1), _bits(o2))


def test_two_expert_sets_of_one_family_share_graphs(backend, fp8):
    gen = torch.Generator().manual_seed(torch.seed())
    runner = Runner(backend, 16)
    a, b = (expert_set(G, 512, 128, fp8, DEV, gen, name=n) for n in "ab")
    assert runner.prepare(a) > 0
    assert runner.prepare(b) == 0  # b replays a's graphs through the address words
    x, _ = random_x(16, 512, gen, None)
    sizes = random_m_sizes(G, 16, generator=gen).tolist()
    out_a = runner.ffn(a, x, None, sizes)
    out_b = runner.ffn(b, x, None, sizes)
    assert runner.graphs.captures == runner.graphs.graph_count()  # none on the calls
    xq, xsq = quantized(x, None, fp8)
    assert rel_error(out_a, ffn_float64(a, xq, xsq, sizes, fp8)) <= FFN_TOLERANCE
    assert rel_error(out_b, ffn_float64(b, xq, xsq, sizes, fp8)) <= FFN_TOLERANCE
    assert torch.equal(_bits(runner.ffn(a, x, None, sizes)), _bits(out_a))


def test_prepare_captures_every_bucket_ahead(backend, fp8):
    gen = torch.Generator().manual_seed(torch.seed())
    runner = Runner(backend, 8, top_ks=(2,))
    es = expert_set(4, 256, 128, fp8, DEV, gen)
    # ffn: 4 buckets x 2 input kinds; moe top-2: tokens up to 4, 3 buckets x 2 kinds
    assert runner.prepare(es) == 14
    assert runner.prepare(es) == 0
    x, _ = random_x(3, 256, gen, None)
    ids, w = random_routing(3, 4, 2, gen)
    out = runner.moe(es, x, None, ids, w)
    assert runner.graphs.graph_count() == 14 and runner.graphs.eager_runs == 0
    want = Runner(backend, 8, graphs=False).moe(es, x, None, ids, w)
    assert torch.equal(_bits(out), _bits(want))
    # A top-k with no graphs runs eagerly, on the same kernels: the same bits. Top-3 in an
    # 8-row bucket holds 2 tokens a launch: the 3 tokens take two eager launches.
    ids3, w3 = random_routing(3, 4, 3, gen)
    got = runner.moe(es, x, None, ids3, w3)
    assert runner.graphs.eager_runs == 2 and runner.graphs.graph_count() == 14
    # ... on buffers of its own, gone with the batch: only prepared families hold any.
    assert {f.top_k for f in runner.graphs._buffers} == {0, 2}
    assert torch.equal(_bits(got), _bits(Runner(backend, 8, graphs=False).moe(es, x, None, ids3,
                                                                              w3)))


def test_merged_equals_alone_where_the_tile_changes_with_m(backend, fp8):
    """G=8, H=4096: the w13 GEMM runs split-K decode tiles for buckets up to 256 rows and the
    persistent tile at 512 (no split: other sums), so a 200-row call must never share a
    512-row bucket; where buckets share tiles, merged calls equal alone ones bit for bit. The
    control: forced into one batch, two 200-row calls do not."""
    gen = torch.Generator().manual_seed(torch.seed())
    g, h, i = 8, 4096, 256
    runner = Runner(backend, 512)
    es = expert_set(g, h, i, fp8, DEV, gen)
    assert runner.prepare(es) > 0
    tile = backend.tile_key
    assert tile(256, 2 * i, h, g, torch.float32) != tile(512, 2 * i, h, g, torch.float32)
    ex = runner.executor

    def calls_of(rows):
        out = []
        for m in rows:
            x, xs = random_x(m, h, gen, fp8)
            out.append((x, xs, random_m_sizes(g, m, generator=gen).tolist()))
        return out

    big = calls_of([200, 200])
    made = [ffn_call(es, *c) for c in big]
    assert ex.batch_rows(made[0]) == 256  # the run of 200 rows' tiles ends at 256
    alone = [runner.ffn(es, *c) for c in big]
    forced = runner.run(es, made)
    assert not all(torch.equal(_bits(a), _bits(f)) for a, f in zip(alone, forced))
    small = calls_of([20, 30, 5, 7, 50])  # buckets of 8 to 64 rows: one run of tiles
    made = [ffn_call(es, *c) for c in small]
    assert len({ex.batch_key(c) for c in made}) == 1
    merged = runner.ffn_many(es, small)
    assert runner.launches[-1].graph == 1  # one launch for the five
    for got, call in zip(merged, small):
        assert torch.equal(_bits(got), _bits(runner.ffn(es, *call)))
    for got, call in zip(runner.ffn_many(es, big + small), big + small):  # by key, as the engine
        assert torch.equal(_bits(got), _bits(runner.ffn(es, *call)))
    assert runner.graphs.eager_runs == 0 and runner.graphs.captures == runner.graphs.graph_count()


def test_the_engine_merges_expert_calls_from_graphs_captured_at_load(backend, fp8):
    """Through ``Engine.submit`` on the GPU: the set's graphs are captured by ``load`` on the
    loader thread; concurrent small calls merge on the event loop's thread; every answer
    equals the call alone, bit for bit; no call captures or runs eagerly."""
    import asyncio
    import threading

    from moegemm.server.engine import Engine
    from moegemm.server.experts import ExpertSet

    gen = torch.Generator().manual_seed(torch.seed())
    ns = expert_set(G, H, I, fp8, DEV, gen, name="eng")
    es = ExpertSet(name="eng", G=G, H=H, I=I, w13=ns.w13, w2=ns.w2, created="", source="test")
    engine = Engine(backend, max_bucket_m=MAX_BUCKET)
    engine.start()
    graphs = engine._experts.graphs
    seen = []
    real = engine._experts.run_calls
    engine._experts.run_calls = lambda s, batch: seen.append(
        (threading.current_thread() is threading.main_thread(), len(batch))) or real(s, batch)
    raw_ffn = [random_x(m, H, gen, fp8 if m % 2 else None) + (random_m_sizes(G, m, generator=gen)
                                                               .tolist(),) for m in (1, 5, 9, 16, 3)]
    raw_moe = []
    for T in (1, 3, 4, 2):
        x, xs = random_x(T, H, gen, None)
        raw_moe.append((x, xs, *random_routing(T, G, 2, gen, dtype=torch.int32)))

    def calls():
        return [ffn_call(es, *r) for r in raw_ffn] + [moe_call(es, *r) for r in raw_moe]

    async def scenario():
        await engine.load(lambda: es)
        captured = graphs.captures
        assert captured > 0 and graphs.graph_count() == captured
        alone = [await engine.submit(c, alone=True) for c in calls()]
        together = await asyncio.gather(*(engine.submit(c) for c in calls()))
        assert graphs.captures == captured and graphs.eager_runs == 0
        return alone, together

    try:
        alone, together = asyncio.run(scenario())
    finally:
        engine.close()
    for a, b in zip(alone, together):
        assert torch.equal(_bits(answer_rows(a, H)), _bits(answer_rows(b, H)))
    assert any(n > 1 for _, n in seen) and all(on_loop for on_loop, _ in seen)
