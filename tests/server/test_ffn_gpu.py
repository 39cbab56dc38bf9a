"""FfnGraphs on the GPU: SPEC 5.1 ``ffn`` and 5.2 ``moe`` in captured graphs.

Against the float64 chain (bound 3e-2): ragged groups with empty ones, M = 0,
1 and odd; top-k 1, 2 and 8, tokens whose experts are all empty but one;
calls past the largest bucket (chunks). Bit for bit: merged == unmerged,
graph == eager, int32 ids == int64 ids, the routing and combine kernels ==
their torch definitions. Bad routing is answered ``bad_routing`` and leaves
the next call's answer unchanged. Skipped without an NVIDIA GPU and triton.
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
    expert_set,
    ffn_float64,
    moe_float64,
    pooled_error,
    quantized,
    random_routing,
    random_x,
    repeats,
)
from moegemm.kernels import get_backend
from moegemm.kernels.testing import random_m_sizes, rel_error
from moegemm.server._ffn_graphs import FfnGraphs, combine_torch, route_torch
from moegemm.server._moe_route import combine, route

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
def graphs(backend):
    return FfnGraphs(backend, MAX_BUCKET)


@pytest.fixture(scope="module")
def eager(backend):
    return FfnGraphs(backend, MAX_BUCKET, graphs=False)


@pytest.fixture(scope="module")
def es(fp8):
    return expert_set(G, H, I, fp8, DEV, torch.Generator().manual_seed(torch.seed()))


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
    assert graphs.replays > 0


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


def test_route_and_combine_kernels_equal_their_torch_definitions():
    gen = _gen()
    for g, k, bucket, tokens in ((5, 2, 4, 3), (256, 8, 256, 200), (128, 8, 1, 1), (9, 6, 16, 11),
                                 (64, 1, 64, 64)):
        ids = torch.stack([torch.randperm(g, generator=gen)[:k] for _ in range(bucket)])
        ids = ids.reshape(-1)
        w = torch.rand(bucket * k, generator=gen)
        if tokens > 2:
            ids[k] = g + 3
            ids[2 * k] = -1
            w[k * (tokens - 1)] = float("nan")
        ids, w = ids.to(DEV), w.to(DEV)
        n = torch.tensor(tokens, device=DEV)
        got = []
        for fn in (route, route_torch):
            outs = (torch.full((g,), -5, dtype=torch.int64, device=DEV),
                    torch.full((bucket * k,), -5, dtype=torch.int64, device=DEV),
                    torch.full((bucket * k,), -5, dtype=torch.int64, device=DEV),
                    torch.tensor(-1, device=DEV),
                    torch.full((bucket,), 9, dtype=torch.int8, device=DEV))
            fn(ids, w, n, g, k, *outs)
            got.append(outs)
        for a, b in zip(*got):
            assert torch.equal(a, b), (g, k, bucket, tokens)
        y = torch.randn((bucket * k, 384), generator=gen).to(torch.bfloat16).to(DEV)
        pos, ww = got[0][1], w.nan_to_num()
        o1 = torch.zeros((bucket, 384), dtype=torch.bfloat16, device=DEV)
        o2 = o1.clone()
        combine(y, pos, ww, n, k, o1)
        combine_torch(y, pos, ww, n, k, o2)
        assert torch.equal(_bits(o1), _bits(o2))


def test_two_expert_sets_of_one_family_share_graphs(backend, fp8):
    gen = torch.Generator().manual_seed(torch.seed())
    runner = FfnGraphs(backend, 16)
    a, b = (expert_set(G, 512, 128, fp8, DEV, gen, name=n) for n in "ab")
    x, _ = random_x(16, 512, gen, None)
    sizes = random_m_sizes(G, 16, generator=gen).tolist()
    out_a = runner.ffn(a, x, None, sizes)
    count = runner.graph_count()
    out_b = runner.ffn(b, x, None, sizes)
    assert runner.graph_count() == count  # b replays a's graph through the weight tables
    xq, xsq = quantized(x, None, fp8)
    assert rel_error(out_a, ffn_float64(a, xq, xsq, sizes, fp8)) <= FFN_TOLERANCE
    assert rel_error(out_b, ffn_float64(b, xq, xsq, sizes, fp8)) <= FFN_TOLERANCE
    assert torch.equal(_bits(runner.ffn(a, x, None, sizes)), _bits(out_a))


def test_prepare_captures_every_bucket_ahead(backend, fp8):
    gen = torch.Generator().manual_seed(torch.seed())
    runner = FfnGraphs(backend, 8)
    es = expert_set(4, 256, 128, fp8, DEV, gen)
    # ffn: 4 buckets x 2 input kinds; moe top-2: tokens up to 4, 3 buckets x 2 kinds
    assert runner.prepare(es, top_ks=(2,)) == 14
    assert runner.prepare(es, top_ks=(2,)) == 0
    x, _ = random_x(3, 256, gen, None)
    ids, w = random_routing(3, 4, 2, gen)
    out = runner.moe(es, x, None, ids, w)
    assert runner.graph_count() == 14
    want = FfnGraphs(backend, 8, graphs=False).moe(es, x, None, ids, w)
    assert torch.equal(_bits(out), _bits(want))
