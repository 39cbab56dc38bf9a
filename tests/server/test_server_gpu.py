"""The whole server on a GPU: uploads, graphs captured at load, merged and chunked calls.

Skipped without a CUDA device; the device's backend is whatever the kernels pick.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm device", allow_module_level=True)

from moegemm.kernels import (
    fn_to_fnuz,
    quantize_activations,
    quantize_weights,
    reference_float64,
)
from moegemm.kernels.testing import random_m_sizes
from moegemm.server import Settings
from server_support import close_to, fp8_problem, out_of, serve, wire

N, K, G = 256, 512, 8


@pytest.fixture(scope="module")
def gpu_server():
    settings = Settings(device="cuda", demo=False, max_bucket_m=256, merge_window_us=5_000)
    with serve(settings) as srv:
        yield srv


def test_gpu_gemm_fp8_bf16_fnuz_chunked_merged(gpu_server):
    srv = gpu_server
    info = srv.http.get("/v1/info").json()
    assert info["device"].startswith("cuda")
    p = fp8_problem(1, N, K, G)
    assert srv.put("g", {"w": wire(p.wq), "w_scale": wire(p.w_scale)}).status_code == 201
    w16 = torch.randn(G, N, K).bfloat16()
    assert srv.put("g16", {"w": wire(w16)}).status_code == 201
    wq16, ws16 = quantize_weights(w16)

    for rows in (1, 83, 256, 1335):  # 1335 > max_bucket_m: chunks
        x = fp8_problem(rows, N, K, G)
        out = out_of(srv.gemm("g", {"x": wire(x.xq), "x_scale": wire(x.x_scale),
                                    "m_sizes": wire(x.m_sizes)}))
        assert close_to(out, reference_float64(x.xq, p.wq, x.x_scale, p.w_scale, x.m_sizes))
        xb = torch.randn(rows, K).bfloat16()
        m = random_m_sizes(G, rows)
        out = out_of(srv.gemm("g16", {"x": wire(xb), "m_sizes": wire(m)}))
        xq, xs = quantize_activations(xb)
        assert close_to(out, reference_float64(xq, wq16, xs, ws16, m))
    x = fp8_problem(40, N, K, G)
    xq, xs = fn_to_fnuz(x.xq, x.x_scale)
    out = out_of(srv.gemm("g", {"x": wire(xq), "x_scale": wire(xs), "m_sizes": wire(x.m_sizes)}))
    assert close_to(out, reference_float64(x.xq, p.wq, x.x_scale, p.w_scale, x.m_sizes))

    problems = [fp8_problem(3 + 17 * i, N, K, G) for i in range(8)]

    def one(q):
        import httpx
        from moegemm.client._wire import packb
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            r = http.post("/v1/weights/g/gemm", headers={"content-type": "application/msgpack"},
                          content=packb({"x": wire(q.xq), "x_scale": wire(q.x_scale),
                                         "m_sizes": wire(q.m_sizes)}))
        return close_to(out_of(r), reference_float64(q.xq, p.wq, q.x_scale, p.w_scale,
                                                     q.m_sizes))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, problems * 3))
    text = srv.http.get("/metrics").text
    graph = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith('moegemm_launches_total{mode="graph"}'))
    if info["graphs"]:
        assert graph > 0
    print(info, "graph launches:", graph)
