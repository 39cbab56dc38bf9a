"""Expert sets on a GPU server: ffn/moe answers within the bound, equal bit for bit
to the eager chain (FfnExecutor) on the same device, from graphs captured when
the set loaded (no call captures one), and bad routing refused without touching
memory.

Skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm device", allow_module_level=True)

from experts_support import check_any_set, ffn_body, moe_body, post, put_experts, upload_body
from ffn_support import FfnExecutor
from moegemm.kernels.testing import random_m_sizes, rel_error
from moegemm.kernels.testing_ffn import (
    FFN_TOLERANCE,
    random_experts,
    random_routing,
)
from moegemm.server import Settings
from server_support import assert_error, out_of, serve


@pytest.fixture(scope="module")
def gpu_server():
    settings = Settings(device="cuda", demo=False, max_bucket_m=256)
    with serve(settings) as srv:
        yield srv


def test_gpu_ffn_and_moe(gpu_server):
    srv = gpu_server
    g, h, i = 16, 512, 256
    p = random_experts(g, h, i)
    assert put_experts(srv.http, "e", upload_body(p)).status_code == 201
    es = srv.app.state.experts.store.get("e")
    eager = FfnExecutor(srv.services.engine.backend)
    graphs = srv.services.engine._experts.graphs
    captured = graphs.captures
    assert captured > 0 and graphs.graph_count() == captured  # at load
    for m in (0, 1, 83, 256, 700):  # 700 > max_bucket_m
        sizes = random_m_sizes(g, m)
        x = p.tokens(m)
        out = out_of(post(srv.http, "e", "ffn", ffn_body(x, sizes)))
        assert torch.equal(out, eager.ffn(es, x, None, sizes.tolist()))
        if m:
            assert rel_error(out, p.ffn_reference(*p.quantized(x), sizes)) <= FFN_TOLERANCE
    for tokens, k in ((1, 8), (16, 8), (64, 2), (200, 1)):
        ids, weights = random_routing(tokens, k, g)
        x = p.tokens(tokens)
        out = out_of(post(srv.http, "e", "moe", moe_body(x, ids, weights)))
        assert torch.equal(out, eager.moe(es, x, None, ids, weights))
        ref = p.moe_reference(*p.quantized(x), ids, weights)
        assert rel_error(out, ref) <= FFN_TOLERANCE
    bad, weights = random_routing(8, 2, g)
    bad[3, 1] = 1 << 40  # far out of bounds: must be refused, never indexed
    assert_error(post(srv.http, "e", "moe", moe_body(p.tokens(8), bad, weights)), 400,
                 "bad_routing")
    sizes = random_m_sizes(g, 32)
    x = p.tokens(32)
    assert torch.equal(out_of(post(srv.http, "e", "ffn", ffn_body(x, sizes))),
                       eager.ffn(es, x, None, sizes.tolist()))
    assert graphs.captures == captured  # no call captured a graph
    assert srv.http.delete("/v1/experts/e").status_code == 204
    assert graphs.graph_count() == 0  # the last set of its shape took its graphs along


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    g=st.sampled_from([1, 2, 8, 60, 128, 256]),
    h_blocks=st.integers(1, 24),
    i_blocks=st.integers(1, 12),
    m=st.integers(0, 600),
    tokens=st.integers(0, 300),
    k=st.sampled_from([1, 2, 3, 8]),
    hot=st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
def test_any_expert_set_shape_and_routing(gpu_server, g, h_blocks, i_blocks, m, tokens, k, hot,
                                          seed):
    """Shapes and routings the test above does not name: H and I any multiple of 128 (up to
    3072 and 1536), 1-256 experts, ffn rows past the largest bucket, a top-k with no
    captured graph (3), and tokens routed to only a few hot experts (``hot`` > 0) or to
    all (:func:`experts_support.check_any_set`)."""
    assume(g * 3 * (128 * i_blocks) * (128 * h_blocks) <= 1 << 27)  # the fp8 bytes uploaded
    check_any_set(gpu_server, g, 128 * h_blocks, 128 * i_blocks, m, tokens, k, hot, seed)
