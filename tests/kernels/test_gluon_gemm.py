"""The Gluon many-expert prefill schedule (``gluon_ws``) on an NVIDIA Hopper GPU: SPEC 1 on ragged groups.

Launched through ``triton_kernel`` as every entry launches it: against the
float64 oracle with empty groups, a group of one row, M not a multiple of the
128-row tile, G up to 384, a float32 output; and the server's form (weights and
activations by address, rows stored through a map) captured in a CUDA graph,
its replay equal bit for bit to the public entry. Outputs are NaN-poisoned
first, so a row the kernel skips fails.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.version.hip:
    pytest.skip("needs an NVIDIA CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs compute capability 9.0 (Hopper)", allow_module_level=True)

from moegemm.kernels import grouped_gemm, reference_float64
from moegemm.kernels import triton_kernel as tk
from moegemm.kernels.testing import SPEC_TOLERANCE, random_m_sizes, random_problem, rel_error

DEV = torch.device("cuda")
GLUON = tk.TileConfig("gluon_ws", 128, 256, 4, 3, group_tiles_m=8)
STORE = tk.TileConfig("gluon_ws_store", 128, 256, 4, 3, group_tiles_m=8)  # the table's tile to K = 5120


def _poisoned(m, n, dtype=torch.bfloat16):
    return torch.full((m, n), float("nan"), dtype=dtype, device=DEV)


def _launch(p, out, config=GLUON):
    return tk.launch(*p.args(), out, config)


@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("m,n,k,g", [(1000, 256, 1152, 8), (3000, 768, 1024, 8), (16384, 512, 2048, 128),
                                     (8191, 256, 7168, 256), (5000, 512, 1536, 384)])
def test_matches_float64_on_ragged_groups(stages, m, n, k, g):
    gen = torch.Generator(device=DEV).manual_seed(m + g)
    torch.manual_seed(m * g)
    p = random_problem(m, n, k, g, device=DEV, generator=gen)
    assert int((p.m_sizes == 0).sum()) >= 1  # empty groups in the split
    config = tk.TileConfig("gluon_ws", 128, 256, 4, stages, group_tiles_m=8)
    out = _launch(p, _poisoned(m, n), config)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert rel_error(out, reference_float64(*p.args())) <= SPEC_TOLERANCE


@pytest.mark.parametrize("config", [GLUON, STORE], ids=lambda c: c.schedule)
def test_tiles_whose_second_half_has_no_row_of_the_group(config):
    """A group's last row tile with 64 rows or fewer (the second consumer's half holds no row of
    the group and runs no wgmma). Sizes around the 64-row edge, groups of one tile and of
    several, against float64; then one group's first r rows alone give the bits of the same
    rows in a full 128-row tile (each consumer's sums are its own)."""
    sizes = torch.tensor([64, 65, 1, 0, 63, 128 + 64, 128 + 65, 129, 256, 2 * 128 + 1, 0, 40] * 8)
    m, n, k, g = int(sizes.sum()), 512, 1536, int(sizes.numel())
    gen = torch.Generator(device=DEV).manual_seed(11)
    p = random_problem(m, n, k, g, device=DEV, m_sizes=sizes, generator=gen)
    out = _launch(p, _poisoned(m, n), config)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert rel_error(out, reference_float64(*p.args())) <= SPEC_TOLERANCE
    full = None
    for rows in (128, 1, 40, 63, 64, 65, 100):
        sizes_r = torch.zeros(g, dtype=torch.int64, device=DEV)
        sizes_r[0] = rows
        got = tk.launch(p.xq[:rows], p.wq, p.x_scale[:rows], p.w_scale, sizes_r, _poisoned(rows, n), config)
        full = got if full is None else full
        assert torch.equal(got, full[:rows])


@pytest.mark.parametrize("config", [GLUON, STORE], ids=lambda c: c.schedule)
def test_launches_claim_their_tiles_from_a_fresh_count(config):
    """The programs claim tiles from a counter in the work buffer, and the last program of a
    launch puts it back to zero. Back-to-back launches of different tile counts that share one
    buffer (the same programs and G), eager and captured in two graphs replayed in turn (each
    capture's own buffer), each store every row of every group: NaN-poisoned outputs, the
    float64 oracle, and replays equal to eager launches bit for bit."""
    g, n, k = 128, 512, 1024
    gen = torch.Generator(device=DEV).manual_seed(21)
    problems = [random_problem(m, n, k, g, device=DEV, generator=gen) for m in (40000, 6000, 40000, 17000)]
    assert tk.grid_for(config, 6000, n, k, g, tk._sm_count(DEV)) == tk.grid_for(config, 40000, n, k, g,
                                                                                 tk._sm_count(DEV))
    eager = []
    for p in problems:
        eager.append(_launch(p, _poisoned(p.xq.shape[0], n), config))
        torch.cuda.synchronize()
        assert not eager[-1].isnan().any()
        assert rel_error(eager[-1], reference_float64(*p.args())) <= SPEC_TOLERANCE
    outs = [_poisoned(p.xq.shape[0], n) for p in problems[:2]]
    graphs = []
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for p, out in zip(problems[:2], outs):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _launch(p, out, config)
            graphs.append(graph)
    torch.cuda.synchronize()
    for _ in range(3):
        for graph, out, want in zip(graphs, outs, eager[:2]):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)


