"""Where a small call's time goes: the executor, the engine, the transport, the client.

    python bench/diag_service.py [--in-process]   # on the GPU box; prints p50s and a profile

Each layer is timed alone (medians of a few hundred calls), from the inside
out, so the difference between two lines is the cost of one layer:
executor.run (staging, graph, download) -> Engine.gemm (queue, worker thread,
event-loop wake-up) -> HTTP through ``moegemm serve`` (health endpoint, a raw
prebuilt POST, the client's grouped_gemm).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np


def p50(f, n=300, warm=20) -> float:
    for _ in range(warm):
        f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1e6 * sorted(times)[n // 2]


def in_process(m: int) -> None:
    import torch
    from moegemm.kernels import get_backend, quantize_activations
    from moegemm.server._executor import Executor, Part
    from moegemm.server._graphs import GraphPool
    from moegemm.server._staging import Staging
    from moegemm.server.engine import Engine

    dev = torch.device("cuda")
    backend = get_backend(dev)
    g, n, k = 8, 2048, 7168
    wq = torch.randint(0, 0x7F, (g, n, k), dtype=torch.uint8, device=dev).view(backend.fp8_dtype)
    ws_scale = torch.rand((g, k // 128, n // 128), device=dev) * 1e-3 + 1e-4
    ws = SimpleNamespace(name="w", G=g, N=n, K=k, wq=wq, w_scale=ws_scale)
    xq, xs = quantize_activations(torch.randn(m, k, device=dev), backend.fp8_dtype)
    xq, xs = xq.cpu(), xs.cpu()
    sizes = [m] + [0] * (g - 1)
    part = Part(xq, xs, sizes)
    # The checks and regrouping as torch ops, then as one kernel (_prologue.py).
    for fused in (False, True):
        other = Executor(GraphPool(backend, 256, fused_prologue=fused), Staging(dev))
        other.prepare(g, n, k, wq, ws_scale)
        graph = other.pool.graph(other.family(g, n, k, xq.dtype), other.pool.launch_rows(m), wq, ws_scale)

        def replay_sync(graph=graph):
            graph.replay()
            torch.cuda.synchronize()
        print(f"M={m} fused prologue {fused}: executor.run p50 "
              f"{p50(lambda other=other: other.run(ws, [part])):.0f} us, graph replay + sync "
              f"(bucket {other.pool.launch_rows(m)}) p50 {p50(replay_sync):.1f} us")
    ex = other
    print(f"M={m} executor.run p50 {p50(lambda: ex.run(ws, [part])):.0f} us")
    pinned = Part(xq.pin_memory(), xs.pin_memory(), sizes)
    print(f"M={m} executor.run (pinned input) p50 {p50(lambda: ex.run(ws, [pinned])):.0f} us")
    print(f"pinned alloc [1,2048] bf16 p50 "
          f"{p50(lambda: torch.empty((1, 2048), dtype=torch.bfloat16, pin_memory=True)):.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        ex.run(ws, [part])
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(out.getvalue()[-3500:])

    engine = Engine(backend, max_bucket_m=1024)
    engine._executor = ex
    engine.start()
    m_t = torch.tensor(sizes)

    async def loop_calls():
        for _ in range(20):
            await engine.gemm(ws, xq, xs, m_t)
        times = []
        for _ in range(300):
            t0 = time.perf_counter()
            await engine.gemm(ws, xq, xs, m_t)
            times.append(time.perf_counter() - t0)
        return 1e6 * sorted(times)[150]
    import uvloop
    print(f"M={m} engine.gemm (validate, queue, worker, wake-up) p50 {uvloop.run(loop_calls()):.0f} us")
    engine.close()


def over_http(m: int, transport: str, port: int) -> None:
    import httpx
    import ml_dtypes
    from moegemm.client import Client
    from moegemm.client._wire import encode_tensor, packb

    entry = ([str(Path(__file__).with_name("uvicorn_peer.py"))] if transport == "uvicorn"
             else ["-m", "moegemm.cli"])
    proc = subprocess.Popen([sys.executable, *entry, "serve", "--device", "cuda",
                             "--port", str(port), "--demo", "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        client = Client(url, timeout=60, retries=0)
        for _ in range(600):
            try:
                if httpx.get(url + "/v1/health/ready").status_code == 200:
                    break
            except Exception:  # noqa: BLE001 -- not up yet
                pass
            time.sleep(0.1)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((m, 512)).astype(ml_dtypes.bfloat16)
        sizes = np.array([m] + [0] * 7)
        http = httpx.Client(base_url=url)
        body = packb({"x": encode_tensor(x), "m_sizes": encode_tensor(sizes)})
        headers = {"content-type": "application/vnd.msgpack"}
        live = p50(lambda: http.get("/v1/health/live"))
        raw = p50(lambda: http.post("/v1/weights/demo/gemm", content=body, headers=headers))
        full = p50(lambda: client.grouped_gemm("demo", x, sizes))
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = (b"POST /v1/weights/demo/gemm HTTP/1.1\r\nhost: x\r\ncontent-type: "
                   b"application/vnd.msgpack\r\ncontent-length: %d\r\n\r\n" % len(body)) + body

        def raw_socket():
            sock.sendall(request)
            got = b""
            while b"\r\n\r\n" not in got:
                got += sock.recv(65536)
            head, _, rest = got.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(rest) < length:
                rest += sock.recv(65536)
        bare = p50(raw_socket)
        print(f"{transport:8s} demo M={m}: GET live {live:.0f} us | raw socket POST {bare:.0f} us"
              f" | httpx POST prebuilt {raw:.0f} us | Client.grouped_gemm {full:.0f} us")
    finally:
        proc.terminate()
        proc.wait(20)


if __name__ == "__main__":
    for m in (1, 128):
        in_process(m)
    if "--in-process" not in sys.argv:
        over_http(1, "fast", 18901)
        over_http(1, "uvicorn", 18902)
