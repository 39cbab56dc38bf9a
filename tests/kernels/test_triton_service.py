"""The service path on an NVIDIA Hopper GPU: a server graph runs the public function's kernel.

A ``GraphPool`` as the server builds it (triton backend, the weights by
address, one graph per bucket) must choose the same tile as
``moegemm.kernels.grouped_gemm`` for the shape and give the same output bit
for bit (SPEC 3), for ragged groups with empty ones, G up to 384, every
bucket, graph replay and eager alike, and operands past 2^31 elements.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.version.hip:
    pytest.skip("needs an NVIDIA CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs compute capability 9.0 (Hopper)", allow_module_level=True)
pytest.importorskip("triton")

from moegemm.kernels import get_backend, grouped_gemm, reference_float64
from moegemm.kernels import triton_kernel as tk
from moegemm.kernels.testing import SPEC_TOLERANCE, random_m_sizes, rel_error
from moegemm.server._graphs import Family, GraphPool
from moegemm.server._merge import plan_merge

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn


def _problem(m, n, k, g, sizes, gen):
    xq = (torch.randn((m, k), generator=gen, device=DEV) * 32).to(FP8)
    x_scale = torch.exp(torch.randn((m, k // 128), generator=gen, device=DEV)) / 64
    wq = torch.empty((g, n, k), dtype=FP8, device=DEV)
    for lo in range(0, g, 8):
        hi = min(g, lo + 8)
        wq[lo:hi] = (torch.randn((hi - lo, n, k), generator=gen, device=DEV) * 32).to(FP8)
    w_scale = torch.exp(torch.randn((g, k // 128, n // 128), generator=gen, device=DEV)) / 64
    return xq, wq, x_scale, w_scale, sizes.to(DEV)


def _service(pool, problem, family=None):
    """One call through the pool (graph when captured): the output rows, and "graph"/"eager"."""
    xq, wq, x_scale, w_scale, sizes = problem
    g, n, k = wq.shape
    family = family or Family(g, n, k, quantize=False)
    bufs = pool.buffers(family)
    m = xq.shape[0]
    bufs.result.fill_(0xFF)  # NaN-poisoned output
    bufs.x[:m].copy_(xq)
    bufs.x_scale[:m].copy_(x_scale)
    how = pool.launch(family, wq, w_scale, sizes.cpu().numpy())
    torch.cuda.synchronize()
    return bufs.out(pool.launch_rows(m))[:m].clone(), how


def _public_over(bucket: int, problem) -> torch.Tensor:
    """The public function over the bucket's rows, the call's rows of it: what the service's
    graph must equal bit for bit (it launches over the whole bucket, whose rows past the
    call belong to no group, and picks the tile for that shape)."""
    xq, wq, x_scale, w_scale, m_sizes = problem
    m, k = xq.shape
    pad = bucket - m
    return grouped_gemm(torch.cat([xq, xq.new_zeros((pad, k))]), wq,
                        torch.cat([x_scale, x_scale.new_ones((pad, k // 128))]), w_scale, m_sizes)[:m]


@pytest.fixture
def gen():
    g = torch.Generator(device=DEV)
    g.manual_seed(torch.seed() % (1 << 62))
    return g


@pytest.fixture(scope="module")
def backend():
    return get_backend(DEV, "triton")


# (m, n, k, g): decode at G = 8, 128, 256 and 384; prefill at G = 8 (warp-specialised)
# and at G = 128 and 384 (the persistent TMA tiles with their tile table).
SHAPES = [(5, 1280, 8192, 8), (37, 4096, 1024, 256), (2048, 512, 2048, 8), (3000, 512, 1536, 128),
          (1500, 256, 1024, 384), (200, 7168, 2048, 384), (9000, 512, 1536, 128), (30000, 256, 512, 384)]


@pytest.mark.parametrize("m,n,k,g", SHAPES)
def test_service_path_runs_the_public_tile_bit_for_bit(m, n, k, g, backend, gen):
    sizes = random_m_sizes(g, m)
    sizes[0] = 0  # an empty group first
    sizes[1] += m - int(sizes.sum())
    problem = _problem(m, n, k, g, sizes, gen)
    bucket = 1 << (m - 1).bit_length()
    # The same tile: the public function's choice for the shape it sees (M = the call's
    # rows) and the service's (M = the bucket) come from one table row.
    pool = GraphPool(backend, bucket)
    pool.capture(Family(g, n, k, quantize=False), problem[1], problem[3], only=[bucket])
    assert pool.run_table is not None
    got, how = _service(pool, problem)
    assert how == "graph"
    assert torch.equal(got, _public_over(bucket, problem))
    ref = reference_float64(*problem)
    assert torch.isfinite(got).all()
    assert rel_error(got, ref) <= SPEC_TOLERANCE


def test_every_bucket_replay_equals_eager_with_384_groups(backend, gen):
    g, n, k, max_bucket = 384, 256, 512, 256
    first = _problem(1, n, k, g, torch.ones(1), gen)
    captured = GraphPool(backend, max_bucket)
    eager = GraphPool(backend, max_bucket, graphs=False)
    family = Family(g, n, k, quantize=False)
    assert all(captured.variants(family, b) == (False, True) for b in captured.buckets)  # decode tiles
    assert captured.capture(family, first[1], first[3]) == 2 * len(captured.buckets)  # lone, merged
    for bucket in captured.buckets:
        for m in sorted({max(1, bucket // 2 + 1), bucket}):
            sizes = random_m_sizes(g, m)
            problem = _problem(m, n, k, g, sizes, gen)
            # Another weight set of the same shape: the shared graphs follow its addresses.
            problem = (problem[0], first[1] if m % 2 else problem[1], problem[2],
                       first[3] if m % 2 else problem[3], problem[4])
            got, how = _service(captured, problem, family)
            assert how == "graph"
            want, how_eager = _service(eager, problem, family)
            assert how_eager == "eager"
            assert torch.equal(got, want), f"bucket {bucket}, {m} rows"
            assert torch.isfinite(got).all()
            assert rel_error(got, reference_float64(*problem)) <= SPEC_TOLERANCE


def _routed_sizes(g: int, m: int, routing: str, seed: int) -> torch.Tensor:
    """``m`` rows over ``g`` experts as a router might send them: ragged with empty experts,
    all on one expert, Zipf-skewed over every expert, or even."""
    gen = torch.Generator().manual_seed(seed)
    if routing == "ragged":
        return random_m_sizes(g, m, generator=gen)
    if routing == "one":
        sizes = torch.zeros(g, dtype=torch.int64)
        sizes[int(torch.randint(g, (1,), generator=gen))] = m
        return sizes
    if routing == "zipf":
        weights = 1.0 / torch.arange(1, g + 1, dtype=torch.float64)[torch.randperm(g, generator=gen)]
    else:
        weights = torch.ones(g, dtype=torch.float64)
    picks = torch.multinomial(weights, m, replacement=True, generator=gen) if m else None
    return torch.bincount(picks, minlength=g) if m else torch.zeros(g, dtype=torch.int64)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    g=st.sampled_from([1, 2, 3, 8, 60, 128, 160, 256, 384]),
    n_blocks=st.integers(1, 40),
    k_blocks=st.integers(1, 40),
    m=st.one_of(st.integers(0, 64), st.integers(65, 6000)),
    routing=st.sampled_from(["ragged", "one", "zipf", "even"]),
    seed=st.integers(0, 2**31),
)
def test_any_shape_and_routing_through_the_service_and_the_public_entry(
        g, n_blocks, k_blocks, m, routing, seed, backend):
    """Shapes and routings the tables above do not name (N and K any multiple of 128 up to
    5120, 1-384 experts, 0-6000 rows, skewed, all on one expert, or even): the service's
    graph for the call's bucket equals the public function bit for bit, within SPEC 1's
    bound of the float64 reference and finite."""
    n, k = 128 * n_blocks, 128 * k_blocks
    assume(g * n * k <= 1 << 30)  # the weights' bytes a case draws
    gen = torch.Generator(device=DEV)
    gen.manual_seed(seed)
    sizes = _routed_sizes(g, m, routing, seed)
    problem = _problem(m, n, k, g, sizes, gen)
    family = Family(g, n, k, quantize=False)
    if m == 0:
        assert grouped_gemm(*problem).shape == (0, n)
        return
    bucket = 1 << (m - 1).bit_length()
    pool = GraphPool(backend, bucket)
    pool.capture(family, problem[1], problem[3], only=[bucket])
    got, how = _service(pool, problem, family)
    assert how == "graph"
    assert torch.isfinite(got).all()
    assert torch.equal(got, _public_over(bucket, problem))
    assert rel_error(got, reference_float64(*problem)) <= SPEC_TOLERANCE


@pytest.mark.parametrize("m,n,k,g", [(5, 1024, 2048, 8), (700, 512, 1024, 16)])
def test_run_gemm_into_float32_is_the_public_float32_bit_for_bit(m, n, k, g, backend, gen):
    """The pool's launcher (what an FFN graph captures for GEMM(w13)) with a float32 out,
    eager and replayed in a graph on new data: the public function's float32 bits."""
    pool = GraphPool(backend, 1 << (m - 1).bit_length())
    family = Family(g, n, k, quantize=False)
    bufs = pool.buffers(family)
    first = _problem(m, n, k, g, random_m_sizes(g, m), gen)
    pool._set_table(bufs, first[1], first[3])
    assert pool.run_table is not None
    xq, x_scale, sizes = first[0].clone(), first[2].clone(), first[4].clone()
    wide = torch.full((m, n), float("nan"), dtype=torch.float32, device=DEV)

    def launch():
        pool.run_gemm(xq, x_scale, sizes, wide, addresses=bufs.addresses, wq=first[1],
                      w_scale=first[3])

    launch()
    want = torch.full_like(wide, float("nan"))
    grouped_gemm(*first, out=want)
    torch.cuda.synchronize()
    assert torch.isfinite(wide).all() and torch.equal(wide, want)
    assert tk.default_config(m, n, k, g).schedule != "persistent_ws"  # one tile for both dtypes
    assert torch.equal(wide.to(torch.bfloat16), grouped_gemm(*first))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    second = _problem(m, n, k, g, random_m_sizes(g, m), gen)
    xq.copy_(second[0])
    x_scale.copy_(second[2])
    sizes.copy_(second[4])
    wide.fill_(float("nan"))
    graph.replay()
    want = torch.full_like(wide, float("nan"))
    grouped_gemm(second[0], first[1], second[2], first[3], second[4], out=want)
    torch.cuda.synchronize()
    assert torch.isfinite(wide).all() and torch.equal(wide, want)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        pool.run_gemm(xq, x_scale, sizes, wide.half(), addresses=bufs.addresses, wq=first[1],
                      w_scale=first[3])


