"""The graph pool and executor on the CPU: eager, same code path as the GPU.

Every call goes through staging, merging, chunking and the pool's static
buffers; the results must meet the SPEC tolerance against the float64 oracle
for each caller separately.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from moegemm.kernels import quantize_activations, reference_float64
from moegemm.kernels._backend import weight_addresses
from moegemm.kernels.reference import create as reference_backend
from moegemm.kernels.testing import SPEC_TOLERANCE, random_m_sizes, random_problem, rel_error
from moegemm.server._executor import Executor, chunk_sizes
from moegemm.server._graphs import (
    LAUNCH_ALLOWANCE,
    Family,
    GraphPool,
    allocated_bytes,
    bucket_for,
    buckets_up_to,
    fill_addresses,
)
from moegemm.server._staging import Staging
from server_support import bf16_rows, gemm_call

N, K, G = 256, 256, 5


def _executor(max_bucket: int = 64) -> Executor:
    backend = reference_backend(torch.device("cpu"))
    return Executor(GraphPool(backend, max_bucket, graphs=True), Staging(backend.device))


def _weights(gen: torch.Generator):
    p = random_problem(1, N, K, G, generator=gen)
    return SimpleNamespace(name="w", G=G, N=N, K=K, wq=p.wq, w_scale=p.w_scale)


def Part(x, x_scale, m_sizes):
    """A call's tensors (validated against its weight set by ``_run``)."""
    return (x, x_scale, list(m_sizes))


def _fp8_part(ws, m: int, gen: torch.Generator):
    p = random_problem(m, N, K, G, generator=gen)
    return Part(p.xq, p.x_scale, random_m_sizes(G, m, generator=gen).tolist())


def _run(ex: Executor, ws, parts):
    """``Executor.run`` on validated calls of these parts: (bf16 outs, flags, launches)."""
    calls = [gemm_call(ws, *part) for part in parts]
    ex.staging.enter()
    results, launches = ex.run(ws, calls)
    return [bf16_rows(out) for out, _ in results], [f for _, f in results], launches


def _check(ws, part, out: torch.Tensor) -> None:
    x, xs, m_sizes = part
    xq = x
    if xs is None:
        xq, xs = quantize_activations(x, torch.float8_e4m3fn)
    ref = reference_float64(xq, ws.wq, xs, ws.w_scale, torch.tensor(m_sizes))
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    if out.shape[0]:
        assert rel_error(out, ref) <= SPEC_TOLERANCE


def test_buckets():
    assert buckets_up_to(8) == [1, 2, 4, 8]
    assert [bucket_for(r, [1, 2, 4, 8]) for r in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError):
        bucket_for(9, [1, 2, 4, 8])


def test_chunk_sizes_cover_each_group_once():
    gen = torch.Generator().manual_seed(torch.seed())
    sizes = random_m_sizes(7, 201, generator=gen).numpy()
    chunks = [chunk_sizes(sizes, a, min(201, a + 32)) for a in range(0, 201, 32)]
    assert all(c.sum() == min(32, 201 - a) for c, a in zip(chunks, range(0, 201, 32)))
    assert (sum(chunks) == sizes).all()


def test_single_fp8_call_on_the_cpu():
    gen = torch.Generator().manual_seed(torch.seed())
    ex, ws = _executor(), _weights(gen)
    part = _fp8_part(ws, 37, gen)
    [out], [flags], launches = _run(ex, ws, [part])
    assert flags.shape == (out.shape[0],) and not flags.any()
    _check(ws, part, out)
    assert (launches.graph, launches.eager) == (0, 1)  # no graphs on a CPU
    assert ex.pool.use_graphs is False