def test_one_live_group_of_one_row():
    m, n, k, g = 1, 256, 512, 128
    sizes = torch.zeros(g, dtype=torch.int64)
    sizes[77] = 1
    gen = torch.Generator(device=DEV).manual_seed(5)
    p = random_problem(m, n, k, g, device=DEV, m_sizes=sizes, generator=gen)
    out = _launch(p, _poisoned(m, n))
    torch.cuda.synchronize()
    assert rel_error(out, reference_float64(*p.args())) <= SPEC_TOLERANCE


def test_float32_out_is_the_sum_unrounded():
    """Rounded to bf16 it is the bf16 output bit for bit (the table's gluon_ws_store tile; a
    float32 output runs it as gluon_ws); closer to the oracle than that."""
    sizes = torch.tensor([0, 301, 1, 0, 77, 500, 17, 128] * 8)
    m, n, k, g = int(sizes.sum()), 512, 1152, 64
    assert tk.default_config(m, n, k, g) == STORE
    gen = torch.Generator(device=DEV).manual_seed(6)
    p = random_problem(m, n, k, g, device=DEV, m_sizes=sizes, generator=gen)
    narrow = grouped_gemm(*p.args(), out=_poisoned(m, n))
    wide = grouped_gemm(*p.args(), out=_poisoned(m, n, torch.float32))
    torch.cuda.synchronize()
    assert torch.isfinite(wide).all()
    assert torch.equal(wide.to(torch.bfloat16), narrow)
    assert not torch.equal(wide, narrow.float())
    ref = reference_float64(*p.args())
    assert rel_error(wide, ref) < rel_error(narrow, ref)


def test_rows_outside_every_group_are_not_written():
    # Sizes summing to less than M: the rows past them belong to no group and stay as they were.
    m, n, k, g = 700, 256, 1024, 8
    sizes = torch.tensor([100, 0, 250, 0, 0, 50, 0, 0], dtype=torch.int64)
    gen = torch.Generator(device=DEV).manual_seed(9)
    p = random_problem(m, n, k, g, device=DEV, m_sizes=sizes, generator=gen)
    out = _launch(p, _poisoned(m, n))
    torch.cuda.synchronize()
    assert out[400:].isnan().all()
    ref = reference_float64(p.xq[:400], p.wq, p.x_scale[:400], p.w_scale, p.m_sizes)
    assert rel_error(out[:400], ref) <= SPEC_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_server_form_in_a_graph_equals_the_public_entry(dtype):
    """G = 384, ragged with empty groups: weights and activations by address (device words
    rewritten between replays), rows stored through a map; each replay == the public entry on
    the same data, bit for bit, and both run the Gluon tile (gluon_ws_store; as gluon_ws into
    float32)."""
    m, n, k, g = 13000, 512, 1536, 384  # 33.9 rows per group: the Gluon tile's class (r >= 32)
    assert tk.default_config(m, n, k, g) == STORE
    gen = torch.Generator(device=DEV).manual_seed(13)
    torch.manual_seed(13)
    first = random_problem(m, n, k, g, device=DEV, generator=gen)
    second = random_problem(m, n, k, g, device=DEV, generator=gen, m_sizes=random_m_sizes(g, m))
    assert int((first.m_sizes == 0).sum()) >= 1 and int((second.m_sizes == 0).sum()) >= 1
    sizes = first.m_sizes.clone()
    words = torch.zeros(4, dtype=torch.int64, device=DEV)
    rows = torch.randperm(m, device=DEV)
    pairs = torch.stack([rows, rows], 1)  # a map with stride 2, as the server's
    out = _poisoned(m, n, dtype)

    def point_at(p):
        words.copy_(torch.tensor([p.wq.data_ptr(), p.w_scale.data_ptr(), p.xq.data_ptr(), p.x_scale.data_ptr()]))
        sizes.copy_(p.m_sizes)

    point_at(first)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tk.run_addressed(first.xq, words[:2], first.x_scale, sizes, out, groups=g, inputs=words[2:],
                         out_rows=pairs[:, 1])  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tk.run_addressed(first.xq, words[:2], first.x_scale, sizes, out, groups=g, inputs=words[2:],
                             out_rows=pairs[:, 1])
    torch.cuda.synchronize()
    for p in (first, second, first):
        point_at(p)
        out.fill_(float("nan"))
        graph.replay()
        want = grouped_gemm(*p.args(), out=_poisoned(m, n, dtype))
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert torch.equal(out[rows], want)
    assert tk.tile_key(m, n, k, g, dtype, device=DEV) == (STORE if dtype == torch.bfloat16 else GLUON).key()