@pytest.mark.slow
def test_weights_past_2_31_elements_through_the_service(backend, gen):
    g, n, k, m = 48, 7168, 7168, 128
    assert g * n * k >= 2**31
    sizes = torch.zeros(g, dtype=torch.int64)
    sizes[0], sizes[g // 2], sizes[g - 1] = 5, 40, 83
    problem = _problem(m, n, k, g, sizes, gen)
    pool = GraphPool(backend, m)
    pool.capture(Family(g, n, k, quantize=False), problem[1], problem[3], only=[m])
    got, how = _service(pool, problem)
    assert how == "graph"
    assert torch.equal(got, grouped_gemm(*problem))
    last = (problem[0][45:], problem[1][g - 1:], problem[2][45:], problem[3][g - 1:],
            torch.tensor([83], device=DEV))
    assert rel_error(got[45:], reference_float64(*last)) <= SPEC_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("k, schedule", [(4224, "gluon_ws_store"), (5248, "gluon_ws")])
def test_many_expert_weights_past_2_31_elements_through_the_service(backend, gen, k, schedule):
    """Both Gluon tiles (G >= 64, 64 rows per group; the store-warp form to K = 5120) over a
    weight set of 2^31+ elements: the last groups' rows sit past 2^31 in the descriptor's
    [G * N, K] view. M is a bucket (a power of two), so the graph's launch covers exactly
    the public call's rows."""
    g, n, m = 128, 4096, 128 * 64
    assert g * n * k >= 2**31
    assert tk.default_config(m, n, k, g).schedule == schedule
    sizes = random_m_sizes(g, m - 100)
    sizes[g - 1] += 100  # rows in the last group, whose weights start past 2^31
    problem = _problem(m, n, k, g, sizes, gen)
    pool = GraphPool(backend, m)
    pool.capture(Family(g, n, k, quantize=False), problem[1], problem[3], only=[m])
    got, how = _service(pool, problem)
    assert how == "graph"
    assert torch.equal(got, grouped_gemm(*problem))
    xq, wq, xs, ws, _ = problem
    last = int(sizes[g - 1])
    part = (xq[m - last:], wq[g - 1:], xs[m - last:], ws[g - 1:], torch.tensor([last], device=DEV))
    assert rel_error(got[m - last:], reference_float64(*part)) <= SPEC_TOLERANCE


@pytest.mark.slow
def test_activations_past_2_31_elements_through_the_service(backend, gen):
    g, n, k, m = 4, 256, 8192, 1 << 18
    assert m * k >= 2**31
    sizes = torch.tensor([1000, m // 2, 0, m - 1000 - m // 2])
    problem = _problem(m, n, k, g, sizes, gen)
    pool = GraphPool(backend, m)
    pool.capture(Family(g, n, k, quantize=False), problem[1], problem[3], only=[m])
    got, how = _service(pool, problem)
    assert how == "graph"
    assert torch.equal(got, grouped_gemm(*problem))
    xq, wq, xs, ws, _ = problem
    tail = 3000
    part = (xq[m - tail:], wq[3:], xs[m - tail:], ws[3:], torch.tensor([tail], device=DEV))
    assert rel_error(got[m - tail:], reference_float64(*part)) <= SPEC_TOLERANCE
    assert bool(np.isfinite(got[m - tail:].float().cpu().numpy()).all())


@pytest.mark.parametrize("m,n,k,g", [(300, 1280, 1024, 8), (9000, 512, 1536, 128), (3000, 256, 512, 384)])
def test_merged_calls_come_back_in_the_callers_order_and_a_lone_call_moves_no_row(m, n, k, g, backend, gen):
    """Three callers merged into one replay: the rows regrouped per expert by the check
    kernel, the GEMM storing each row at its caller's place (no pass after it): every
    caller's rows equal the public function's on the regrouped rows. A lone call's graph
    leaves the regroup buffer alone (the GEMM reads the rows where they arrived)."""
    parts = [random_m_sizes(g, r).numpy() for r in (m // 3, m // 3, m - 2 * (m // 3))]
    plan = plan_merge(parts)
    assert not plan.is_identity
    sizes = torch.from_numpy(plan.m_sizes)
    problem = _problem(m, n, k, g, sizes, gen)
    xq, wq, x_scale, w_scale, m_sizes = problem  # rows in merged (per-expert) order
    bucket = 1 << (m - 1).bit_length()
    pool = GraphPool(backend, bucket)
    family = Family(g, n, k, quantize=False)
    pool.capture(family, wq, w_scale, only=[bucket])
    bufs = pool.buffers(family)
    # The callers' concatenated rows: concatenated row gather[r] is merged row r.
    gather = torch.from_numpy(plan.gather).to(DEV)
    concatenated = torch.empty_like(xq)
    concatenated[gather] = xq
    concatenated_scale = torch.empty_like(x_scale)
    concatenated_scale[gather] = x_scale
    bufs.result.fill_(0xFF)
    bufs.x[:m].copy_(concatenated)
    bufs.x_scale[:m].copy_(concatenated_scale)
    assert pool.launch(family, wq, w_scale, plan.m_sizes, plan.gather) == "graph"
    torch.cuda.synchronize()
    got = bufs.out(bucket)[:m].clone()
    pad = bucket - m
    public = grouped_gemm(torch.cat([xq, xq.new_zeros((pad, k))]), wq,
                          torch.cat([x_scale, x_scale.new_ones((pad, k // 128))]), w_scale, m_sizes)[:m]
    assert torch.equal(got[gather], public)
    assert not bool(bufs.flags(bucket)[:m].any())
    # A lone call: no row is copied to the regroup buffer.
    bufs.xg.view(torch.uint8).fill_(0x7F)
    lone, how = _service(pool, (xq, wq, x_scale, w_scale, m_sizes), family)
    assert how == "graph"
    assert torch.equal(lone, public)
    assert bool((bufs.xg.view(torch.uint8) == 0x7F).all())


# Decode tiles, then one shape per persistent schedule: persistent_ws, persistent_tma, gluon_ws,
# gluon_ws_store.
@pytest.mark.parametrize("m,n,k,g", [(5, 1280, 8192, 8), (1500, 512, 1536, 128), (900, 1280, 1024, 8),
                                     (300, 1024, 1024, 8), (700, 7168, 1024, 8), (9000, 512, 1536, 128)])
def test_a_lone_calls_gemm_checks_its_rows_and_flags_bad_ones(m, n, k, g, backend, gen):
    """A lone call's graph is its own, one kernel where the tile checks the rows itself (a
    decode tile through the row map, a persistent one storing in place) and no check kernel
    runs; on ``persistent_ws`` (``checks_rows`` false) the check kernel on a stream beside the
    GEMM storing in place (the GEMM reads nothing it writes). Both graphs exist per bucket,
    the lone one flags a bad scale as the check kernel does (an fp8 NaN code is no flag: SPEC
    2.2 checks fp8 rows' scales), and the other rows are the public function's bits."""
    sizes = random_m_sizes(g, m)
    problem = _problem(m, n, k, g, sizes, gen)
    xq, wq, x_scale, w_scale, m_sizes = problem
    bucket = 1 << (m - 1).bit_length()
    pool = GraphPool(backend, bucket)
    family = Family(g, n, k, quantize=False)
    inside = tk.checks_rows(bucket, n, k, g, device=DEV)
    assert inside == (tk.default_config(bucket, n, k, g).schedule != "persistent_ws")
    assert pool.variants(family, bucket) == (False, True)  # the check inside the GEMM, or in place
    pool.capture(family, wq, w_scale, only=[bucket])
    lone_graph, merged_graph = (pool.graph(family, bucket, wq, w_scale, merged) for merged in (False, True))
    assert lone_graph is not None and merged_graph is not None and lone_graph is not merged_graph
    checks = []
    real_check = pool.check_and_gather
    pool.check_and_gather = lambda *a, **kw: (checks.append(torch.cuda.current_stream(DEV)),
                                              real_check(*a, **kw))
    here = torch.cuda.current_stream(DEV)
    bufs = pool.buffers(family)
    pool._body(bufs, family, bucket, wq, w_scale, merged=False)  # a lone call's graph, eagerly
    assert checks == ([] if inside else [here])  # eagerly, in order on the caller's stream
    checks.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captured (what the pool's graphs hold): beside the GEMM
        pool._body(bufs, family, bucket, wq, w_scale, merged=False)
    assert checks == ([] if inside else [pool._beside])
    assert pool._beside != here
    del graph
    checks.clear()
    # merged calls': the check kernel regroups first
    pool._body(bufs, family, bucket, wq, w_scale)
    assert checks == [here]
    pool.check_and_gather = real_check
    bad_x, bad_scale = m // 2, m - 1
    xq = xq.clone()
    xq.view(torch.uint8)[bad_x, 7] = 0x7F  # an fp8 NaN code: not a flag (SPEC 2.2), NaN out
    x_scale = x_scale.clone()
    x_scale[bad_scale, 0] = -1.0
    got, how = _service(pool, (xq, wq, x_scale, w_scale, m_sizes), family)
    assert how == "graph"
    flags = pool.buffers(family).flags(bucket)[:m].cpu()
    want = torch.zeros(m, dtype=torch.int8)
    want[bad_scale] |= 2
    assert torch.equal(flags, want)
    pad = bucket - m
    public = grouped_gemm(torch.cat([xq, xq.new_zeros((pad, k))]), wq,
                          torch.cat([x_scale, x_scale.new_ones((pad, k // 128))]), w_scale, m_sizes)[:m]
    good = torch.ones(m, dtype=torch.bool)
    good[[bad_x, bad_scale]] = False
    assert torch.equal(got[good.to(DEV)], public[good.to(DEV)])


# Prefill; a banded pair (G = 8, 16 rows a group); one token of 8 experts on the 8-warp
# single-block tile; a few experts split along K.
@pytest.mark.parametrize("m,n,k,g", [(16384, 2048, 1024, 8), (9000, 512, 1536, 128), (37, 4096, 1024, 256),
                                     (128, 4096, 2048, 8), (8, 5120, 1536, 160), (2, 4096, 4096, 8)])
def test_the_service_and_the_public_function_pick_one_tile(m, n, k, g, backend, gen, monkeypatch):
    """SPEC 3 pinned: the pool's launcher and ``grouped_gemm`` launch the same kernel with the
    same tile for a shape (recorded at the launch), merged calls' graph and a lone call's
    alike (the lone one: the rows' check inside the GEMM, the store in place on a
    persistent tile), and the same bits come out."""
    launched = []
    real = tk._launch

    def recording(xq, w_arg, x_scale, ws_arg, m_sizes, out, n_, g_, config, addrs, x_words=None,
                  out_rows=None, flags=None):
        launched.append((config, addrs, x_words is not None, out_rows is not None, flags is not None))
        return real(xq, w_arg, x_scale, ws_arg, m_sizes, out, n_, g_, config, addrs, x_words, out_rows, flags)

    monkeypatch.setattr(tk, "_launch", recording)
    sizes = random_m_sizes(g, m)
    problem = _problem(m, n, k, g, sizes, gen)
    bucket = 1 << (m - 1).bit_length()
    pool = GraphPool(backend, bucket)
    family = Family(g, n, k, quantize=False)
    pool.capture(family, problem[1], problem[3], only=[bucket])
    launched.clear()
    bufs = pool.buffers(family)
    # What the merged calls' graph runs, eagerly, and a lone call's:
    pool._body(bufs, family, bucket, problem[1], problem[3])
    pool._body(bufs, family, bucket, problem[1], problem[3], merged=False)
    bufs.x[:m].copy_(problem[0])
    bufs.x_scale[:m].copy_(problem[2])
    got, _ = _service(pool, problem, family)
    xq, wq, x_scale, w_scale, m_sizes = problem
    pad = bucket - m
    public = grouped_gemm(torch.cat([xq, xq.new_zeros((pad, k))]), wq,
                          torch.cat([x_scale, x_scale.new_ones((pad, k // 128))]), w_scale, m_sizes)
    (merged_tile, *merged_how), (lone_tile, *lone_how), *_, (public_tile, *public_how) = launched
    assert merged_tile == lone_tile == public_tile == tk.default_config(bucket, n, k, g)
    decode = not tk.persistent(bucket, n, k, g, device=DEV)
    inside = tk.checks_rows(bucket, n, k, g, device=DEV)
    assert merged_how == [True, True, True, False] and public_how == [False, False, False, False]
    assert lone_how == [True, True, decode, inside]  # decode: row map, prefill: in place
    assert torch.equal(got, public[:m])


def test_split_k_graphs_never_share_counters_the_pool_left_dirty(monkeypatch):
    """A split-K launch captured into a graph gets counters of its own, zeroed at every
    replay. Before, the workspace was cached per stream even when first made inside a
    capture: its zeroing was captured (not run) into that first graph, and a second graph
    sharing it read counters holding whatever the pool's memory held, stored nothing and
    answered zeros (a shipped server's expert FFN, once other graphs had used the pool)."""
    monkeypatch.setattr(tk, "_workspaces", {})  # no workspace of an earlier test
    gen = torch.Generator(device=DEV).manual_seed(11)
    m, n, k, g = 4, 512, 4096, 8
    config = tk.default_config(m, n, k, g)
    assert config.swap_ab and config.split_k > 1  # the shape runs split-K
    sizes = torch.tensor([1, 0, 2, 0, 0, 1, 0, 0])
    xq, wq, x_scale, w_scale, sizes = _problem(m, n, k, g, sizes, gen)
    want = torch.empty((m, n), dtype=torch.bfloat16, device=DEV)
    side = torch.cuda.Stream(DEV)
    with torch.cuda.stream(side):  # warm-up (compiles), its workspace keyed by this stream
        tk.launch(xq, wq, x_scale, w_scale, sizes, want, config)
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    capture = torch.cuda.Stream(DEV)
    # A graph whose replay leaves non-zero words in memory the pool hands out again.
    dirty = torch.cuda.CUDAGraph()
    with torch.cuda.graph(dirty, pool=pool, stream=capture):
        junk = torch.empty(1 << 17, dtype=torch.int32, device=DEV)
        junk.fill_(7)
        del junk
    dirty.replay()
    torch.cuda.synchronize()
    outs, graphs = [], []
    for _ in range(2):  # two graphs of one shape on one capture stream
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=capture):
            tk.launch(xq, wq, x_scale, w_scale, sizes, out, config)
        outs.append(out)
        graphs.append(graph)
    graphs[1].replay()  # the second graph first: the first one's memset never ran
    graphs[0].replay()
    torch.cuda.synchronize()
    for out in outs:
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))


# Decode tiles: one token over 8 experts (the 8-warp pair); a few experts split 8 ways along K
# (33 blocks: the last split empty); a banded pair; the banded single-block tile; one expert's
# 64-row pairs; the 8-warp single-block tile; 32-token tiles at G = 128. Then the persistent
# tiles that check the rows (all but persistent_ws), stored in place (a lone prefill call's
# graph), at 9 K blocks and at one: persistent_tma, gluon_ws, gluon_ws_store. The last two:
# groups of 64, 192, 100 and 28 rows (a 128-row tile whose second half is another group's).
@pytest.mark.parametrize("m,n,k,g,schedule", [
    (8, 2048, 768, 128, "decode_pair"), (6, 1024, 4096, 8, "decode"), (6, 1024, 4224, 8, "decode"),
    (128, 4096, 2048, 8, "decode_pair"), (128, 8192, 1024, 8, "decode"), (4, 4096, 1024, 8, "decode_pair"),
    (8, 7168, 2048, 256, "decode"), (2048, 3072, 4096, 128, "decode"),
    (512, 1024, 1152, 8, "persistent_tma"),
    (1024, 7168, 1152, 8, "gluon_ws"), (9000, 512, 1152, 128, "gluon_ws_store"),
    (512, 1024, 128, 8, "persistent_tma"),
    (1024, 7168, 128, 8, "gluon_ws"), (9000, 512, 128, 128, "gluon_ws_store"),
    (1024, 7168, 1280, 8, "gluon_ws"), (512, 1024, 1280, 8, "persistent_tma")])
def test_every_tile_checks_the_rows_inside_the_gemm(m, n, k, g, schedule, gen):
    """``run_addressed(flags=)`` (a lone call's graph, one kernel): each grouped row's flag is
    the server's check of its scales (``bad_rows``: 2 where one is not finite and > 0), stored
    at the row's place (through the row map on a decode tile, in place on a persistent one);
    rows in no group keep what the buffer held; the output is the same bits as without the
    check. A persistent tile refuses the check with a row map. Besides the fixed bad scales
    (the first and last K block, a row past the groups' end), one row in 20 gets one at a
    random block (the same draw on every run), so each tile half and row position meets some."""
    from moegemm.server._checks import bad_rows

    config = tk.default_config(m, n, k, g)
    assert config.schedule == schedule, config.key()
    if k == 1280:  # groups ending on a 64-row half and inside a 128-row tile
        sizes = torch.tensor([64, 192, 100, 0, 28, 0, 0, m - 386], dtype=torch.int64)
    else:
        sizes = random_m_sizes(g, m - 2)  # two rows past the groups' end
    xq, wq, x_scale, w_scale, sizes = _problem(m, n, k, g, sizes, gen)
    kbs = k // 128
    bad = [(0, 0, float("nan")), (m // 2, kbs - 1, float("inf")), (m - 3, min(1, kbs - 1), 0.0),
           (m - 4, 0, -1.0), (m - 1, 0, float("nan"))]  # m - 1 lies in no group (or the last)
    draw = torch.Generator().manual_seed(m * 7919 + n + k)
    values = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -3.0)
    for i, row in enumerate(torch.randperm(m, generator=draw)[: max(1, m // 20)].tolist()):
        bad.append((row, int(torch.randint(kbs, (1,), generator=draw)), values[i % len(values)]))
    for row, kb, value in bad:
        x_scale[row, kb] = value
    words = torch.tensor([wq.data_ptr(), w_scale.data_ptr(), xq.data_ptr(), x_scale.data_ptr()],
                         dtype=torch.int64, device=DEV)
    # A row map on a decode tile (row r stored at order[r]); in place on a persistent one.
    order = torch.randperm(m, device=DEV) if config.swap_ab else torch.arange(m, device=DEV)
    out_rows = order if config.swap_ab else None
    want = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    tk.run_addressed(xq, words[:2], x_scale, sizes, want, groups=g, inputs=words[2:], out_rows=out_rows)
    out = torch.full_like(want, float("nan"))
    flags = torch.full((m,), 7, dtype=torch.int8, device=DEV)
    tk.run_addressed(xq, words[:2], x_scale, sizes, out, groups=g, inputs=words[2:], out_rows=out_rows,
                     flags=flags)
    torch.cuda.synchronize()
    grouped = int(sizes.sum())
    placed = order[:grouped]
    assert torch.equal(out[placed].view(torch.int16), want[placed].view(torch.int16))
    expected = bad_rows(xq[:grouped], x_scale[:grouped]).to(DEV)
    assert torch.equal(flags[placed], expected.to(torch.int8))
    assert int(expected.sum()) == 2 * len({row for row, _, _ in bad if row < grouped})  # 2 each
    assert (flags[order[grouped:]] == 7).all()
    if not config.swap_ab:
        with pytest.raises(ValueError, match="in-place store"):
            tk.run_addressed(xq, words[:2], x_scale, sizes, out, groups=g, inputs=words[2:],
                             out_rows=torch.arange(m, device=DEV), flags=flags)


def test_persistent_ws_leaves_the_rows_check_to_the_check_kernel(gen):
    """``persistent_ws`` takes no ``flags`` (its loop ran slower with the check: ``checks_rows``
    false); a lone call's graph on it runs the check kernel first
    (``test_a_lone_calls_gemm_checks_its_rows_and_flags_bad_ones``)."""
    m, n, k, g = 1024, 2048, 1152, 8
    assert tk.default_config(m, n, k, g).schedule == "persistent_ws"
    assert not tk.checks_rows(m, n, k, g, device=DEV)
    xq, wq, x_scale, w_scale, sizes = _problem(m, n, k, g, random_m_sizes(g, m), gen)
    words = torch.tensor([wq.data_ptr(), w_scale.data_ptr(), xq.data_ptr(), x_scale.data_ptr()],
                         dtype=torch.int64, device=DEV)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="persistent_ws"):
        tk.run_addressed(xq, words[:2], x_scale, sizes, out, groups=g, inputs=words[2:],
                         flags=torch.empty(m, dtype=torch.int8, device=DEV))
