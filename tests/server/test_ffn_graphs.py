"""The expert executor and FfnGraphs on the CPU (the reference backend: eager, the
same code path) and the routing and combine kernels in Triton's interpreter.

Against the float64 chain (bound 3e-2) for ffn and moe, chunked calls equal
unchunked ones, merged calls equal alone ones bit for bit, bad routing and bad
rows get the contract's codes. In Triton's interpreter (a fresh process with
``TRITON_INTERPRET=1``): ``route`` and ``combine`` equal their torch
definitions bit for bit (int32 and int64 ids), and the GPU's path (rows padded
to buckets, the Triton steps, NaN in the GEMMs' rows of no expert) answers
what the CPU's path answers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ffn_support import (
    FFN_TOLERANCE,
    Runner,
    expert_set,
    ffn_float64,
    moe_float64,
    pooled_error,
    quantized,
    random_routing,
    random_x,
    repeats,
)
from moegemm.client._errors import NotFinite
from moegemm.kernels.reference import create as reference_backend
from moegemm.kernels.testing import random_m_sizes
from moegemm.server._graphs import LAUNCH_ALLOWANCE, allocated_bytes

FP8 = torch.float8_e4m3fn
G, H, I = 5, 512, 256


@pytest.fixture(scope="module")
def es():
    return expert_set(G, H, I, FP8, "cpu", torch.Generator().manual_seed(torch.seed()))


def _runner(max_bucket: int = 16) -> Runner:
    return Runner(reference_backend(torch.device("cpu")), max_bucket)


def test_a_shapes_buffers_go_with_the_last_set_prepared_for_it(es):
    """A family's buffers stay while any set prepared for its shape is not released, the
    tests' stand-in sets (no weak references) included; they go with the last one."""
    runner = _runner()
    other = expert_set(G, H, I, FP8, "cpu", torch.Generator().manual_seed(1), name="other")
    for s in (es, other):
        runner.prepare(s)
    graphs = runner.executor.graphs
    graphs.buffers(graphs.family(es, True))  # as a capture makes them (no graphs on the CPU)
    x, _ = random_x(3, H, torch.Generator().manual_seed(2))
    runner.ffn(es, x, None, [3] + [0] * (G - 1))
    assert {(f.G, f.H, f.I) for f in graphs._buffers} == {(G, H, I)}
    runner.executor.forget(es)
    assert graphs._buffers  # other has the shape
    runner.executor.forget(other)
    assert not graphs._buffers


def test_batches_of_families_nobody_prepared_hold_no_buffers(es):
    """Only a set's prepare (its captures) makes a family's static buffers. A batch of a
    family without them (a top-k with no graphs, any call on the CPU, the calls of a set
    deleted while they waited) runs on buffers of its own size, freed with it: a caller
    trying every top-k up to G cannot pile up device memory (each family's buffers are
    ``max_bucket_m`` rows of H)."""
    runner = _runner()
    runner.prepare(es)
    gen = torch.Generator().manual_seed(3)
    for k in range(1, G + 1):
        x, xs = random_x(2, H, gen, FP8 if k % 2 else None)
        ids, w = random_routing(2, G, k, gen)
        want = moe_float64(es, *quantized(x, xs, FP8), ids, w, FP8)
        assert pooled_error([(runner.moe(es, x, xs, ids, w), want)]) <= FFN_TOLERANCE
    x, _ = random_x(20, H, gen)  # 20 rows: chunks of the largest bucket (16)
    runner.ffn(es, x, None, random_m_sizes(G, 20, generator=gen).tolist())
    assert not runner.executor.graphs._buffers