@pytest.mark.parametrize("words,row_map", [(True, False), (True, True)], ids=["words", "words_row_map"])
@pytest.mark.parametrize("config", [GLUON, STORE], ids=lambda c: c.schedule)
def test_tail_tiles_give_the_public_bits_in_every_form(config, words, row_map):
    """Skewed sizes with empty groups and tails on both sides of 64 rows (G = 256, r = 42, as
    Kimi-K2 / DeepSeek-V3 at 2048 tokens: most tiles skip a dead half, in the order the programs
    claim them): the server's forms give the public launch's bits, rows outside every group
    untouched, within SPEC 1's tolerance of float64."""
    g, n, k = 256, 512, 1536
    sizes = random_m_sizes(g, 42 * g, generator=torch.Generator().manual_seed(5))
    sizes[:6] = torch.tensor([0, 64, 65, 1, 128 + 64, 128 + 65])
    live = int(sizes.sum())
    m = live + 70  # rows past the last group: never written
    gen = torch.Generator(device=DEV).manual_seed(17)
    p = random_problem(m, n, k, g, device=DEV, m_sizes=sizes, generator=gen)
    rem = p.m_sizes % 128
    assert int((p.m_sizes == 0).sum()) >= 1
    assert int(((rem > 0) & (rem <= 64)).sum()) >= 40 and int((rem > 64).sum()) >= 20
    out_rows = torch.randperm(m, device=DEV) if row_map else None
    public = _launch_form(p, _poisoned(m, n), config, False)
    out = _launch_form(p, _poisoned(m, n), config, words, out_rows)
    torch.cuda.synchronize()
    got = out[out_rows] if row_map else out
    assert torch.equal(_bits(got), _bits(public))
    assert not got[:live].isnan().any() and got[live:].isnan().all()
    want = reference_float64(p.xq[:live], p.wq, p.x_scale[:live], p.w_scale, p.m_sizes)
    assert rel_error(got[:live], want) <= SPEC_TOLERANCE


# ---- the issue-15 variants (kernels/_gluon_gemm.py): gluon_ws's bits in every form ---------------

VARIANTS = ["gluon_ws_store"]


def _tile(schedule):
    return tk.TileConfig(schedule, 128, 256, 4, 3, group_tiles_m=8)