@pytest.mark.parametrize("rows", [[3, 0, 17, 1], [64], [50, 50, 29]])
def test_merged_and_chunked_calls_each_get_their_rows(rows):
    gen = torch.Generator().manual_seed(torch.seed())
    ex, ws = _executor(max_bucket=32), _weights(gen)
    parts = [_fp8_part(ws, m, gen) for m in rows]
    outs, flags, launches = _run(ex, ws, parts)
    assert [f.shape[0] for f in flags] == [o.shape[0] for o in outs]
    assert not any(f.any() for f in flags)
    assert launches.eager == -(-sum(rows) // 32)  # ceil: chunks of the largest bucket
    for part, out in zip(parts, outs):
        _check(ws, part, out)


def test_mixed_input_dtypes_in_one_batch():
    gen = torch.Generator().manual_seed(torch.seed())
    ex, ws = _executor(), _weights(gen)
    fp8 = _fp8_part(ws, 9, gen)
    # fnuz -> fn is exact only at or above 2^-6 (SPEC 1.2; halved below): keep
    # the fp8 part clear of tiny values so the fnuz twin must match it bit for bit.
    x8, xs8, sizes8 = fp8
    tiny = x8.float().abs() < 2**-5
    fp8 = Part(x8.float().masked_fill(tiny, 0).to(x8.dtype), xs8, sizes8)
    parts = [fp8]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(11, K, generator=gen).to(dtype)
        parts.append(Part(x, None, random_m_sizes(G, 11, generator=gen).tolist()))
    # fnuz input: the server converts it to the device's fn format (SPEC 1.2).
    xq_fnuz = (fp8[0].float() * 0.5).to(torch.float8_e4m3fnuz)
    parts.append(Part(xq_fnuz, xs8 * 2, sizes8))
    # One batch is one input dtype (the engine groups them): each runs on its own.
    outs = [_run(ex, ws, [part])[0][0] for part in parts]
    for part, out in zip(parts[:4], outs[:4]):
        _check(ws, part, out)
    torch.testing.assert_close(outs[4], outs[0], rtol=0, atol=0)


def test_empty_call_beside_others():
    gen = torch.Generator().manual_seed(torch.seed())
    ex, ws = _executor(), _weights(gen)
    empty = Part(torch.empty(0, K, dtype=torch.float8_e4m3fn), torch.empty(0, K // 128), [0] * G)
    parts = [empty, _fp8_part(ws, 6, gen)]
    outs, flags, _ = _run(ex, ws, parts)
    assert outs[0].shape == (0, N) and flags[0].shape == (0,)
    _check(ws, parts[1], outs[1])


def test_static_buffers_come_from_captures_alone_and_go_with_their_shape():
    """A family's static buffers are made by its captures (one per family, shared by its
    sets) and go when its shape is released; an eager batch without them (the CPU: no
    captures) runs on buffers of its own size, so none stay between batches."""
    gen = torch.Generator().manual_seed(torch.seed())
    ex = _executor()
    a, b = _weights(gen), _weights(gen)
    parts = [_fp8_part(a, 5, gen)], [_fp8_part(b, 40, gen)], [_fp8_part(b, 70, gen)]
    for ws, part in zip((a, b, b), parts):  # (70 rows: two launches of the 64-row bucket)
        _check(ws, part[0], _run(ex, ws, part)[0][0])
    assert not ex.pool._buffers
    family = Family(G, N, K, quantize=False)
    bufs = ex.pool.buffers(family)  # as a capture makes them
    for ws, part in zip((a, b, b), parts):
        _check(ws, part[0], _run(ex, ws, part)[0][0])
    assert ex.pool._buffers == {family: bufs}
    ex.release(G, N, K)
    assert not ex.pool._buffers and not ex._routes


def test_a_new_shapes_graph_memory_is_its_buffers_and_largest_temporaries():
    """What a load of a new shape adds beside its weights (the weight store counts it before
    reading anything): both families' static buffers at the largest bucket, as a capture
    makes them, and a bf16 call's quantized rows at that bucket twice (the warm-up's and the
    capture's); nothing for a held shape or with graphs off."""
    pool = GraphPool(reference_backend(torch.device("cpu")), 64)
    assert not pool.use_graphs and pool.shape_bytes(G, N, K) == 0
    pool.use_graphs = True  # the GPU's accounting, on the CPU's buffers
    made = 0
    for quantize in (False, True):
        bufs = pool._allocate(Family(G, N, K, quantize))
        made += sum(allocated_bytes(t.nbytes) for t in (bufs.x, bufs.x_scale, bufs.xg, bufs.xsg,
                                                         bufs.meta, bufs.result) if t is not None)
    # (the CPU launches without the address table: the output before its scatter too)
    assert pool.shape_bytes(G, N, K) == made + 2 * 64 * (K + K // 128 * 4 + 2 * N) + LAUNCH_ALLOWANCE
    # The allocator's rounding: 512 bytes up to 1 MiB, 2 MiB past it.
    assert [allocated_bytes(n) for n in (1, 512, 513, 1 << 20, (1 << 20) + 1, 5 << 20)] == \
        [512, 512, 1024, 1 << 20, 2 << 20, 6 << 20]
    pool.buffers(Family(G, N, K, quantize=True))
    assert pool.shape_bytes(G, N, K) == 0 and pool.shape_bytes(G, N, 2 * K) > 0


def test_address_words_hold_the_weight_sets_bases():
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _weights(gen)
    words = fill_addresses(torch.empty(2, dtype=torch.int64), ws.wq, ws.w_scale)
    assert words.tolist() == [ws.wq.data_ptr(), ws.w_scale.data_ptr()]
    with pytest.raises(ValueError):
        fill_addresses(torch.empty(2, dtype=torch.int64), ws.wq.transpose(1, 2), ws.w_scale)
    # The pool's meta words: sizes, the two addresses, the input words, then the order.
    bufs = _executor().pool.buffers(Family(G, N, K, quantize=False))
    assert bufs.meta_words(3) == G + 2 + 3 + 6
    assert bufs.addresses.shape == (2,) and bufs.inputs.shape == (2,) and bufs.regroup.shape == (1,)
    # A lone call's GEMM reads the rows where they arrived; merged calls' the regrouped copy.
    assert bufs.input_words(regrouped=False) == (bufs.x.data_ptr(), bufs.x_scale.data_ptr(), 0)
    assert bufs.input_words(regrouped=True) == (bufs.xg.data_ptr(), bufs.xsg.data_ptr(), 1)
    quantized = _executor().pool.buffers(Family(G, N, K, quantize=True))
    assert quantized.xg is None and quantized.input_words(regrouped=False)[2] == 1
    # A backend without an address launcher (the CPU reference) gets graphs per weight set.
    assert _executor().pool.run_table is None


@pytest.mark.parametrize("kind", ["scale_zero", "scale_inf", "bf16_inf"])
def test_bad_rows_are_flagged_for_their_call_only(kind):
    """Content checks run with the launch: a bad row flags its own call, merged or not,
    and every other caller still gets its right rows."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _weights(gen)
    ex = _executor(max_bucket=64)
    bf16 = kind == "bf16_inf"
    parts = []
    for m in (7, 12, 5):
        if bf16:
            x = torch.randn(m, K, generator=gen).to(torch.bfloat16)
            parts.append(Part(x, None, random_m_sizes(G, m, generator=gen).tolist()))
        else:
            parts.append(_fp8_part(ws, m, gen))
    bad = parts[1]
    x, xs = bad[0].clone(), None if bad[1] is None else bad[1].clone()
    if kind == "scale_zero":
        xs[2, 1] = 0.0
    elif kind == "scale_inf":
        xs[0, 0] = float("inf")
    else:
        x[3, 3] = float("-inf")
    parts[1] = Part(x, xs, bad[2])
    outs, flags, _ = _run(ex, ws, parts)
    assert flags[1].any() and not flags[0].any() and not flags[2].any()
    expected = 2 if kind.startswith("scale") else 1
    assert int(np.bitwise_or.reduce(flags[1])) == expected
    for i in (0, 2):
        _check(ws, parts[i], outs[i])


def test_an_fp8_nan_code_is_no_flag_and_stays_in_its_row():
    """SPEC 2.2 checks fp8 rows' scales, not their codes: a NaN code is computed (NaN in
    its own row's answer, as in the float64 reference), merged or alone, and no other row
    or caller changes."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _weights(gen)
    ex = _executor(max_bucket=64)
    parts = [_fp8_part(ws, m, gen) for m in (7, 12, 5)]
    x = parts[1][0].clone()
    x.view(torch.uint8)[4, 9] = 0xFF
    parts[1] = Part(x, parts[1][1], parts[1][2])
    for run, at in ((parts, 1), (parts[1:2], 0)):  # merged, then alone
        outs, flags, _ = _run(ex, ws, run)
        assert not any(f.any() for f in flags)
        got = outs[at].float()
        assert torch.isnan(got[4]).any() and not torch.isnan(got[[0, 1, 2, 3, 5]]).any()
        for i, part in enumerate(run):
            if i != at:
                _check(ws, part, outs[i])


def test_lone_and_merged_calls_alternating_keep_each_callers_rows():
    # The launch words left by one launch (an identity order, a merge order, a
    # weight set's table) must never leak into the next one's.
    gen = torch.Generator().manual_seed(torch.seed())
    ex = _executor(max_bucket=64)
    sets = [_weights(gen), _weights(gen)]
    for step, rows in enumerate([[5], [3, 4, 9], [7], [20], [2, 2], [20], [1]]):
        ws = sets[step % 2]
        parts = [_fp8_part(ws, m, gen) for m in rows]
        outs, flags, _ = _run(ex, ws, parts)
        assert not any(f.any() for f in flags)
        for part, out in zip(parts, outs):
            _check(ws, part, out)


def test_the_graph_path_by_address_copies_equals_the_general_path():
    """The graph path (rows copied by address into the static buffers, the launch's
    words, one result copy back), with the graph replaced by an eager run of its body:
    merged calls of both input kinds give exactly the general path's rows."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _weights(gen)
    ex, ref = _executor(max_bucket=64), _executor(max_bucket=64)
    pool = ex.pool

    class Eager:  # what a captured graph replays, run now
        def __init__(self, family, rows, merged):
            self.family, self.rows, self.merged = family, rows, merged

        def replay(self):
            pool._body(pool.buffers(self.family), self.family, self.rows, ws.wq, ws.w_scale,
                       self.merged)

    pool.graph = lambda family, launched, wq, w_scale, merged=False: Eager(family, launched, merged)
    pool.held = pool.buffers  # every family "captured": its static buffers made on use
    for kind in ("fp8", "bf16"):
        parts = []
        for m in (3, 0, 17, 1, 30):
            if kind == "bf16":
                x = torch.randn(m, K, generator=gen).to(torch.bfloat16)
                parts.append(Part(x, None, random_m_sizes(G, m, generator=gen).tolist()))
            else:
                parts.append(_fp8_part(ws, m, gen))
        outs, flags, launches = _run(ex, ws, parts)
        assert launches.graph == 1 and launches.eager == 0  # the graph path took them
        for part, out in zip(parts, outs):
            [want], _, _ = _run(ref, ws, [part])
            assert torch.equal(out, want)
            _check(ws, part, out)
        assert not any(f.any() for f in flags)


def test_launch_words_say_where_the_gemm_reads_each_launch():
    """A lone call's words point the GEMM at the rows where they arrived (no regroup copy);
    merged calls' at the regrouped buffer, with the regroup flag set; and back again."""
    gen = torch.Generator().manual_seed(torch.seed())
    ws = _weights(gen)
    pool = _executor(max_bucket=16).pool
    bufs = pool.buffers(Family(G, N, K, quantize=False))
    meta = bufs.meta_host.numpy()
    at = G + 2
    sizes = np.array([3, 0, 2, 1, 0])
    pool.fill_words(bufs, meta, sizes, None, 6, 8, weight_addresses(ws.wq, ws.w_scale))
    assert tuple(meta[at:at + 3]) == (bufs.x.data_ptr(), bufs.x_scale.data_ptr(), 0)
    gather = np.array([5, 0, 3, 1, 4, 2])
    pool.fill_words(bufs, meta, sizes, gather, 6, 8, weight_addresses(ws.wq, ws.w_scale))
    assert tuple(meta[at:at + 3]) == (bufs.xg.data_ptr(), bufs.xsg.data_ptr(), 1)
    pairs = meta[at + 3:at + 3 + 16].reshape(8, 2)
    assert pairs[:6, 0].tolist() == gather.tolist()
    assert (pairs[gather, 1] == np.arange(6)).all() and pairs[6:].tolist() == [[6, 6], [7, 7]]
    pool.fill_words(bufs, meta, sizes, None, 6, 8, weight_addresses(ws.wq, ws.w_scale))
    assert tuple(meta[at:at + 3]) == (bufs.x.data_ptr(), bufs.x_scale.data_ptr(), 0)
    assert pairs[:, 0].tolist() == list(range(8))


def test_only_the_familys_own_buffers_replay_its_graphs():
    """A batch on buffers of its own (a deleted set's calls of a shape released, then captured
    again for a new set) runs eagerly on them: a replay would compute on the static buffers
    while the batch reads its own (zeros, or another caller's rows). A capture publishes a new
    family's buffers only with its graphs."""
    gen = torch.Generator().manual_seed(torch.seed())
    ex, ws = _executor(max_bucket=16), _weights(gen)
    pool = ex.pool
    family = Family(G, N, K, quantize=False)
    replays = []

    class Stand:  # a captured graph of the family
        def replay(self):
            replays.append(1)

    sizes = np.array([3, 1, 0, 0, 0])
    key = pool._graph_key(family, pool.launch_rows(4), ws.wq, ws.w_scale, False)
    pool._graphs[key] = Stand()
    own = pool.batch_buffers(family, 4)  # no static buffers yet: its own
    assert pool.held(family) is None
    assert pool.launch(family, ws.wq, ws.w_scale, sizes, bufs=own) == "eager" and not replays
    static = pool.buffers(family)
    assert pool.batch_buffers(family, 4) is static and own is not static
    assert pool.launch(family, ws.wq, ws.w_scale, sizes, bufs=own) == "eager" and not replays
    assert pool.launch(family, ws.wq, ws.w_scale, sizes) == "graph" and replays == [1]
