"""What ships, on a GPU: ``moegemm serve`` as its own process at its defaults (the fast
transport, its acceptor processes, the engine's lanes), driven over loopback.

Skipped without a CUDA device.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm device", allow_module_level=True)

from moegemm.client._wire import encode_tensor, packb
from server_support import MSGPACK, assert_error, close_to, fp8_problem, out_of, reference, wire

N, K, G = 256, 512, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """``moegemm serve --device cuda`` with nothing else set; its http client."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("shipped") / "server.log", "w+")  # noqa: SIM115 -- the server writes it until teardown
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEGEMM_")}
    proc = subprocess.Popen([sys.executable, "-m", "moegemm.cli", "serve", "--device", "cuda",
                             "--port", str(port), "--no-demo"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the server exited: {log.read()[-4000:]}")
            try:
                if http.get("/v1/health/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not become ready")
            time.sleep(0.2)
        http.proc, http.log = proc, log
        yield http
    finally:
        http.close()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _gemm(http, name, body):
    return http.post(f"/v1/weights/{name}/gemm", content=packb(body), headers=MSGPACK)


def test_overflowing_m_sizes_are_refused_and_the_device_stays_exact(shipped):
    """The issue's body ([2^63-1, 2^63-1, 18, 0...]: int64 sum 16, exact 2^64+16) on
    every lane a lone call, a merged turn and the general path take."""
    p = fp8_problem(1, N, K, G)
    r = shipped.put("/v1/weights/ovf", content=packb({"w": wire(p.wq), "w_scale": wire(p.w_scale)}),
                    headers=MSGPACK)
    assert r.status_code == 201, r.text
    overflow = np.array([2**63 - 1, 2**63 - 1, 18, 0, 0, 0, 0, 0], dtype=np.int64)
    for rows in (16, 16, 300):  # lone (twice: the lane, then warm), and a general-path size
        x = fp8_problem(rows, N, K, G)
        sizes = overflow.copy()
        sizes[2] = rows + 2
        bad = {"x": wire(x.xq), "x_scale": wire(x.x_scale), "m_sizes": encode_tensor(sizes)}
        assert_error(_gemm(shipped, "ovf", bad), 400, "bad_m_sizes")
        out = out_of(_gemm(shipped, "ovf", {"x": wire(x.xq), "x_scale": wire(x.x_scale),
                                            "m_sizes": wire(x.m_sizes)}))
        assert close_to(out, reference(x.xq, x.x_scale, p.wq, p.w_scale, x.m_sizes))
    # Several at once (loop batches merge them): bad ones refused, good ones exact.
    from concurrent.futures import ThreadPoolExecutor

    def one(i):
        x = fp8_problem(5 + i, N, K, G)
        with httpx.Client(base_url=str(shipped.base_url), timeout=120) as http:
            if i % 2:
                sizes = overflow.copy()
                sizes[2] = 5 + i + 2
                r = _gemm(http, "ovf", {"x": wire(x.xq), "x_scale": wire(x.x_scale),
                                        "m_sizes": encode_tensor(sizes)})
                return r.status_code == 400 and r.json()["error"]["code"] == "bad_m_sizes"
            r = _gemm(http, "ovf", {"x": wire(x.xq), "x_scale": wire(x.x_scale),
                                    "m_sizes": wire(x.m_sizes)})
            return close_to(out_of(r), reference(x.xq, x.x_scale, p.wq, p.w_scale, x.m_sizes))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(32)))
    assert shipped.get("/v1/health/ready").status_code == 200
    assert shipped.proc.poll() is None
