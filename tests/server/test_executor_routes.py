"""The graph path's lookups, memoised per weight set and input dtype, follow every change
of what they looked up: a replaced set (new tensors, even under the same object), a
deleted one, graphs captured or dropped, the weight table given up.

On the CPU the pool launches by a stub "address launcher", its graphs are stand-ins that
count replays and the driver copies are skipped: the memo's bookkeeping is what runs
(the GPU's own check: ``test_engine_gpu.py``, ``test_routes_follow_replaced_and_captured_sets``).
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import torch
from moegemm.kernels.reference import create as reference_backend
from moegemm.kernels.testing import random_problem
from moegemm.server._executor import Executor
from moegemm.server._graphs import ADDRESS_WORDS, INPUT_WORDS, Family, GraphPool
from moegemm.server._staging import Staging
from server_support import gemm_call

N, K, G = 256, 256, 4


class _Graph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class _NoCopies:
    def htod(self, *a) -> None:
        pass

    def dtoh(self, *a) -> None:
        pass

    def wait(self) -> None:
        pass


def _setup(table: bool = True):
    """An executor whose pool launches as on a GPU (buckets, a weight table when
    ``table``) and counts its graph lookups; every (family, bucket) has a stand-in graph
    unless taken out of ``graphs``."""
    pool = GraphPool(reference_backend(torch.device("cpu")), 16, graphs=False)
    pool.pad_to_bucket = True
    if table:
        pool.run_table = lambda *a, **kw: None
    graphs: dict[tuple, _Graph] = {}
    looked: list[tuple] = []

    def graph(family, launched, wq, w_scale, merged=False):
        key = (family, launched, merged) if pool.run_table is not None else \
            (family, launched, merged, wq.data_ptr())
        looked.append(key)
        return graphs.setdefault(key, _Graph()) if key not in missing else None

    missing: set[tuple] = set()
    pool.graph = graph
    pool.held = pool.buffers  # every family "captured": its static buffers made on use
    staging = Staging(torch.device("cpu"))
    staging._copies = _NoCopies()
    return Executor(pool, staging), graphs, looked, missing


def _weights(seed: int):
    p = random_problem(1, N, K, G, generator=torch.Generator().manual_seed(seed))
    return SimpleNamespace(name="w", G=G, N=N, K=K, wq=p.wq, w_scale=p.w_scale)


def _call(ws, rows: int = 1):
    x = torch.zeros(rows, K, dtype=torch.float8_e4m3fn)
    return gemm_call(ws, x, torch.ones(rows, K // 128), [rows] + [0] * (G - 1))


def _launch(ex, ws, rows: int = 1):
    ex.staging.enter()
    ex.staging.begin()
    return ex._run_graph(ws, [_call(ws, rows)])


def _table_words(ex) -> tuple[int, int]:
    meta = ex._lane(Family(G, N, K, False)).meta_host
    return tuple(int(v) for v in meta[G:G + ADDRESS_WORDS])


def test_lookups_are_made_once_per_set_and_bucket():
    ex, graphs, looked, _ = _setup()
    ws = _weights(0)
    for _ in range(5):
        assert _launch(ex, ws) is not None
    assert len(looked) == 1 and next(iter(graphs.values())).replays == 5
    assert _table_words(ex) == (ws.wq.data_ptr(), ws.w_scale.data_ptr())
    _launch(ex, ws, rows=3)  # another bucket: one more lookup, then memoised too
    _launch(ex, ws, rows=4)
    assert len(looked) == 2 and looked[-1][1] == 4


def test_a_replaced_set_is_looked_up_again_even_under_the_same_object():
    ex, _, looked, _ = _setup()
    ws = _weights(0)
    _launch(ex, ws)
    b = _weights(1)  # a replacement: a new set of the same shape
    _launch(ex, b)
    assert len(looked) == 2 and _table_words(ex) == (b.wq.data_ptr(), b.w_scale.data_ptr())
    # The same Python object now holding other tensors (as a set freed and another made
    # at its address would look by id): its table words are the new tensors'.
    c = _weights(2)
    ws.wq, ws.w_scale = c.wq, c.w_scale
    _launch(ex, ws)
    assert len(looked) == 3 and _table_words(ex) == (c.wq.data_ptr(), c.w_scale.data_ptr())


def test_a_deleted_sets_route_keeps_nothing_alive():
    ex, _, _, _ = _setup()
    ws = _weights(0)
    _launch(ex, ws)
    freed = []
    import weakref

    weakref.finalize(ws.wq, freed.append, "wq")
    del ws
    gc.collect()
    assert freed == ["wq"]  # the memo held no reference to the set's memory


def test_captures_forgets_and_a_dropped_table_invalidate_the_routes():
    ex, graphs, looked, missing = _setup(table=False)
    pool, ws = ex.pool, _weights(0)
    family = Family(G, N, K, False)
    key = (family, 1, False, ws.wq.data_ptr())
    missing.add(key)  # not captured yet: the general path runs the call
    assert _launch(ex, ws) is None and _launch(ex, ws) is None
    assert len(looked) == 1  # "no graph" is memoised as well
    # A capture of the set's graphs bumps the pool's generation (GraphPool.capture).
    missing.discard(key)
    pool.generation += 1
    assert _launch(ex, ws) is not None and len(looked) == 2
    # Forgetting the set's graphs (per-set graphs: their keys hold its wq address).
    pool._graphs[(family, 1, ws.wq.data_ptr(), ws.w_scale.data_ptr())] = graphs[key]
    before = pool.generation
    pool.forget(ws.wq)
    assert pool.generation == before + 1
    missing.add(key)
    assert _launch(ex, ws) is None and len(looked) == 3


def test_the_lone_call_rewrites_only_the_sizes():
    """After the first launch a lone call's words differ only in the sizes: the table,
    input words and identity order are not written again, and stay right."""
    ex, _, _, _ = _setup()
    ws = _weights(0)
    _launch(ex, ws, rows=4)
    lane = ex._lane(Family(G, N, K, False))
    meta = lane.meta_host
    at = G + ADDRESS_WORDS
    words = tuple(int(v) for v in meta[at:at + INPUT_WORDS])
    assert words == (lane.bufs.x.data_ptr(), lane.bufs.x_scale.data_ptr(), 0)
    meta[at + INPUT_WORDS:] = -1  # would show any order the next launch relied on
    lane.bufs.host_known = (lane.bufs.host_known[0], lane.bufs.host_known[1], 0)
    _launch(ex, ws, rows=2)
    pairs = meta[at + INPUT_WORDS:at + INPUT_WORDS + 4].reshape(2, 2)
    assert pairs.tolist() == [[0, 0], [1, 1]]
    assert meta[:G].tolist() == [2, 0, 0, 0]
