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
from server_support import (
    MSGPACK, assert_error, close_to, fp8_problem, metric_sum, out_of, reference, wire,
)

N, K, G = 256, 512, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def shipped(tmp_path_factory, weights_dir):
    """``moegemm serve --device cuda`` with nothing else set (but a weights directory);
    its http client (``.url``: its address).

    Ready means this process logged that it listens on its port and the port answers ready:
    a port another worker's server took between ``_free_port`` and the bind answers ready
    too, while this server exits (the port is refused when taken: ``_http._refuse_if_taken``),
    so another port is tried then."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEGEMM_")}
    for _attempt in range(3):
        port = _free_port()
        log = open(tmp_path_factory.mktemp("shipped") / "server.log", "w+")  # noqa: SIM115 -- the server writes it until teardown
        proc = subprocess.Popen([sys.executable, "-m", "moegemm.cli", "serve", "--device", "cuda",
                                 "--port", str(port), "--no-demo", "--weights-dir", str(weights_dir)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        if _ready(proc, log, port):
            break
        log.close()
    else:
        raise RuntimeError("three ports taken while the server started")
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    try:
        http.proc, http.log, http.url = proc, log, f"http://127.0.0.1:{port}"
        yield http
    finally:
        http.close()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _ready(proc, log, port: int, timeout_s: float = 300) -> bool:
    """Wait until ``proc`` listens on ``port`` and answers ready: True; False when it exited
    because the port was taken; raises on any other exit or after ``timeout_s``."""
    listening = f"listening on http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        while True:
            text = _text(log)
            if proc.poll() is not None:
                if "Address already in use" in text:
                    return False
                raise RuntimeError(f"the server exited: {text[-4000:]}")
            if listening in text:
                try:
                    if http.get("/v1/health/ready").status_code == 200:
                        return True
                except httpx.TransportError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not become ready")
            time.sleep(0.2)


def _text(log) -> str:
    """What the server wrote to its log so far."""
    log.flush()
    log.seek(0)
    return log.read()


def _exited(http) -> str | None:
    """Why the shipped server is gone (its exit code and the tail of its log), or None."""
    if http.proc.poll() is None:
        return None
    return f"the server exited with {http.proc.returncode}: {_text(http.log)[-6000:]}"


@pytest.fixture(autouse=True)
def _server_stays_up(request):
    """A test that finds or leaves the shipped server gone fails with the server's own log
    (a refused connection alone says nothing of why)."""
    if "shipped" not in request.fixturenames:
        yield
        return
    http = request.getfixturevalue("shipped")
    gone = _exited(http)
    assert gone is None, f"before the test: {gone}"
    yield
    gone = _exited(http)
    assert gone is None, f"after the test: {gone}"


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


# -- the real client against what ships, bit for bit against the general path -------------


@pytest.fixture(scope="module")
def general():
    """The server's general path in this process (eager, no graphs, no merging): the
    answer every lane of the shipped server must give, bit for bit."""
    import asyncio

    from moegemm.kernels import get_backend
    from moegemm.server.engine import Engine

    engine = Engine(get_backend(torch.device("cuda")), graphs=False, merge_window_us=0)
    engine.start()

    def answer(ws, x, x_scale, m_sizes) -> torch.Tensor:
        from server_support import bf16_rows, gemm_call

        return bf16_rows(asyncio.run(engine.submit(gemm_call(ws, x, x_scale, m_sizes))))

    yield answer
    engine.close()


def _set(g: int, n: int, k: int, seed: int):
    """A device weight set (SimpleNamespace) and its host tensors, in the wire format."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(g, n, k, generator=gen).bfloat16()
    from moegemm.kernels import quantize_weights

    wq, ws = quantize_weights(w.cuda(), torch.float8_e4m3fn)
    return SimpleNamespace(name="s", G=g, N=n, K=k, wq=wq, w_scale=ws), wq.cpu(), ws.cpu()


def _calls(g: int, k: int, seed: int):
    """Calls of every lane: small (merged on the loop or alone), large (the worker),
    several buckets, fp8 and bf16 as they are, fp16 and fnuz converted."""
    from moegemm.kernels.testing import random_m_sizes

    gen = torch.Generator().manual_seed(seed)
    out = []
    for m, kind in [(1, "fp8"), (7, "bf16"), (128, "fp8"), (256, "bf16"), (257, "fp8"),
                    (1024, "fp8"), (3000, "bf16"), (5, "fp16"), (33, "fnuz"), (0, "fp8")]:
        sizes = random_m_sizes(g, m, generator=gen)
        x = torch.randn(m, k, generator=gen)
        if kind in ("fp8", "fnuz"):
            from moegemm.kernels import quantize_activations

            xq, xs = quantize_activations(x, torch.float8_e4m3fn)
            if kind == "fnuz":
                tiny = xq.float().abs() < 2**-5  # exact conversion (SPEC 1.2)
                xq = xq.float().masked_fill(tiny, 0).mul(0.5).to(torch.float8_e4m3fnuz)
                xs = xs * 2
            out.append((xq, xs, sizes))
        else:
            out.append((x.to(torch.bfloat16 if kind == "bf16" else torch.float16), None, sizes))
    return out