def test_a_moe_familys_buffers_hold_its_tokens_rows_of_x():
    """A moe family's x (and scales) hold the tokens a launch takes, ``max_bucket_m / k``,
    not its routed rows: at the default bucket that is 1.8 GiB less for a DeepSeek-V3
    expert-set shape. The routed rows' buffers hold ``max_bucket_m`` rows."""
    graphs = _runner(64).executor.graphs
    for k, quantize in ((0, True), (0, False), (1, False), (2, True), (4, False)):
        family = graphs.family(SimpleNamespace(G=G, H=H, I=I), quantize, k)
        bufs = graphs.buffers(family)
        tokens = 64 // max(k, 1)
        assert bufs.units == tokens and bufs.x.shape == (tokens, H)
        assert bufs.x_scale is None if quantize else bufs.x_scale.shape == (tokens, H // 128)
        if k:
            assert bufs.ids.shape == bufs.pos.shape == bufs.src.shape == (64,)


def test_a_new_expert_shapes_graph_memory_is_its_buffers_and_largest_chain():
    """What a load of a new expert-set shape adds for its ffn and moe graphs: every captured
    family's static buffers at the largest bucket and the chain's temporaries over its rows,
    twice (the warm-up's and the capture's); nothing for a held shape or with graphs off."""
    graphs = _runner(64).executor.graphs
    shape = SimpleNamespace(G=G, H=H, I=I)
    assert not graphs.use_graphs and graphs.shape_bytes(shape, (1, 2)) == 0
    graphs.use_graphs = True  # the GPU's accounting, on the CPU's buffers
    made = 0
    for f in graphs.families(shape, (1, 2, G + 1)):  # a top-k past G captures nothing
        bufs = graphs._allocate(f)
        made += sum(allocated_bytes(t.nbytes) for t in vars(bufs).values()
                    if isinstance(t, torch.Tensor) and t is not bufs.meta_host)
    assert len(graphs.families(shape, (1, 2, G + 1))) == 6
    chain = H + H // 128 * 4 + 2 * I * 4 + I + I // 128 * 4 + 2 * H
    assert graphs.shape_bytes(shape, (1, 2, G + 1)) == made + 2 * 64 * chain + LAUNCH_ALLOWANCE
    graphs.buffers(graphs.family(shape, True, 2))
    assert graphs.shape_bytes(shape, (1, 2)) == 0


def test_ffn_meets_the_bound_and_chunks_agree(es):
    gen = torch.Generator().manual_seed(torch.seed())
    small, large = _runner(16), _runner(64)
    for m in (1, 7, 40):
        for fp8 in (None, FP8):
            pairs = []
            for _ in range(repeats(m)):
                x, xs = random_x(m, H, gen, fp8)
                sizes = random_m_sizes(G, m, generator=gen).tolist()
                out = small.ffn(es, x, xs, sizes)
                xq, xsq = quantized(x, xs, FP8)
                pairs.append((out, ffn_float64(es, xq, xsq, sizes, FP8)))
                if m > 16:
                    assert torch.equal(out, large.ffn(es, x, xs, sizes))
            assert pooled_error(pairs) <= FFN_TOLERANCE, (m, fp8)
    assert small.ffn(es, *random_x(0, H, gen), [0] * G).shape == (0, H)


def test_ffn_many_answers_each_call(es):
    gen = torch.Generator().manual_seed(torch.seed())
    runner = _runner()
    calls = [(random_x(m, H, gen)[0], None, random_m_sizes(G, m, generator=gen).tolist())
             for m in (3, 0, 6)]
    bad = random_x(2, H, gen)[0]
    bad[1, 0] = float("nan")
    calls.append((bad, None, [2] + [0] * (G - 1)))
    got = runner.ffn_many(es, calls)
    assert isinstance(got[3], NotFinite)
    pairs = []
    for out, (x, _, sizes) in zip(got[:3], calls):
        assert out.shape == (x.shape[0], H)
        if not x.shape[0]:
            continue
        xq, xsq = quantized(x, None, FP8)
        pairs.append((out, ffn_float64(es, xq, xsq, sizes, FP8)))
    assert pooled_error(pairs) <= FFN_TOLERANCE


@pytest.mark.parametrize("k", [1, 2, 4])
def test_moe_meets_the_bound(es, k):
    gen = torch.Generator().manual_seed(torch.seed())
    runner = _runner()
    for T in (1, 5, 11):  # 11 * 2 and 11 * 4 rows: chunks of the 16-row bucket
        pairs = []
        for _ in range(repeats(T)):
            x, xs = random_x(T, H, gen, FP8 if T == 5 else None)
            ids, w = random_routing(T, G, k, gen, dtype=torch.int32 if T == 1 else torch.int64)
            out = runner.moe(es, x, xs, ids, w)
            xq, xsq = quantized(x, xs, FP8)
            pairs.append((out, moe_float64(es, xq, xsq, ids, w, FP8)))
        assert pooled_error(pairs) <= FFN_TOLERANCE, (T, k)


def test_moe_edges(es):
    from moegemm.client._errors import BadShape

    gen = torch.Generator().manual_seed(torch.seed())
    runner = _runner()
    x, _ = random_x(3, H, gen)
    empty = torch.zeros((3, 0), dtype=torch.int64)
    with pytest.raises(BadShape):  # k = 0: no expert for any token is refused (1 <= k <= G)
        runner.moe(es, x, None, empty, empty.float())
    none = torch.zeros((0, 2), dtype=torch.int64)
    assert runner.moe(es, x[:0], None, none, none.float()).shape == (0, H)


def test_moe_bad_routing_and_bad_rows(es):
    gen = torch.Generator().manual_seed(torch.seed())
    runner = _runner()
    x, _ = random_x(4, H, gen)
    ids, w = random_routing(4, G, 2, gen)
    for b, bw in ((ids.clone().index_fill_(0, torch.tensor([3]), G), w),
                  (ids.clone().index_fill_(0, torch.tensor([0]), 1), w),
                  (ids, w.clone().index_fill_(0, torch.tensor([2]), float("nan")))):
        with pytest.raises(Exception) as info:
            runner.moe(es, x, None, b, bw)
        assert info.value.code == "bad_routing" and info.value.status == 400
    bad = x.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(NotFinite):
        runner.moe(es, bad, None, ids, w)


def ids_words(ids: torch.Tensor, wide: int) -> torch.Tensor:
    """Ids as the moe buffers hold them: int32 words, int64 ids as (low, high) pairs, the
    int32 ones in the first half (the rest stale)."""
    if wide:
        return ids.to(torch.int64).view(torch.int32).clone()
    words = torch.full((2 * ids.numel(),), 12345, dtype=torch.int32)
    words[: ids.numel()] = ids.to(torch.int32)
    return words


def _route_quantizes_as_torch(words, wide, w, n, g, k, bucket, src, gen, H=384) -> None:
    """``route`` with ``quantize`` gives route's words and ``gather_quantize``'s rows and flags
    (the torch definitions: ``quantize_activations(x[src])``, ``bad_rows(x)``), bit for bit,
    tokens holding NaN and Inf among them."""
    from moegemm.kernels import _triton_act, quantize_activations
    from moegemm.kernels._triton_route import quantize_scatter, route
    from moegemm.server._checks import bad_rows

    dev = words.device
    x = (torch.randn((bucket, H), generator=gen) * 8).to(torch.bfloat16).to(dev)
    x[bucket // 2, 5] = float("nan")
    x[bucket - 1, H - 1] = float("-inf")
    rows = bucket * k
    saved = _triton_act._FEW_ROWS
    try:  # a row wider than 16 blocks both ways (_triton_act.row_chunk): whole, and in chunks
        for few_rows in (saved, 0) if H > 16 * 128 else (saved,):
            _triton_act._FEW_ROWS = few_rows
            outs = (torch.full((g,), -5, dtype=torch.int64, device=dev),
                    torch.full((rows,), -5, dtype=torch.int64, device=dev),
                    torch.full((rows,), -5, dtype=torch.int64, device=dev), torch.tensor(-1, device=dev),
                    torch.full((bucket,), 9, dtype=torch.int8, device=dev))
            xq = torch.full((rows, H), 0x55, dtype=torch.uint8, device=dev).view(FP8)
            xs = torch.full((rows, H // 128), -7.0, device=dev)
            x_flags = torch.full((bucket,), 9, dtype=torch.int8, device=dev)
            route(words, wide, w, n, g, k, *outs, quantize=(x, (xq, xs), x_flags))
            assert torch.equal(outs[2], src)
            want_q, want_s = quantize_activations(x[src], FP8)
            assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(xs.view(torch.int32), want_s.view(torch.int32))  # NaN scales too
            assert torch.equal(x_flags.cpu(), bad_rows(x.cpu(), None))
            # Past the routing's few rows: each token quantized once, stored at its k rows (pos).
            xq.view(torch.uint8).fill_(0x55)
            xs.fill_(-7.0)
            x_flags.fill_(9)
            quantize_scatter(x, outs[1], k, x_flags, (xq, xs))
            assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(xs.view(torch.int32), want_s.view(torch.int32))
            assert torch.equal(x_flags.cpu(), bad_rows(x.cpu(), None))
    finally:
        _triton_act._FEW_ROWS = saved


def compare_kernels_on_cpu() -> None:
    from moegemm.kernels._triton_route import combine, route
    from moegemm.server._ffn_graphs import combine_torch, route_torch

    gen = torch.Generator().manual_seed(0)
    for g, k, bucket, tokens, wide in ((5, 2, 4, 3, 1), (7, 3, 8, 8, 0), (16, 8, 16, 11, 1),
                                       (3, 1, 1, 1, 0), (9, 6, 4, 2, 1), (9, 6, 4, 3, 0)):
        ids = torch.stack([torch.randperm(g, generator=gen)[:k] for _ in range(bucket)])
        ids = ids.reshape(-1)
        w = torch.rand(bucket * k, generator=gen)
        if tokens > 2:
            ids[k], ids[2 * k] = g + 3, -1
            if k > 1:
                ids[2 * k + 1] = ids[2 * k]
            w[min(tokens - 1, 3) * k] = float("nan")
        if wide and tokens > 2:  # int64 ids past int32: refused, never read as their low word
            ids[0] = (1 << 32) + 1
            ids[min(tokens - 1, 2) * k] = -(1 << 40)
        words = ids_words(ids, wide)
        n = torch.tensor(tokens)
        got = []
        for fn in (route, route_torch):
            outs = (torch.full((g,), -5, dtype=torch.int64),
                    torch.full((bucket * k,), -5, dtype=torch.int64),
                    torch.full((bucket * k,), -5, dtype=torch.int64), torch.tensor(-1),
                    torch.full((bucket,), 9, dtype=torch.int8))
            fn(words, torch.tensor(wide), w, n, g, k, *outs)
            got.append(outs)
        for a, b in zip(*got):
            assert torch.equal(a, b), (g, k, bucket, tokens, a, b)
        # H 2176: in chunks, a row is quantized in three (_triton_act.row_chunk), its NaN in
        # the first and its -Inf in the last
        _route_quantizes_as_torch(words, torch.tensor(wide), w, n, g, k, bucket, got[0][2], gen,
                                  H=2176 if g == 9 else 384)
        if wide and tokens > 2:
            assert got[0][4][0] == 1
        assert got[0][4][: min(tokens, 4)].tolist()[1:] == [1] * (min(tokens, 4) - 1) \
            if tokens > 2 else True
        y = torch.randn((bucket * k, 256), generator=gen).to(torch.bfloat16)
        o1 = torch.zeros((bucket, 256), dtype=torch.bfloat16)
        o2 = o1.clone()
        combine(y, got[0][1], w.nan_to_num(), n, k, o1)
        combine_torch(y, got[0][1], w.nan_to_num(), n, k, o2)
        assert torch.equal(o1.view(torch.int16), o2.view(torch.int16))


def test_route_and_combine_in_the_triton_interpreter():
    pytest.importorskip("triton")
    here = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_ffn_graphs; " \
           "test_ffn_graphs.compare_kernels_on_cpu()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


class _EagerGraph:
    """Stands in for a captured graph on the CPU: its replay runs the same body eagerly."""

    def __init__(self, steps, family, launched, es) -> None:
        self.steps, self.family, self.launched, self.es = steps, family, launched, es

    def replay(self) -> None:
        self.steps._body(self.steps.buffers(self.family), self.es, self.launched)


def _padded_runner(graph_path: bool) -> Runner:
    """A CPU runner on the GPU's steps (rows padded to buckets, the Triton kernels in the
    interpreter; the GEMM the reference on the live rows, NaN past them: rows of no expert
    must never reach an answer). ``graph_path``: "graphs" that replay the body eagerly, so
    calls take the executor's graph path (driver-copy staging, the launch's words)."""
    from moegemm.kernels._triton_act import gather_quantize_triton, silu_mul_quant_triton
    from moegemm.kernels._triton_prologue import check_and_gather
    from moegemm.kernels._triton_route import combine, quantize_scatter, route
    from moegemm.kernels.reference import grouped_gemm

    runner = _runner()
    steps = runner.graphs
    steps.pad_to_bucket = True
    steps.check_and_gather = check_and_gather
    steps._act = lambda h, rows: silu_mul_quant_triton(h, FP8, rows=rows)
    steps._route, steps._combine = route, combine
    steps._quantize_scatter = quantize_scatter
    steps._gather_quant = gather_quantize_triton

    def gemm(xq, xs, table, ws, m_sizes, out):
        n = int(m_sizes.sum())
        out.fill_(float("nan"))
        grouped_gemm(xq[:n], ws.wq, xs[:n], ws.w_scale, m_sizes, out[:n])

    steps._gemm = gemm
    if graph_path:
        steps.graph = lambda f, launched, es: _EagerGraph(steps, f, launched, es)
        steps.held = steps.buffers  # every family "prepared": its static buffers made on use
    return runner


def compare_padded_path_on_cpu() -> None:
    """The GPU's paths equal the CPU's bit for bit: the general path on padded rows, and the
    graph path (each caller's bytes copied to their place, the words, one download),
    merged or alone, int32 or int64 ids."""
    gen = torch.Generator().manual_seed(0)
    es = expert_set(G, 256, 256, FP8, "cpu", gen)
    plain, padded, fast = _runner(), _padded_runner(False), _padded_runner(True)

    def same(a, b):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))

    for m, kind in ((3, None), (7, FP8), (20, None), (16, FP8)):  # 20: chunks of 16
        x, xs = random_x(m, 256, gen, kind)
        sizes = random_m_sizes(G, m, generator=gen).tolist()
        want = plain.ffn(es, x, xs, sizes)
        assert same(want, padded.ffn(es, x, xs, sizes)), (m, kind)
        assert same(want, fast.ffn(es, x, xs, sizes)), (m, kind)
    calls = [(random_x(m, 256, gen)[0], None, random_m_sizes(G, m, generator=gen).tolist())
             for m in (3, 2, 5, 1)]
    for a, b, c in zip(plain.ffn_many(es, calls), padded.ffn_many(es, calls),
                       fast.ffn_many(es, calls)):
        assert same(a, b) and same(a, c)
    assert fast.launches[-1].graph == 1  # the four merged into one "replay"
    for T, k, kind in ((1, 1, None), (3, 2, FP8), (6, 4, None)):
        x, xs = random_x(T, 256, gen, kind)
        ids, w = random_routing(T, G, k, gen)
        want = plain.moe(es, x, xs, ids, w)
        for runner in (padded, fast):
            assert same(want, runner.moe(es, x, xs, ids, w)), (T, k)
            assert same(want, runner.moe(es, x, xs, ids.to(torch.int32), w)), (T, k)
    ids[0, 0] = G
    for runner in (plain, padded, fast):
        with pytest.raises(Exception) as info:
            runner.moe(es, x, xs, ids, w)
        assert info.value.code == "bad_routing"
    moe_calls = []
    for T in (2, 1, 3):
        x, _ = random_x(T, 256, gen)
        moe_calls.append((x, None, *random_routing(T, G, 2, gen, dtype=torch.int32)))
    bad = moe_calls[1][2].clone()
    bad[0, 1] = G
    moe_calls.append((moe_calls[1][0], None, bad, moe_calls[1][3]))
    wants = plain.moe_many(es, moe_calls)
    gots = fast.moe_many(es, moe_calls)
    assert fast.launches[-1].graph == 1
    for a, b in zip(wants[:3], gots[:3]):
        assert same(a, b)
    assert wants[3].code == gots[3].code == "bad_routing"


def test_the_padded_triton_path_in_the_interpreter():
    pytest.importorskip("triton")
    here = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_ffn_graphs; " \
           "test_ffn_graphs.compare_padded_path_on_cpu()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=False, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]



def test_only_the_familys_own_buffers_replay_its_graphs(es):
    """As the gemm pool's: a batch on buffers of its own runs eagerly on them, whatever
    graph the family has meanwhile; its static buffers replay it."""
    graphs = _runner().executor.graphs
    f = graphs.family(es, True)
    replays = []

    class Stand:
        def replay(self):
            replays.append(1)

    graphs._graphs[graphs._graph_key(f, 4, es)] = Stand()
    own = graphs.batch_buffers(f, 4)
    own.meta[0] = 4  # the four rows in the first expert (the rest of the words as made)
    assert graphs.launch(own, es, 4) == "eager" and not replays
    static = graphs.buffers(f)
    assert graphs.launch(own, es, 4) == "eager" and not replays
    assert graphs.launch(static, es, 4) == "graph" and replays == [1]
