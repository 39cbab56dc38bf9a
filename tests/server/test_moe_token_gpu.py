"""The one-token moe body (two kernels, ``kernels/_triton_moe_token.py``) on the GPU: bit for bit
the grouped path.

A lone token's moe runs the two kernels; the same token merged with others runs the
grouped body of a larger bucket, and the eager chain (``FfnExecutor``: the public GEMM
at ``k`` rows, the activation kernel, torch's combine) is the grouped computation
without graphs. All three must give the same bits (SPEC 5.1: merged == alone), on
Qwen3-30B-like and DeepSeek-V3-like shapes (their real H and I, fewer experts: the tiles
are those of G >= 64) and a small-G shape whose w2 tile splits K two ways over an odd
block count (the pair's tail inside a split); int32 and int64 ids, bf16 and fp8 tokens,
top-k 1, 2 and 8. Bad routing and bad tokens are refused, and the next call's bits do
not change (the kernels' counters are left at zero). Skipped without an NVIDIA GPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.version.hip:
    pytest.skip("needs an NVIDIA CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from types import SimpleNamespace

from ffn_support import FfnExecutor, Runner, random_routing
from moegemm.client._errors import NotFinite
from moegemm.kernels import get_backend, quantize_activations

DEV = torch.device("cuda")
SHAPES = {"qwen3-30b-like": (64, 2048, 768), "deepseek-v3-like": (64, 7168, 2048),
          "split-k": (8, 1152, 4224),
          # One expert's w13 is 80 weight tiles at H = 4096: the unsplit 6-slot tile (rule 1a).
          "unsplit-ring": (8, 4096, 5120)}
# (shape, top-k, token kind, ids dtype)
CASES = [("qwen3-30b-like", 8, "bf16", torch.int64), ("qwen3-30b-like", 8, "fp8", torch.int32),
         ("qwen3-30b-like", 1, "bf16", torch.int32), ("qwen3-30b-like", 2, "fp8", torch.int64),
         ("deepseek-v3-like", 8, "bf16", torch.int32), ("deepseek-v3-like", 1, "fp8", torch.int64),
         ("split-k", 2, "bf16", torch.int64), ("split-k", 8, "fp8", torch.int32),
         ("unsplit-ring", 1, "fp8", torch.int64)]


@pytest.fixture(scope="module")
def backend():
    return get_backend(DEV)


def _weights(G: int, N: int, K: int, gen: torch.Generator, name: str):
    bits = torch.randint(0, 256, (G, N, K), dtype=torch.uint8, device=DEV, generator=gen)
    bits[(bits & 0x7F) == 0x7F] = 0x38  # no NaN codes
    scale = torch.rand((G, K // 128, N // 128), device=DEV, generator=gen) * 1e-3 + 1e-4
    return SimpleNamespace(wq=bits.view(torch.float8_e4m3fn), w_scale=scale, G=G, N=N, K=K,
                           name=name)


_SETS: dict = {}


def _experts(shape: str):
    """A duck-typed expert set of ``shape``, random fp8 made on the device (made once)."""
    if shape not in _SETS:
        _SETS.clear()  # one at a time: the DeepSeek-like set is 2.8 GB
        G, H, I = SHAPES[shape]
        gen = torch.Generator(device=DEV).manual_seed(torch.seed())
        _SETS[shape] = SimpleNamespace(name=shape, G=G, H=H, I=I,
                                       w13=_weights(G, 2 * I, H, gen, f"{shape}.w13"),
                                       w2=_weights(G, H, I, gen, f"{shape}.w2"))
    return _SETS[shape]


def _token(H: int, kind: str, gen: torch.Generator):
    x = (torch.randn((1, H), generator=gen) * 2).to(torch.bfloat16)
    if kind == "bf16":
        return x, None
    xq, xs = quantize_activations(x.float(), torch.float8_e4m3fn)
    return xq, xs


def _twice(x: torch.Tensor) -> torch.Tensor:
    """Row 0 of ``x`` twice (fp8 through its bytes)."""
    return x.view(torch.uint8).repeat(2, 1).view(x.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _counting(runner: Runner) -> list:
    """Count the one-token body's launches (it must be the path a lone token takes)."""
    calls = []
    real = runner.graphs._moe_token
    runner.graphs._moe_token = lambda *a: calls.append(1) or real(*a)
    return calls


def _same_tiles(backend, es, k: int) -> bool:
    """Whether buckets of 1 and 2 tokens run both GEMMs with the same tiles (the executor
    merges calls only then)."""
    t = backend.tile_key
    return all(t(k, n, kk, es.G, dt) == t(2 * k, n, kk, es.G, dt)
               for n, kk, dt in ((2 * es.I, es.H, torch.float32), (es.H, es.I, torch.bfloat16)))