def test_the_client_gets_the_general_paths_answer_on_every_lane(shipped, general):
    """Concurrent real clients (``moegemm.client.Client``, keep-alive, through the
    acceptors) on every lane: each answer equals the general path's, bit for bit."""
    from concurrent.futures import ThreadPoolExecutor

    from moegemm.client import Client

    ws, wq, w_scale = _set(8, 512, 1024, seed=1)
    with Client(shipped.url, timeout=120) as c:
        c.load_weights("lanes", wq, w_scale)
    calls = _calls(8, 1024, seed=2)
    want = [general(ws, *call) for call in calls]

    def one(i):
        with Client(shipped.url, timeout=120) as c:
            for j in range(3):  # alone at first, then among the others
                k = (i + j) % len(calls)
                x, xs, sizes = calls[k]
                got = c.grouped_gemm("lanes", x, sizes, x_scale=xs)
                if not (got.shape == want[k].shape and torch.equal(got, want[k])):
                    return k
        return None

    assert one(0) is None  # one client alone first
    with ThreadPoolExecutor(16) as pool:
        assert [k for k in pool.map(one, range(32)) if k is not None] == []


def test_a_load_from_a_file_never_stops_the_calls(shipped, general, weights_dir):
    """While a 1 GB set is loaded from a file (twice: a load and a replacement), another
    set's calls keep coming back right; then the loaded set answers right."""
    import json
    import struct
    import threading

    from moegemm.client import Client

    ws, wq, w_scale = _set(8, 512, 1024, seed=3)
    g, n, k = 64, 2048, 7168
    gen = torch.Generator().manual_seed(4)
    big_w = torch.randint(0, 0x7F, (g, n, k), dtype=torch.uint8, generator=gen)
    big_s = torch.rand(g, k // 128, n // 128, generator=gen) * 1e-3 + 1e-4
    header = {"w": {"dtype": "F8_E4M3", "shape": [g, n, k], "data_offsets": [0, g * n * k]},
              "w_scale": {"dtype": "F32", "shape": [g, k // 128, n // 128],
                          "data_offsets": [g * n * k, g * n * k + big_s.numel() * 4]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(weights_dir / "big.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.write(big_w.numpy().tobytes())
        f.write(big_s.numpy().tobytes())
    x, xs, sizes = _calls(8, 1024, seed=5)[2]
    with Client(shipped.url, timeout=300) as c:
        c.load_weights("steady", wq, w_scale)
        want = general(ws, x, xs, sizes)
        answered, wrong, loading = [0], [0], threading.Event()

        def calls():
            with Client(shipped.url, timeout=120) as mine:
                while loading.is_set():
                    got = mine.grouped_gemm("steady", x, sizes, x_scale=xs)
                    answered[0] += 1
                    wrong[0] += not torch.equal(got, want)

        loading.set()
        caller = threading.Thread(target=calls)
        caller.start()
        started = time.monotonic()
        for _ in range(2):
            c.load_weights_file("big", "big.safetensors", "w", "w_scale")
        took = time.monotonic() - started
        loading.clear()
        caller.join(60)
        assert wrong[0] == 0 and answered[0] >= 50 * took, (answered, took)
        from types import SimpleNamespace

        big = SimpleNamespace(name="big", G=g, N=n, K=k, wq=big_w.view(torch.float8_e4m3fn).cuda(),
                              w_scale=big_s.cuda())
        bx, bxs, bsizes = _calls(g, k, seed=6)[2]
        got = c.grouped_gemm("big", bx, bsizes, x_scale=bxs)
        assert torch.equal(got, general(big, bx, bxs, bsizes))
    assert shipped.proc.poll() is None


# -- expert calls on what ships: merged or alone, the same bits -----------------------------


def _metric(http, sample: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    return metric_sum(http.get("/metrics").text, sample, **labels)


def test_a_call_past_8192_rows_is_one_launch_with_the_public_bits(shipped):
    """SPEC 3 at the defaults (the largest bucket holds ``max_m`` rows): a call of 20000 rows,
    past the 8192-row bucket that was the default before session 56 (then three chunks, run
    eagerly, each with its own tile), is one replay of the 32768-row graph and answers
    the public ``grouped_gemm``'s bits on the same inputs (its kernel and tile, issue 15)."""
    from moegemm.kernels import grouped_gemm

    p = fp8_problem(20000, N, K, G)
    r = shipped.put("/v1/weights/long", content=packb({"w": wire(p.wq), "w_scale": wire(p.w_scale)}),
                    headers=MSGPACK)
    assert r.status_code == 201, r.text
    graph = _metric(shipped, "moegemm_launches_total", mode="graph")
    eager = _metric(shipped, "moegemm_launches_total", mode="eager")
    out = out_of(_gemm(shipped, "long", {"x": wire(p.xq), "x_scale": wire(p.x_scale),
                                         "m_sizes": wire(p.m_sizes)}))
    assert _metric(shipped, "moegemm_launches_total", mode="graph") == graph + 1
    assert _metric(shipped, "moegemm_launches_total", mode="eager") == eager
    want = grouped_gemm(*(t.cuda() for t in p.args())).cpu()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert shipped.delete("/v1/weights/long").status_code == 204


def test_expert_calls_merged_or_alone_answer_the_same_bits(shipped):
    """ffn and moe calls through the shipped server (fast transport, acceptors, the loop's
    merges) on G=8, H=4096, I=256, where the w13 GEMM's split-K changes between the 128-
    and 256-row buckets: each call answers the same bits sent alone (one client, one at a
    time) and among 16 concurrent clients (merged where their tiles agree), within SPEC
    5.1's bound, from graphs captured at load (no eager launch)."""
    from concurrent.futures import ThreadPoolExecutor

    from moegemm.client import Client
    from moegemm.kernels.testing import random_m_sizes, rel_error
    from moegemm.kernels.testing_ffn import FFN_TOLERANCE, random_experts, random_routing

    g, h, i = 8, 4096, 256
    gen = torch.Generator().manual_seed(7)
    p = random_experts(g, h, i, generator=gen)
    calls = []
    for n, rows in enumerate((1, 5, 9, 30, 64, 100, 120, 150, 200, 3, 17)):
        x = p.tokens(rows, generator=gen)
        sizes = random_m_sizes(g, rows, generator=gen)
        calls.append(("ffn", x, sizes, None))
        if n % 3 == 0:  # the same rows as fp8 with scales
            calls.append(("ffn", *p.quantized(x)[:1], sizes, p.quantized(x)[1]))
    for n, (tokens, k) in enumerate(((1, 8), (2, 2), (5, 8), (16, 2), (24, 8), (3, 1))):
        ids, w = random_routing(tokens, k, g, generator=gen)
        calls.append(("moe", p.tokens(tokens, generator=gen),
                      ids.to(torch.int32) if n % 2 else ids, w))

    def one(c, call):
        kind, x, a, b = call
        if kind == "ffn":
            return c.expert_ffn("shipx", x, a, x_scale=b)
        return c.moe("shipx", x, a, b)

    with Client(shipped.url, timeout=300) as c:
        c.load_experts("shipx", p.w13q, p.w2q, w13_scale=p.w13_scale, w2_scale=p.w2_scale)
        eager_before = _metric(shipped, "moegemm_launches_total", mode="eager")
        alone = [one(c, call) for call in calls]
    for (kind, x, a, b), out in zip(calls, alone):
        xq, xs = (x, b) if kind == "ffn" and b is not None else p.quantized(x)
        ref = p.ffn_reference(xq, xs, a) if kind == "ffn" else p.moe_reference(xq, xs, a, b)
        assert rel_error(out, ref) <= FFN_TOLERANCE
    batches = _metric(shipped, "moegemm_batch_calls_count")
    merged = _metric(shipped, "moegemm_batch_calls_sum")

    def rotated(start):
        wrong = []
        with Client(shipped.url, timeout=300) as c:
            for j in range(len(calls)):
                k = (start + j) % len(calls)
                if not torch.equal(one(c, calls[k]), alone[k]):
                    wrong.append(k)
        return wrong

    with ThreadPoolExecutor(16) as pool:
        assert [k for wrong in pool.map(rotated, range(16)) for k in wrong] == []
    batches = _metric(shipped, "moegemm_batch_calls_count") - batches
    merged = _metric(shipped, "moegemm_batch_calls_sum") - merged
    assert merged == 16 * len(calls) and batches < merged  # some calls shared a launch
    assert _metric(shipped, "moegemm_launches_total", mode="eager") == eager_before
    with Client(shipped.url, timeout=300) as c:
        c.delete_experts("shipx")