def _bits(t):
    """The output's bit patterns: equal NaN poison compares equal (a row no kernel wrote)."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _launch_form(p, out, config, words: bool, out_rows=None):
    """``config`` on ``p`` as a launch takes it: plain pointers, or (``words``) the weights and
    activations by address, as a server graph; ``out_rows``: the row map."""
    g, n, _ = p.wq.shape
    if words:
        w = torch.tensor([p.wq.data_ptr(), p.w_scale.data_ptr(), p.xq.data_ptr(), p.x_scale.data_ptr()],
                         dtype=torch.int64, device=DEV)
        return tk._launch(p.xq, w[:2], p.x_scale, w[:2], p.m_sizes, out, n, g, config, addrs=True,
                          x_words=w[2:], out_rows=out_rows)
    return tk._launch(p.xq, p.wq, p.x_scale, p.w_scale, p.m_sizes, out, n, g, config, addrs=False,
                      out_rows=out_rows)


# The forms a launch takes: the public entry's; a server graph's lone prefill call (weights and
# rows by address, stored in place); its merged call (and the row map).
FORMS = [(False, False), (True, False), (True, True)]


@pytest.mark.parametrize("words,row_map", FORMS, ids=["pointers", "words", "words_row_map"])
@pytest.mark.parametrize("m,n,k,g", [(1000, 256, 1152, 8), (16384, 512, 2048, 128), (8191, 256, 7168, 256),
                                     (5000, 512, 1536, 384), (20000, 1024, 128, 64)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_is_gluon_ws_bit_for_bit(variant, m, n, k, g, words, row_map):
    """Ragged groups with empty ones, G up to 384, M not a multiple of 128, K of one block (a
    tile per ring slot: the tile ring and the staging turn over fastest), more tiles than SMs;
    the row map a permutation with the server's stride 2 (plain pointers with the row map:
    test_variant_leaves_rows_outside_every_group)."""
    gen = torch.Generator(device=DEV).manual_seed(m + g + k)
    torch.manual_seed(m * g + k)
    p = random_problem(m, n, k, g, device=DEV, generator=gen)
    assert int((p.m_sizes == 0).sum()) >= 1
    out_rows = None
    if row_map:
        pairs = torch.zeros((m, 2), dtype=torch.int64, device=DEV)
        pairs[:, 0] = torch.randperm(m, device=DEV)
        out_rows = pairs[:, 0]
    want = _launch_form(p, _poisoned(m, n), _tile("gluon_ws"), words, out_rows)
    got = _launch_form(p, _poisoned(m, n), _tile(variant), words, out_rows)
    torch.cuda.synchronize()
    assert not want.isnan().any()  # every row is some group's
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_leaves_rows_outside_every_group(variant):
    # Sizes summing to less than M, and a group ending mid-tile: the rows past the groups stay as
    # they were (the store warps' chunk count and masks), in place and through the row map.
    m, n, k, g = 700, 512, 1024, 8
    sizes = torch.tensor([100, 0, 250, 0, 0, 50, 0, 0], dtype=torch.int64)
    gen = torch.Generator(device=DEV).manual_seed(19)
    p = random_problem(m, n, k, g, device=DEV, m_sizes=sizes, generator=gen)
    rows = torch.randperm(m, device=DEV)
    for out_rows in (None, rows):
        want = _launch_form(p, _poisoned(m, n), _tile("gluon_ws"), False, out_rows)
        got = _launch_form(p, _poisoned(m, n), _tile(variant), False, out_rows)
        torch.cuda.synchronize()
        written = torch.arange(m, device=DEV) < 400
        if out_rows is not None:
            written = torch.zeros(m, dtype=torch.bool, device=DEV).index_fill_(0, rows[:400], True)
        assert got[~written].isnan().all() and not got[written].isnan().any()
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_into_float32(variant):
    """float32 out (the FFN's h): gluon_ws_store's tile runs as gluon_ws (tile_for_out), so
    gluon_ws's bits."""
    sizes = torch.tensor([0, 301, 1, 0, 77, 500, 17, 128] * 8)
    m, n, k, g = int(sizes.sum()), 512, 1152, 64
    gen = torch.Generator(device=DEV).manual_seed(6)
    p = random_problem(m, n, k, g, device=DEV, m_sizes=sizes, generator=gen)
    want = _launch(p, _poisoned(m, n, torch.float32))
    got = _launch(p, _poisoned(m, n, torch.float32), _tile(variant))
    torch.cuda.synchronize()
    assert torch.isfinite(want).all()
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_in_a_graph_follows_the_words(variant):
    """Captured once in the server's form (device words rewritten between replays, a row map):
    each replay is gluon_ws's eager output on the data the words point at."""
    m, n, k, g = 13000, 512, 1536, 384
    gen = torch.Generator(device=DEV).manual_seed(23)
    torch.manual_seed(23)
    first = random_problem(m, n, k, g, device=DEV, generator=gen)
    second = random_problem(m, n, k, g, device=DEV, generator=gen, m_sizes=random_m_sizes(g, m))
    sizes = first.m_sizes.clone()
    words = torch.zeros(4, dtype=torch.int64, device=DEV)
    rows = torch.randperm(m, device=DEV)
    pairs = torch.stack([rows, rows], 1)
    out = _poisoned(m, n)

    def point_at(p):
        words.copy_(torch.tensor([p.wq.data_ptr(), p.w_scale.data_ptr(), p.xq.data_ptr(), p.x_scale.data_ptr()]))
        sizes.copy_(p.m_sizes)

    def launch():
        tk._launch(first.xq, words[:2], first.x_scale, words[:2], sizes, out, n, g, _tile(variant), addrs=True,
                   x_words=words[2:], out_rows=pairs[:, 1])

    point_at(first)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launch()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
    torch.cuda.synchronize()
    for p in (first, second, first):
        point_at(p)
        out.fill_(float("nan"))
        graph.replay()
        want = _launch(p, _poisoned(m, n))
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert torch.equal(out[rows], want)