@pytest.mark.parametrize(("shape", "k", "kind", "ids_dtype"), CASES)
def test_one_token_equals_the_grouped_path(backend, shape, k, kind, ids_dtype):
    es = _experts(shape)
    gen = torch.Generator().manual_seed(torch.seed())
    runner = Runner(backend, 16, graphs=False, top_ks=(k,))
    calls = _counting(runner)
    x, xs = _token(es.H, kind, gen)
    ids, w = random_routing(1, es.G, k, gen, dtype=ids_dtype)
    lone = runner.moe(es, x, xs, ids, w)
    assert len(calls) == 1
    assert torch.equal(_bits(lone), _bits(FfnExecutor(backend).moe(es, x, xs, ids, w)))
    if shape not in ("split-k", "unsplit-ring") and (shape, k) != ("deepseek-v3-like", 1):
        # The real shapes' t1 and t2 tiles agree; one expert's w13 at G = 64 splits K by its
        # weight tiles (8 ways for 32 tiles, 4 for 64), and one expert's 80 tiles run unsplit
        # where two experts' 160 do not: the calls then run apart (SPEC 5.1).
        assert _same_tiles(backend, es, k)
    if not _same_tiles(backend, es, k):
        return
    # The same token twice in one call: a 2-token bucket, the grouped body.
    twice = runner.moe(es, _twice(x), None if xs is None else xs.repeat(2, 1),
                       ids.repeat(2, 1), w.repeat(2, 1))
    assert len(calls) == 1
    assert torch.equal(_bits(twice[0:1]), _bits(lone)) and torch.equal(_bits(twice[1:2]), _bits(lone))
    # Two calls merged by the executor (as the engine merges them), each its own answer.
    y, ys = _token(es.H, kind, gen)
    ids2, w2 = random_routing(1, es.G, k, gen, dtype=ids_dtype)
    merged = runner.moe_many(es, [(x, xs, ids, w), (y, ys, ids2, w2)])
    assert runner.launches[-1].eager == 1 and len(calls) == 1  # one launch for both
    assert torch.equal(_bits(merged[0]), _bits(lone))
    assert torch.equal(_bits(merged[1]), _bits(runner.moe(es, y, ys, ids2, w2)))


def test_graph_replays_equal_eager_and_bad_calls_change_nothing(backend):
    """Captured (as a load captures it) the one-token graph answers the eager bits; bad
    routing and bad tokens are refused and the next call's bits do not change."""
    es = _experts("qwen3-30b-like")
    gen = torch.Generator().manual_seed(torch.seed())
    k = 8
    graphs = Runner(backend, 16, top_ks=(k,))
    assert graphs.prepare(es) > 0
    calls = _counting(graphs)
    eager = Runner(backend, 16, graphs=False, top_ks=(k,))
    for kind, ids_dtype in (("bf16", torch.int64), ("fp8", torch.int32)):
        x, xs = _token(es.H, kind, gen)
        ids, w = random_routing(1, es.G, k, gen, dtype=ids_dtype)
        want = graphs.moe(es, x, xs, ids, w)
        assert graphs.graphs.eager_runs == 0 and not calls  # replayed: the capture's kernels
        assert torch.equal(_bits(want), _bits(eager.moe(es, x, xs, ids, w)))
        bad_ids = [es.G, -1] + ([1 << 40, -(1 << 62)] if ids_dtype == torch.int64 else [])
        cases = []
        for value in bad_ids:
            b = ids.clone()
            b[0, k - 1] = value
            cases.append((b, w))
        dup = ids.clone()
        dup[0, 1] = dup[0, 0]
        cases.append((dup, w))
        for value in (float("nan"), float("inf")):
            bw = w.clone()
            bw[0, 0] = value
            cases.append((ids, bw))
        for b, bw in cases:
            with pytest.raises(Exception) as info:
                graphs.moe(es, x, xs, b, bw)
            assert getattr(info.value, "code", None) == "bad_routing", (b, bw)
            assert torch.equal(_bits(graphs.moe(es, x, xs, ids, w)), _bits(want))
        bad, bad_s = x.clone(), None if xs is None else xs.clone()
        if kind == "bf16":
            bad[0, 3] = float("nan")
        else:
            bad_s[0, 3] = float("nan")
        with pytest.raises(NotFinite):
            graphs.moe(es, bad, bad_s, ids, w)
        assert torch.equal(_bits(graphs.moe(es, x, xs, ids, w)), _bits(want))
